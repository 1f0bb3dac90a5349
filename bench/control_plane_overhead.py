"""The gateway's cost per request (issue 44: "gateway overhead per request <= 5 ms p50 at 1,000 req/s,
echo engine, across replicas"), measured at the rates this machine carries, and what they imply.

    .venv/bin/fleet bench control-plane --overhead            # ~1.5 minutes
    .venv/bin/fleet bench control-plane --overhead --quick    # ~25 s (what the tests run)
    .venv/bin/fleet bench control-plane --overhead --rates 25,50,100 --step-seconds 4

One embedded stack whose worker offers only the echo engine, plus a second gateway process on the
same NATS, Redis and S3 (a replica: the same service on another port). 1-token chat completions,
open loop: Poisson arrivals at each offered rate, a bounded count per rate.
1. Overhead per request, from each request's own trace (every request is traced: the default
   FLEET_TRACE_SAMPLE_RATE is 1): the client's wait less the engine-worker's spans (worker task:
   the echo engine and the worker around it) and the scheduler's (KV lookup, route decision). The
   rest is split into the gateway's own spans' self time (HTTP handler, tokenize, detokenize, stream
   write), the bus (the route and task hops less the other services' spans, the task's JetStream
   queue wait) and the client's HTTP exchange around the gateway's root span.
2. CPU per request of every process, from /proc/<pid>/stat over each rate's run (less the process's
   idle rate, measured first): requests/s one gateway core carries, one scheduler core routes, and
   the cores each needs for 1,000 req/s.
3. Replicas: one gateway takes all the load while the other idles, then the same rates alternate
   over both.
4. The gateway's per-request reads of State (model resolution and admission, from the RoutingView
   it keeps per State) timed on synthetic clusters of 16 to 1,000 workers: a cost the embedded
   stack cannot show.
(Whole at ~580 lines, as control_plane_scale.py: one stack and one sweep, and the verdict reads every
part; the pure parts are tested in tests/test_bench_control_plane_overhead.py.)
Every load loop is bounded by its count; two rates in a row not carried (answers falling behind the
arrivals, or the overhead doubled) end a side's sweep. Other work on the machine shows as other_work_cores.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO
from loadgen import percentile

from fleet_proto.traces import REQUEST_ID_ATTRIBUTE, SpanBatch, SpanRecord, root_span, self_times

MODEL = "tiny/echo"
BODY = msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
JSON = {"Content-Type": "application/json"}
RATES, QUICK_RATES = (25, 50, 100, 150, 200, 300), (20, 40)
GOAL_RPS, GOAL_OVERHEAD_MS = 1000, 5.0
# The gateway's spans that wait on another service (their self time is the hop, not its work).
WAITING_SPANS = frozenset({"route", "generate"})
PARTS = ("overhead", "gateway", "bus", "route_hop", "task_hop", "queue", "client_http", "worker", "scheduler",
         "client")  # fmt: skip
SATURATED_SHARE = 0.9  # achieved / asked below this: the rate is not carried
LATENCY_GROWTH = 2.0  # nor when the overhead's p50 grew past this many times the lowest rate's
NOISY_CORES = 0.3  # other work beside the run past this: the verdict says so
GIVE_UP_AFTER = 2  # rates not carried in a row before a side stops (once may be the machine's noise)
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- one request's trace (pure) ------------------------------------------------------------------
def overhead_parts(spans: Sequence[SpanRecord], client_s: float) -> dict[str, float]:
    """One request's client wait split by its trace, in ms: `overhead` = client - worker -
    scheduler = gateway (its own spans' self time) + bus (the hops' self time and the JetStream queue
    wait) + client_http (the client's wait around the gateway's root span)."""
    root = root_span(spans)
    own = self_times(spans)

    def ms(keep) -> float:
        return sum(own[s.span_id] for s in spans if keep(s)) / 1e6

    worker = ms(lambda s: s.service == "engine-worker" and s.category != "queue")
    scheduler = ms(lambda s: s.service == "scheduler")
    client = 1000 * client_s
    root_ms = root.duration_ns / 1e6 if root is not None else 0.0
    return {
        "client": client,
        "worker": worker,
        "scheduler": scheduler,
        "overhead": client - worker - scheduler,
        "gateway": ms(lambda s: s.service == "gateway" and s.name not in WAITING_SPANS),
        "bus": ms(lambda s: s.name in WAITING_SPANS or s.category == "queue"),
        "route_hop": ms(lambda s: s.name == "route"),  # to the scheduler and back, less its spans
        "task_hop": ms(lambda s: s.name == "generate"),  # task out, chunks back, less the worker's
        "queue": ms(lambda s: s.category == "queue"),  # published -> the worker took it
        "client_http": client - root_ms,
    }


def complete(spans: Sequence[SpanRecord]) -> bool:
    """Every service's spans are in: the gateway's root, the scheduler's decision, the worker's task."""
    names = {s.name for s in spans}
    return {"route decision", "worker task"} <= names and any(not s.parent_id for s in spans)


def parts_summary(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """p50 of every part, and p99 of the overhead and the client's wait."""
    summary = {f"{k}_ms_p50": percentile([p[k] for p in parts], 50) for k in PARTS}
    for k in ("overhead", "client"):
        summary[f"{k}_ms_p99"] = percentile([p[k] for p in parts], 99)
    return summary


# -- CPU from the kernel -------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """User + system seconds of the process itself, from /proc/<pid>/stat (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces; fields from 3 on follow it
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process: /proc/stat)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLK_TCK  # less idle and iowait; guests are in user


def snapshot(processes: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_s(pid) for pid in pids) for name, pids in processes.items()}


def cpu_ms_per_request(
    before: dict[str, float],
    after: dict[str, float],
    idle_per_s: dict[str, float],
    wall_s: float,
    requests: int,
) -> dict[str, float]:
    """CPU ms per request of each process over a run of `wall_s`, less what it spends idle."""
    return {
        name: 1000
        * max(after[name] - before[name] - idle_per_s.get(name, 0.0) * wall_s, 0.0)
        / max(requests, 1)
        for name in after
    }


# -- load ----------------------------------------------------------------------------------------
def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """Send times (s from the start) of `count` Poisson arrivals at `rate` per second."""
    rng, at, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        offsets.append(at)
    return offsets


class Reply(msgspec.Struct):
    id: str = ""


@dataclass
class Sample:
    late_s: float  # sent this long after its scheduled time (the load generator falling behind)
    latency_s: float = 0.0
    request_id: str = ""
    error: str = ""


async def open_loop(
    sessions: Sequence[tuple[aiohttp.ClientSession, str]], offsets: list[float]
) -> tuple[list[Sample], float]:
    """Each request sent at its time whatever the others do, request i to gateway i % len(sessions);
    the samples and the wall time from the first send to the last reply."""
    start = time.perf_counter() + 0.02
    last_done = start

    async def one(i: int, at: float) -> Sample:
        nonlocal last_done
        await asyncio.sleep(max(start + at - time.perf_counter(), 0))
        sent = time.perf_counter()
        session, url = sessions[i % len(sessions)]
        sample = Sample(late_s=sent - start - at)
        try:
            async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=JSON) as response:
                body = await response.read()
                if response.status != 200:
                    sample.error = f"HTTP {response.status}: {body[:200]!r}"
                else:
                    sample.request_id = msgspec.json.decode(body, type=Reply).id
        except (aiohttp.ClientError, TimeoutError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        done = time.perf_counter()
        sample.latency_s, last_done = done - sent, max(last_done, done)
        return sample

    samples = await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets)))
    return list(samples), last_done - start


class SpanTap:
    """Every span the services publish (fleet.traces.spans), by trace, and each request's trace id."""

    def __init__(self) -> None:
        self.traces: dict[str, list[SpanRecord]] = {}
        self.trace_of: dict[str, str] = {}
        self._decoder = msgspec.json.Decoder(SpanBatch)
        self._arrived = asyncio.Event()

    async def on_batch(self, msg) -> None:
        self._arrived.set()
        for span in self._decoder.decode(msg.data).spans:
            self.traces.setdefault(span.trace_id, []).append(span)
            if request_id := span.attributes.get(REQUEST_ID_ATTRIBUTE):
                self.trace_of[str(request_id)] = span.trace_id

    def spans_of(self, request_id: str) -> list[SpanRecord]:
        return self.traces.get(self.trace_of.get(request_id, ""), [])

    async def wait_for(self, request_ids: Sequence[str], timeout_s: float) -> None:
        """Until every request's trace is complete, or the time is up (the incomplete are left out)."""
        deadline = time.monotonic() + timeout_s
        while not all(complete(self.spans_of(r)) for r in request_ids):
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - time.monotonic())
            except TimeoutError:
                return

    def clear(self) -> None:
        self.traces.clear()
        self.trace_of.clear()


# -- one offered rate ----------------------------------------------------------------------------
def carried(step: dict, base_overhead_ms: float) -> bool:
    """The gateway(s) kept up: nearly every request answered, at nearly the rate asked, and the
    overhead's p50 not grown past LATENCY_GROWTH times the lowest rate's (a queue building up)."""
    return (
        step["errors"] <= 0.01 * step["requests"]
        and step["achieved_rps"] >= SATURATED_SHARE * step["arrivals_rps"]
        and step["overhead_ms_p50"] <= LATENCY_GROWTH * base_overhead_ms
    )


async def run_step(
    sessions: Sequence[tuple[aiohttp.ClientSession, str]],
    tap: SpanTap,
    processes: dict[str, list[int]],
    idle_per_s: dict[str, float],
    rate: float,
    count: int,
    seed: int,
) -> dict:
    offsets = poisson_offsets(rate, count, seed)
    before, machine, started = snapshot(processes), machine_busy_s(), time.perf_counter()
    samples, wall = await open_loop(sessions, offsets)
    await asyncio.sleep(0.3)  # spans go out every 0.2 s: their publishing falls inside the window
    after, window = snapshot(processes), time.perf_counter() - started
    machine = machine_busy_s() - machine
    answered = [s for s in samples if not s.error]
    await tap.wait_for([s.request_id for s in answered], 5.0)
    traces = [(tap.spans_of(s.request_id), s.latency_s) for s in answered]
    parts = [overhead_parts(spans, latency) for spans, latency in traces if complete(spans)]
    tap.clear()
    cpu = cpu_ms_per_request(before, after, idle_per_s, window, len(answered))
    late = [s.late_s for s in samples]
    return {
        "gateways": len(sessions),
        "offered_rps": rate,
        "requests": count,
        "arrivals_rps": count / offsets[-1],  # the rate this draw of Poisson arrivals asked for
        "achieved_rps": len(answered) / wall if wall > 0 else 0.0,
        "errors": len(samples) - len(answered),
        "error_examples": sorted({s.error for s in samples if s.error})[:3],
        "traced": len(parts),
        "send_late_ms_p50": 1000 * percentile(late, 50),
        "send_late_ms_p99": 1000 * percentile(late, 99),
        **parts_summary(parts),
        "gateway_cpu_ms_per_request": sum(v for k, v in cpu.items() if k.startswith("gateway")),
        "cpu_ms_per_request": cpu,
        # every process measured, idle included, bench client too; and the machine's other work beside
        "cores_busy": sum(after[k] - before[k] for k in after) / window,
        "other_work_cores": max(machine - sum(after[k] - before[k] for k in after), 0.0) / window,
    }


async def sweep(
    urls: Sequence[str],
    nats_url: str,
    processes: dict[str, list[int]],
    rates: Sequence[float],
    step_s: float,
    idle_s: float,
) -> dict:
    """Warm up, measure every process's idle rate, then each rate on one gateway and on both (in
    turn, so the machine's noise hits both alike) until neither kept up GIVE_UP_AFTER rates in a row."""
    import nats

    from fleet_proto.subjects import TRACE_SPANS_SUBJECT

    tap = SpanTap()
    nc = await nats.connect(nats_url, name="bench-control-plane-overhead")
    await nc.subscribe(TRACE_SPANS_SUBJECT, cb=tap.on_batch)
    timeout = aiohttp.ClientTimeout(total=60)
    # open loop: no client-side queue (limit=0), each request sent at its time
    sessions = [
        (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout), url) for url in urls
    ]
    runs: dict[int, list[dict]] = {1: [], len(urls): []}
    try:
        health = [await warm_up(session, url) for session, url in sessions]
        before = snapshot(processes)
        await asyncio.sleep(idle_s)
        idle_per_s = {k: (v - before[k]) / idle_s for k, v in snapshot(processes).items()}
        tap.clear()
        for number, rate in enumerate(rates):
            count = max(int(rate * step_s), 10)
            for gateways, steps in runs.items():
                if len(steps) >= GIVE_UP_AFTER and not any(s["carried"] for s in steps[-GIVE_UP_AFTER:]):
                    continue
                step = await run_step(sessions[:gateways], tap, processes, idle_per_s, rate, count, number)
                step["carried"] = carried(step, (runs[1] or [step])[0]["overhead_ms_p50"])
                steps.append(step)
                print(
                    f"  {gateways} gateway(s) at {rate:g} req/s: {step['achieved_rps']:.0f} req/s, "
                    f"overhead p50 {step['overhead_ms_p50']:.2f} ms, gateway CPU "
                    f"{step['gateway_cpu_ms_per_request']:.2f} ms/request"
                    f"{'' if step['carried'] else ' (not carried)'}",
                    flush=True,
                )
            if all(
                len(steps) >= GIVE_UP_AFTER and not any(s["carried"] for s in steps[-GIVE_UP_AFTER:])
                for steps in runs.values()
            ):
                break
    finally:
        for session, _ in sessions:
            await session.close()
        await nc.close()
    return {
        "health_ms_p50": health,
        "idle_cpu_ms_per_s": {k: 1000 * v for k, v in idle_per_s.items()},
        "one_gateway": runs[1],
        "two_gateways": runs[len(urls)],
    }


async def warm_up(session: aiohttp.ClientSession, url: str) -> float:
    """Until the gateway serves the model (a replica loads its tokenizer on its first request), then
    a few more requests; the HTTP floor: GET /health p50 in ms."""
    deadline = time.monotonic() + 60
    while True:
        async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=JSON) as response:
            if response.status == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{url} never served {MODEL}: HTTP {response.status} {await response.text()}"
                )
        await asyncio.sleep(0.2)
    floor = []
    for _ in range(30):
        async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=JSON) as response:
            await response.read()
        started = time.perf_counter()
        async with session.get(f"{url}/health") as response:
            await response.read()
        floor.append(time.perf_counter() - started)
    return 1000 * percentile(floor, 50)


# -- the gateway's scans of State, at cluster sizes the stack cannot have ------------------------
def state_scans(sizes: Sequence[int], calls: int) -> dict:
    """What the gateway does per request with the State, on a State of N workers (one ready instance
    each, 4 models: cluster_events), us p50: serving_model (model resolution), admission's entry (its
    room) and full (when routing), and the three together, each on the RoutingView the gateway keeps
    per State (KeptView); and the first request on a new State, which builds the view's index."""
    from control_plane import cluster_events

    from fleet_gateway.admission import Admission
    from fleet_gateway.aliases import serving_model
    from fleet_proto import replay
    from fleet_proto.routing_view import KeptView

    async def timed(n: int) -> dict:
        state = replay(enumerate(cluster_events(n, n), start=1))
        view = KeptView(lambda: state)
        admission = Admission(view)
        times: dict[str, list[float]] = {"serving_model": [], "admission_entry": [], "admission_full": []}
        for _ in range(calls):
            at = time.perf_counter_ns()
            serving_model(view(), "model-0")
            resolved = time.perf_counter_ns()
            async with admission.entry("model-0", "anonymous"):
                entered = time.perf_counter_ns()
                admission.full("model-0")
                done = time.perf_counter_ns()
            times["serving_model"].append((resolved - at) / 1000)
            times["admission_entry"].append((entered - resolved) / 1000)
            times["admission_full"].append((done - entered) / 1000)
        together = [sum(parts) for parts in zip(*times.values(), strict=True)]
        return {f"{k}_us_p50": percentile(v, 50) for k, v in times.items()} | {
            "per_request_us_p50": percentile(together, 50),
            "per_request_us_p99": percentile(together, 99),
            "first_on_a_state_us": together[0],  # once per State change: the index is built
        }

    return {str(n): asyncio.run(timed(n)) for n in sizes}


# -- what the figures imply ----------------------------------------------------------------------
def implied(one: Sequence[dict], two: Sequence[dict]) -> dict:
    """From the highest rate one gateway carried: its CPU per request, and the scheduler's, turned
    into requests/s per core and the cores 1,000 req/s need (a gateway or a scheduler process runs
    on one core: its event loop)."""
    kept = [s for s in one if s["carried"]]
    step = (kept or list(one))[-1 if kept else 0]
    gateway, scheduler = step["gateway_cpu_ms_per_request"], step["cpu_ms_per_request"]["scheduler"]
    return {
        "at_offered_rps": step["offered_rps"],
        "carried": step["carried"],
        "overhead_ms_p50": step["overhead_ms_p50"],
        "overhead_ms_p99": step["overhead_ms_p99"],
        "gateway_cpu_ms_per_request": gateway,
        "requests_per_s_per_gateway_core": 1000 / gateway if gateway else math.inf,
        "gateway_replicas_for_1000_rps": math.ceil(GOAL_RPS * gateway / 1000),
        "scheduler_cpu_ms_per_request": scheduler,
        "routes_per_s_per_scheduler_core": 1000 / scheduler if scheduler else math.inf,
        "scheduler_cores_for_1000_rps": GOAL_RPS * scheduler / 1000,
        "stack_cpu_ms_per_request": sum(
            v for k, v in step["cpu_ms_per_request"].items() if k != "bench client"
        ),
        "max_carried_rps_one_gateway": max((s["achieved_rps"] for s in kept), default=0.0),
        "max_carried_rps_two_gateways": max((s["achieved_rps"] for s in two if s["carried"]), default=0.0),
    }


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else math.nan


def replica_ratios(one: Sequence[dict], two: Sequence[dict]) -> list[dict]:
    """At each rate both ran: two gateways over one."""
    by_rate = {s["offered_rps"]: s for s in one}
    keys = ("achieved_rps", "overhead_ms_p50", "overhead_ms_p99", "gateway_cpu_ms_per_request")
    return [
        {
            "offered_rps": s["offered_rps"],
            "both_carried": s["carried"] and by_rate[s["offered_rps"]]["carried"],
        }
        | {k: ratio(s[k], by_rate[s["offered_rps"]][k]) for k in keys}
        for s in two
        if s["offered_rps"] in by_rate
    ]


# -- the stack -----------------------------------------------------------------------------------
def stack_processes(manifest, replica_pid: int) -> dict[str, list[int]]:
    """Process name -> PIDs: the stack's servers and services (the engine-worker with its engine
    process), the second gateway, and this process (the load generator and the span tap)."""
    import psutil

    processes: dict[str, list[int]] = {}
    for handle in manifest.processes:
        name = "gateway-1" if handle.name == "gateway" else handle.name
        processes[name] = [handle.pid]
        if handle.name == "engine-worker":
            processes[name] += [child.pid for child in psutil.Process(handle.pid).children(recursive=True)]
    return processes | {"gateway-2": [replica_pid], "bench client": [os.getpid()]}


def run_overhead(root: Path, rates: Sequence[float], step_s: float, quick: bool) -> dict:
    from fleet_local import stack
    from fleet_local.bootstrap import stage_and_serve
    from fleet_local.processes import free_port, spawn, stop_pid, wait_http

    sys.path.insert(0, str(REPO))
    from tests.support import make_chat_model

    # the worker offers only the echo engine, and computes no calibration or quality reference (a
    # float32 reference run of the model would take a core for seconds after the instance is ready)
    os.environ |= {"FLEET_NODE_ENGINES": "echo", "FLEET_CALIBRATION": "off"}
    source = f"file://{make_chat_model(root / 'tiny-src')}"
    manifest = stack.up(root / "stack", gateway_port=0, auth=False)
    replica = None
    try:
        stage_and_serve(manifest.gateway_url, MODEL, source, 300, print, engine="echo")
        port, log = free_port(), root / "gateway-2.log"
        env = os.environ | stack.joining_env(manifest) | {
            "FLEET_GATEWAY_HOST": "127.0.0.1",
            "FLEET_GATEWAY_PORT": str(port),
            "FLEET_HEALTH_PORT": "0",
            "FLEET_STATE_DIR": str(root / "gateway-2"),
        }  # fmt: skip
        replica = spawn([sys.executable, "-m", "fleet_gateway"], log, env)
        url = f"http://127.0.0.1:{port}"
        wait_http(replica, "gateway-2", log, f"{url}/health", 60)
        processes = stack_processes(manifest, replica.pid)
        idle_s = 1.0 if quick else 2.0
        measured = asyncio.run(
            sweep([manifest.gateway_url, url], manifest.nats_url, processes, rates, step_s, idle_s)
        )
    finally:
        if replica is not None:
            stop_pid(replica.pid)
        stack.down(root / "stack")
    one, two = measured["one_gateway"], measured["two_gateways"]
    result = {
        "engine": "echo (no model: one token per engine step), 1-token chat completions",
        "arrivals": f"open loop, Poisson, {step_s:g} s of arrivals per rate",
        "tracing": "every request traced (FLEET_TRACE_SAMPLE_RATE's default, 1): its spans split the wait",
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        **measured,
        "implied": implied(one, two),
        "two_over_one": replica_ratios(one, two),
        "state_scans": state_scans((16, 100) if quick else (16, 100, 1000), 50 if quick else 300),
    }
    result["verdict"] = verdict(result)
    return result


def verdict(result: dict) -> list[str]:
    i = result["implied"]
    lines = [
        f"gateway overhead p50 {i['overhead_ms_p50']:.2f} ms / p99 {i['overhead_ms_p99']:.2f} ms at "
        f"{i['at_offered_rps']:g} req/s on one gateway (goal: <= {GOAL_OVERHEAD_MS:g} ms p50 at "
        f"{GOAL_RPS:,} req/s across replicas)",
        f"one gateway core carries ~{i['requests_per_s_per_gateway_core']:.0f} req/s "
        f"({i['gateway_cpu_ms_per_request']:.2f} CPU ms a request): {GOAL_RPS:,} req/s need >= "
        f"{i['gateway_replicas_for_1000_rps']} gateway replicas (one core each, run full)",
        f"the scheduler spends {i['scheduler_cpu_ms_per_request']:.2f} CPU ms a request: one core routes "
        f"~{i['routes_per_s_per_scheduler_core']:.0f} req/s, {GOAL_RPS:,} req/s take "
        f"{i['scheduler_cores_for_1000_rps']:.2f} of a core (routes go to a NATS queue group: scheduler "
        "replicas can share them)",
        f"the whole stack spends {i['stack_cpu_ms_per_request']:.1f} CPU ms a request (this machine: "
        f"{result['cores']} cores for all of it and the load generator)",
    ]
    if both := [r for r in result["two_over_one"] if r["both_carried"]]:
        r = both[-1]
        lines.append(
            f"two gateways / one at {r['offered_rps']:g} req/s (the highest both carried): overhead p50 "
            f"{r['overhead_ms_p50']:.2f}x, gateway CPU per request {r['gateway_cpu_ms_per_request']:.2f}x"
        )
    steps = (*result["one_gateway"], *result["two_gateways"])
    if (busiest := max(s["other_work_cores"] for s in steps)) > NOISY_CORES:
        lines.append(
            f"other work on the machine took up to {busiest:.2f} cores during a rate's run: its latencies "
            "(and carried or not) are the machine's too; the CPU figures are each process's own"
        )
    scans = result["state_scans"]
    largest = max(scans, key=int)
    lines.append(
        f"the gateway's per-request reads of State: {scans['16']['per_request_us_p50']:.0f} us p50 at 16 "
        f"workers, {scans[largest]['per_request_us_p50']:.0f} us at {int(largest):,} (read from a view kept "
        "per State)"
    )
    return lines


def report(result: dict) -> None:
    print(f"\ngateway overhead per request, ms (GET /health p50 {result['health_ms_p50'][0]:.2f} ms)")
    print(
        "  gateways  offered achieved  overhead p50 / p99 | gateway    bus client | worker sched"
        " | CPU ms/request gateway sched | cores: ours other"
    )
    steps = sorted(
        (*result["one_gateway"], *result["two_gateways"]), key=lambda s: (s["offered_rps"], s["gateways"])
    )
    for s in steps:
        print(
            f"  {s['gateways']:8} {s['offered_rps']:8g} {s['achieved_rps']:8.0f}  "
            f"{s['overhead_ms_p50']:12.2f} / {s['overhead_ms_p99']:6.2f} | "
            f"{s['gateway_ms_p50']:7.2f} {s['bus_ms_p50']:6.2f} "
            f"{s['client_http_ms_p50']:6.2f} | {s['worker_ms_p50']:6.2f} {s['scheduler_ms_p50']:5.2f} | "
            f"{s['gateway_cpu_ms_per_request']:22.2f} {s['cpu_ms_per_request']['scheduler']:5.2f} | "
            f"{s['cores_busy']:11.2f} {s['other_work_cores']:5.2f}{'' if s['carried'] else '  not carried'}"
        )
    print("two gateways / one at the same offered rate")
    for r in result["two_over_one"]:
        print(
            f"  {r['offered_rps']:5g} req/s: achieved {r['achieved_rps']:.2f}x, overhead p50 "
            f"{r['overhead_ms_p50']:.2f}x, p99 {r['overhead_ms_p99']:.2f}x, gateway CPU per request "
            f"{r['gateway_cpu_ms_per_request']:.2f}x"
        )
    print("what it implies")
    for line in result["verdict"]:
        print(f"  {line}")
