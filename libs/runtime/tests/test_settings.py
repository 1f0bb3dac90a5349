from __future__ import annotations

import pytest

from fleet_runtime.health import run_checks
from fleet_runtime.settings import Settings, SettingsError, load_settings, settings_env

pytestmark = pytest.mark.unit


def test_defaults_without_environment():
    assert load_settings({}) == Settings()


def test_fleet_variables_are_parsed_by_type():
    settings = load_settings(
        {"FLEET_GATEWAY_PORT": "9000", "FLEET_S3_SECURE": "yes", "FLEET_NATS_URL": "nats://x:1"}
    )
    assert (settings.gateway_port, settings.s3_secure, settings.nats_url) == (9000, True, "nats://x:1")


def test_pipeline_ring_settings():
    assert (Settings().ring_host, Settings().ring_port_base) == ("127.0.0.1", 52400)
    settings = load_settings({"FLEET_RING_HOST": "auto", "FLEET_RING_PORT_BASE": "0"})
    assert (settings.ring_host, settings.ring_port_base) == ("auto", 0)


def test_a_bad_value_names_the_variable():
    with pytest.raises(SettingsError, match="FLEET_GATEWAY_PORT='http'"):
        load_settings({"FLEET_GATEWAY_PORT": "http"})


def test_settings_env_round_trips():
    settings = Settings(gateway_port=1234, s3_secure=True, node_id="n")
    assert load_settings(settings_env(settings)) == settings


async def test_health_checks_report_each_failure():
    async def ok() -> None:
        return None

    async def broken() -> None:
        raise ConnectionError("redis down")

    healthy, results = await run_checks({"a": ok, "b": broken})
    assert not healthy
    assert results == {"a": "ok", "b": "error: redis down"}


def test_a_setting_can_come_from_a_file(tmp_path):
    secret = tmp_path / "nats_password"
    secret.write_text("s3cret\n")
    settings = load_settings({"FLEET_NATS_PASSWORD_FILE": str(secret), "FLEET_NATS_PASSWORD": "ignored"})
    assert settings.nats_password == "s3cret"  # the file wins, without its newline


def test_an_unreadable_secret_file_is_a_clear_error(tmp_path):
    with pytest.raises(SettingsError, match=r"FLEET_API_KEYS_FILE=.*cannot read it"):
        load_settings({"FLEET_API_KEYS_FILE": str(tmp_path / "missing")})


def test_the_redis_password_goes_into_the_url():
    settings = load_settings({"FLEET_REDIS_URL": "redis://redis:6379/0", "FLEET_REDIS_PASSWORD": "p@ss/word"})
    assert settings.redis_url == "redis://:p%40ss%2Fword@redis:6379/0"
    again = load_settings({"FLEET_REDIS_URL": settings.redis_url, "FLEET_REDIS_PASSWORD": "new"})
    assert again.redis_url == "redis://:new@redis:6379/0"


def test_the_routing_policy_is_one_the_scheduler_knows():
    assert load_settings({"FLEET_ROUTING_POLICY": "round-robin"}).routing_policy == "round-robin"
    expected = "FLEET_ROUTING_POLICY='random': expected one of kv, least-loaded"
    with pytest.raises(SettingsError, match=expected):
        load_settings({"FLEET_ROUTING_POLICY": "random"})
