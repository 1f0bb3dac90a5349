"""Real servers for integration tests: nats-server, SeaweedFS S3 and Redis/Valkey on free ports.

One of each per test session, started with the same launchers `fleet up` uses, stopped by PID.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_local.servers import ServerHandle, start_nats, start_redis, start_s3


@pytest.fixture(scope="session")
def servers_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def nats_server(servers_root: Path) -> Iterator[ServerHandle]:
    handle = start_nats(servers_root / "nats-root")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def s3_server(servers_root: Path) -> Iterator[ServerHandle]:
    handle = start_s3(servers_root / "s3-root")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def redis_server(servers_root: Path) -> Iterator[ServerHandle]:
    handle = start_redis(servers_root / "redis-root")
    yield handle
    handle.stop()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[ServerHandle]:
    """A nats-server of the test's own (~0.1 s to start), for tests that need empty streams."""
    handle = start_nats(tmp_path / "nats-own")
    yield handle
    handle.stop()
