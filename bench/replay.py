"""fleet bench replay: a workload trace (bench/workload.py: multi-turn chats, agent loops, long
documents, shared system prompts) replayed against OpenAI-compatible servers, side by side.

    fleet bench replay --write-trace chat.jsonl --sessions 24 --rate 0.5 \
        --param agent_share=0 --param document_share=0                          # write a trace
    fleet bench replay --trace chat.jsonl --url http://127.0.0.1:8080 --model M   # any server
    fleet bench replay --policies kv,round-robin,least-loaded --workers 2     # Fleet, own stacks
    fleet bench replay --trace chat.jsonl --peers llama.cpp                  # + llama.cpp's server
    fleet bench replay --quick                                                # what the test runs

Each Fleet side is a fresh embedded stack (so every side starts cold) whose own worker serves
nothing, plus `--workers` engine-workers (one llama.cpp instance of the default model each, one
thread each) and the scheduler's FLEET_ROUTING_POLICY set to the side's policy. Sessions replay as
closed loops: a session's first request at its arrival, each next one `think_s` after the previous
answer ended (greedy, streamed, the trace's max_tokens). Per side: TTFT p50/p99, end-to-end latency
p50/p99, output tokens/s over the replay, and the prompt tokens the engine found cached (each
response's usage.prompt_tokens_details.cached_tokens, which Fleet fills from its engines' prefix
caches) against those it had to compute. A peer (`--peers llama.cpp`: llama-cpp-python's server with
its RAM prompt cache, `make bench-install`) serves the same GGUF with as many threads as the largest
Fleet side has workers (the same cores); it reports no cached tokens. Ratios are to the side named
by --baseline. Bounded: a timeout per request and per replay; every server on 127.0.0.1. Writes JSON
to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from itertools import pairwise
from pathlib import Path
from typing import TypeVar

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, discard, scratch_dir, serving_everywhere, stage, workers_stack, write_result
from loadgen import percentile
from workload import TraceParams, TraceRequest, describe, generate, read_trace, write_trace

from fleet_proto.routing import ROUTING_POLICIES

Turned = TypeVar("Turned", TraceRequest, "TurnResult")
REQUEST_TIMEOUT_S = 300.0
ENGINE = "llamacpp"  # the default model's engine; its KV stays in its slots (routed_prefixes.py)
# one thread per worker (the sides share this machine's cores) and room for many conversations'
# histories in its slots (the trained context, 8k cells, would hold only a few)
ENGINE_OPTIONS = {"n_threads": 1, "n_ctx": 16384}
PEER_CACHE_BYTES = 2 << 30  # llama.cpp server's prompt cache: many conversations' states
QUICK = TraceParams(sessions=4, chat_turns=(2, 3), agent_steps=(2, 3), system_tokens=120, document_tokens=300,
                    think_s=0.2, agent_think_s=0.1, rate=2.0, max_tokens=8)  # fmt: skip


@dataclass
class TurnResult:
    session: str
    turn: int
    kind: str
    sent_at_s: float  # since the replay began
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cache_reported: bool = False  # the server said how many prompt tokens it found cached
    content_chunks: int = 0  # streamed chunks with text: the output tokens of a server without usage
    error: str = ""
    request_id: str = ""
    worker: str = ""  # Fleet sides: the worker the scheduler routed it to, and why
    route_reason: str = ""


# -- pure parts ------------------------------------------------------------------------------------
def sessions_of(requests: Sequence[Turned]) -> dict[str, list[Turned]]:
    """Each session's requests (or results) in turn order."""
    sessions: dict[str, list[Turned]] = defaultdict(list)
    for request in requests:
        sessions[request.session].append(request)
    return {name: sorted(turns, key=lambda r: r.turn) for name, turns in sessions.items()}


def chat_body(model: str, request: TraceRequest) -> dict:
    return {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def read_event(data: dict, result: TurnResult, sent: float, now: float) -> None:
    """One streamed chunk into the turn's result: the first content sets TTFT, usage the counts."""
    result.request_id = result.request_id or data.get("id", "")
    for choice in data.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            result.ttft_s = result.ttft_s or now - sent
            result.content_chunks += 1
    usage = data.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details")
        result.cache_reported = details is not None
        result.cached_tokens = (details or {}).get("cached_tokens") or 0


def summarize(results: Sequence[TurnResult], wall_s: float) -> dict:
    ok = [r for r in results if not r.error]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s]
    e2e = [r.e2e_s for r in ok]
    hit = cached / prompt if prompt and any(r.cache_reported for r in ok) else None  # None: not said
    by_kind = {}
    for kind in sorted({r.kind for r in ok}):
        mine = [r for r in ok if r.kind == kind]
        kind_prompt = sum(r.prompt_tokens for r in mine)
        by_kind[kind] = {
            "requests": len(mine),
            "ttft_p50_ms": 1000 * percentile([r.ttft_s for r in mine if r.ttft_s] or [0.0], 50),
            "cache_hit": sum(r.cached_tokens for r in mine) / kind_prompt if kind_prompt else 0.0,
        }
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r.error for r in results if r.error][:3],
        "ttft_p50_ms": 1000 * percentile(ttft or [0.0], 50),
        "ttft_p99_ms": 1000 * percentile(ttft or [0.0], 99),
        "e2e_p50_ms": 1000 * percentile(e2e or [0.0], 50),
        "e2e_p99_ms": 1000 * percentile(e2e or [0.0], 99),
        "output_tokens_per_s": sum(r.completion_tokens or r.content_chunks for r in ok) / wall_s
        if wall_s
        else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit": hit,
        "recomputed": None if hit is None else 1 - hit,
        "by_kind": by_kind,
        "stayed_with_history": stayed_share(ok),
        "wall_s": wall_s,
    }


def stayed_share(results: Sequence[TurnResult]) -> float | None:
    """Of the later turns whose worker is known, the share routed to the worker of the session's
    previous turn, where its history is (None when no worker is known: not a Fleet side)."""
    pairs = [
        (a.worker, b.worker)
        for turns in sessions_of(results).values()
        for a, b in pairwise(turns)
        if a.worker and b.worker
    ]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def ratios(sides: dict[str, dict], baseline: str) -> dict[str, dict[str, float]]:
    """Each side's TTFT p50/p99 and end-to-end p50 over the baseline's (< 1: faster)."""
    base = sides.get(baseline)
    if not base:
        return {}
    keys = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms")
    return {
        name: {key: side[key] / base[key] for key in keys if base[key]}
        for name, side in sides.items()
        if name != baseline
    }


def report_lines(sides: dict[str, dict], baseline: str) -> list[str]:
    columns = ("TTFT p50", 10), ("p99", 9), ("e2e p50", 10), ("p99", 9), ("tok/s", 8), ("cached", 8)
    header = "".join(f"{name:>{width}}" for name, width in (*columns, ("stayed", 8), ("errors", 8)))
    lines = [f"{'side':<22}{header}"]
    for name, s in sides.items():
        stayed = "-" if s.get("stayed_with_history") is None else f"{s['stayed_with_history']:.0%}"
        hit = "-" if s.get("cache_hit") is None else f"{s['cache_hit']:.0%}"
        lines.append(
            f"{name:<22}{s['ttft_p50_ms']:>8.0f}ms{s['ttft_p99_ms']:>7.0f}ms{s['e2e_p50_ms']:>8.0f}ms"
            f"{s['e2e_p99_ms']:>7.0f}ms{s['output_tokens_per_s']:>8.1f}{hit:>8}{stayed:>8}{s['errors']:>8}"
        )
    for name, r in ratios(sides, baseline).items():
        shown = ", ".join(f"{k.removesuffix('_ms')} {v:.2f}x" for k, v in r.items())
        lines.append(f"{name} / {baseline}: {shown}")
    return lines


# -- replaying -------------------------------------------------------------------------------------
async def send_turn(
    session: aiohttp.ClientSession, url: str, model: str, request: TraceRequest, began: float
) -> TurnResult:
    sent = time.monotonic()
    result = TurnResult(request.session, request.turn, request.kind, sent - began)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=chat_body(model, request)) as response:
            if response.status != 200:
                result.error = f"{response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                if line.startswith(b"data: {"):
                    read_event(json.loads(line[6:]), result, sent, time.monotonic())
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.monotonic() - sent
    return result


async def routed_workers(nats_url: str, workers: dict[str, tuple[str, str]]):
    """Follow Fleet's routing decisions (fleet.route.decided): request id -> (worker, reason)."""
    import msgspec

    from fleet_bus import Bus
    from fleet_proto import RouteDecided
    from fleet_proto.subjects import ROUTE_DECIDED_SUBJECT

    bus = await Bus.connect(nats_url, "bench-replay")

    async def on_decided(msg) -> None:
        decided = msgspec.json.decode(msg.data, type=RouteDecided)
        workers[decided.request_id] = (decided.reply.worker_id, decided.reply.reason)

    await bus.nc.subscribe(ROUTE_DECIDED_SUBJECT, cb=on_decided)
    return bus


async def replay(
    url: str, model: str, requests: Sequence[TraceRequest], nats_url: str = "", headers: dict | None = None
) -> dict:
    """Every session as a closed loop from its arrival; the summary of the whole replay (with
    `nats_url`, a Fleet side's, each turn's worker too)."""
    results: list[TurnResult] = []
    workers: dict[str, tuple[str, str]] = {}
    bus = await routed_workers(nats_url, workers) if nats_url else None
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async with aiohttp.ClientSession(timeout=timeout, headers=headers or {}) as session:
        began = time.monotonic()

        async def run_session(turns: list[TraceRequest]) -> None:
            await asyncio.sleep(max(0.0, turns[0].arrival_s - (time.monotonic() - began)))
            for request in turns:
                await asyncio.sleep(request.think_s)
                result = await send_turn(session, url, model, request, began)
                results.append(result)
                if result.error:
                    return  # the rest of this session builds on an answer it did not get

        await asyncio.gather(*(run_session(turns) for turns in sessions_of(requests).values()))
        wall = time.monotonic() - began
    if bus is not None:
        await bus.close()
    for result in results:
        result.worker, result.route_reason = workers.get(result.request_id, ("", ""))
    return summarize(results, wall) | {"turns": [asdict(r) for r in results]}


# -- Fleet sides -----------------------------------------------------------------------------------
def worker_env(kv_cells: int = 0) -> dict[str, str]:
    """Each worker's engine settings; `kv_cells` (when set) the KV cells its instance holds, for a
    replay where the histories outgrow what the workers keep."""
    options = ENGINE_OPTIONS | ({"n_ctx": kv_cells} if kv_cells else {})
    return {
        "FLEET_NODE_ENGINES": ENGINE,
        "FLEET_CALIBRATION": "off",
        "FLEET_ENGINE_OPTIONS": json.dumps({ENGINE: options}),
    }


async def warm_up(url: str, model: str) -> None:
    """One short request, so no side's first measured request pays a new process's first-use costs."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()


def fleet_side(
    root: Path, policy: str, workers: int, requests: Sequence[TraceRequest], kv_cells: int = 0
) -> dict:
    from fleet_local.bootstrap import DEFAULT_MODEL, DEFAULT_SOURCE

    nodes = [f"w{n}" for n in range(1, workers + 1)]
    stack_env = {"FLEET_ROUTING_POLICY": policy, "FLEET_DISAGG_MIN_TOKENS": "1000000000"}
    with workers_stack(root, nodes, worker_env(kv_cells), stack_env) as cluster:
        asyncio.run(stage(cluster.gateway, DEFAULT_MODEL, DEFAULT_SOURCE, nodes=workers + 1))
        asyncio.run(serving_everywhere(cluster, DEFAULT_MODEL, 30, ENGINE))
        asyncio.run(warm_up(cluster.gateway, DEFAULT_MODEL))
        return asyncio.run(replay(cluster.gateway, DEFAULT_MODEL, requests, cluster.manifest.nats_url))


def llamacpp_peer_side(root: Path, threads: int, requests: Sequence[TraceRequest]) -> dict:
    """llama.cpp's own server on the default model's GGUF, its prompt cache on (prefix reuse across
    conversations: it restores the longest cached prefix into its one context)."""
    from compare import llamacpp_peer_gguf
    from peers import launch, llamacpp_server_command, wait_served

    from fleet_local.processes import free_port

    root.mkdir(parents=True, exist_ok=True)
    port, model = free_port(), "smollm2-gguf"
    command = llamacpp_server_command(llamacpp_peer_gguf(root), model, port, threads)
    command += ["--cache", "True", "--cache_type", "ram", "--cache_size", str(PEER_CACHE_BYTES)]
    with ExitStack() as stack:
        server = launch(stack, "llama.cpp", command, port, root, {})
        wait_served([server])
        asyncio.run(warm_up(server.url, model))
        return asyncio.run(replay(server.url, model, requests))


def peer_missing(name: str) -> str:
    """Why a peer cannot run here ("" when it can)."""
    if name != "llama.cpp":
        return f"no peer {name!r} (known: llama.cpp)"
    if importlib.util.find_spec("starlette_context") is None:
        return "llama.cpp's server is not installed (make bench-install)"
    return ""


# -- the command -----------------------------------------------------------------------------------
def param_value(name: str, raw: str) -> object:
    """A --param value as its TraceParams field's type (a range as "low,high")."""
    default = getattr(TraceParams(), name, None)
    if default is None:
        known = ", ".join(f.name for f in fields(TraceParams))
        raise SystemExit(f"fleet bench replay: no trace parameter {name!r}; known: {known}")
    if isinstance(default, tuple):
        return tuple(int(v) for v in raw.split(","))
    return type(default)(raw)


def trace_params(args: argparse.Namespace) -> TraceParams:
    if args.quick:
        return QUICK
    chosen = dict(seed=args.seed, sessions=args.sessions, rate=args.rate, arrival=args.arrival,
                  max_tokens=args.max_tokens, think_s=args.think_s)  # fmt: skip
    for assignment in args.param:
        name, _, raw = assignment.partition("=")
        chosen[name] = param_value(name, raw)
    return TraceParams(**chosen)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet bench replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, help="a JSONL trace to replay (default: generate one)")
    parser.add_argument("--write-trace", type=Path, help="write the generated trace here and stop")
    parser.add_argument("--url", help="replay against this OpenAI-compatible server instead of Fleet")
    parser.add_argument("--model", default="", help="the model name to send (with --url)")
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES), help="routing policies to compare")
    parser.add_argument("--workers", default="2", help="Fleet worker counts, e.g. 1,2,3")
    parser.add_argument("--kv-cells", type=int, default=0, help="KV cells per worker (default 16384)")
    parser.add_argument("--peers", default="", help="single-server peers to replay too: llama.cpp")
    parser.add_argument("--baseline", default="", help="the side ratios are to (default: round-robin's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.4, help="sessions per second (poisson)")
    parser.add_argument("--arrival", default="poisson", choices=("poisson", "bursty"))
    parser.add_argument("--think-s", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a trace parameter (bench/workload.py), e.g. user_tokens=50,200",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny trace, one worker, kv only")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trace:
        params, requests = read_trace(args.trace)
    else:
        generated = trace_params(args)
        params, requests = asdict(generated), generate(generated)
        if args.write_trace:
            write_trace(args.write_trace, generated, requests)
            print(f"wrote {len(requests)} requests to {args.write_trace}: {describe(requests)}")
            return 0
    print(f"trace: {describe(list(requests))}", flush=True)
    sides: dict[str, dict] = {}
    if args.url:
        sides[args.url] = asyncio.run(replay(args.url.rstrip("/"), args.model, requests))
    else:
        policies = ["kv"] if args.quick else args.policies.split(",")
        counts = [1] if args.quick else [int(n) for n in args.workers.split(",")]
        root = scratch_dir("fleet-bench-replay-")
        for workers in counts:
            for policy in policies:
                name = f"fleet-{policy}-{workers}w"
                print(f"\n{name}: {workers} llama.cpp workers, FLEET_ROUTING_POLICY={policy}", flush=True)
                sides[name] = fleet_side(root / name, policy, workers, requests, args.kv_cells)
                print("\n".join(report_lines({name: sides[name]}, "")), flush=True)
        for peer in [p for p in args.peers.split(",") if p]:
            if why := peer_missing(peer):
                print(f"\n{peer}: skipped ({why})", flush=True)
                continue
            print(f"\n{peer}: its server, {max(counts)} threads", flush=True)
            sides[peer] = llamacpp_peer_side(root / peer, max(counts), requests)
            print("\n".join(report_lines({peer: sides[peer]}, "")), flush=True)
        discard(root)
    baseline = args.baseline or next((n for n in sides if "round-robin" in n), next(iter(sides)))
    print("\n" + "\n".join(report_lines(sides, baseline)))
    summary = {name: {k: v for k, v in side.items() if k != "turns"} for name, side in sides.items()}
    result = {"trace_params": params, "trace": describe(list(requests)), "baseline": baseline,
              "kv_cells_per_worker": args.kv_cells or ENGINE_OPTIONS["n_ctx"],
              "sides": summary, "ratios": ratios(summary, baseline),
              "turns": {name: side["turns"] for name, side in sides.items()}}  # fmt: skip
    write_result(args.out, "replay-quick" if args.quick else "replay", result)
    return 0 if all(not side["errors"] for side in sides.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
