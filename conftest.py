"""Real servers for integration tests: nats-server, SeaweedFS S3 and Redis/Valkey on free ports.

One of each per test session, started with the same launchers `fleet up` uses, stopped by PID.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_local.servers import ServerHandle, start_nats, start_redis, start_s3
from fleet_store import ObjectStore

# No test talks to a real model hub: hub sources point at a closed local port unless a test starts
# its own fake hub (services/downloader/tests/fake_hub.py). Child processes inherit this.
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# Workers time only the engine a test loads; timing the node's other engines in the background would
# load a vLLM beside every MLX instance. The engine choice tests turn "all" on themselves.
os.environ.setdefault("FLEET_CALIBRATION", "loaded")


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


@pytest.fixture
def store(s3_server: ServerHandle) -> Iterator[ObjectStore]:
    """An ObjectStore on the session's S3 server (no credentials: auth is off there)."""
    store = ObjectStore(s3_server.url)
    yield store
    store.close()


@pytest.fixture
def bucket(store: ObjectStore) -> str:
    """A fresh bucket of the test's own."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    store.ensure_bucket(name)
    return name
