"""`fleet <service>`: env files, the order settings override each other in, and the CLI's errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleet_local.services import (
    SERVICE_MODULES,
    EnvFileError,
    dotenv,
    parse_env_file,
    service_env,
)
from fleet_local.stack import StackManifest, joining_env


def test_every_service_has_a_command_and_the_engine_worker_is_fleet_worker() -> None:
    assert SERVICE_MODULES == {
        "scheduler": "fleet_scheduler",
        "downloader": "fleet_downloader",
        "metrics-collector": "fleet_metrics",
        "worker": "fleet_worker",
        "gateway": "fleet_gateway",
    }


def test_an_env_file_reads_comments_exports_and_quotes() -> None:
    text = (
        "# stack\n\nexport FLEET_NATS_URL=nats://h:4222\nFLEET_NATS_PASSWORD='a b$c'\nFLEET_X=\"q\" # tail\n"
    )
    assert parse_env_file(text, "f.env") == {
        "FLEET_NATS_URL": "nats://h:4222",
        "FLEET_NATS_PASSWORD": "a b$c",
        "FLEET_X": "q",
    }


@pytest.mark.parametrize("line", ["FLEET_NATS_URL", "=value", "9X=1", "A='unclosed"])
def test_a_bad_env_file_line_is_named_with_its_file_and_line(line: str) -> None:
    with pytest.raises(EnvFileError, match=r"f\.env:2"):
        parse_env_file(f"# ok\n{line}\n", "f.env")


def test_dotenv_output_reads_back_unchanged() -> None:
    env = {"FLEET_REDIS_URL": "redis://:p@ss w'rd@127.0.0.1:6379/0", "FLEET_NATS_USER": "fleet", "E": ""}
    assert parse_env_file(dotenv(env), "-") == env


def test_flags_beat_the_environment_which_beats_env_files_later_files_winning() -> None:
    files = [
        {"FLEET_NATS_URL": "nats://file1", "FLEET_LOG_LEVEL": "DEBUG", "FLEET_NODE_ID": "a"},
        {"FLEET_NODE_ID": "b"},
    ]
    env = service_env("worker", {"FLEET_LOG_LEVEL": "WARNING"}, files)
    assert env["FLEET_NATS_URL"] == "nats://file1" and env["FLEET_NODE_ID"] == "b"
    assert env["FLEET_LOG_LEVEL"] == "WARNING"
    flagged = service_env("worker", {"FLEET_NODE_ID": "env"}, files, nats_url="nats://flag", node_id="w9")
    assert flagged["FLEET_NATS_URL"] == "nats://flag" and flagged["FLEET_NODE_ID"] == "w9"


@pytest.mark.parametrize(
    ("service", "setting"),
    [
        ("gateway", "FLEET_GATEWAY_PORT"),
        ("metrics-collector", "FLEET_METRICS_PORT"),
        ("worker", "FLEET_HEALTH_PORT"),
    ],
)
def test_port_sets_the_port_the_service_answers_health_on(service: str, setting: str) -> None:
    assert service_env(service, {}, port=9999)[setting] == "9999"


def test_the_joining_env_carries_the_gateway_keys_only_when_the_stack_has_them() -> None:
    servers = {"FLEET_NATS_URL": "nats://127.0.0.1:1", "FLEET_NATS_PASSWORD": "p"}
    keyed = StackManifest(state_dir="/s", env=servers, api_key="k", admin_key="a")
    assert joining_env(keyed) == servers | {"FLEET_API_KEYS": "k", "FLEET_ADMIN_KEYS": "a"}
    assert joining_env(StackManifest(state_dir="/s", env=servers)) == servers


def fleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet_local", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_a_missing_env_file_or_a_bad_setting_fails_before_the_service_starts(tmp_path) -> None:
    missing = fleet("worker", "--env-file", str(tmp_path / "none.env"))
    assert missing.returncode == 2 and "none.env" in missing.stderr
    bad = tmp_path / "bad.env"
    bad.write_text("FLEET_NODE_MEMORY_BYTES=lots\n")
    result = fleet("worker", "--env-file", str(bad))
    assert result.returncode == 2
    assert "FLEET_NODE_MEMORY_BYTES='lots'" in result.stderr


def test_fleet_env_without_a_stack_says_how_to_start_one(tmp_path) -> None:
    result = fleet("env", "--state-dir", str(tmp_path))
    assert result.returncode == 1 and "fleet up --infra-only" in result.stderr
