"""Serving sweep against any OpenAI-compatible endpoint: prompt length x generation length x
concurrency, streamed greedy chat completions.

    .venv/bin/fleet bench serve --fleet                        # start Fleet (SmolLM2) and sweep it
    .venv/bin/fleet bench serve --fleet --tiny --engine mlx    # a tiny random llama, seconds
    .venv/bin/fleet bench serve --url http://127.0.0.1:8000 --model my/model --tokenizer DIR \\
        --prompt-lens 128,512,1024 --gen-lens 64 --concurrency 1,4,8 --mode cartesian --pid 1234
    .venv/bin/fleet bench serve --url http://127.0.0.1:8000 --model my/model --place vllm --ensure-cuda

With --place ENGINE the target is a Fleet gateway: the sweep places its own instance of the model on
that engine first (waiting until it is ready) and deletes it at the end, as the seed's exo_bench
sets up and tears down instances; --ensure-cuda refuses to run unless a CUDA node offers vLLM.
A gateway with API keys takes them from $FLEET_API_KEY (requests) and $FLEET_ADMIN_KEY (--place):
`FLEET_API_KEY=$(fleet key) FLEET_ADMIN_KEY=$(fleet key --admin) fleet bench serve --url ...`.

Per workload: TTFT p50/p99, TPOT p50, decode tok/s per stream, aggregate tok/s, prompt tok/s
(prompt tokens of a round / its slowest TTFT), peak memory of --pid's process tree (Fleet's whole
stack with --fleet), errors. Prompts count --prompt-lens tokens with the model's tokenizer
(--tokenizer DIR; else words), each unique. Writes JSON and two PNG plots to bench/results/:
aggregate throughput vs concurrency, TTFT vs prompt length.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import ExitStack
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, call, delete, discard, scratch_dir, until, write_result
from loadgen import (
    Workload,
    auth_headers,
    chat_prompt,
    parse_lengths,
    round_prompts,
    summarize,
    sweep,
    word_count,
)
from peers import Side, http_side, token_counter
from plots import line_plot

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


async def run_sweep(side: Side, workloads: list[Workload], repeats: int, warmup: int, count) -> dict:
    for _ in range(warmup):
        await side.measure([chat_prompt(8, 0, count)], 4)
    results = {}
    salt = 1
    for workload in workloads:
        rounds = []
        for _ in range(repeats):
            rounds.append(await side.measure(round_prompts(workload, salt, count), workload.gen_tokens))
            salt += workload.concurrency
        summary = summarize(rounds)
        results[workload.label] = {"workload": vars(workload), **summary}
        print(
            f"  {workload.label:>14}  TTFT p50 {summary['ttft_s_p50'] * 1000:8.0f} ms  p99 "
            f"{summary['ttft_s_p99'] * 1000:8.0f} ms  TPOT {summary['tpot_s_p50'] * 1000:7.1f} ms  "
            f"agg {summary['aggregate_tps_p50']:7.1f} tok/s  prompt {summary['prompt_tps_p50']:7.1f} tok/s  "
            f"peak {summary['peak_rss_bytes'] / 2**20:6.0f} MiB  errors {summary['errors']}",
            flush=True,
        )
    return results


def plots(results: dict, out: Path, title: str, name: str) -> list[str]:
    throughput: dict[str, list] = {}
    ttft: dict[str, list] = {}
    for entry in results.values():
        w = entry["workload"]
        key = f"{w['prompt_tokens']} in, {w['gen_tokens']} out"
        throughput.setdefault(key, []).append((w["concurrency"], entry["aggregate_tps_p50"]))
        ttft.setdefault(f"{w['concurrency']} streams", []).append((w["prompt_tokens"], entry["ttft_s_p50"]))
    paths = [
        line_plot(out / f"{name}-throughput.png", f"{title}: throughput", "concurrent streams",
                  "aggregate tokens/s", throughput, log_x=True),
        line_plot(out / f"{name}-ttft.png", f"{title}: time to first token", "prompt tokens",
                  "TTFT p50 (s)", ttft),
    ]  # fmt: skip
    return [str(p) for p in paths]


def cuda_vllm_nodes(capabilities: dict) -> list[str]:
    """Nodes of a Fleet cluster (its GET /capabilities) that are CUDA machines offering vLLM."""
    offering = set(capabilities.get("engines", {}).get("vllm", {}).get("nodes", []))
    return sorted(
        n for n, about in capabilities.get("nodes", {}).items() if about["kind"] == "cuda" and n in offering
    )


async def place_instance(gateway: str, model: str, engine: str) -> str:
    body = {"model": model, "engine": engine}
    async with aiohttp.ClientSession(headers=auth_headers(admin=True)) as session:
        iid = (await call(session, "POST", f"{gateway}/instances", body))["instance_id"]
        settled = lambda s: s["instances"].get(iid, {}).get("status") in ("ready", "failed")  # noqa: E731
        instance = (await until(session, gateway, settled, 1200))["instances"][iid]
    if instance["status"] == "failed":
        raise SystemExit(f"instance {iid} of {model} on {engine} failed: {instance.get('reason')}")
    print(f"placed {iid} ({model} on {engine})")
    return iid


async def capabilities_of(gateway: str) -> dict:
    async with aiohttp.ClientSession(headers=auth_headers()) as session:
        return await call(session, "GET", f"{gateway}/capabilities")


def start_fleet(
    stack: ExitStack, state_dir: Path, tiny: bool, engine: str
) -> tuple[str, str, Path, list[int]]:
    from fleet_local import stack as fleet_stack
    from fleet_local.bootstrap import DEFAULT_SOURCE, stage_and_serve
    from fleet_local.processes import free_port

    model, source = DEFAULT_MODEL, DEFAULT_SOURCE
    if tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        model, source = "tiny/llama-serve", f"file://{make_chat_model(state_dir / 'tiny-src', hidden=128)}"
    manifest = fleet_stack.up(state_dir, gateway_port=free_port(), auth=False)
    stack.callback(fleet_stack.down, state_dir)
    stage_and_serve(manifest.gateway_url, model, source, 1200, print, engine=engine)
    model_dir = state_dir / "models" / model / "main"
    return manifest.gateway_url, model, model_dir, [p.pid for p in manifest.processes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="the model name its requests use")
    target.add_argument("--tokenizer", type=Path, help="a folder with the model's tokenizer.json")
    target.add_argument("--pid", type=int, action="append", default=[], help="a server PID, for peak memory")
    target.add_argument(
        "--place", metavar="ENGINE", help="--url is a Fleet gateway: place (then delete) an instance"
    )
    target.add_argument(
        "--ensure-cuda", action="store_true", help="with --url of a Fleet gateway: need CUDA vLLM"
    )
    target.add_argument("--fleet", action="store_true", help="start Fleet's embedded stack and sweep it")
    target.add_argument("--tiny", action="store_true", help="with --fleet: a tiny random llama")
    target.add_argument(
        "--engine", default="", help="with --fleet: the instance's engine (default: placement's)"
    )
    parser.add_argument("--prompt-lens", default="128,512", help="prompt tokens, comma separated")
    parser.add_argument("--gen-lens", default="32", help="generated tokens, comma separated")
    parser.add_argument("--mode", choices=("tandem", "cartesian"), default="tandem")
    parser.add_argument("--concurrency", default="1,4,8", help="concurrent streams, comma separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="tiny requests first (not measured)")
    parser.add_argument("--name", default="", help="result file name (default: serve-<model>)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if not args.fleet and not (args.url and args.model):
        parser.error("give --url and --model, or --fleet")
    try:
        workloads = sweep(
            parse_lengths(args.prompt_lens),
            parse_lengths(args.gen_lens),
            parse_lengths(args.concurrency),
            args.mode,
        )
    except ValueError as exc:
        parser.error(str(exc))

    scratch = scratch_dir("fleet-bench-serve-")
    with ExitStack() as stack:
        url, model, tokenizer, pids = args.url, args.model, args.tokenizer, list(args.pid)
        if args.fleet:
            url, model, tokenizer, fleet_pids = start_fleet(stack, scratch, args.tiny, args.engine)
            pids += fleet_pids
        if args.ensure_cuda and not cuda_vllm_nodes(asyncio.run(capabilities_of(url))):
            raise SystemExit("--ensure-cuda: no CUDA node of this Fleet cluster offers vLLM")
        if args.place:
            instance_id = asyncio.run(place_instance(url, model, args.place))
            stack.callback(lambda: asyncio.run(delete(url, instance_id)))
        count = token_counter(tokenizer) if tokenizer else word_count
        side = http_side("target", url, "", url, model, pids)
        print(f"sweeping {model} at {url}: {len(workloads)} workloads x {args.repeats} rounds")
        results = asyncio.run(run_sweep(side, workloads, args.repeats, args.warmup, count))
    discard(scratch)
    result = {
        "url": url,
        "model": model,
        "engine": args.engine or args.place or "",
        "mode": args.mode,
        "repeats": args.repeats,
        "prompt_lengths_counted_by": "tokenizer" if tokenizer else "words",
        "workloads": results,
    }
    name = args.name or f"serve-{model.rsplit('/', 1)[-1]}"
    result["plots"] = plots(results, args.out, model.rsplit("/", 1)[-1], name)
    write_result(args.out, name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
