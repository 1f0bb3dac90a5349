"""Disaggregated prefill/decode measured in one run (after the seed's prefill_decode_bench.py).

    fleet bench disagg                      # SmolLM2-135M: vLLM CPU prefill on w2 -> MLX decode on w1
    fleet bench disagg --tiny               # a tiny random llama, MLX -> MLX (seconds, not minutes)
    fleet bench disagg --pp 512,2048 --tg 8,64  # the sweep (prompt tokens x generated tokens)
    fleet bench disagg --url http://gateway:8000 --decode-model M [--prefill-instance ID] [--dry-run]

Without --url it starts an embedded stack (its worker w1 runs a decode-only MLX instance) plus a
worker w2 with a prefill-only instance; with --url it measures a running cluster (its key from
$FLEET_API_KEY), whose router picks the decoder among the ready instances of the decode model and
the prefill partner among that model's partners (GET /state's "partners"). Then for every prompt
length it serves a new prompt (a nonce first: nothing is cached anywhere) several ways through
POST /bench/chat/completions: colocated (the decoder prefills itself), and disaggregated over the
TCP stream and staged through object storage, each with the KV sent layer by layer as the prefill
computes it (overlapping) and after the whole prefill ("batch": the request's `"overlap": false`),
side by side (--batch: batch only). Reported: TTFT, decode tok/s, KV bytes and chunks, time to the
first and the last chunk, and the tail (the last chunk's write on the prefill worker -> its arrival
on the decoder: what the transfer adds after the prefill's compute). --repeat N serves each N
times and keeps the median TTFT's; --dry-run prints the requests it would send and sends nothing.

The router chooses by model: --decode-instance and --prefill-instance are checked before the run
(ready, of a role that decodes / prefills, partners of each other) and every disaggregated reply's
prefill worker is checked against them (a row served elsewhere is flagged); the decoder itself is
not reported by the bench endpoint, so a pinned decoder is certain only when it is its model's one
ready decoder.

Then (own stack only) the transport alone, side by side: a handoff folder of the run's chunk count
and bytes sent through Fleet's stream path (send_folder -> receive_stream, as workers do) vs a raw
loopback TCP socket moving the same bytes, alternating, best of 3. Targets: stream >= 0.5 x raw
loopback; for prompts >= 2,000 tokens the tail is small next to the prefill (transfer hidden behind
compute). Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, call, discard, scratch_dir, serve_on, stage, two_workers, write_result
from loadgen import auth_headers

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TRANSPORTS = ("stream", "staged")
BENCH_PATH = "/bench/chat/completions"
# chat sizes whose token counts fix the line that sizes a live run's prompts: short, as a slow
# decoder prefills them itself (MLX 4-bit on a CPU: ~0.15 s a token)
PROBE_UNITS = (4, 24)


def disagg_modes(batch_only: bool = False, transports: Sequence[str] = TRANSPORTS) -> dict[str, dict]:
    """The request options of each way a prompt is served: colocated, then per transport the KV sent
    layer by layer (overlapping the prefill) and after it ("<transport>_batch"), or batch only."""
    modes: dict[str, dict] = {"colocated": {"disaggregated": False}}
    for transport in transports:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        if not batch_only:
            modes[transport] = {"disaggregated": True, "transport": transport}
        modes[f"{transport}_batch"] = {"disaggregated": True, "transport": transport, "overlap": False}
    return modes


def chat(units: int, nonce: str) -> list[dict]:
    """A chat of `units` sentences, starting with a nonce (no cached prefix anywhere)."""
    text = " ".join(f"item {n} weighs {n * 7 % 97} grams." for n in range(units))
    return [{"role": "user", "content": f"{nonce} {text} Which item is heaviest?"}]


def units_for(tokens: int, count: Callable[[int], float]) -> int:
    """The most sentences whose chat is at most `tokens` long (at least 1); count(units) -> tokens."""
    per_unit = (count(100) - count(0)) / 100 or 1.0
    units = max(int((tokens - count(0)) / per_unit), 1)
    while count(units) > tokens and units > 1:
        units -= 1
    return units


def linear_count(probes: dict[int, int]) -> Callable[[int], float]:
    """count(units) through two probes' (units -> prompt tokens): a live cluster's tokenizer is
    not here, so two short requests measure the line."""
    (u0, t0), (u1, t1) = sorted(probes.items())
    slope = (t1 - t0) / (u1 - u0)
    return lambda units: t0 + slope * (units - u0)


@dataclass
class Plan:
    """What one run does: where, which model, which requests (`requests` also makes the dry run)."""

    gateway: str  # "" for the embedded stack, not started yet
    model: str
    pps: list[int]
    tgs: list[int]
    modes: dict[str, dict]
    repeat: int = 1
    decode_instance: str = ""
    prefill_instance: str = ""
    prefill_model: str = ""
    notes: list[str] = field(default_factory=list)

    def body(self, messages: object, tg: int, mode: str) -> dict:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": tg,
            "temperature": 0,
            **self.modes[mode],
        }

    def requests(self) -> list[tuple[int, int, int, str, dict]]:
        """(pp, tg, repeat, mode, body) in the order they are sent; messages as a placeholder."""
        return [
            (pp, tg, rep, mode, self.body(f"<a new chat of about {pp} tokens, a nonce first>", tg, mode))
            for pp in self.pps
            for tg in self.tgs
            for rep in range(self.repeat)
            for mode in self.modes
        ]


def describe_plan(plan: Plan) -> str:
    url = f"{plan.gateway or '<the embedded stack>'}{BENCH_PATH}"
    requests = plan.requests()
    decoder = f" (expected: instance {plan.decode_instance})" if plan.decode_instance else ""
    prefill = "the router's choice among the decoder's partners"
    if plan.prefill_instance or plan.prefill_model:
        named = (
            f"instance {plan.prefill_instance}"
            if plan.prefill_instance
            else f"an instance of {plan.prefill_model}"
        )
        prefill += f" (expected: {named}; checked on every reply)"
    lines = [
        f"plan: {len(plan.pps)} prompt lengths x {len(plan.tgs)} generation lengths x "
        f"{len(plan.modes)} modes x {plan.repeat} repeats = {len(requests)} requests to {url}",
        f"  decode: the router's choice among the ready decoders of {plan.model}{decoder}",
        f"  prefill: {prefill}",
        *(f"  {note}" for note in plan.notes),
    ]
    if plan.gateway:
        lines.append("  first: 2 probe requests (colocated, max_tokens 1) to size the prompts")
    lines += [f"  POST {url} {json.dumps(body)}" for _, _, _, _, body in requests]
    return "\n".join(lines)


def pinned_problems(state: dict, plan: Plan) -> list[str]:
    """Why the named instances cannot serve the plan, from GET /state (empty when they can)."""
    instances, partners = state.get("instances", {}), state.get("partners")
    problems = []

    def check(instance_id: str, roles: tuple[str, ...], what: str) -> dict | None:
        instance = instances.get(instance_id)
        if instance is None:
            problems.append(f"no instance {instance_id}")
        elif instance.get("status") != "ready":
            problems.append(f"instance {instance_id} is {instance.get('status')}, not ready")
        elif instance.get("role", "both") not in roles:
            problems.append(
                f"instance {instance_id} is a {instance.get('role')} instance: it does not {what}"
            )
        else:
            return instance
        return None

    decoder = check(plan.decode_instance, ("both", "decode"), "decode") if plan.decode_instance else None
    if decoder is not None and decoder.get("model_id") != plan.model:
        problems.append(f"instance {plan.decode_instance} serves {decoder.get('model_id')}, not {plan.model}")
    if plan.prefill_instance:
        check(plan.prefill_instance, ("both", "prefill"), "prefill")
    if plan.prefill_model and not prefill_nodes(state, plan):
        problems.append(f"no ready instance of {plan.prefill_model} prefills")
    if decoder is not None and partners is not None and plan.prefill_instance:
        ids = [p.get("instance_id") for p in partners.get(plan.decode_instance, [])]
        if plan.prefill_instance not in ids:
            problems.append(
                f"instance {plan.prefill_instance} is not a prefill partner of {plan.decode_instance} "
                f"(its partners: {', '.join(ids) or 'none'})"
            )
    return problems


def prefill_nodes(state: dict, plan: Plan) -> set[str]:
    """The nodes a pinned prefill may run on (empty: not pinned, or none can)."""
    instances = state.get("instances", {}).values()
    if plan.prefill_instance:
        instance = state.get("instances", {}).get(plan.prefill_instance, {})
        return {instance["node_id"]} if instance.get("node_id") else set()
    return {
        i["node_id"]
        for i in instances
        if plan.prefill_model
        and i.get("model_id") == plan.prefill_model
        and i.get("status") == "ready"
        and i.get("role", "both") in ("both", "prefill")
    }


async def bench_request(session: aiohttp.ClientSession, gateway: str, body: dict) -> dict:
    reply = await call(session, "POST", f"{gateway}{BENCH_PATH}", body)
    return reply["generation_stats"]


def median_run(runs: list[dict]) -> dict:
    """The run of the median TTFT (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda stats: stats["ttft_s"])
    return ordered[(len(ordered) - 1) // 2]


async def sweep(
    gateway: str,
    plan: Plan,
    count: Callable[[str], Callable[[int], float]],
    allowed_nodes: Collection[str] = (),
) -> list[dict]:
    """Every (pp, tg) point, each mode `plan.repeat` times (modes interleaved, a new prompt each)."""
    timeout = aiohttp.ClientTimeout(total=3600)
    rows = []
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
        for pp in plan.pps:
            for tg in plan.tgs:
                runs: dict[str, list[dict]] = {mode: [] for mode in plan.modes}
                for _ in range(plan.repeat):
                    for mode in plan.modes:
                        nonce = f"run {secrets.token_hex(4)}:"
                        messages = chat(units_for(pp, count(nonce)), nonce)
                        stats = await bench_request(session, gateway, plan.body(messages, tg, mode))
                        runs[mode].append(stats)
                        ttft = f"TTFT {stats['ttft_s'] * 1000:9.0f} ms"
                        print(
                            f"  pp {pp:5} tg {tg:4} {mode:12} {ttft}  {describe(stats, allowed_nodes)}",
                            flush=True,
                        )
                rows.append(point_row(pp, tg, runs, allowed_nodes))
    return rows


def point_row(pp: int, tg: int, runs: dict[str, list[dict]], allowed_nodes: Collection[str] = ()) -> dict:
    """One sweep point: each mode's median run (and all runs when repeated), TTFT ratios to
    colocated and batch / overlapping per transport, and any reply prefilled off the pinned nodes."""
    row: dict = {"pp": pp, "tg": tg}
    for mode, stats in runs.items():
        row[mode] = median_run(stats)
        if len(stats) > 1:
            row[f"{mode}_runs"] = stats
    for mode in runs:
        if mode != "colocated" and "colocated" in runs:
            row[f"ttft_{mode}_over_colocated"] = row[mode]["ttft_s"] / row["colocated"]["ttft_s"]
        if mode.endswith("_batch") and mode.removesuffix("_batch") in runs:
            overlapped = row[mode.removesuffix("_batch")]["ttft_s"]
            row[f"ttft_{mode}_over_overlap"] = row[mode]["ttft_s"] / overlapped
    elsewhere = [
        mode
        for mode, stats in runs.items()
        for s in stats
        if allowed_nodes and s.get("handoff") and (s["handoff"].get("prefill_worker_id") not in allowed_nodes)
    ]
    if elsewhere:
        row["prefilled_elsewhere"] = sorted(set(elsewhere))
    return row


def describe(stats: dict, allowed_nodes: Collection[str] = ()) -> str:
    handoff = stats.get("handoff")
    if not handoff:
        return f"prompt {stats['prompt_tokens']} tokens, decode {stats['generation_tps']:.1f} tok/s"
    if handoff["fallback"]:
        return f"FELL BACK: {handoff['fallback']}"
    where = handoff.get("prefill_worker_id", "")
    flag = f" PREFILLED ON {where}, NOT A PINNED NODE" if allowed_nodes and where not in allowed_nodes else ""
    return (
        f"KV {handoff['bytes'] / 1e6:7.1f} MB in {handoff['chunks']} chunks, first chunk "
        f"{handoff['prefill_s'] * 1000:.0f} ms, last {handoff['transfer_s'] * 1000:.0f} ms, "
        f"tail {handoff['tail_s'] * 1000:.1f} ms, decode {stats['generation_tps']:.1f} tok/s{flag}"
    )


# -- the transport alone ---------------------------------------------------------------------------
def synthetic_handoff(folder: Path, chunks: int, total_bytes: int) -> None:
    """A complete handoff folder of `chunks` kv chunks carrying about `total_bytes`."""
    from fleet_store.handoff import HandoffWriter
    from fleet_store.kv import WireTensor

    rows = max(total_bytes // max(chunks, 1) // 128, 1)  # F16 [rows, 1, 32] keys + values: 128 bytes a row
    data = os.urandom(rows * 64)
    writer = HandoffWriter(folder, "bench")
    for i in range(chunks):
        tensor = WireTensor("F16", (rows, 1, 32), data)
        writer.kv(i * rows, (i + 1) * rows, {0: (tensor, tensor)})
    writer.done(0, chunks * rows)


async def fleet_stream(folder: Path, into: Path) -> tuple[int, float]:
    from fleet_worker.handoff_transport import receive_stream, send_folder

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        await send_folder(writer, folder, 30)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    started = time.perf_counter()
    received = await receive_stream((f"127.0.0.1:{port}",), "bench", into, 30)
    elapsed = time.perf_counter() - started
    server.close()
    return received.bytes, elapsed


async def raw_loopback(total_bytes: int) -> float:
    """Seconds to move total_bytes through one loopback TCP connection in 1 MiB writes."""
    done = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        left = total_bytes
        while left:
            left -= len(await reader.read(min(left, 1 << 20)))
        writer.close()
        done.set()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    payload = os.urandom(1 << 20)
    started = time.perf_counter()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    while sent < total_bytes:
        piece = payload[: min(len(payload), total_bytes - sent)]
        writer.write(piece)
        await writer.drain()
        sent += len(piece)
    await done.wait()
    elapsed = time.perf_counter() - started
    writer.close()
    server.close()
    return elapsed


TRANSPORT_BYTES = 256 << 20  # enough that connection setup does not count


def transport_vs_loopback(chunk_bytes: int, repeats: int = 3) -> dict:
    """Fleet's stream path vs a raw socket, in chunks of the run's size, TRANSPORT_BYTES in all."""
    chunks = max(TRANSPORT_BYTES // max(chunk_bytes, 1), 1)
    total_bytes = chunks * chunk_bytes
    fleet_s, raw_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "out"
        synthetic_handoff(source, chunks, total_bytes)
        moved = sum(p.stat().st_size for p in source.iterdir())
        for i in range(repeats):
            _, seconds = asyncio.run(fleet_stream(source, Path(tmp) / f"in-{i}"))
            fleet_s.append(seconds)
            raw_s.append(asyncio.run(raw_loopback(moved)))
    fleet, raw = min(fleet_s), min(raw_s)
    return {
        "bytes": moved,
        "chunks": chunks + 1,
        "chunk_bytes": chunk_bytes,
        "stream_gbps": moved / fleet / 1e9,
        "raw_loopback_gbps": moved / raw / 1e9,
        "ratio_stream_over_loopback": raw / fleet,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fleet bench disagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="own stack: a tiny random llama, MLX -> MLX")
    parser.add_argument("--pp", default="", help="prompt lengths, comma-separated (default 512,2048)")
    parser.add_argument("--tg", default="8", help="tokens to generate per request, comma-separated")
    parser.add_argument("--url", default="", help="a running cluster's gateway instead of an own stack")
    parser.add_argument("--decode-model", "--model", default="", help="--url: the model requests name")
    parser.add_argument("--decode-instance", default="", help="--url: the decoder expected (its model's)")
    parser.add_argument("--prefill-model", default="", help="--url: prefill on an instance of this model")
    parser.add_argument("--prefill-instance", default="", help="--url: prefill on this instance")
    parser.add_argument("--batch", action="store_true", help="only batch transfers (KV after the prefill)")
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help="comma-separated (default stream,staged)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="serve each point N times: median TTFT")
    parser.add_argument("--dry-run", action="store_true", help="print the requests; send nothing")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    live_only = ("decode_model", "decode_instance", "prefill_model", "prefill_instance")
    if not args.url and (named := [f"--{n.replace('_', '-')}" for n in live_only if getattr(args, n)]):
        parser.error(f"{', '.join(named)} name parts of a running cluster: add --url")
    if args.url and args.tiny:
        parser.error("--tiny starts its own stack: not with --url")
    if args.prefill_instance and args.prefill_model:
        parser.error("name --prefill-instance or --prefill-model, not both")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.url and not (args.decode_model or args.decode_instance):
        parser.error("--url needs --decode-model (or --decode-instance, whose model it then reads)")
    return args


def plan_of(args: argparse.Namespace, model: str = "") -> Plan:
    """The run `args` asks for (model: the decode model, when known only from the cluster)."""
    try:
        modes = disagg_modes(args.batch, [t for t in args.transports.split(",") if t])
    except ValueError as error:
        raise SystemExit(f"fleet bench disagg: {error}") from None
    default = "tiny/llama-disagg" if args.tiny else SMOLLM2
    plan = Plan(
        gateway=args.url.rstrip("/"),
        model=model or args.decode_model or ("" if args.url else default),
        pps=[int(p) for p in (args.pp or "512,2048").split(",")],
        tgs=[int(t) for t in args.tg.split(",")],
        modes=modes,
        repeat=args.repeat,
        decode_instance=args.decode_instance,
        prefill_instance=args.prefill_instance,
        prefill_model=args.prefill_model,
    )
    if not args.url:
        engine = "mlx" if args.tiny else "vllm"
        plan.notes.append(f"own stack: {plan.model}, decode-only MLX on w1, prefill-only {engine} on w2")
    return plan


async def read_state(gateway: str) -> dict:
    async with aiohttp.ClientSession(headers=auth_headers()) as session:
        return await call(session, "GET", f"{gateway}/state")


async def probe_count(gateway: str, model: str) -> Callable[[int], float]:
    """Two colocated max_tokens=1 requests measure how many prompt tokens a chat of n units takes."""
    probes = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
        for units in PROBE_UNITS:
            body = {"model": model, "messages": chat(units, f"probe {secrets.token_hex(4)}:"),
                    "max_tokens": 1, "temperature": 0, "disaggregated": False}  # fmt: skip
            probes[units] = (await bench_request(session, gateway, body))["prompt_tokens"]
    return linear_count(probes)


def run_live(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    if args.dry_run:  # nothing is sent, so a decoder's model is not looked up
        plan.model = plan.model or f"<the model of instance {args.decode_instance}>"
        print(describe_plan(plan))
        return 0
    state = asyncio.run(read_state(plan.gateway))
    if not plan.model:
        plan.model = state.get("instances", {}).get(args.decode_instance, {}).get("model_id", "")
    problems = pinned_problems(state, plan)
    if problems or not plan.model:
        print("fleet bench disagg: " + ("; ".join(problems) or "no decode model"), file=sys.stderr)
        return 1
    if "partners" not in state:
        print("(this gateway's /state lists no prefill partners: pins are checked on the replies only)")
    allowed = prefill_nodes(state, plan)
    print(describe_plan(plan).split("\n  POST", 1)[0])
    count = asyncio.run(probe_count(plan.gateway, plan.model))
    rows = asyncio.run(sweep(plan.gateway, plan, lambda _nonce: count, allowed))
    summarize(rows)
    result = {"gateway": plan.gateway, "model": plan.model, "pins": pins(plan), "sweep": rows}
    write_result(args.out, "disagg-url", result)
    return 0


def pins(plan: Plan) -> dict:
    return {
        "decode_instance": plan.decode_instance,
        "prefill_instance": plan.prefill_instance,
        "prefill_model": plan.prefill_model,
    }


def summarize(rows: list[dict]) -> None:
    for row in rows:
        ratios = ", ".join(
            f"{key.removeprefix('ttft_').replace('_over_', ' / ')} {value:.3f}"
            for key, value in row.items()
            if key.startswith("ttft_")
        )
        print(f"pp {row['pp']:5} tg {row['tg']:4}: TTFT {ratios}")
        if row.get("prefilled_elsewhere"):
            print(f"  prefilled off the pinned nodes in: {', '.join(row['prefilled_elsewhere'])}")


def run_own_stack(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    if args.dry_run:
        print(describe_plan(plan))
        return 0
    from fleet_gateway.tokenizer import ChatTokenizer
    from fleet_local.bootstrap import DEFAULT_SOURCE

    state_dir = scratch_dir("fleet-bench-disagg-")
    model, source, layers, prefill_engine = plan.model, DEFAULT_SOURCE, 30, "vllm"
    w2 = {
        "FLEET_NODE_ENGINES": "vllm",
        "FLEET_ENGINE_OPTIONS": json.dumps({"vllm": {"kv_cache_bytes": 768 << 20, "max_model_len": 4096}}),
    }
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        layers, prefill_engine = 2, "mlx"
        source = f"file://{make_chat_model(state_dir / 'tiny-src', max_positions=8192)}"
        w2 = {"FLEET_NODE_ENGINES": "mlx"}
    with two_workers(state_dir, {"FLEET_NODE_ENGINES": "mlx"}, w2) as (manifest, _):
        gateway = plan.gateway = manifest.gateway_url
        print(f"staging {model}; decode: MLX on w1, prefill: {prefill_engine} on w2")
        asyncio.run(stage(gateway, model, source))
        asyncio.run(serve_on(gateway, model, "w1", layers, engine="mlx", role="decode"))
        asyncio.run(serve_on(gateway, model, "w2", layers, engine=prefill_engine, role="prefill"))
        tokenizer = ChatTokenizer.from_folder(state_dir / "models" / model / "main")

        def count(nonce: str) -> Callable[[int], float]:
            return lambda units: len(tokenizer.encode_chat(chat(units, nonce)))

        rows = asyncio.run(sweep(gateway, plan, count))
    handoffs = [r[m]["handoff"] for r in rows for m in plan.modes if r[m].get("handoff")]
    transport = None
    if handoffs:
        largest = max(handoffs, key=lambda h: h["bytes"])
        transport = transport_vs_loopback(largest["bytes"] // max(largest["chunks"], 1))
        print(
            f"\ntransport alone ({transport['bytes'] / 1e6:.1f} MB in {transport['chunks']} chunks): "
            f"Fleet stream {transport['stream_gbps']:.2f} GB/s vs raw loopback "
            f"{transport['raw_loopback_gbps']:.2f} GB/s = {transport['ratio_stream_over_loopback']:.2f}"
            " (target >= 0.5)"
        )
    summarize(rows)
    result = {
        "model": model,
        "prefill_engine": prefill_engine,
        "decode_engine": "mlx",
        "sweep": rows,
        "transport": transport,
    }
    write_result(args.out, f"disagg-{'tiny' if args.tiny else 'smollm2'}", result)
    discard(state_dir)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_live(args) if args.url else run_own_stack(args)


if __name__ == "__main__":
    sys.exit(main())
