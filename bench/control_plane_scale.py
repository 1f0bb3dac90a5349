"""The control plane at scale, simulated: no engines and no NATS, a synthetic State of N workers and the
KV block index in a real Redis (valkey-server, as `fleet up` runs it) holding millions of blocks.
(Whole at ~680 lines: its three measurements share one synthetic cluster and one Redis fill, and the
verdict reads them all; the pure parts are tested in tests/test_bench_control_plane_scale.py.)

    .venv/bin/fleet bench control-plane --scale                # 1,000 workers, 10M blocks (minutes)
    .venv/bin/fleet bench control-plane --scale --quick        # 100 workers, 100k blocks (seconds)
    .venv/bin/fleet bench control-plane --scale --workers 2000 --blocks 2000000

1. Routing: `route()` on a State of 16, 100 and N workers (one mlx instance per node, 4 models, the
   events bench/control_plane.py's cluster_events makes), with a load on every instance and a cached
   prefix on 4 nodes: p50/p99 per decision on a RoutingView kept across decisions (as the scheduler
   does), and the first decision on a new State (a new view: what a decision after an event costs).
2. KV index: Redis filled with `blocks` blocks (prompts of 8-64 chained blocks, each on one node,
   every other prompt in object storage too): the fill rate, used_memory per block, p50/p99 for
   prompts of 4, 16 and 64 blocks of routing's lookup `prefix_blocks()` (one Lua script) and of
   `holders()` (a pipeline of SMEMBERS) with its fold (cached_prefix_blocks + tokens_by_holder), and
   the whole decision as the scheduler makes it (KVLookup.cached_prefixes + LoadTracker.load() +
   route()) at N workers.
3. State: its JSON size (and GET /state's, partner table included), events/s replayed and decoded +
   applied, one event applied to the N-worker State, and the NodeMetrics each worker sends once a
   second: messages/s and the scheduler's CPU to decode and fold them (LoadTracker.on_metrics).
4. A verdict against the goal: decision p99 <= 5 ms at 1,000 workers and 10M indexed blocks.
Every call is timed on its own, so p99s take in whatever else the machine runs: run it on a quiet one
(the result records the load average). Writes bench/results/control_plane_scale-*.json.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_plane import cluster_events
from loadgen import percentile

from fleet_proto import RouteRequest, State
from fleet_proto.partners import PARTNERS_LISTED
from fleet_store.kv import DEFAULT_BLOCK_SIZE, block_hashes, model_fingerprint
from fleet_store.kv_index import DEFAULT_TTL_S, TIER2, block_key

MODELS = 4  # cluster_events' models: instance i serves model-(i % 4)
GOAL_WORKERS, GOAL_BLOCKS, GOAL_DECISION_MS = 1000, 10_000_000, 5.0
PROMPT_BLOCKS = (8, 64)  # a filled prompt's blocks, low and high
LOOKUP_BLOCKS = (4, 16, 64)
SMALL_SIZES = (16, 100)  # routing is also timed here, so the scaling shows
FILL_BATCH_PROMPTS = 2000


def summary_us(samples_ns: Sequence[int]) -> dict:
    """p50/p99/mean/max in microseconds of per-call times in nanoseconds."""
    values = [s / 1000 for s in samples_ns]
    mean = sum(values) / len(values) if values else math.nan
    return {
        "n": len(values),
        "p50_us": percentile(values, 50),
        "p99_us": percentile(values, 99),
        "mean_us": mean,
        "max_us": max(values, default=math.nan),
    }


def decision_summary(parts: Sequence[tuple[int, int, int]]) -> dict:
    """The whole decision's summary from its parts per call (KV lookup, load, route() in ns), with
    each part's, and the p50/p99 of all but route() (what route() leaves of the budget)."""
    lookup, load, routed = zip(*parts, strict=True) if parts else ((), (), ())
    rest = [a + b for a, b in zip(lookup, load, strict=True)]
    rest_summary = summary_us(rest)
    return summary_us([sum(p) for p in parts]) | {
        "lookup": summary_us(lookup),
        "load": summary_us(load),
        "route": summary_us(routed),
        "rest_p50_us": rest_summary["p50_us"],
        "rest_p99_us": rest_summary["p99_us"],
    }


def growth_exponent(small: float, large: float, small_n: int, large_n: int) -> float:
    """k in value ~ workers^k between two sizes (1: linear, 2: quadratic)."""
    if small <= 0 or large <= 0 or small_n == large_n:
        return math.nan
    return math.log(large / small) / math.log(large_n / small_n)


# --- the synthetic cluster ---------------------------------------------------------------------


def synthetic_state(workers: int) -> State:
    from fleet_proto import replay

    return replay(enumerate(cluster_events(workers, workers), start=1))


def synthetic_load(state: State, seed: int = 0) -> dict[str, int]:
    """Every instance busy: 0-32k tokens running + queued, as its worker last reported."""
    rng = random.Random(seed)
    return {instance_id: rng.randrange(32_768) for instance_id in sorted(state.instances)}


def synthetic_cached(
    state: State, model_id: str, prompt_tokens: int, holders: int = 4, seed: int = 0
) -> dict:
    """node id -> leading prompt tokens cached there, on `holders` nodes serving the model."""
    rng = random.Random(f"{seed}/{model_id}/{prompt_tokens}")
    nodes = sorted({i.node_id for i in state.instances.values() if i.model_id == model_id})
    blocks = max(prompt_tokens // DEFAULT_BLOCK_SIZE, 1)
    return {
        node: rng.randint(1, blocks) * DEFAULT_BLOCK_SIZE
        for node in rng.sample(nodes, min(holders, len(nodes)))
    }


def route_requests(count: int, blocks: Sequence[int] = LOOKUP_BLOCKS) -> list[RouteRequest]:
    """Requests cycling through the models and prompt sizes (a partial last block of 100 tokens)."""
    return [
        RouteRequest(
            request_id=f"r{i}",
            model_id=f"model-{i % MODELS}",
            prompt_tokens=blocks[i % len(blocks)] * DEFAULT_BLOCK_SIZE + 100,
        )
        for i in range(count)
    ]


# --- the KV index's synthetic prompts ------------------------------------------------------------
# Prompt p lives on node p % workers, which serves model (p % workers) % 4 (cluster_events' layout),
# and every other prompt is in object storage too.


def model_fingerprints(models: int = MODELS) -> list[str]:
    return [model_fingerprint({f"model-{m}.safetensors": f"{m:064x}"}) for m in range(models)]


def prompt_blocks(prompt: int, low: int = PROMPT_BLOCKS[0], high: int = PROMPT_BLOCKS[1]) -> int:
    """A prompt's block count, low..high, spread evenly by a multiplicative hash (no RNG state)."""
    return low + (prompt * 2654435761 % 2**32) % (high - low + 1)


def prompt_node(prompt: int, workers: int) -> int:
    return prompt % workers


def prompt_model(prompt: int, workers: int) -> int:
    return prompt_node(prompt, workers) % MODELS


def prompt_members(prompt: int, workers: int) -> tuple[str, ...]:
    node = f"node-{prompt_node(prompt, workers)}"
    return (node, TIER2) if prompt % 2 == 0 else (node,)


def prompt_hashes(fingerprint: str, prompt: int, blocks: int) -> list[str]:
    """Fleet's chained block hashes (fleet_store.kv.block_hashes) of a synthetic prompt, one token per
    block: the real scheme and key shape without hashing 256 tokens per block. The prompt number is
    its first token, so prompts share no block, and a longer call extends a shorter one's chain."""
    return block_hashes(fingerprint, [prompt, *range(1, blocks)], 1)


def fill_plan(total_blocks: int, first_prompt: int = 0) -> Iterator[tuple[int, int]]:
    """(prompt, blocks) until `total_blocks` are written (the last prompt cut short)."""
    left, prompt = total_blocks, first_prompt
    while left > 0:
        blocks = min(prompt_blocks(prompt), left)
        yield prompt, blocks
        left -= blocks
        prompt += 1


def bulk(part: str) -> str:
    """One argument of a Redis command in RESP (the protocol a pipeline speaks; ASCII here)."""
    return f"${len(part)}\r\n{part}\r\n"


def fill_commands(
    prompts: Iterable[tuple[int, int]], workers: int, fingerprints: Sequence[str], ttl_s: int = DEFAULT_TTL_S
) -> tuple[bytes, int, int]:
    """(RESP payload, commands, blocks) writing the prompts' blocks with KVIndex.add's layout: per block
    SADD fleet:kv:<fingerprint>:<hash> <members> then EXPIRE <ttl>. One SADD with both members ends where
    a worker's add(node) and later add(TIER2) end. Built as text, a block's two commands in one string:
    redis-py's packing would take most of a 10M-block fill."""
    parts: list[str] = []
    blocks = 0
    expire_tail = bulk(str(ttl_s))
    for prompt, count in prompts:
        fingerprint = fingerprints[prompt_model(prompt, workers)]
        members = prompt_members(prompt, workers)
        sadd_head, sadd_tail = f"*{2 + len(members)}\r\n{bulk('SADD')}", "".join(map(bulk, members))
        for block_hash in prompt_hashes(fingerprint, prompt, count):
            key = bulk(block_key(fingerprint, block_hash))
            parts.append(f"{sadd_head}{key}{sadd_tail}*3\r\n$6\r\nEXPIRE\r\n{key}{expire_tail}")
        blocks += count
    return "".join(parts).encode(), 2 * blocks, blocks


# --- the verdict -------------------------------------------------------------------------------


def workers_at_goal(workers: int, route_k: float, route_ms: float, rest_ms: float) -> float:
    """Workers at which rest + route() (growing as workers^route_k) reach the goal; 0 when the rest
    alone does."""
    room_ms = GOAL_DECISION_MS - rest_ms
    if room_ms <= 0 or route_ms <= 0:
        return 0.0
    return workers * (room_ms / route_ms) ** (1 / route_k)


def verdict(scale: dict) -> list[str]:
    """Lines judging the measured figures against the goal, and what grows first."""
    workers, blocks, index, state = scale["workers"], scale["blocks"], scale["index"], scale["state"]
    decision = scale["decision"]
    worst = max(decision, key=lambda size: decision[size]["p99_us"])
    p99_ms = decision[worst]["p99_us"] / 1000
    parts = decision[worst]  # route() and the KV lookup as timed inside the same decisions
    route_ms, lookup_ms = parts["route"]["p99_us"] / 1000, parts["lookup"]["p99_us"] / 1000
    ok = "meets" if p99_ms <= GOAL_DECISION_MS else "MISSES"
    at = ""
    if (workers, blocks) != (GOAL_WORKERS, GOAL_BLOCKS):
        at = f" (set at {GOAL_WORKERS:,} workers, {GOAL_BLOCKS:,} blocks)"
    larger = "route()" if parts["route"]["p50_us"] >= parts["lookup"]["p50_us"] else "the KV lookup"
    lookups = "/".join(f"{index['prefix_blocks'][s]['p99_us'] / 1000:.2f}" for s in index["prefix_blocks"])
    pipelined = "/".join(f"{index['holders'][s]['p99_us'] / 1000:.2f}" for s in index["holders"])
    lines = [
        f"decision p99 {p99_ms:.2f} ms at {workers:,} workers and {blocks:,} blocks ({worst}-block "
        f"prompts): {ok} the {GOAL_DECISION_MS:g} ms goal{at}",
        f"  in it route() p50 {parts['route']['p50_us'] / 1000:.2f} p99 {route_ms:.2f} ms, KV lookup "
        f"p50 {parts['lookup']['p50_us'] / 1000:.2f} p99 {lookup_ms:.2f} ms: the larger part is {larger}",
        f"  prefix_blocks() p99 by prompt blocks ({'/'.join(index['prefix_blocks'])}): {lookups} ms "
        f"(holders(): {pipelined} ms); by index size, holders() of 16 blocks p50 "
        f"{index['holders']['16']['p50_us'] / 1000:.2f} ms at {blocks:,} blocks, "
        f"{index['holders_16_small_index']['p50_us'] / 1000:.2f} ms at {index['small_index_blocks']:,}",
    ]
    smaller = [int(n) for n in scale["routing"] if int(n) < workers]
    small = max(smaller, default=workers)  # the next size down, to compare with

    def grow(section: dict, key: str) -> float:
        return growth_exponent(section[str(small)][key], section[str(workers)][key], small, workers)

    growth = {
        "GET /state body (partner table)": grow(state, "get_state_bytes"),
        "route() per decision": grow(scale["routing"], "p50_us"),
        "State JSON": grow(state, "state_json_bytes"),
        "one event applied": grow(state, "apply_one_event_us"),
    }
    ranked = sorted(growth.items(), key=lambda kv: -kv[1] if not math.isnan(kv[1]) else math.inf)
    lines.append(
        f"growth from {small} to {workers:,} workers: " + ", ".join(f"{n} ~N^{k:.1f}" for n, k in ranked)
    )
    route_k = growth["route() per decision"]
    if route_k > 0:  # route() is O(the model's instances), here a quarter of all: it grows with workers
        at_p99 = workers_at_goal(workers, route_k, route_ms, parts["rest_p99_us"] / 1000)
        at_p50 = workers_at_goal(
            workers, route_k, parts["route"]["p50_us"] / 1000, parts["rest_p50_us"] / 1000
        )
        said = [
            f"~{n:,.0f} workers" if n else "any size (the KV lookup and load() alone)"
            for n in (at_p99, at_p50)
        ]
        lines.append(
            f"grows first with workers: route() (O(the model's instances) per decision, ~N^{route_k:.1f} "
            f"here, where every model has N/{MODELS}): the decision "
            f"reaches {GOAL_DECISION_MS:g} ms at {said[0]} at p99, {said[1]} at p50"
        )
    top = state[str(workers)]
    metrics, per_block = scale["metrics"], index["used_memory_bytes_per_block"]
    lines += [
        f"GET /state at {workers:,} workers: {top['get_state_bytes'] / 1e6:.1f} MB in "
        f"{top['get_state_ms']:.0f} ms (its partner table: at most {PARTNERS_LISTED} partners per decoder)",
        f"metrics: {metrics['messages_per_s']:,.0f} NodeMetrics/s cost the scheduler "
        f"{100 * metrics['scheduler_core_share']:.2f}% of a core",
        f"Redis: {per_block:.0f} bytes/block: {per_block * GOAL_BLOCKS / 2**30:.2f} GiB at "
        f"{GOAL_BLOCKS:,} blocks",
    ]
    return lines


# --- what the lookups and the metrics look like --------------------------------------------------


def lookup_request(prompt: int, blocks: int, workers: int, fingerprints: Sequence[str]) -> RouteRequest:
    """A request whose first blocks are filled prompt `prompt`'s: its leading min(blocks, the prompt's)
    blocks hit, the rest (a longer conversation) miss."""
    model = prompt_model(prompt, workers)
    fingerprint = fingerprints[model]
    return RouteRequest(
        request_id=f"p{prompt}-{blocks}",
        model_id=f"model-{model}",
        prompt_tokens=blocks * DEFAULT_BLOCK_SIZE + 100,
        kv_fingerprint=fingerprint,
        block_hashes=tuple(prompt_hashes(fingerprint, prompt, blocks)),
    )


def worker_metrics(state: State, seed: int = 0) -> list:
    """One NodeMetrics per node, as fleet_worker.main.publish_metrics fills it (one GPU sampled)."""
    from fleet_proto import GpuSample, NodeMetrics

    rng = random.Random(seed)
    by_node: dict[str, list[str]] = {}
    for instance in state.instances.values():
        by_node.setdefault(instance.node_id, []).append(instance.instance_id)
    out = []
    for node_id in sorted(state.nodes):
        ids = sorted(by_node.get(node_id, []))
        gpu = GpuSample(
            index=0,
            utilization_ratio=0.8,
            temperature_c=61.0,
            power_w=350.0,
            memory_used_bytes=70 << 30,
            memory_total_bytes=80 << 30,
        )
        out.append(
            NodeMetrics(
                node_id=node_id,
                at=1.8e9 + rng.random(),
                memory_used_bytes=48 << 30,
                memory_available_bytes=16 << 30,
                cpu_percent=35.5,
                disk_free_bytes=1 << 40,
                active_requests={i: rng.randrange(1, 9) for i in ids},
                request_slots={i: 8 for i in ids},
                running_tokens={i: rng.randrange(32_768) for i in ids},
                queued_tokens={i: rng.randrange(8192) for i in ids},
                gpus=(gpu,),
                kv_memory_blocks=rng.randrange(20_000),
                kv_fetched_blocks=rng.randrange(10**6),
                kv_fetched_bytes=rng.randrange(10**12),
                kv_uploaded_blocks=rng.randrange(10**6),
                kv_uploaded_bytes=rng.randrange(10**12),
            )
        )
    return out


# --- measuring ---------------------------------------------------------------------------------


def time_routing(state: State, calls: int, first_calls: int = 50) -> dict:
    """route() per decision on the State's RoutingView, kept across decisions as the scheduler keeps
    it (the first call builds it); and `first_calls` decisions each on a new view (a new State)."""
    from fleet_proto.routing import route
    from fleet_proto.routing_view import RoutingView, view_of

    load = synthetic_load(state)
    asks = route_requests(calls)
    cached = {
        (a.model_id, a.prompt_tokens): synthetic_cached(state, a.model_id, a.prompt_tokens) for a in asks
    }
    samples, firsts = [], []
    view: RoutingView | None = None
    for ask in asks:
        held = cached[ask.model_id, ask.prompt_tokens]
        started = time.perf_counter_ns()
        view = view_of(state, view)
        reply = route(state, ask, load, held, view=view)
        samples.append(time.perf_counter_ns() - started)
        assert reply.instance_id, reply.error
    for ask in asks[:first_calls]:
        held = cached[ask.model_id, ask.prompt_tokens]
        started = time.perf_counter_ns()
        route(state, ask, load, held, view=RoutingView(state))
        firsts.append(time.perf_counter_ns() - started)
    return summary_us(samples) | {"instances": len(state.instances), "first_on_new_state": summary_us(firsts)}


def state_figures(workers: int, one_event_repeats: int = 200) -> dict:
    from fleet_proto import NodeJoined, apply, decode_event, encode, replay
    from fleet_proto.partners import partner_table
    from fleet_proto.routing_view import RoutingView

    events = cluster_events(workers, workers)
    started = time.perf_counter()
    state = replay(enumerate(events, start=1))
    replay_s = time.perf_counter() - started
    wire = [encode(e) for e in events]
    started = time.perf_counter()
    folded = State()
    for seq, data in enumerate(wire, start=1):  # what a follower does with the stream
        folded = apply(folded, decode_event(data), seq)
    decode_apply_s = time.perf_counter() - started
    state_json = msgspec.json.encode(state)
    started = time.perf_counter()  # the gateway's GET /state (fleet_gateway.app.get_state)
    body = msgspec.json.encode(
        msgspec.to_builtins(state) | {"partners": partner_table(state, RoutingView(state))}
    )
    get_state_s = time.perf_counter() - started
    rejoin = NodeJoined(node=state.nodes["node-0"])  # one more event on the full State (dicts are copied)
    samples = []
    for k in range(1, one_event_repeats + 1):
        started = time.perf_counter_ns()
        apply(state, rejoin, state.last_seq + k)
        samples.append(time.perf_counter_ns() - started)
    return {
        "events": len(events),
        "state_json_bytes": len(state_json),
        "get_state_bytes": len(body),
        "get_state_ms": 1000 * get_state_s,
        "replay_events_per_s": len(events) / replay_s,
        "decode_apply_events_per_s": len(events) / decode_apply_s,
        "apply_one_event_us": summary_us(samples)["p50_us"],
    }


def metrics_figures(state: State, messages: int) -> dict:
    from fleet_proto import NodeMetrics, encode
    from fleet_scheduler.main import LoadTracker
    from fleet_worker.main import METRICS_INTERVAL_S

    wire = [encode(m) for m in worker_metrics(state)]
    decoder, tracker = msgspec.json.Decoder(NodeMetrics), LoadTracker()
    samples = []
    for data in itertools.islice(itertools.cycle(wire), max(messages, len(wire))):
        started = time.perf_counter_ns()  # the scheduler's on_metrics callback
        tracker.on_metrics(decoder.decode(data))
        samples.append(time.perf_counter_ns() - started)
    loads = []
    for _ in range(200):
        started = time.perf_counter_ns()
        tracker.load()
        loads.append(time.perf_counter_ns() - started)
    per_s = len(wire) / METRICS_INTERVAL_S
    decode_apply = summary_us(samples)
    size = sum(map(len, wire)) / len(wire)
    return {
        "workers": len(wire),
        "interval_s": METRICS_INTERVAL_S,
        "messages_per_s": per_s,
        "message_bytes": size,
        "bytes_per_s": per_s * size,
        "decode_apply": decode_apply,
        "scheduler_core_share": per_s * decode_apply["mean_us"] / 1e6,
        "load_per_decision": summary_us(loads),
    }


def drain(sock: socket.socket, replies: int) -> None:
    """Read `replies` integer replies (":1\\r\\n"); an error reply ("-ERR ...") fails the fill."""
    lines = 0
    while lines < replies:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("Redis closed the connection during the fill")
        if b"-" in chunk:
            raise RuntimeError(f"Redis refused a fill command: {chunk[:200]!r}")
        lines += chunk.count(b"\n")


def fill(
    port: int, plan: Iterator[tuple[int, int]], workers: int, fingerprints: Sequence[str]
) -> tuple[int, int]:
    """Write the plan's blocks with KVIndex's keys and values, through one raw pipelined connection:
    KVIndex.add (redis-py, two commands per block) is too slow for 10M blocks. The next batch is built
    while Redis works on the last. Returns (prompts, blocks)."""
    prompts = blocks = owed = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        while batch := list(itertools.islice(plan, FILL_BATCH_PROMPTS)):
            payload, commands, written = fill_commands(batch, workers, fingerprints)
            drain(sock, owed)
            sock.sendall(payload)
            owed, prompts, blocks = commands, prompts + len(batch), blocks + written
        drain(sock, owed)
    return prompts, blocks


async def used_memory(client) -> int:
    return int((await client.info("memory"))["used_memory"])


async def index_figures(
    port: int, state: State, blocks: int, lookups: int, add_blocks: int
) -> tuple[dict, dict]:
    import redis.asyncio as aioredis

    from fleet_proto.routing import route
    from fleet_proto.routing_view import RoutingView, view_of
    from fleet_scheduler.main import KV_LOOKUP_TIMEOUT_S, KVLookup, LoadTracker
    from fleet_store.kv_index import KVIndex, cached_prefix_blocks, tokens_by_holder

    workers, fingerprints = len(state.nodes), model_fingerprints()
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
    index = KVIndex(client)
    sample = list(fill_plan(add_blocks, first_prompt=10**9))  # KVIndex.add's own rate, apart from the fill
    started = time.perf_counter()
    for prompt, count in sample:
        fingerprint = fingerprints[prompt_model(prompt, workers)]
        hashes = prompt_hashes(fingerprint, prompt, count)
        for member in prompt_members(prompt, workers):  # a worker adds its node, later TIER2
            await index.add(fingerprint, hashes, member)
    add_rate = add_blocks / (time.perf_counter() - started)
    small_index = []  # lookups while the index is small, to set beside those at full size
    for prompt, _ in itertools.islice(itertools.cycle(sample), lookups):
        ask = lookup_request(prompt, 16, workers, fingerprints)
        started_ns = time.perf_counter_ns()
        await index.holders(ask.kv_fingerprint, ask.block_hashes)
        small_index.append(time.perf_counter_ns() - started_ns)
    before = await used_memory(client)
    started = time.perf_counter()
    prompts, written = fill(port, fill_plan(blocks), workers, fingerprints)
    fill_s = time.perf_counter() - started
    after = await used_memory(client)
    rss = int((await client.info("memory"))["used_memory_rss"])
    for prompt in range(min(prompts, 3)):  # the fill's layout is the index's: its own reads see it
        count = min(prompt_blocks(prompt), written)
        ask = lookup_request(prompt, count, workers, fingerprints)
        assert (
            await index.holders(ask.kv_fingerprint, ask.block_hashes)
            == [set(prompt_members(prompt, workers))] * count
        )
        assert 0 < await client.ttl(block_key(ask.kv_fingerprint, ask.block_hashes[0])) <= DEFAULT_TTL_S

    tracker = LoadTracker()
    for metrics in worker_metrics(state):
        tracker.on_metrics(metrics)
    lookup = KVLookup(index, DEFAULT_BLOCK_SIZE, KV_LOOKUP_TIMEOUT_S)
    rng = random.Random(1)
    holders, prefixes, folds, decisions, hits = {}, {}, {}, {}, {}
    view: RoutingView | None = None
    for size in LOOKUP_BLOCKS:
        asks = [lookup_request(rng.randrange(prompts), size, workers, fingerprints) for _ in range(lookups)]
        times, replies, prefix_times = [], [], []
        for ask in asks:
            started = time.perf_counter_ns()
            replies.append(await index.holders(ask.kv_fingerprint, ask.block_hashes))
            times.append(time.perf_counter_ns() - started)
            started = time.perf_counter_ns()
            in_redis = await index.prefix_blocks(ask.kv_fingerprint, ask.block_hashes)
            prefix_times.append(time.perf_counter_ns() - started)
            assert in_redis == cached_prefix_blocks(replies[-1])
        fold_times, hit_blocks = [], []
        for reply in replies:  # what KVLookup.cached_prefixes does with the reply
            started = time.perf_counter_ns()
            tokens = tokens_by_holder(cached_prefix_blocks(reply), DEFAULT_BLOCK_SIZE)
            tokens.pop(TIER2, 0)
            fold_times.append(time.perf_counter_ns() - started)
            hit_blocks.append(max(tokens.values(), default=0) // DEFAULT_BLOCK_SIZE)
        parts: list[tuple[int, int, int]] = []  # per decision: the lookup, load() and route() in ns
        for ask in asks:  # the scheduler's on_route, less NATS, tracing and the RouteDecided publish
            started = time.perf_counter_ns()
            cached, tier2, _ = await lookup.cached_prefixes(ask)
            looked_up = time.perf_counter_ns()
            load = tracker.load()
            loaded = time.perf_counter_ns()
            view = view_of(state, view)
            reply = route(state, ask, load, cached, tier2, view=view)
            parts.append((looked_up - started, loaded - looked_up, time.perf_counter_ns() - loaded))
            assert reply.instance_id, reply.error
        holders[str(size)], folds[str(size)] = summary_us(times), summary_us(fold_times)
        prefixes[str(size)] = summary_us(prefix_times)
        decisions[str(size)], hits[str(size)] = (
            decision_summary(parts),
            sum(hit_blocks) / (size * len(asks)),
        )
    await client.aclose()
    index_result = {
        "blocks": written,
        "prompts": prompts,
        "fill_s": fill_s,
        "fill_blocks_per_s": written / fill_s,
        "kv_index_add_blocks_per_s": add_rate,
        "used_memory_before_bytes": before,
        "used_memory_after_bytes": after,
        "used_memory_rss_bytes": rss,
        "used_memory_bytes_per_block": (after - before) / written,
        "lookups": lookups,
        "holders": holders,
        "prefix_blocks": prefixes,
        "holders_16_small_index": summary_us(small_index),
        "small_index_blocks": add_blocks,
        "fold": folds,
        "hit_fraction": hits,
    }
    return index_result, decisions


# --- the run -----------------------------------------------------------------------------------


def report(scale: dict) -> None:
    workers, blocks, index = scale["workers"], scale["blocks"], scale["index"]
    machine = scale["machine"]
    print(
        f"\ncontrol plane at scale (simulated: {workers:,} workers, {blocks:,} indexed blocks; "
        f"{machine['cpus']} CPUs, load average {machine['load_avg_1m_at_start']:.2f} at the start)"
    )
    print(
        "route() per decision (one instance per node, 4 models, load on every instance; a RoutingView kept)"
    )
    for size, r in scale["routing"].items():
        first = r["first_on_new_state"]
        print(
            f"  {int(size):6,} workers   p50 {r['p50_us']:9.1f} us   p99 {r['p99_us']:9.1f} us   "
            f"({r['n']:,} calls); first on a new State p50 {first['p50_us']:7.1f} us"
        )
    print(
        f"KV index in Redis: {index['blocks']:,} blocks in {index['prompts']:,} prompts, filled at "
        f"{index['fill_blocks_per_s']:,.0f} blocks/s ({index['fill_s']:.1f} s; KVIndex.add "
        f"{index['kv_index_add_blocks_per_s']:,.0f} blocks/s)"
    )
    print(
        f"  used_memory {index['used_memory_bytes_per_block']:.0f} bytes/block "
        f"({index['used_memory_after_bytes'] / 2**30:.2f} GiB in all, "
        f"rss {index['used_memory_rss_bytes'] / 2**30:.2f} GiB)"
    )
    for size in map(str, LOOKUP_BLOCKS):
        h, f, d = index["holders"][size], index["fold"][size], scale["decision"][size]
        pb = index["prefix_blocks"][size]
        print(
            f"  {size:>2}-block prompt ({100 * index['hit_fraction'][size]:.0f}% of blocks hit): "
            f"prefix_blocks() p50 {pb['p50_us']:7.1f} p99 {pb['p99_us']:7.1f} us; holders() p50 "
            f"{h['p50_us']:7.1f} p99 "
            f"{h['p99_us']:7.1f} us + fold p50 {f['p50_us']:4.1f} p99 {f['p99_us']:4.1f} us"
        )
        print(
            f"      decision p50 {d['p50_us'] / 1000:6.2f} p99 {d['p99_us'] / 1000:6.2f} ms = KV lookup "
            f"p50 {d['lookup']['p50_us'] / 1000:.2f} + load() {d['load']['p50_us'] / 1000:.2f} + route() "
            f"{d['route']['p50_us'] / 1000:.2f} ms"
        )
    print("State")
    for size, s in scale["state"].items():
        print(
            f"  {int(size):6,} workers   JSON {s['state_json_bytes'] / 1e3:9.1f} kB   GET /state "
            f"{s['get_state_bytes'] / 1e6:7.2f} MB in {s['get_state_ms']:7.1f} ms   replay "
            f"{s['replay_events_per_s']:9,.0f} ev/s   "
            f"decode+apply {s['decode_apply_events_per_s']:9,.0f} ev/s   "
            f"one more event {s['apply_one_event_us']:6.1f} us"
        )
    m = scale["metrics"]
    print(
        f"NodeMetrics: {m['workers']:,} workers every {m['interval_s']:g} s = "
        f"{m['messages_per_s']:,.0f} msg/s of "
        f"{m['message_bytes']:.0f} bytes ({m['bytes_per_s'] / 1e6:.2f} MB/s); decode + on_metrics p50 "
        f"{m['decode_apply']['p50_us']:.1f} us, p99 {m['decode_apply']['p99_us']:.1f} us = "
        f"{100 * m['scheduler_core_share']:.2f}% of a core; LoadTracker.load() per decision p50 "
        f"{m['load_per_decision']['p50_us']:.1f} us"
    )
    print("verdict")
    for line in scale["verdict"]:
        print(f"  {line}")


def run_scale(workers: int | None = None, blocks: int | None = None, quick: bool = False) -> dict:
    from cluster import discard, scratch_dir

    from fleet_local.processes import stop_pid
    from fleet_local.servers import start_redis

    workers = workers or (100 if quick else GOAL_WORKERS)
    blocks = blocks or (100_000 if quick else GOAL_BLOCKS)
    calls, lookups, add_blocks, messages = (500, 100, 2000, 5000) if quick else (5000, 500, 20_000, 50_000)
    sizes = sorted({*SMALL_SIZES, workers})
    states = {n: synthetic_state(n) for n in sizes}
    result: dict = {"workers": workers, "blocks": blocks, "simulated": "no engines, no NATS; Redis real"}
    # p99s on a shared machine are mostly its other load: say how busy it was
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0]}
    result["routing"] = {str(n): time_routing(states[n], calls) for n in sizes}
    result["state"] = {str(n): state_figures(n) for n in sizes}
    result["metrics"] = metrics_figures(states[workers], messages)
    root = scratch_dir("fleet-bench-scale-")
    # no persistence, and no maxmemory, so nothing is evicted while it is measured
    redis = start_redis(root, save="", maxmemory="0")
    try:
        port = urlsplit(redis.url).port or 0
        result["index"], result["decision"] = asyncio.run(
            index_figures(port, states[workers], blocks, lookups, add_blocks)
        )
    finally:
        stop_pid(redis.pid)
    discard(root)
    result["verdict"] = verdict(result)
    report(result)
    return result
