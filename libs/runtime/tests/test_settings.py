from __future__ import annotations

import pytest

from fleet_runtime.health import run_checks
from fleet_runtime.settings import Settings, SettingsError, load_settings, settings_env


def test_defaults_without_environment():
    assert load_settings({}) == Settings()


def test_fleet_variables_are_parsed_by_type():
    settings = load_settings(
        {"FLEET_GATEWAY_PORT": "9000", "FLEET_S3_SECURE": "yes", "FLEET_NATS_URL": "nats://x:1"}
    )
    assert (settings.gateway_port, settings.s3_secure, settings.nats_url) == (9000, True, "nats://x:1")


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
