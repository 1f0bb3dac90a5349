"""Disaggregated prefill/decode measured in one run (after the seed's prefill_decode_bench.py).

    fleet bench disagg                      # SmolLM2-135M: vLLM CPU prefill on w2 -> MLX decode on w1
    fleet bench disagg --tiny               # a tiny random llama, MLX -> MLX (seconds, not minutes)
    fleet bench disagg --pp 512,2048 --tg 8,64  # the sweep (prompt tokens x generated tokens)

Starts an embedded stack (its worker w1 runs a decode-only MLX instance) plus a worker w2 with a
prefill-only instance, then for every prompt length serves a new prompt (a nonce first: nothing is
cached anywhere) three ways through POST /bench/chat/completions: colocated (w1 prefills itself),
disaggregated over the TCP stream, and staged through object storage. Reported: TTFT, decode
tok/s, KV bytes and chunks, time to the first and the last chunk, and the tail (the last chunk's
write on w2 -> its arrival on w1: what the transfer adds after the prefill's compute).

Then the transport alone, side by side: a handoff folder of the run's chunk count and bytes sent
through Fleet's stream path (send_folder -> receive_stream, as workers do) vs a raw loopback TCP
socket moving the same bytes, alternating, best of 3. Targets: stream >= 0.5 x raw loopback; for
prompts >= 2,000 tokens the tail is small next to the prefill (transfer hidden behind compute).
Writes JSON to bench/results/.
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
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, call, discard, scratch_dir, serve_on, stage, two_workers, write_result

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODES = {"colocated": {"disaggregated": False}, "stream": {"disaggregated": True, "transport": "stream"}}
MODES["staged"] = {"disaggregated": True, "transport": "staged"}


def prompt_for(tokenizer, tokens: int, nonce: str) -> list[dict]:
    """A chat whose prompt is about `tokens` long, starting with a nonce (no cached prefix)."""

    def chat(units: int) -> list[dict]:
        text = " ".join(f"item {n} weighs {n * 7 % 97} grams." for n in range(units))
        return [{"role": "user", "content": f"{nonce} {text} Which item is heaviest?"}]

    per_unit = len(tokenizer.encode_chat(chat(100))) / 100
    units = max(int(tokens / per_unit), 1)
    while len(tokenizer.encode_chat(chat(units))) > tokens and units > 1:
        units -= 1
    return chat(units)


async def bench_request(gateway: str, model: str, messages: list[dict], tg: int, options: dict) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": tg, "temperature": 0, **options}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        reply = await call(session, "POST", f"{gateway}/bench/chat/completions", body)
    return reply["generation_stats"]


async def sweep(gateway: str, model: str, tokenizer, pps: list[int], tgs: list[int]) -> list[dict]:
    return [await sweep_point(gateway, model, tokenizer, pp, tg) for pp in pps for tg in tgs]


async def sweep_point(gateway: str, model: str, tokenizer, pp: int, tg: int) -> dict:
    """One prompt length and generation length, served colocated, streamed and staged."""
    row: dict = {"pp": pp, "tg": tg}
    for mode, options in MODES.items():
        messages = prompt_for(tokenizer, pp, f"run {secrets.token_hex(4)}:")
        stats = await bench_request(gateway, model, messages, tg, options)
        row[mode] = stats
        ttft = f"TTFT {stats['ttft_s'] * 1000:9.0f} ms"
        print(f"  pp {pp:5} tg {tg:4} {mode:9} {ttft}  {describe(stats)}", flush=True)
    for mode in ("stream", "staged"):
        row[f"ttft_{mode}_over_colocated"] = row[mode]["ttft_s"] / row["colocated"]["ttft_s"]
    return row


def describe(stats: dict) -> str:
    handoff = stats.get("handoff")
    if not handoff:
        return f"prompt {stats['prompt_tokens']} tokens, decode {stats['generation_tps']:.1f} tok/s"
    if handoff["fallback"]:
        return f"FELL BACK: {handoff['fallback']}"
    return (
        f"KV {handoff['bytes'] / 1e6:7.1f} MB in {handoff['chunks']} chunks, first chunk "
        f"{handoff['prefill_s'] * 1000:.0f} ms, last {handoff['transfer_s'] * 1000:.0f} ms, "
        f"tail {handoff['tail_s'] * 1000:.1f} ms, decode {stats['generation_tps']:.1f} tok/s"
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama, MLX -> MLX")
    parser.add_argument("--pp", default="", help="prompt lengths, comma-separated (default 512,2048)")
    parser.add_argument("--tg", default="8", help="tokens to generate per request, comma-separated")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    pps = [int(p) for p in (args.pp or "512,2048").split(",")]

    from fleet_gateway.tokenizer import ChatTokenizer
    from fleet_local.bootstrap import DEFAULT_SOURCE

    state_dir = scratch_dir("fleet-bench-disagg-")
    model, source, layers, prefill_engine = SMOLLM2, DEFAULT_SOURCE, 30, "vllm"
    w2 = {
        "FLEET_NODE_ENGINES": "vllm",
        "FLEET_ENGINE_OPTIONS": json.dumps({"vllm": {"kv_cache_bytes": 768 << 20, "max_model_len": 4096}}),
    }
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        model, layers, prefill_engine = "tiny/llama-disagg", 2, "mlx"
        source = f"file://{make_chat_model(state_dir / 'tiny-src', max_positions=8192)}"
        w2 = {"FLEET_NODE_ENGINES": "mlx"}
    with two_workers(state_dir, {"FLEET_NODE_ENGINES": "mlx"}, w2) as (manifest, _):
        gateway = manifest.gateway_url
        print(f"staging {model}; decode: MLX on w1, prefill: {prefill_engine} on w2")
        asyncio.run(stage(gateway, model, source))
        asyncio.run(serve_on(gateway, model, "w1", layers, engine="mlx", role="decode"))
        asyncio.run(serve_on(gateway, model, "w2", layers, engine=prefill_engine, role="prefill"))
        tokenizer = ChatTokenizer.from_folder(state_dir / "models" / model / "main")
        rows = asyncio.run(sweep(gateway, model, tokenizer, pps, [int(t) for t in args.tg.split(",")]))
    largest = max(
        (r["stream"]["handoff"] for r in rows if r["stream"].get("handoff")), key=lambda h: h["bytes"]
    )
    transport = transport_vs_loopback(largest["bytes"] // largest["chunks"])
    print(
        f"\ntransport alone ({transport['bytes'] / 1e6:.1f} MB in {transport['chunks']} chunks): "
        f"Fleet stream {transport['stream_gbps']:.2f} GB/s vs raw loopback "
        f"{transport['raw_loopback_gbps']:.2f} GB/s = {transport['ratio_stream_over_loopback']:.2f}"
        " (target >= 0.5)"
    )
    for row in rows:
        print(
            f"pp {row['pp']:5} tg {row['tg']:4}: TTFT stream / colocated "
            f"{row['ttft_stream_over_colocated']:.3f}, "
            f"staged / colocated {row['ttft_staged_over_colocated']:.3f}"
        )
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


if __name__ == "__main__":
    sys.exit(main())
