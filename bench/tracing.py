"""What tracing costs: two embedded stacks side by side, one tracing every request
(FLEET_TRACE_SAMPLE_RATE=1), one tracing none (0), serving the default model on llama.cpp; rounds
alternate between them (the same prompts on both, the side going first alternating), so machine
noise hits both. Prints TTFT and decode tok/s per stream with
tracing on / off (target >= 0.98 for tok/s, <= 1.02 for TTFT) and writes JSON.

    .venv/bin/fleet bench tracing [--workloads 32x64@1,32x64@4] [--repeats 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

from cluster import REPO, discard, scratch_dir, write_result
from loadgen import RoundResult, http_round, paired_ratio, parse_workloads, round_prompts, summarize

SIDES = {"traced": "1", "untraced": "0"}


def start(stack_: ExitStack, state_dir: Path, sample_rate: str, threads: int) -> str:
    """An embedded stack tracing `sample_rate` of its requests, serving the default model on
    llama.cpp; its gateway URL."""
    from fleet_local import stack
    from fleet_local.bootstrap import DEFAULT_MODEL, DEFAULT_SOURCE, stage_and_serve
    from fleet_local.processes import free_port

    os.environ |= {"FLEET_TRACE_SAMPLE_RATE": sample_rate, "FLEET_CALIBRATION": "off"}
    os.environ["OMP_NUM_THREADS"] = str(threads)
    manifest = stack.up(state_dir, gateway_port=free_port(), auth=False)
    stack_.callback(stack.down, state_dir)
    stage_and_serve(manifest.gateway_url, DEFAULT_MODEL, DEFAULT_SOURCE, 900, print, engine="llamacpp")
    return manifest.gateway_url


async def measure(gateways: dict[str, str], workloads, repeats: int) -> dict:
    from fleet_local.bootstrap import DEFAULT_MODEL

    for url in gateways.values():  # first-request costs are not serving speed
        await http_round(url, DEFAULT_MODEL, round_prompts(workloads[0], 0), 4)
    results = {}
    for workload in workloads:
        rounds: dict[str, list[RoundResult]] = {name: [] for name in gateways}
        for repeat in range(repeats):
            # both sides get the same prompts (greedy: the same tokens), the side going first alternates
            prompts = round_prompts(workload, 1000 * repeat)
            for name in sorted(gateways, reverse=repeat % 2 == 1):
                rounds[name].append(
                    await http_round(gateways[name], DEFAULT_MODEL, prompts, workload.gen_tokens)
                )
                print(f"  {workload.label} {name:9} round {repeat + 1}/{repeats}", flush=True)
        traced, untraced = rounds["traced"], rounds["untraced"]
        pairs = [
            summarize([a])["decode_tps_per_stream_p50"] / summarize([b])["decode_tps_per_stream_p50"]
            for a, b in zip(traced, untraced, strict=True)
        ]
        results[workload.label] = {
            "traced": summarize(traced),
            "untraced": summarize(untraced),
            "ttft_ratio": paired_ratio(traced, untraced, "ttft_s"),
            "decode_tps_ratio": statistics.median(pairs),
            "aggregate_tps_ratio": paired_ratio(traced, untraced, "aggregate_tps"),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads", default="32x64@1,32x64@4", help="PROMPTxGEN@CONCURRENCY, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    workloads = parse_workloads(args.workloads)
    scratch = scratch_dir("fleet-bench-tracing-")
    with ExitStack() as stack_:
        gateways = {name: start(stack_, scratch / name, rate, args.threads) for name, rate in SIDES.items()}
        results = asyncio.run(measure(gateways, workloads, args.repeats))
    discard(scratch)
    print("\ntracing on (100%) / off, paired rounds (target: tok/s >= 0.98, TTFT <= 1.02)")
    for label, r in results.items():
        print(
            f"  {label:10} TTFT {r['ttft_ratio']:.3f}  decode tok/s/stream {r['decode_tps_ratio']:.3f}  "
            f"aggregate tok/s {r['aggregate_tps_ratio']:.3f}"
        )
    write_result(
        args.out, "tracing", {"workloads": results, "repeats": args.repeats, "threads": args.threads}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
