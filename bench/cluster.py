"""What the multi-worker benchmarks share: a gateway client, an embedded stack with a second
engine-worker, placing instances on a node, and writing a result file."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import aiohttp
from loadgen import auth_headers

REPO = Path(__file__).resolve().parents[1]


async def call(session: aiohttp.ClientSession, method: str, url: str, body: dict | None = None) -> dict:
    async with session.request(method, url, json=body) as response:
        if response.status >= 300:
            raise RuntimeError(f"{method} {url}: {response.status} {await response.text()}")
        return await response.json()


async def until(session: aiohttp.ClientSession, gateway: str, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = await call(session, "GET", f"{gateway}/state")
        if predicate(state):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting; instances {state['instances']}")
        await asyncio.sleep(0.5)


async def stage(gateway: str, model: str, source: str, nodes: int = 2) -> dict:
    async with aiohttp.ClientSession() as session:
        await call(session, "POST", f"{gateway}/models", {"model": model, "source": source})
        return await until(session, gateway, lambda s: model in s["models"] and len(s["nodes"]) == nodes, 900)


async def serve_on(gateway: str, model: str, node: str, layers: int, **extra: str) -> str:
    """A ready instance of the whole model on `node` (extra: engine, role)."""
    shards = [{"node_id": node, "start_layer": 0, "end_layer": layers}]
    async with aiohttp.ClientSession() as session:
        body = {"model": model, "shards": shards, **extra}
        iid = (await call(session, "POST", f"{gateway}/instances", body))["instance_id"]
        await until(session, gateway, lambda s: s["instances"].get(iid, {}).get("status") == "ready", 900)
    return iid


async def delete(gateway: str, instance_id: str) -> None:
    async with aiohttp.ClientSession(headers=auth_headers(admin=True)) as session:
        await call(session, "DELETE", f"{gateway}/instances/{instance_id}")
        await until(session, gateway, lambda s: instance_id not in s["instances"], 120)


@contextmanager
def two_workers(state_dir: Path, w1: dict[str, str], w2: dict[str, str]) -> Iterator:
    """An embedded stack whose own worker is w1, plus a second worker w2; yields the manifest and
    w2's PID."""
    from fleet_local import stack

    os.environ |= {"FLEET_NODE_ID": "w1", **w1}
    manifest = stack.up(state_dir, gateway_port=0, auth=False)
    cluster = Cluster(manifest, state_dir, ("w2",), w2)
    try:
        cluster.start("w2")
        yield manifest, cluster.pids["w2"]
    finally:
        cluster.stop_all()
        stack.down(state_dir)


class Cluster:
    """An embedded stack whose own worker serves nothing, and the workers a benchmark starts, kills
    and restarts (by PID), each with `worker_env`."""

    def __init__(self, manifest, root: Path, nodes: Sequence[str], worker_env: dict[str, str]) -> None:
        self.manifest = manifest
        self.gateway = manifest.gateway_url
        self.root = root
        self.nodes = tuple(nodes)
        self.worker_env = worker_env
        self.pids: dict[str, int] = {}

    def start(self, node: str) -> None:
        from fleet_local.processes import spawn

        env = {
            **os.environ,
            **self.manifest.env,
            "FLEET_STATE_DIR": str(self.root / node),
            "FLEET_HEALTH_PORT": "0",
            "FLEET_NODE_ID": node,
            **self.worker_env,
        }
        proc = spawn([sys.executable, "-m", "fleet_worker"], self.root / "logs" / f"{node}.log", env)
        self.pids[node] = proc.pid

    def kill(self, node: str) -> None:
        """The worker and its engine child, with no goodbye (the process group spawn gave it)."""
        os.killpg(self.pids[node], signal.SIGKILL)
        os.waitpid(self.pids[node], 0)  # ours: reap it

    def stop_all(self) -> None:
        from fleet_local.processes import stop_pid

        for pid in self.pids.values():
            stop_pid(pid)


@contextmanager
def workers_stack(
    root: Path, nodes: Sequence[str], worker_env: dict[str, str], stack_env: dict[str, str]
) -> Iterator[Cluster]:
    """`Cluster`: the stack's services (its worker w0 with no engine) with `stack_env`, then `nodes`."""
    from fleet_local import stack

    os.environ |= {"FLEET_NODE_ID": "w0", "FLEET_NODE_ENGINES": "none", **stack_env}
    manifest = stack.up(root, gateway_port=0, auth=False)
    cluster = Cluster(manifest, root, nodes, worker_env)
    try:
        for node in nodes:
            cluster.start(node)
        yield cluster
    finally:
        cluster.stop_all()
        stack.down(root)


def instance_ready(instance_id: str, state: dict) -> bool:
    return state["instances"].get(instance_id, {}).get("status") == "ready"


async def serving_everywhere(cluster: Cluster, model: str, layers: int, engine: str) -> None:
    """A ready instance of `model` on each node (a restarted worker's loads again, or a new one)."""
    async with aiohttp.ClientSession() as session:
        gateway = cluster.gateway
        state = await until(session, gateway, lambda s: set(cluster.nodes) <= s["nodes"].keys(), 120)
        for node in cluster.nodes:
            mine = [
                i["instance_id"]
                for i in state["instances"].values()
                if i["node_id"] == node and i["model_id"] == model and i["status"] != "failed"
            ]
            if not mine:
                shards = [{"node_id": node, "start_layer": 0, "end_layer": layers}]
                body = {"model": model, "shards": shards, "engine": engine}
                mine = [(await call(session, "POST", f"{gateway}/instances", body))["instance_id"]]
            await until(session, gateway, partial(instance_ready, mine[0]), 900)


def scratch_dir(prefix: str) -> Path:
    """A temporary folder for a benchmark's servers, models and logs (see `discard`)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"scratch folder {path} (servers' logs under it; removed after a successful run)", flush=True)
    return path


def discard(scratch: Path) -> None:
    """Remove a benchmark's temporary folder (servers' data, model copies) after a run that
    succeeded; a failed run never gets here, so its logs stay for reading."""
    shutil.rmtree(scratch, ignore_errors=True)


def write_result(out: Path, name: str, result: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result | {"at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"\nwrote {path}")
    return path
