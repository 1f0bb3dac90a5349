"""Storage faults on the real embedded stack (issue 13): object storage (weed) and Redis are SIGKILLed
by PID while a tiny MLX chat model is served, the promised degraded behaviour is checked, then the
server is restarted (same command line, ports and data) and recovery is checked.

- S3 down: a ready instance keeps serving (greedy tokens identical to before the fault, long
  prompts too: the KV tier logs and recomputes); staging a model fails clearly and quickly;
  creating an instance is refused (gateway) or fails (worker) with a reason naming object storage;
  no gateway endpoint answers 500. After a restart staging works again.
- Redis down: completions still succeed, routed by load only (the decision says so); /kv, the
  dashboard series and the collector's series degrade cleanly; scheduler and collector stay up and
  name Redis in /health. After a restart routing uses the KV index again, including for blocks that
  reached engine memory while Redis was down (the worker rewrites its entries).

Both tests print what they measured (kill -> clear download failure; restart -> KV-aware routing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import pid_alive
from fleet_local.servers import ServerHandle, restart
from fleet_proto import CreateInstance, DownloadProgressed, RouteDecided
from fleet_proto.subjects import ROUTE_DECIDED_SUBJECT, event_subject
from tests.support import MESSAGES, MODEL, TokenTap, embedded_stack, engine_children, make_chat_model

OTHER = "tiny/llama-other"  # staged before the faults, never served: its files are on no worker
LATE = "tiny/llama-late"  # staged while object storage is down (fails), then after the restart
HUNG = "tiny/llama-hung"  # staged while object storage hangs (fails), then after it resumes
MAX_TOKENS = 8
DOWNLOAD_FAILS_WITHIN_S = 30.0  # the promise: a clear failure in seconds, not a hang
INDEX_BACK_WITHIN_S = 15.0
TIER2_BACK_WITHIN_S = 30.0  # the worker retries object storage 10 s after it failed (STORE_RETRY_S)
HUNG_FAILS_WITHIN_S = 30.0  # a server that never answers: 2 x fleet_store's QUICK_READ_TIMEOUT_S
STORE_SKIPPED = "KV blocks are neither fetched nor uploaded"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def long_conversation(salt: str) -> list[dict]:
    """~600 prompt tokens (two 256-token KV blocks); the salt first, so no other prompt shares a block."""
    facts = " ".join(f"fact {n}: the number {n * 13 % 97} is fine." for n in range(26))
    return [{"role": "system", "content": f"[{salt}] {facts}"}, {"role": "user", "content": "Which is fine?"}]


@dataclass
class Fleet:
    manifest: stack.StackManifest
    root: Path

    def handle(self, name: str) -> ServerHandle:
        return next(p for p in self.manifest.processes if p.name == name)

    @property
    def gateway(self) -> str:
        return self.manifest.gateway_url

    @property
    def collector(self) -> str:
        return self.manifest.metrics_url.removesuffix("/metrics")

    def log(self, name: str) -> str:
        return Path(self.handle(name).log_path).read_text(errors="replace")

    def kill(self, name: str) -> float:
        """SIGKILL the server and everything it started, by PID; returns when all are gone."""
        handle = self.handle(name)
        assert pid_alive(handle.pid, handle.started_at), f"{name} is not running"
        family = [psutil.Process(handle.pid), *psutil.Process(handle.pid).children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, signal.SIGKILL)  # its own session: the group it leads
        for process in family:  # and any child that left the group
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], f"{name}: {alive} survived"
        return time.monotonic()

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send `sig` to the server and everything it started, by PID (SIGSTOP: it hangs, sockets open)."""
        handle = self.handle(name)
        family = [psutil.Process(handle.pid), *psutil.Process(handle.pid).children(recursive=True)]
        os.killpg(handle.pid, sig)
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)

    def bring_back(self, name: str) -> float:
        """Restart the killed server; stack.json names the new process, so `fleet down` stops it."""
        index = next(i for i, p in enumerate(self.manifest.processes) if p.name == name)
        self.manifest.processes[index] = restart(self.manifest.processes[index])
        stack.write_manifest(self.manifest)  # 0600: it holds the stack's credentials
        return time.monotonic()

    def ensure_running(self, name: str) -> None:
        handle = self.handle(name)
        if not pid_alive(handle.pid, handle.started_at):
            self.bring_back(name)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("faults")
    model_dir = make_chat_model(root / "model", max_positions=1024)
    for name in ("other", "late", "hung"):
        make_chat_model(root / name)
    env = {**os.environ, "FLEET_LOG_FORMAT": "text"}
    with embedded_stack(root / "state", MODEL, model_dir, env=env) as manifest:
        yield Fleet(manifest, root)


@dataclass
class Completion:
    status: int
    body: dict
    tokens: list[int]
    reason: str  # the scheduler's route decision


class Client:
    """Chat completions through the gateway, each with its token ids and route decision (from NATS)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.decisions: dict[str, RouteDecided] = {}
        self.downloads: list[DownloadProgressed] = []

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        self.tap = await TokenTap(self.fleet.manifest.nats_url).__aenter__()
        self.bus = await Bus.connect(self.fleet.manifest.nats_url, "fault-test")

        async def on_decided(msg) -> None:
            decided = msgspec.json.decode(msg.data, type=RouteDecided)
            self.decisions[decided.request_id] = decided

        async def on_download(msg) -> None:  # JetStream events reach core subscribers too
            event = msgspec.json.decode(msg.data, type=DownloadProgressed)
            self.downloads.append(event)

        self.subs = [
            await self.bus.nc.subscribe(ROUTE_DECIDED_SUBJECT, cb=on_decided),
            await self.bus.nc.subscribe(event_subject(DownloadProgressed), cb=on_download),
        ]
        await self.bus.nc.flush()
        return self

    async def __aexit__(self, *exc) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        await self.bus.close()
        await self.tap.__aexit__(*exc)
        await self.session.close()

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        async with self.session.request(method, f"{self.fleet.gateway}{path}", json=body) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text

    async def get(self, url: str) -> tuple[int, dict | list]:
        async with self.session.get(url) as response:
            return response.status, await response.json(content_type=None)

    async def chat(self, messages: list[dict], model: str = MODEL) -> Completion:
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        status, reply = await self.request("POST", "/v1/chat/completions", body)
        if status != 200:
            return Completion(status, reply if isinstance(reply, dict) else {"text": reply}, [], "")
        request_id = reply["id"]
        for _ in range(40):  # the decision and the last chunk come on other connections
            chunks = self.tap.chunks.get(request_id, [])
            if request_id in self.decisions and any(c.finish_reason for c in chunks):
                break
            await asyncio.sleep(0.05)
        decided = self.decisions.get(request_id)
        return Completion(
            status, reply, self.tap.token_ids(request_id), decided.reply.reason if decided else ""
        )

    async def state(self) -> dict:
        status, state = await self.request("GET", "/state")
        assert status == 200, state
        return state

    async def until(self, predicate, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self.state()
            if predicate(state):
                return state
            assert time.monotonic() < deadline, f"{what} not within {timeout_s} s: {state['instances']}"
            await asyncio.sleep(0.1)

    async def stage(self, model: str, source: Path, timeout_s: float = 90.0) -> DownloadProgressed:
        """POST /models (202), then this command's final download_progressed event (done or failed)."""
        seen = len(self.downloads)
        status, reply = await self.request("POST", "/models", {"model": model, "source": f"file://{source}"})
        assert status == 202, reply
        deadline = time.monotonic() + timeout_s
        while True:
            final = [
                e for e in self.downloads[seen:] if e.model_id == model and e.phase in ("done", "failed")
            ]
            if final:
                return final[0]
            assert time.monotonic() < deadline, f"staging {model}: no outcome within {timeout_s} s"
            await asyncio.sleep(0.05)


def cached_tokens(reason: str) -> int:
    """N of the routing reason's "N of M prompt tokens cached in memory"."""
    found = re.search(r"(\d+) of \d+ prompt tokens cached in memory", reason)
    assert found, reason
    return int(found[1])


async def sweep(client: Client, node: str) -> dict[str, tuple[int, object]]:
    """GET every read endpoint of the gateway: none may answer 500, a 503 must be a clean JSON error."""
    paths = (
        "/health", "/state", "/downloads", "/instances", "/capabilities", "/kv", "/v1/models",
        f"/placements?model={OTHER}", "/dashboard/live", "/dashboard/metrics",
        f"/dashboard/series?node={node}&metric=cpu_percent", "/openapi.json", "/",
    )  # fmt: skip
    results = {path: await client.request("GET", path) for path in paths}
    assert_no_500(results)
    return results


def assert_no_500(results: dict[str, tuple[int, object]]) -> None:
    errors = {path: r for path, r in results.items() if r[0] >= 500 and r[0] != 503}
    assert not errors, errors
    for path, (status, body) in results.items():
        if status == 503:  # a clean OpenAI-style error, never an HTML page or a traceback
            assert isinstance(body, dict) and body["error"]["type"] == "service_unavailable", (path, body)


async def test_object_storage_down_serving_continues_and_downloads_fail_clearly(fleet: Fleet) -> None:
    async with Client(fleet) as client:
        # before: a second model staged (on no worker), reference outputs
        assert (await client.stage(OTHER, fleet.root / "other")).phase == "done"
        before = await client.chat(MESSAGES)
        assert before.status == 200 and len(before.tokens) == MAX_TOKENS, before
        node = next(iter((await client.state())["nodes"]))

        killed = fleet.kill("s3")
        try:
            # staging needs object storage: a clear failure in /state and /downloads, within seconds
            failed = await client.stage(LATE, fleet.root / "late", timeout_s=DOWNLOAD_FAILS_WITHIN_S)
            download_failed_s = time.monotonic() - killed
            assert failed.phase == "failed" and "object storage" in failed.reason, failed
            shown = await client.until(
                lambda s: s["downloads"].get(LATE, {}).get("phase") == "failed", 5, "failed in /state"
            )
            assert "object storage" in shown["downloads"][LATE]["reason"]
            status, downloads = await client.request("GET", "/downloads")
            assert status == 200 and downloads[LATE]["status"]["phase"] == "failed", downloads

            # serving from memory continues, token for token
            during = await client.chat(MESSAGES)
            assert during.status == 200 and during.tokens == before.tokens, during

            # a long prompt: its blocks can be neither fetched nor uploaded, the engine prefills it
            long_prompt = long_conversation(uuid.uuid4().hex)
            long = await client.chat(long_prompt)
            assert long.status == 200 and len(long.tokens) == MAX_TOKENS, long
            assert long.body["usage"]["prompt_tokens"] > 512, long.body["usage"]
            assert STORE_SKIPPED in fleet.log("engine-worker")  # said once, then tier 2 is skipped

            # a new instance: refused by the gateway, and failed by the worker when placed anyway
            # (as a failover re-placement would do), both naming object storage
            status, refused = await client.request("POST", "/instances", {"model": OTHER})
            assert status == 503 and "object storage" in refused["error"]["message"], refused
            instance_id = f"inst-fault-{uuid.uuid4().hex[:8]}"
            bus = await Bus.connect(fleet.manifest.nats_url, "fault-test-cmd")
            try:
                await bus.publish_command(
                    CreateInstance(command_id=f"cmd-{instance_id}", model_id=OTHER, instance_id=instance_id)
                )
            finally:
                await bus.close()
            state = await client.until(
                lambda s: s["instances"].get(instance_id, {}).get("status") == "failed", 60, instance_id
            )
            assert "object storage" in state["instances"][instance_id]["reason"], state["instances"]
            status, _ = await client.request("DELETE", f"/instances/{instance_id}")
            assert status == 202

            # no endpoint of the gateway answers 500; those that need object storage say so
            results = await sweep(client, node)
            assert all(results[p][0] == 200 for p in ("/health", "/state", "/downloads", "/kv", "/v1/models"))
            results["DELETE /downloads"] = await client.request("DELETE", f"/downloads/{OTHER}")
            results["POST /instances"] = (status, refused)
            other_chat = await client.chat(MESSAGES, model=OTHER)  # known, not ready: 503 says so
            results["chat OTHER"] = (other_chat.status, other_chat.body)
            assert_no_500(results)
            assert results["DELETE /downloads"][0] == 503, results["DELETE /downloads"]
            assert "object storage" in results["DELETE /downloads"][1]["error"]["message"]

            # the downloader reports object storage in /health and keeps running
            status, health = await client.get(fleet.handle("downloader").health_url)
            assert status == 503 and health["checks"]["s3"].startswith("error"), health
            assert all(pid_alive(p.pid, p.started_at) for p in fleet.manifest.processes if p.name != "s3")
        except BaseException:
            fleet.ensure_running("s3")  # the next test needs it
            raise
        restarting = time.monotonic()
        restarted = fleet.bring_back("s3")
        restart_s = restarted - restarting

        # after the restart: staging works again, serving too
        staged = await client.stage(LATE, fleet.root / "late")
        staged_again_s = time.monotonic() - restarted
        assert staged.phase == "done", staged
        after = await client.chat(MESSAGES)
        assert after.status == 200 and after.tokens == before.tokens
        long_after = await client.chat(long_prompt)  # its prefix from memory now: same tokens
        assert long_after.status == 200 and long_after.tokens == long.tokens, long_after
        # and tier 2 again: a new prompt's blocks reach object storage once the worker tries again
        uploaded = (await client.request("GET", "/kv"))[1]["index"]["object_storage_blocks"]
        deadline = restarted + TIER2_BACK_WITHIN_S
        while (await client.request("GET", "/kv"))[1]["index"]["object_storage_blocks"] <= uploaded:
            assert time.monotonic() < deadline, "no KV block reached object storage after the restart"
            assert (await client.chat(long_conversation(uuid.uuid4().hex))).status == 200
            await asyncio.sleep(0.5)
        tier2_back_s = time.monotonic() - restarted
        status, health = await client.get(fleet.handle("downloader").health_url)
        assert status == 200, health
    print(
        f"\nS3 killed -> download failed clearly in {download_failed_s:.2f} s; weed restarted in "
        f"{restart_s:.2f} s; then a model staged in {staged_again_s:.2f} s, KV blocks reached object "
        f"storage again after {tier2_back_s:.1f} s"
    )


async def test_redis_down_routes_by_load_then_by_kv_index_again(fleet: Fleet) -> None:
    async with Client(fleet) as client:
        node = next(iter((await client.state())["nodes"]))
        before_prompt = long_conversation(uuid.uuid4().hex)
        first = await client.chat(before_prompt)
        assert first.status == 200, first
        for _ in range(20):  # the index learns the blocks right after the step that stored them
            again = await client.chat(before_prompt)
            if cached_tokens(again.reason) > 0:
                break
            await asyncio.sleep(0.2)
        assert cached_tokens(again.reason) > 0 and again.tokens == first.tokens, again

        fleet.kill("redis")
        try:
            during = await client.chat(before_prompt)
            assert during.status == 200 and during.tokens == first.tokens, during
            assert "routed by load only" in during.reason and "KV index unavailable" in during.reason
            # a new prompt: its blocks reach engine memory while the index cannot hear of it
            outage_prompt = long_conversation(uuid.uuid4().hex)
            new = await client.chat(outage_prompt)
            assert new.status == 200 and len(new.tokens) == MAX_TOKENS, new
            assert "routed by load only" in new.reason, new.reason

            # what reads Redis degrades cleanly
            status, kv = await client.request("GET", "/kv")
            assert status == 200 and not kv["index"]["available"] and "Redis" in kv["index"]["error"], kv
            assert node in kv["nodes"]  # the per-node tier traffic is still served
            status, series = await client.request("GET", f"/dashboard/series?node={node}&metric=cpu_percent")
            assert status == 503 and "Redis" in series["error"]["message"], series
            assert series["error"]["type"] == "service_unavailable"
            status, series = await client.get(f"{fleet.collector}/api/nodes/{node}/series?metric=cpu_percent")
            assert status == 503 and "Redis" in series["error"], series
            for name in ("scheduler", "metrics-collector"):
                status, health = await client.get(fleet.handle(name).health_url)
                assert status == 503 and health["checks"]["redis"].startswith("error"), (name, health)
                assert health["checks"]["nats"] == "ok"
            results = await sweep(client, node)
            assert all(results[p][0] == 200 for p in ("/health", "/state", "/kv", "/v1/models"))
            await asyncio.sleep(2)  # two series-writer intervals and metrics periods with Redis gone
            assert all(pid_alive(p.pid, p.started_at) for p in fleet.manifest.processes if p.name != "redis")
        except BaseException:
            fleet.ensure_running("redis")
            raise
        restarted = fleet.bring_back("redis")

        # after the restart: the blocks stored during the outage are indexed again and routing uses them
        deadline, by_load = restarted + INDEX_BACK_WITHIN_S, 0
        while True:
            back = await client.chat(outage_prompt)
            assert back.status == 200 and back.tokens == new.tokens, back
            if "routed by load only" not in back.reason and cached_tokens(back.reason) > 0:
                break
            by_load += 1
            assert time.monotonic() < deadline, f"routing did not use the index again: {back.reason}"
            await asyncio.sleep(0.1)
        index_back_s = time.monotonic() - restarted
        status, kv = await client.request("GET", "/kv")
        assert status == 200 and kv["index"]["available"] and kv["index"]["memory_blocks_by_node"][node] > 0
        status, _ = await client.request("GET", f"/dashboard/series?node={node}&metric=cpu_percent")
        assert status == 200
        for name in ("scheduler", "metrics-collector"):
            status, health = await client.get(fleet.handle(name).health_url)
            assert status == 200, (name, health)
        worker_log = fleet.log("engine-worker")
        assert "KV index (Redis) answers again" in worker_log
    print(
        f"\nRedis restarted -> routing used the KV index again after {index_back_s:.2f} s "
        f"({by_load} requests routed without it first): {back.reason}"
    )


async def timed(coro) -> tuple[object, float]:
    began = time.monotonic()
    result = await coro
    return result, time.monotonic() - began


async def test_object_storage_that_hangs_costs_seconds_and_never_stops_serving(fleet: Fleet) -> None:
    """weed SIGSTOPped: connections are accepted, nothing answers. Every call gives up within
    HUNG_FAILS_WITHIN_S (not minio's minutes), the worker keeps its heartbeat, and once the KV tier
    has seen the failure, long prompts no longer wait on object storage."""
    async with Client(fleet) as client:
        state = await client.state()
        node, ready = next(iter(state["nodes"])), [i for i in state["instances"] if i.startswith("inst-")]
        before = await client.chat(MESSAGES)
        fleet.signal("s3", signal.SIGSTOP)
        try:
            staging = asyncio.create_task(timed(client.stage(HUNG, fleet.root / "hung", HUNG_FAILS_WITHIN_S)))
            creating = asyncio.create_task(timed(client.request("POST", "/instances", {"model": OTHER})))
            await asyncio.sleep(0.2)  # let those reach object storage first
            (first, first_s), (short, short_s) = await asyncio.gather(
                timed(client.chat(long_conversation(uuid.uuid4().hex))), timed(client.chat(MESSAGES))
            )
            second, second_s = await timed(client.chat(long_conversation(uuid.uuid4().hex)))
            (failed, staging_s), ((status, refused), creating_s) = await staging, await creating

            assert failed.phase == "failed" and "object storage" in failed.reason, failed
            assert status == 503 and "object storage" in refused["error"]["message"], refused
            assert staging_s < HUNG_FAILS_WITHIN_S and creating_s < HUNG_FAILS_WITHIN_S
            assert first.status == 200 and len(first.tokens) == MAX_TOKENS, first
            assert first_s < HUNG_FAILS_WITHIN_S + 10, first_s
            assert short.status == 200 and short.tokens == before.tokens, short
            assert second.status == 200 and second_s < 5.0, (second_s, second)  # tier 2 skipped now
            state = await client.state()  # the worker's heartbeat never stopped: no failover
            assert node in state["nodes"] and all(state["instances"][i]["status"] == "ready" for i in ready)
            assert_no_500(await sweep(client, node) | {"POST /instances": (status, refused)})
        finally:
            fleet.signal("s3", signal.SIGCONT)
        staged = await client.stage(HUNG, fleet.root / "hung")
        assert staged.phase == "done", staged
    print(
        f"\nS3 hung -> staging failed in {staging_s:.1f} s, POST /instances answered 503 in "
        f"{creating_s:.1f} s; the first long prompt took {first_s:.1f} s (a short one beside it "
        f"{short_s:.1f} s), the next long one {second_s:.2f} s"
    )


async def test_an_engine_that_crashes_while_object_storage_is_down_restarts_from_cached_files(
    fleet: Fleet,
) -> None:
    fleet.ensure_running("s3")
    worker = fleet.handle("engine-worker")
    [child] = engine_children(worker.pid)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    async with aiohttp.ClientSession() as session:  # the gateway has the model's tokenizer in memory
        async with session.post(f"{fleet.gateway}/v1/chat/completions", json=body) as response:
            assert response.status == 200
    fleet.kill("s3")
    try:
        os.kill(child, signal.SIGKILL)
        killed_at = time.monotonic()
        async with aiohttp.ClientSession() as session:
            for _ in range(600):  # the worker has restarted the engine from its cache
                async with session.get(f"{fleet.gateway}/state") as response:
                    instances = (await response.json())["instances"].values()
                restarted = engine_children(worker.pid) not in ([], [child])
                if restarted and any(i["node_id"] and i["status"] == "ready" for i in instances):
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"no instance came back: {list(instances)}")
            back_s = time.monotonic() - killed_at
            async with session.post(f"{fleet.gateway}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
        assert "starts from its cached files" in fleet.log("engine-worker")
        print(f"\nengine restarted from the cache {back_s:.1f} s after the kill, object storage down")
    finally:
        fleet.bring_back("s3")
