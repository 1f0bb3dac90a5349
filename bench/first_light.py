"""First-light benchmark: the stack against mlx-lm called directly, on the same model, in one run.

    .venv/bin/python bench/first_light.py                 # starts its own embedded stack (make bench)
    .venv/bin/python bench/first_light.py --gateway http://127.0.0.1:8000 --nats nats://127.0.0.1:PORT \\
        --model-dir .fleet/models/HuggingFaceTB/SmolLM2-135M-Instruct/main

Measures, interleaving direct and stack runs so machine noise hits both alike:
  1. single-stream decode tokens/s through the stack / mlx-lm `stream_generate` (target >= 0.95)
  2. TTFT the stack adds for a ~32-token prompt, p50 of paired runs (target <= 5 ms)
  3. aggregate tokens/s at 8 concurrent streams / 1 stream through the stack (target >= 2.5)
Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Templated with SmolLM2's default system prompt this is ~32 prompt tokens.
SHORT_PROMPT = [{"role": "user", "content": "Hi"}]
LONG_ANSWER_PROMPT = [{"role": "user", "content": "Tell me a long story about a dragon who learns to cook."}]


class StreamResult:
    def __init__(
        self, ttft_s: float, decode_tps: float, tokens: int, wall_s: float, request_id: str = ""
    ) -> None:
        self.ttft_s, self.decode_tps, self.tokens, self.wall_s = ttft_s, decode_tps, tokens, wall_s
        self.request_id = request_id


class EngineTimings:
    """The engine's own prefill time per request, read from the token stream on NATS."""

    def __init__(self) -> None:
        self.prompt_time_s: dict[str, float] = {}

    async def start(self, nats_url: str) -> None:
        import msgspec

        from fleet_bus import Bus
        from fleet_proto import TokenChunk

        self.bus = await Bus.connect(nats_url, "bench-tap")

        async def record(msg) -> None:
            chunk = msgspec.json.decode(msg.data, type=TokenChunk)
            if chunk.finish_reason:
                self.prompt_time_s[chunk.request_id] = chunk.prompt_time_s

        await self.bus.nc.subscribe("fleet.tok.>", cb=record)
        await self.bus.nc.flush()


def direct_run(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> StreamResult:
    import mlx.core as mx
    from mlx_lm import stream_generate

    greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    started = time.perf_counter()
    first = last = 0.0
    count = 0
    for _ in stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=greedy):
        last = time.perf_counter()
        if count == 0:
            first = last
        count += 1
    decode = (count - 1) / (last - first) if count > 1 else 0.0
    return StreamResult(first - started, decode, count, last - started)


async def stack_run(
    session: aiohttp.ClientSession, gateway: str, model: str, messages, max_tokens: int
) -> StreamResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    request_id = ""
    async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            data = json.loads(line[6:])
            request_id = data.get("id", request_id)
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            choices = data.get("choices") or []
            if choices and choices[0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return StreamResult(first - started, decode, tokens, last - started, request_id)


def make_tiny_chat_model(folder: Path) -> Path:
    """The tests' tiny random llama with their ChatML tokenizer (tests/support.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fleet_test_support", REPO / "tests" / "support.py")
    support = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(support)
    return support.make_chat_model(folder)


def p50(values: list[float]) -> float:
    return statistics.median(values)


async def measure(
    gateway: str, nats_url: str, model_id: str, model_dir: Path, repeats: int, max_tokens: int
) -> dict:
    from mlx_lm import load

    from fleet_gateway.tokenizer import ChatTokenizer

    chat = ChatTokenizer.from_folder(model_dir)
    short_ids = chat.encode_chat(SHORT_PROMPT)
    long_ids = chat.encode_chat(LONG_ANSWER_PROMPT)
    model, tokenizer = load(str(model_dir))
    engine = EngineTimings()
    await engine.start(nats_url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        direct_run(model, tokenizer, short_ids, 2)  # warm up both paths
        await stack_run(session, gateway, model_id, SHORT_PROMPT, 2)

        ttft_direct, ttft_stack, over_engine_ms = [], [], []
        for _ in range(repeats * 2):
            ttft_direct.append(direct_run(model, tokenizer, short_ids, 1).ttft_s)
            run = await stack_run(session, gateway, model_id, SHORT_PROMPT, 1)
            ttft_stack.append(run.ttft_s)
            await asyncio.sleep(0.05)  # the tap's copy of the last chunk
            over_engine_ms.append(1000 * (run.ttft_s - engine.prompt_time_s[run.request_id]))
        added_ms = [1000 * (s - d) for s, d in zip(ttft_stack, ttft_direct, strict=True)]

        decode_direct, decode_stack, single_wall, single_tokens = [], [], [], []
        for _ in range(repeats):
            decode_direct.append(direct_run(model, tokenizer, long_ids, max_tokens).decode_tps)
            run = await stack_run(session, gateway, model_id, LONG_ANSWER_PROMPT, max_tokens)
            decode_stack.append(run.decode_tps)
            single_wall.append(run.wall_s)
            single_tokens.append(run.tokens)

        aggregate_8 = []
        for _ in range(repeats):
            started = time.perf_counter()
            runs = await asyncio.gather(
                *(stack_run(session, gateway, model_id, LONG_ANSWER_PROMPT, max_tokens) for _ in range(8))
            )
            aggregate_8.append(sum(r.tokens for r in runs) / (time.perf_counter() - started))
    await engine.bus.close()
    single_aggregate = [t / w for t, w in zip(single_tokens, single_wall, strict=True)]
    return {
        "model": model_id,
        "prompt_tokens_short": len(short_ids),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "ttft_direct_ms_p50": 1000 * p50(ttft_direct),
        "ttft_stack_ms_p50": 1000 * p50(ttft_stack),
        "ttft_added_ms_p50": p50(added_ms),
        "ttft_over_engine_prefill_ms_p50": p50(over_engine_ms),
        "decode_tps_direct_p50": p50(decode_direct),
        "decode_tps_stack_p50": p50(decode_stack),
        "decode_ratio_stack_over_direct": p50(decode_stack) / p50(decode_direct),
        "aggregate_tps_1_stream_p50": p50(single_aggregate),
        "aggregate_tps_8_streams_p50": p50(aggregate_8),
        "aggregate_ratio_8_over_1": p50(aggregate_8) / p50(single_aggregate),
        "raw": {
            "ttft_direct_s": ttft_direct,
            "ttft_stack_s": ttft_stack,
            "ttft_over_engine_prefill_ms": over_engine_ms,
            "decode_direct_tps": decode_direct,
            "decode_stack_tps": decode_stack,
            "aggregate_8_tps": aggregate_8,
            "single_aggregate_tps": single_aggregate,
        },
    }


def report(result: dict) -> None:
    rows = [
        ("decode tok/s, 1 stream", result["decode_tps_direct_p50"], result["decode_tps_stack_p50"],
         f"ratio {result['decode_ratio_stack_over_direct']:.3f} (target >= 0.95)"),
        (f"TTFT ms, {result['prompt_tokens_short']}-token prompt", result["ttft_direct_ms_p50"],
         result["ttft_stack_ms_p50"],
         f"added {result['ttft_added_ms_p50']:.1f} ms p50 vs direct, "
         f"{result['ttft_over_engine_prefill_ms_p50']:.1f} ms over the engine's prefill (target <= 5)"),
        ("aggregate tok/s, 8 streams vs 1", result["aggregate_tps_1_stream_p50"],
         result["aggregate_tps_8_streams_p50"],
         f"ratio {result['aggregate_ratio_8_over_1']:.2f} (target >= 2.5)"),
    ]  # fmt: skip
    print(f"\n{result['model']}  (p50 of {result['repeats']} interleaved runs)")
    print(f"{'':36} {'direct/1':>10} {'stack/8':>10}  verdict")
    for name, a, b, verdict in rows:
        print(f"{name:36} {a:10.2f} {b:10.2f}  {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gateway", help="a running stack's gateway; default: start one")
    parser.add_argument("--nats", help="that stack's NATS URL (see its stack.json)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random llama instead: shows the stack's per-token overhead",
    )
    parser.add_argument("--model-dir", type=Path, help="the model's local folder (default: the stack's copy)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

    from fleet_local import stack
    from fleet_local.bootstrap import DEFAULT_SOURCE, stage_and_serve
    from fleet_local.processes import free_port

    state_dir = None
    gateway, nats_url = args.gateway, args.nats
    if gateway is None:
        state_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
        manifest = stack.up(state_dir, gateway_port=free_port())
        gateway, nats_url = manifest.gateway_url, manifest.nats_url
        source = DEFAULT_SOURCE
        if args.tiny:
            args.model, source = "tiny/llama-chat", f"file://{make_tiny_chat_model(state_dir / 'tiny-src')}"
        stage_and_serve(gateway, args.model, source, 600, print)
    model_dir = args.model_dir or (state_dir / "models" / args.model / "main" if state_dir else None)
    if model_dir is None or nats_url is None:
        parser.error("--model-dir and --nats are needed with --gateway")
    try:
        result = asyncio.run(measure(gateway, nats_url, args.model, model_dir, args.repeats, args.max_tokens))
    finally:
        if state_dir is not None:
            stack.down(state_dir)
    report(result)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "tiny" if args.tiny else "smollm2"
    path = args.out / f"first_light-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
