"""What tracing costs: two embedded stacks side by side, one tracing every request
(FLEET_TRACE_SAMPLE_RATE=1), one tracing none (0), serving the default model on llama.cpp; rounds
alternate between them (the same prompts on both, the side going first alternating), so machine
noise hits both. Every request decodes its full token count (ignore_eos).

Two measures:
- speed: TTFT and decode tok/s per stream with tracing on / off, the median over back-to-back
  round pairs with its quartiles (target >= 0.98 for tok/s, <= 1.02 for TTFT). On 2 cores the
  pairs spread a few percent either way, so the quartiles say how far a median can be trusted.
  The engine process sends outputs in bursts up to FLEET_STREAM_INTERVAL_MS (50) apart, so a
  stream's last token is timed on that grid: 128 tokens keep the grid's share of a stream small.
- CPU: the seconds of CPU the stack's own processes (servers and services, not the engine
  processes) spend per request on each side, read from the kernel around that side's rounds. Their
  difference is what tracing costs, independent of the machine's noise; it is also given as a share
  of all the CPU a request takes (engine included), and by process.

    .venv/bin/fleet bench tracing [--workloads 32x128@1,32x128@4] [--repeats 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from cluster import REPO, discard, scratch_dir, write_result
from loadgen import RoundResult, http_round, pair_ratios, parse_workloads, round_prompts, summarize

SIDES = {"traced": "1", "untraced": "0"}
FULL_LENGTH = {"ignore_eos": True}  # per-stream tok/s over equal lengths on both sides


@dataclass
class Side:
    url: str
    services: dict[str, list[psutil.Process]]  # the stack's servers and services, by name
    engines: list[psutil.Process]  # the engine-worker's engine processes
    rounds: dict[str, list[RoundResult]] = field(default_factory=dict)
    cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)  # workload -> process kind -> s

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds so far: "engines", "services" (all of them) and each service by name."""
        each = {name: own_cpu_s(processes) for name, processes in self.services.items()}
        return {"engines": own_cpu_s(self.engines), "services": sum(each.values()), **each}


def own_cpu_s(processes: list[psutil.Process]) -> float:
    """User + system seconds of each process itself (children are listed on their own)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def start(stack_: ExitStack, state_dir: Path, sample_rate: str, threads: int) -> Side:
    """An embedded stack tracing `sample_rate` of its requests, serving the default model on
    llama.cpp."""
    from fleet_local import stack
    from fleet_local.bootstrap import DEFAULT_MODEL, DEFAULT_SOURCE, stage_and_serve
    from fleet_local.processes import free_port

    os.environ |= {"FLEET_TRACE_SAMPLE_RATE": sample_rate, "FLEET_CALIBRATION": "off"}
    os.environ["OMP_NUM_THREADS"] = str(threads)
    manifest = stack.up(state_dir, gateway_port=free_port(), auth=False)
    stack_.callback(stack.down, state_dir)
    stage_and_serve(manifest.gateway_url, DEFAULT_MODEL, DEFAULT_SOURCE, 900, print, engine="llamacpp")
    services: dict[str, list[psutil.Process]] = {}
    for process in manifest.processes:
        services.setdefault(process.name, []).append(psutil.Process(process.pid))
    workers = services.get("engine-worker", [])
    engines = [child for worker in workers for child in worker.children(recursive=True)]
    return Side(manifest.gateway_url, services, engines)


def quartiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        only = values[0] if values else float("nan")
        return {"p25": only, "p50": only, "p75": only}
    p25, p50, p75 = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25": p25, "p50": p50, "p75": p75}


def cpu_per_request(side: Side, label: str, requests: int) -> dict[str, float]:
    spent = side.cpu_s[label]
    return {name: 1000 * seconds / requests for name, seconds in spent.items()}


async def measure(sides: dict[str, Side], workloads, repeats: int) -> dict:
    from fleet_local.bootstrap import DEFAULT_MODEL

    for side in sides.values():  # first-request costs are not serving speed
        await http_round(side.url, DEFAULT_MODEL, round_prompts(workloads[0], 0), 4, FULL_LENGTH)
    results = {}
    for workload in workloads:
        label = workload.label
        for side in sides.values():
            side.rounds[label], side.cpu_s[label] = [], {}
        for repeat in range(repeats):
            # both sides get the same prompts (greedy: the same tokens), the side going first alternates
            prompts = round_prompts(workload, 1000 * repeat)
            for name in sorted(sides, reverse=repeat % 2 == 1):
                side = sides[name]
                before = side.cpu_now()
                side.rounds[label].append(
                    await http_round(side.url, DEFAULT_MODEL, prompts, workload.gen_tokens, FULL_LENGTH)
                )
                for kind, seconds in side.cpu_now().items():
                    side.cpu_s[label][kind] = side.cpu_s[label].get(kind, 0.0) + seconds - before[kind]
                print(f"  {label} {name:9} round {repeat + 1}/{repeats}", flush=True)
        traced, untraced = sides["traced"], sides["untraced"]
        requests = repeats * workload.concurrency
        on_cpu = cpu_per_request(traced, label, requests)
        off_cpu = cpu_per_request(untraced, label, requests)
        ratios = {
            metric: quartiles(pair_ratios(traced.rounds[label], untraced.rounds[label], metric))
            for metric in ("ttft_s", "decode_tps", "aggregate_tps")
        }
        results[label] = {
            "traced": summarize(traced.rounds[label]),
            "untraced": summarize(untraced.rounds[label]),
            "ttft_ratio": ratios["ttft_s"]["p50"],
            "decode_tps_ratio": ratios["decode_tps"]["p50"],
            "aggregate_tps_ratio": ratios["aggregate_tps"]["p50"],
            "pair_ratio_quartiles": ratios,
            "cpu_ms_per_request": {"traced": on_cpu, "untraced": off_cpu},
            "tracing_cpu_ms_per_request": on_cpu["services"] - off_cpu["services"],
            "tracing_cpu_share": (on_cpu["services"] - off_cpu["services"])
            / (off_cpu["services"] + off_cpu["engines"]),
        }
    return results


def report(results: dict) -> None:
    print("\ntracing on (100%) / off, medians of paired rounds [quartiles]")
    print("(targets: tok/s >= 0.98, TTFT <= 1.02)")
    for label, r in results.items():
        q = r["pair_ratio_quartiles"]
        spread = {m: f"[{q[m]['p25']:.3f}-{q[m]['p75']:.3f}]" for m in q}
        print(
            f"  {label:10} TTFT {r['ttft_ratio']:.3f} {spread['ttft_s']}  "
            f"decode tok/s/stream {r['decode_tps_ratio']:.3f} {spread['decode_tps']}  "
            f"aggregate tok/s {r['aggregate_tps_ratio']:.3f} {spread['aggregate_tps']}"
        )
    print("\nCPU per request, the stack's servers and services (engines apart), ms")
    for label, r in results.items():
        on, off = r["cpu_ms_per_request"]["traced"], r["cpu_ms_per_request"]["untraced"]
        print(
            f"  {label:10} traced {on['services']:.1f}  untraced {off['services']:.1f}  "
            f"tracing {r['tracing_cpu_ms_per_request']:+.1f} ms = {100 * r['tracing_cpu_share']:+.2f}% "
            f"of a request's CPU (engine {off['engines']:.0f} ms)"
        )
        by_process = {name: on[name] - off.get(name, 0.0) for name in set(on) - {"services", "engines"}}
        shares = sorted(by_process.items(), key=lambda item: -item[1])
        print("    by process: " + ", ".join(f"{name} {ms:+.1f}" for name, ms in shares))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads", default="32x128@1,32x128@4", help="PROMPTxGEN@CONCURRENCY, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    workloads = parse_workloads(args.workloads)
    scratch = scratch_dir("fleet-bench-tracing-")
    with ExitStack() as stack_:
        sides = {name: start(stack_, scratch / name, rate, args.threads) for name, rate in SIDES.items()}
        results = asyncio.run(measure(sides, workloads, args.repeats))
    discard(scratch)
    report(results)
    write_result(
        args.out, "tracing", {"workloads": results, "repeats": args.repeats, "threads": args.threads}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
