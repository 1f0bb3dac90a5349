"""A stream that survives its worker (issue 43), measured: the gap a client sees when the worker
serving its stream is SIGKILLed, and what the continuation's prefill costs, with and without the
shared KV tier, side by side in one run.

Whole at ~750 lines: one bench's workers, fault injection, NATS taps, trace reading and report,
none of it used elsewhere (the pure parts are tested in tests/test_bench_migrate.py).

    .venv/bin/fleet bench migrate                 # SmolLM2-135M-Instruct, 5 trials a side (~15 min)
    .venv/bin/fleet bench migrate --engine mlx    # on MLX instead of vLLM
    .venv/bin/fleet bench migrate --tiny          # a tiny random llama (seconds a trial)
    .venv/bin/fleet bench migrate --dry-run       # the plan and the request; starts nothing

Starts an embedded stack whose own worker w0 serves nothing, and two workers w1 and w2 started here
(each in its own process group, state under the run's scratch folder), each with an instance of the
model on one engine: vLLM (float32 on a CPU) where it is installed, else MLX (float32 on OpenBLAS,
`compute_dtype="auto"`); calibration off. Not llama.cpp, which `fleet up` serves: its KV stays local
(EngineFacts.kv_local), so it writes no blocks to the shared tier and a continuation on it always
prefills its whole context. Remote prefill is off (FLEET_DISAGG_MIN_TOKENS): each hop prefills on
its own instance.

A trial streams one greedy request (POST /v1/completions, a fresh 2,048-token prompt given as token
ids, a nonce first: no block of it is cached anywhere; ignore_eos, max_tokens 96). Once the first
instance has streamed --kill-after tokens and the prompt's blocks are in object storage (the Redis
index lists them there), the worker serving it (from fleet.route.decided) is SIGKILLed with its
engine (its process group), and its instance deleted (so the scheduler's failover, 5 s later, does
not load it again on the surviving worker in the middle of the measurement); the gateway moves the
request to the other instance as a continuation. After the stream ends the killed worker starts
again on its state folder; before the next trial each instance started since the last one serves
one untimed request of the same prompt length (an engine process's first requests pay one-time
costs that a long-running instance would not).

Sides, alternating trial by trial:
- "tier": as deployed; the continuation's worker fetches the prompt's blocks from object storage
  and its engine prefills the rest: the last block (a block holding the prompt's last token is never
  stored, so a 2,048-token prompt leaves 7 of its 8 blocks, the most any 2k prompt re-prefills) and
  the tokens already streamed.
- "no tier": just before the kill, the prompt's blocks are deleted from the bucket
  (fleet-kv/<fingerprint>/<hash>) and their object-storage entries from the index: the state of a
  cluster whose dead worker had not uploaded them. The continuation prefills its whole context.

Measured, per side p50 and p99 over the trials:
- the gap, at the client: from its last text event before the kill to its first from the
  continuation (the first once the continuation's first token reached the bench's NATS tap, so
  tokens the dead worker had in flight do not end it). Longer waits later in the stream (a busy
  machine) are printed beside it, not counted;
- the prefill: each hop's engine `prompt_time_s` (admission to its first token, block loading
  included; the object-storage fetch before it is in the gap only), read from the TokenChunks on
  core NATS fleet.tok.<id> (hop 0) and fleet.tok.<id>-m1 (the continuation): the API does not carry
  it. Hop 0 of every trial is a cold prefill of the same 2,048 tokens on the same kind of instance,
  so resumed / cold is a ratio within one trial;
- where the gap went, from the request's trace (GET /v1/traces/<id>): when, after the kill, the
  gateway gave up on the dead worker, routed again, the new worker took the task, fetched the blocks
  and its engine produced the first token.
Goals (issue 43): gap <= 2 s with the tier (checked on p99), resumed prefill <= 0.3 x cold with the
tier (p50). Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import (
    REPO,
    Cluster,
    call,
    discard,
    scratch_dir,
    serving_everywhere,
    stage,
    until,
    workers_stack,
    write_result,
)
from loadgen import WORDS, percentile

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY = "tiny/llama-migrate"
SIDES = ("tier", "no_tier")
NODES = ("w1", "w2")  # the workers this bench starts, kills and restarts
PROMPT_TOKENS = 2048
MAX_TOKENS = 96
TINY_MAX_TOKENS = 1000  # the tiny model decodes fast: long enough for its blocks to reach the tier
KILL_AFTER = 8
GAP_GOAL_S = 2.0
PREFILL_GOAL = 0.3
# The engines whose KV goes through the shared tier (llama.cpp's stays local: EngineFacts.kv_local),
# as Fleet runs them on a CPU: MLX in float32 on OpenBLAS, vLLM in float32 with a bounded KV cache.
ENGINE_OPTIONS = {
    "mlx": {"compute_dtype": "auto"},
    "vllm": {"kv_cache_bytes": 768 << 20, "max_model_len": 4096},
}
TIER_WAIT_S = 60.0  # the prompt's blocks reach object storage within this, or the trial fails
TRIAL_TIMEOUT_S = 900.0
WARM_UP_ROUNDS = 4


# -- pure parts ------------------------------------------------------------------------------------
def trial_sides(trials: int, sides: Sequence[str] = SIDES) -> list[str]:
    """The sides in run order: alternating, `trials` of each."""
    return [side for _ in range(trials) for side in sides]


def prompt_ids(encode: Callable[[str], list[int]], nonce: str, tokens: int) -> list[int]:
    """Exactly `tokens` ids: the nonce, then English filler (encode: text -> ids, no special tokens)."""
    text, ids = nonce, encode(nonce)
    words = itertools.cycle(WORDS)
    while len(ids) < tokens:
        text += " " + " ".join(next(words) for _ in range(max(tokens - len(ids), 16)))
        ids = encode(text)
    return ids[:tokens]


def stored_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks its first prefill stores (full blocks, never its last token)."""
    return max(prompt_tokens - 1, 0) // block_size


TAP_SLACK_S = 0.05  # the bench's NATS tap may see a chunk this much after the client got its text


def client_gap(event_times: Sequence[float], killed_at: float, resumed_at: float) -> tuple[float, float]:
    """(the gap, the longest wait after it): the gap runs from the client's last text event before
    the kill to its first from the continuation, the first event once the continuation's first token
    reached the bench (`resumed_at`, its NATS tap), so tokens the dead worker had in flight are not
    taken for it. nan when either end is missing."""
    before = [t for t in event_times if t <= killed_at]
    resumed = [t for t in event_times if t >= resumed_at - TAP_SLACK_S and t > killed_at]
    if not before or not resumed:
        return float("nan"), float("nan")
    stall = max((b - a for a, b in itertools.pairwise(resumed)), default=0.0)
    return resumed[0] - before[-1], stall


def hop(stream_id: str, request_id: str) -> int:
    """The hop a token stream belongs to (fleet_gateway.generation.hop_stream_id), -1: not this request."""
    if stream_id == request_id:
        return 0
    prefix = f"{request_id}-m"
    tail = stream_id.removeprefix(prefix)
    return int(tail) if stream_id.startswith(prefix) and tail.isdigit() else -1


@dataclass
class Trial:
    """One request's record; the bench fills it as the trial runs."""

    side: str
    request_id: str = ""
    node: str = ""  # the node whose worker was killed
    event_times: list[float] = field(default_factory=list)  # client: each text event (monotonic)
    killed_at: float = 0.0
    tokens_at_kill: int = 0  # hop 0's tokens on the wire when the kill came
    tier_blocks: int = 0  # of the prompt's stored blocks, in object storage at the kill
    deleted_blocks: int = 0  # "no tier": blocks removed from the bucket and the index
    hops: dict[int, dict] = field(default_factory=dict)  # hop -> its last chunk's engine numbers
    completion_tokens: int = 0
    migrations: int = -1  # RequestStats.migrations (-1: no stats seen)
    errors: list[str] = field(default_factory=list)
    killed_at_ns: int = 0  # the kill on the wall clock (the spans' clock)
    resumed_at: float = 0.0  # the continuation's first token chunk at the bench's tap (monotonic)
    spans: list[dict] = field(default_factory=list)  # the request's trace (GET /v1/traces/{id})


# What happened after the kill, in order: the gateway gave up on hop 0, routed again, the new
# worker took the task, fetched the prompt's blocks, its engine sent the first token.
MILESTONES = ("noticed", "routed", "taken", "fetched", "first_token")


def timeline(spans: Sequence[dict], killed_at_ns: int) -> dict[str, float]:
    """Seconds from the kill to each milestone, from the request's trace (spans as GET /v1/traces
    gives them); a milestone with no span is left out."""
    streams = {s["attributes"].get("fleet.hop"): s for s in spans if s["category"] == "stream"}
    if 0 not in streams or 1 not in streams:
        return {}
    moved_ns, hop1 = streams[0]["end_ns"], streams[1]["span_id"]
    task = next((s for s in spans if s["name"] == "worker task" and s["parent_id"] == hop1), None)
    under = [s for s in spans if task is not None and s["parent_id"] == task["span_id"]]
    ends = {
        "noticed": moved_ns,
        "routed": min(
            (s["end_ns"] for s in spans if s["name"] == "route" and s["start_ns"] >= moved_ns), default=0
        ),
        "taken": task["start_ns"] if task else 0,
        "fetched": next((s["end_ns"] for s in under if s["name"].startswith("kv prefetch")), 0),
        "first_token": next((s["end_ns"] for s in under if s["name"] == "prefill"), 0),
    }
    return {name: (ends[name] - killed_at_ns) / 1e9 for name in MILESTONES if ends[name]}


def trial_row(trial: Trial, max_tokens: int) -> dict:
    """A trial's figures and what makes it not count (`problems`) or worth a look (`flags`)."""
    cold, resumed = trial.hops.get(0, {}), trial.hops.get(1, {})
    row: dict = {"side": trial.side, "node_killed": trial.node, "tokens_at_kill": trial.tokens_at_kill}
    row |= {"tier_blocks_at_kill": trial.tier_blocks, "deleted_blocks": trial.deleted_blocks}
    row |= {"migrations": trial.migrations, "completion_tokens": trial.completion_tokens}
    killed = bool(trial.killed_at and trial.resumed_at)
    row["gap_s"], row["later_stall_s"] = (
        client_gap(trial.event_times, trial.killed_at, trial.resumed_at) if killed else (float("nan"),) * 2
    )
    row["timeline_s"] = timeline(trial.spans, trial.killed_at_ns)
    if row["gap_s"] == row["gap_s"]:  # the client's first text event from the continuation
        before = max(t for t in trial.event_times if t <= trial.killed_at)
        row["timeline_s"]["client"] = before + row["gap_s"] - trial.killed_at
    row["cold_prefill_s"] = cold.get("prompt_time_s", 0.0)
    row["resumed_prefill_s"] = resumed.get("prompt_time_s", 0.0)
    row["resumed_cached_tokens"] = resumed.get("prefix_cached_tokens", 0)
    # the continuation's context is the prompt and what hop 0 streamed; what no block covered, it prefilled
    context = resumed.get("prompt_tokens", 0) + cold.get("tokens", 0)
    row["resumed_prefilled_tokens"] = context - row["resumed_cached_tokens"] if resumed else 0
    row["resumed_over_cold"] = (
        row["resumed_prefill_s"] / row["cold_prefill_s"] if row["cold_prefill_s"] > 0 else float("nan")
    )
    problems = list(trial.errors)
    if not trial.killed_at:
        problems.append("no kill")
    elif trial.migrations < 1 or not resumed:
        problems.append("the request did not move")
    if trial.completion_tokens != max_tokens:
        problems.append(f"{trial.completion_tokens} of {max_tokens} tokens")
    if trial.killed_at and row["gap_s"] != row["gap_s"]:
        problems.append("no token from the continuation")
    if cold.get("prefix_cached_tokens", 0):
        problems.append(f"hop 0 reused {cold['prefix_cached_tokens']} tokens: not cold")
    flags = []
    if trial.side == "tier" and resumed and not row["resumed_cached_tokens"]:
        flags.append("the continuation reused no block")
    if trial.side == "no_tier" and row["resumed_cached_tokens"]:
        problems.append(f"the continuation reused {row['resumed_cached_tokens']} tokens without the tier")
    row["problems"], row["flags"] = problems, flags
    return row


def side_summary(rows: Sequence[dict]) -> dict:
    """p50 / p99 of the gap and of resumed / cold over the trials that count."""
    ok = [r for r in rows if not r["problems"]]
    gaps = [r["gap_s"] for r in ok]
    ratios = [r["resumed_over_cold"] for r in ok]
    return {
        "trials": len(ok),
        "failed": len(rows) - len(ok),
        "gap_p50_s": percentile(gaps, 50),
        "gap_p99_s": percentile(gaps, 99),
        "resumed_over_cold_p50": percentile(ratios, 50),
        "resumed_over_cold_p99": percentile(ratios, 99),
        "cold_prefill_p50_s": percentile([r["cold_prefill_s"] for r in ok], 50),
        "resumed_prefill_p50_s": percentile([r["resumed_prefill_s"] for r in ok], 50),
        "resumed_cached_tokens_p50": statistics.median([r["resumed_cached_tokens"] for r in ok]) if ok else 0,
        "later_stall_max_s": max((r["later_stall_s"] for r in ok), default=float("nan")),
        "timeline_p50_s": {
            name: percentile(found, 50)
            for name in (*MILESTONES, "client")
            if (found := [r["timeline_s"][name] for r in ok if name in r["timeline_s"]])
        },
    }


def summarize(rows: Sequence[dict], sides: Sequence[str] = SIDES) -> dict:
    summary: dict = {side: side_summary([r for r in rows if r["side"] == side]) for side in sides}
    tier, no_tier = summary.get("tier", {}), summary.get("no_tier", {})
    if tier and no_tier:  # what the tier saves, side by side
        summary["tier_over_no_tier"] = {
            "gap_p50": tier["gap_p50_s"] / no_tier["gap_p50_s"],
            "resumed_prefill_p50": tier["resumed_prefill_p50_s"] / no_tier["resumed_prefill_p50_s"],
        }
    summary["goals"] = {
        "gap_p99_with_tier_le_2s": tier.get("gap_p99_s", float("nan")) <= GAP_GOAL_S,
        "resumed_over_cold_with_tier_le_0.3": tier.get("resumed_over_cold_p50", float("nan")) <= PREFILL_GOAL,
    }
    return summary


def describe_timeline(offsets: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in offsets.items())


def report_lines(summary: dict, sides: Sequence[str] = SIDES) -> list[str]:
    names = {"tier": "with the tier", "no_tier": "without tier"}
    lines = []
    for side in sides:
        s = summary[side]
        failed = f", {s['failed']} failed" if s["failed"] else ""
        lines.append(
            f"{names.get(side, side):14} gap p50 {s['gap_p50_s']:.2f} s, p99 {s['gap_p99_s']:.2f} s; resumed"
            f" / cold prefill p50 {s['resumed_over_cold_p50']:.3f}, p99 {s['resumed_over_cold_p99']:.3f} "
            f"({s['resumed_prefill_p50_s']:.2f} s / {s['cold_prefill_p50_s']:.2f} s, "
            f"{s['resumed_cached_tokens_p50']:.0f} tokens reused; n={s['trials']}{failed})"
        )
        if s["timeline_p50_s"]:
            lines.append(f"{'':14} after the kill (p50): {describe_timeline(s['timeline_p50_s'])}")
    if "tier_over_no_tier" in summary:
        saved = summary["tier_over_no_tier"]
        lines.append(
            f"with / without the tier: gap p50 {saved['gap_p50']:.2f}x, "
            f"resumed prefill p50 {saved['resumed_prefill_p50']:.2f}x"
        )
    goals = summary["goals"]

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    lines.append(
        f"goals (with the tier): gap p99 <= {GAP_GOAL_S:.0f} s {verdict(goals['gap_p99_with_tier_le_2s'])}; "
        f"resumed <= {PREFILL_GOAL} x cold {verdict(goals['resumed_over_cold_with_tier_le_0.3'])}"
    )
    return lines


def request_body(model: str, prompt: Sequence[int] | str, max_tokens: int, stream: bool = True) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


def describe_plan(args: argparse.Namespace, model: str) -> str:
    sides = trial_sides(args.trials)
    body = request_body(model, f"<{args.prompt_tokens} token ids, a nonce first>", args.max_tokens)
    return "\n".join(
        [
            f"plan: {len(sides)} trials ({args.trials} a side, alternating: {', '.join(sides[:4])}, ...)",
            f"  own stack: w0 serves nothing; {' and '.join(NODES)} each a {args.engine} instance of {model}",
            f"  each trial: POST /v1/completions {json.dumps(body)}",
            f"  after {args.kill_after} tokens and the prompt's blocks in object storage: SIGKILL the "
            "serving worker's process group (no tier: the blocks deleted first), delete its instance; "
            "restart it after the stream, and warm its new instance up with one untimed request",
        ]
    )


def worker_settings(engine: str) -> dict[str, str]:
    """A bench worker's FLEET_* settings: one engine, no calibration (instances name their engine)."""
    return {
        "FLEET_NODE_ENGINES": engine,
        "FLEET_CALIBRATION": "off",
        "FLEET_ENGINE_OPTIONS": json.dumps({engine: ENGINE_OPTIONS[engine]}),
    }


# -- the stack ---------------------------------------------------------------------------------------
@contextmanager
def own_stack(root: Path, engine: str) -> Iterator[Cluster]:
    # no remote prefill: each hop's prefill is its own instance's (a partner would hold the prompt's
    # blocks in its memory, and the cold prefill would not be the decoder's)
    with workers_stack(
        root, NODES, worker_settings(engine), {"FLEET_DISAGG_MIN_TOKENS": "1000000000"}
    ) as cluster:
        yield cluster


async def restart(cluster: Cluster, node: str, model: str, layers: int, engine: str) -> None:
    """Start the killed node's worker again once the cluster has seen it go, and wait for both."""
    async with aiohttp.ClientSession() as session:
        await until(session, cluster.gateway, lambda s: node not in s["nodes"], 120)
    cluster.start(node)
    await serving_everywhere(cluster, model, layers, engine)


# -- one trial -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """What every trial needs: the cluster, the model, its KV identity and tokenizer, the options."""

    cluster: Cluster
    model: str
    fingerprint: str
    block_size: int
    encode: Callable[[str], list[int]]
    args: argparse.Namespace


async def warm_up(run: Run, nodes: Sequence[str]) -> list[str]:
    """Have each of `nodes` serve one untimed request of the trial's prompt length (a fresh prompt,
    a few tokens): a new engine process's first requests pay one-time costs (allocations, kernels
    picked for new shapes) that a long-running instance would not. Routing cannot be pinned, so two
    requests go at once (balanced by load), for a few rounds. Returns the nodes left cold."""
    import msgspec

    from fleet_bus import Bus
    from fleet_proto import RouteDecided
    from fleet_proto.subjects import ROUTE_DECIDED_SUBJECT

    cold, served = set(nodes), []
    if not cold:
        return []
    bus = await Bus.connect(run.cluster.manifest.nats_url, "bench-migrate-warm")

    async def on_decided(msg) -> None:
        served.append(msgspec.json.decode(msg.data, type=RouteDecided).reply.worker_id)

    sub = await bus.nc.subscribe(ROUTE_DECIDED_SUBJECT, cb=on_decided)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TRIAL_TIMEOUT_S)) as session:
            for _ in range(WARM_UP_ROUNDS):
                nonces = [f"Warm {secrets.token_hex(6)}:" for _ in NODES]
                prompts = [prompt_ids(run.encode, nonce, run.args.prompt_tokens) for nonce in nonces]
                bodies = [request_body(run.model, prompt, 4, stream=False) for prompt in prompts]
                url = f"{run.cluster.gateway}/v1/completions"
                await asyncio.gather(*(call(session, "POST", url, body) for body in bodies))
                cold -= set(served)
                if not cold:
                    break
                await asyncio.sleep(1.5)  # the nodes' metrics say idle again
    finally:
        await sub.unsubscribe()
        await bus.close()
    return sorted(cold)


async def trial(run: Run, side: str) -> Trial:
    import msgspec

    from fleet_bus import Bus
    from fleet_local import stack
    from fleet_proto import RequestStats, RouteDecided, TokenChunk
    from fleet_proto.subjects import REQUEST_STATS_SUBJECT, ROUTE_DECIDED_SUBJECT
    from fleet_store import KV_BUCKET, ObjectStore
    from fleet_store.kv import block_hashes
    from fleet_store.kv_index import TIER2, KVIndex, object_key

    args, record = run.args, Trial(side)
    prompt = prompt_ids(run.encode, f"Trial {secrets.token_hex(6)}:", args.prompt_tokens)
    hashes = block_hashes(run.fingerprint, prompt, run.block_size)
    stored = hashes[: stored_blocks(len(prompt), run.block_size)]
    chunks: dict[str, list[TokenChunk]] = {}
    decided: dict[str, tuple[str, str]] = {}  # request id -> (node, instance) hop 0 was routed to
    stats: dict[str, RequestStats] = {}
    done = asyncio.Event()

    async def on_chunk(msg) -> None:
        chunk = msgspec.json.decode(msg.data, type=TokenChunk)
        chunks.setdefault(chunk.request_id, []).append(chunk)
        if chunk.token_ids and not record.resumed_at and hop(chunk.request_id, record.request_id) > 0:
            record.resumed_at = time.monotonic()

    async def on_decided(msg) -> None:
        entry = msgspec.json.decode(msg.data, type=RouteDecided)
        decided.setdefault(entry.request_id, (entry.reply.worker_id, entry.reply.instance_id))

    async def on_stats(msg) -> None:
        entry = msgspec.json.decode(msg.data, type=RequestStats)
        stats[entry.request_id] = entry

    def tokens_of(stream_id: str) -> int:
        return sum(len(c.token_ids) for c in chunks.get(stream_id, []))

    async def stream(session: aiohttp.ClientSession) -> None:
        url = f"{run.cluster.gateway}/v1/completions"
        async with session.post(url, json=request_body(run.model, prompt, args.max_tokens)) as response:
            if response.status != 200:
                record.errors.append(f"{response.status} {await response.text()}")
                return
            while True:
                frame = (await response.content.readuntil(b"\n\n")).decode().strip()
                if frame == "data: [DONE]" or not frame.startswith("data: "):
                    if frame == "data: [DONE]":
                        return
                    continue
                event = json.loads(frame.removeprefix("data: "))
                if "error" in event:
                    record.errors.append(str(event["error"]))
                    continue
                record.request_id = event.get("id", record.request_id)
                if event.get("usage"):
                    record.completion_tokens = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    record.event_times.append(time.monotonic())

    async def fault(session: aiohttp.ClientSession, index: KVIndex, store: ObjectStore) -> None:
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while not (record.request_id and tokens_of(record.request_id) >= args.kill_after):
            if done.is_set() or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + TIER_WAIT_S
        while True:  # the blocks hop 0 stored, uploaded (or the trial says how many were)
            holders = await index.holders(run.fingerprint, stored)
            record.tier_blocks = next((i for i, h in enumerate(holders) if TIER2 not in h), len(stored))
            if record.tier_blocks == len(stored) or done.is_set() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        node, instance_id = decided.get(record.request_id, ("", ""))
        if done.is_set() or node not in run.cluster.pids:
            record.errors.append(f"stream over or no route decision seen (node {node!r}) before the kill")
            return
        if side == "no_tier":
            await asyncio.gather(
                *(asyncio.to_thread(store.delete, KV_BUCKET, object_key(run.fingerprint, h)) for h in hashes)
            )
            await index.remove(run.fingerprint, hashes, TIER2)
            record.deleted_blocks = record.tier_blocks
        record.node, record.tokens_at_kill = node, tokens_of(record.request_id)
        record.killed_at, record.killed_at_ns = time.monotonic(), time.time_ns()
        run.cluster.kill(node)
        # Gone from the state: the scheduler's failover (FLEET_NODE_TIMEOUT_S later) has nothing to
        # place again on the surviving worker, whose engine would load it mid-measurement.
        await call(session, "DELETE", f"{run.cluster.gateway}/instances/{instance_id}")

    settings = stack.connection_settings(run.cluster.manifest)
    bus = await Bus.connect(run.cluster.manifest.nats_url, "bench-migrate")
    index, store = KVIndex.from_url(settings.redis_url), ObjectStore.from_settings(settings)
    subs = [
        await bus.nc.subscribe("fleet.tok.>", cb=on_chunk),
        await bus.nc.subscribe(ROUTE_DECIDED_SUBJECT, cb=on_decided),
        await bus.nc.subscribe(REQUEST_STATS_SUBJECT, cb=on_stats),
    ]
    await bus.nc.flush()
    try:
        timeout = aiohttp.ClientTimeout(total=TRIAL_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            faulting = asyncio.create_task(fault(session, index, store))
            try:
                await stream(session)
            finally:
                done.set()
                await faulting
        for _ in range(50):  # the gateway publishes the stats as the last chunk goes out
            if record.request_id in stats:
                break
            await asyncio.sleep(0.1)
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await bus.close()
        await index.close()
        store.close()
    if record.request_id in stats:
        record.migrations = stats[record.request_id].migrations
    for stream_id, got in chunks.items():
        if (n := hop(stream_id, record.request_id)) >= 0:
            last = max(got, key=lambda c: c.index)
            record.hops[n] = {
                "prompt_time_s": last.prompt_time_s,
                "prefix_cached_tokens": last.prefix_cached_tokens,
                "prompt_tokens": last.prompt_tokens,
                "tokens": tokens_of(stream_id),
            }
    if record.killed_at:
        record.spans = await trace_spans(run.cluster.gateway, record.request_id)
    return record


async def trace_spans(gateway: str, request_id: str) -> list[dict]:
    """The request's spans once the continuation's prefill is among them (spans come in batches)."""
    spans: list[dict] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.get(f"{gateway}/v1/traces/{request_id}") as response:
                spans = (await response.json()).get("spans", []) if response.status == 200 else []
            if timeline(spans, 0).get("first_token"):
                break
            await asyncio.sleep(0.2)
    return spans


def describe_trial(i: int, row: dict) -> str:
    what = "no tier" if row["side"] == "no_tier" else "tier"
    blocks = f"{row['tier_blocks_at_kill']} blocks in the tier"
    if row["deleted_blocks"]:
        blocks += ", deleted"
    notes = "; ".join(row["problems"] + row["flags"])
    return (
        f"  {i:2} {what:7} killed {row['node_killed'] or '-'} after {row['tokens_at_kill']} tokens "
        f"({blocks}): gap {row['gap_s']:.2f} s (later waits <= {row['later_stall_s']:.2f} s); "
        f"prefill cold {row['cold_prefill_s']:.2f} s, resumed "
        f"{row['resumed_prefill_s']:.2f} s ({row['resumed_cached_tokens']} tokens reused, "
        f"{row['resumed_prefilled_tokens']} prefilled) = "
        f"{row['resumed_over_cold']:.3f}{'  [' + notes + ']' if notes else ''}"
        + (f"\n     after the kill: {describe_timeline(row['timeline_s'])}" if row["timeline_s"] else "")
    )


# -- the run ---------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fleet bench migrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5, help="trials a side (default 5)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument(
        "--max-tokens", type=int, default=0, help=f"default {MAX_TOKENS}; --tiny {TINY_MAX_TOKENS}"
    )
    parser.add_argument("--kill-after", type=int, default=KILL_AFTER, help="tokens streamed before the kill")
    parser.add_argument(
        "--engine", choices=sorted(ENGINE_OPTIONS), help="default: vllm where installed, else mlx"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (servers' logs)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (TINY_MAX_TOKENS if args.tiny else MAX_TOKENS)
    args.engine = args.engine or ("vllm" if importlib.util.find_spec("vllm") else "mlx")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if not 0 < args.kill_after < args.max_tokens:
        parser.error("--kill-after must be between 1 and --max-tokens - 1")
    if args.prompt_tokens < 2:
        parser.error("--prompt-tokens must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = TINY if args.tiny else SMOLLM2
    print(describe_plan(args, model), flush=True)
    if args.dry_run:
        return 0
    from tokenizers import Tokenizer

    from fleet_local.bootstrap import DEFAULT_SOURCE
    from fleet_local.stack import connection_settings
    from fleet_store import ObjectStore, load_manifest
    from fleet_store.kv import manifest_fingerprint

    root = scratch_dir("fleet-bench-migrate-")
    source, layers = DEFAULT_SOURCE, 30
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        layers = 2
        wide = {"hidden": 128} if args.engine == "vllm" else {}  # vLLM's CPU attention: head size 32
        source = f"file://{make_chat_model(root / 'tiny-src', max_positions=8192, **wide)}"
    rows = []
    with own_stack(root, args.engine) as cluster:
        asyncio.run(stage(cluster.gateway, model, source, nodes=len(NODES) + 1))
        asyncio.run(serving_everywhere(cluster, model, layers, args.engine))
        settings = connection_settings(cluster.manifest)
        store = ObjectStore.from_settings(settings)
        fingerprint = manifest_fingerprint(load_manifest(store, "fleet-models", model, "main"))
        store.close()
        tokenizer = Tokenizer.from_file(str(root / NODES[0] / "models" / model / "main" / "tokenizer.json"))

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False).ids)

        run = Run(cluster, model, fingerprint, settings.kv_block_size, encode, args)
        print(f"{model} on {args.engine} on {' and '.join(NODES)}; fingerprint {fingerprint}", flush=True)
        to_warm: Sequence[str] = NODES
        for i, side in enumerate(trial_sides(args.trials)):
            if still_cold := asyncio.run(warm_up(run, to_warm)):
                print(f"  (no warm-up request reached {', '.join(still_cold)})", flush=True)
            record = asyncio.run(trial(run, side))
            row = trial_row(record, args.max_tokens) | {"hops": record.hops}
            row["events_after_kill_s"] = [
                round(t - record.killed_at, 3) for t in record.event_times if t > record.killed_at
            ]
            if args.keep:  # the whole trace, for reading beside the logs
                row["spans"] = record.spans
            rows.append(row)
            print(describe_trial(i, row), flush=True)
            if record.killed_at:
                asyncio.run(restart(cluster, record.node, model, layers, args.engine))
            to_warm = (record.node,) if record.killed_at else ()
    summary = summarize(rows)
    print()
    for line in report_lines(summary):
        print(line)
    result = {
        "model": model,
        "engine": args.engine,
        "engine_options": ENGINE_OPTIONS[args.engine],
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "kill_after": args.kill_after,
        "summary": summary,
        "trials": rows,
        "goals": {"gap_s": GAP_GOAL_S, "resumed_over_cold": PREFILL_GOAL},
    }
    write_result(args.out, f"migrate-{'tiny' if args.tiny else 'smollm2'}", result)
    if not args.keep and all(not r["problems"] for r in rows):
        discard(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
