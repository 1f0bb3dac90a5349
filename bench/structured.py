"""What structured outputs cost: decode tok/s and TTFT constrained vs free, side by side, per engine.

    .venv/bin/fleet bench structured                          # every installed engine, SmolLM2
    .venv/bin/fleet bench structured --engines llamacpp --rounds 5 --concurrency 1,8
    .venv/bin/fleet bench structured --tiny --engines mlx      # a tiny random llama: seconds

Starts Fleet's embedded stack, stages the default model and, one engine at a time, places an
instance of it, then sends rounds of `concurrency` streamed greedy chat completions that alternate
free (ignore_eos) / under a JSON schema (a long story in one string field), so both run to
--gen-tokens, on prompts of the same length (each new, so neither side prefills from the other's
cache), the order swapped every round. Ratios are constrained / free of each round pair (median,
[min-max]): the goals are >= 0.9 for decode tok/s and <= 1.1 for TTFT with a warm grammar cache. The
first constrained request of each engine is timed apart (its grammar compiles then: the cold cost a
user sees), and the worker's own grammar code is timed in this process: preparing the tokenizer,
compiling a new schema, asking for one already compiled. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, delete, discard, scratch_dir, stage, write_result
from loadgen import chat_prompt, http_round, pair_ratios, summarize
from peers import installed
from serve import place_instance

# The story's minLength keeps the object open past --gen-tokens (64 tokens are ~250 characters), so
# both sides decode as many tokens: a first run without it closed the JSON after ~22 tokens, and
# TPOT over so few tokens of 8 streams is mostly the others' prefill.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "minLength": 600},
    },
    "required": ["title", "story"],
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
ENGINES = ("llamacpp", "vllm", "mlx")
ENGINE_MODULES = {"llamacpp": "llama_cpp", "vllm": "vllm", "mlx": "mlx_lm"}


def spread(values: list[float]) -> dict:
    """Median and range of paired ratios (nan when there are none)."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def prompts(concurrency: int, prompt_tokens: int, salt: int) -> list[list[dict]]:
    """`concurrency` unique prompts that ask for a long story (answered as JSON or as free text)."""
    ask = " Tell me a long story about them, as JSON with a title and the story."
    return [
        [{"role": "user", "content": chat_prompt(prompt_tokens, salt + i)[0]["content"] + ask}]
        for i in range(concurrency)
    ]


async def measure(url: str, model: str, args: argparse.Namespace) -> dict:
    """One engine's instance: the cold constrained request, then paired rounds per concurrency."""
    constrained = {"response_format": SCHEMA_FORMAT}
    started = time.perf_counter()
    cold = await http_round(url, model, prompts(1, args.prompt_tokens, 0), args.gen_tokens, constrained)
    cold_ttft = cold.streams[0].ttft_s
    warm = await http_round(url, model, prompts(1, args.prompt_tokens, 1), args.gen_tokens, constrained)
    results: dict = {
        "cold_first_constrained_ttft_s": cold_ttft,
        "warm_next_constrained_ttft_s": warm.streams[0].ttft_s,
        "cold_wall_s": time.perf_counter() - started,
    }
    salt = 100
    for concurrency in args.concurrency:
        free_rounds, schema_rounds = [], []
        for index in range(args.rounds):
            order = [(free_rounds, {"ignore_eos": True}), (schema_rounds, constrained)]
            for rounds, extra in order if index % 2 == 0 else reversed(order):
                # prompts of the same length, each new: no side finds the other's in a prefix cache
                batch = prompts(concurrency, args.prompt_tokens, salt)
                salt += concurrency
                rounds.append(await http_round(url, model, batch, args.gen_tokens, extra))
        entry = {
            "free": summarize(free_rounds),
            "constrained": summarize(schema_rounds),
            "decode_tps_ratio": spread(pair_ratios(schema_rounds, free_rounds, "decode_tps")),
            "ttft_ratio": spread(pair_ratios(schema_rounds, free_rounds, "ttft_s")),
        }
        results[f"{concurrency} streams"] = entry
        print(f"    {concurrency} streams: {pair_line(entry)}", flush=True)
    return results


def ratio_text(ratio: dict) -> str:
    return f"x{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"


def pair_line(entry: dict) -> str:
    """One concurrency's constrained vs free numbers and their ratios, as the run prints them."""
    schema, free = entry["constrained"], entry["free"]
    return (
        f"decode {schema['decode_tps_per_stream_p50']:6.1f} vs {free['decode_tps_per_stream_p50']:6.1f} "
        f"tok/s ({ratio_text(entry['decode_tps_ratio'])}), TTFT {schema['ttft_s_p50'] * 1e3:6.0f} vs "
        f"{free['ttft_s_p50'] * 1e3:6.0f} ms ({ratio_text(entry['ttft_ratio'])}), "
        f"errors {schema['errors']}+{free['errors']}"
    )


def compile_costs(model_dir: Path) -> dict:
    """The worker's grammar code (fleet_worker.engines.grammar) on the model's tokenizer, in ms."""
    from fleet_proto import StructuredOutput
    from fleet_worker.engines.base import eos_token_ids
    from fleet_worker.engines.grammar import Grammars

    config = json.loads((model_dir / "config.json").read_text())
    grammars = Grammars(model_dir, int(config["vocab_size"]), eos_token_ids(model_dir))

    def ready_ms(spec: StructuredOutput) -> float:
        started = time.perf_counter()
        grammars.wait(spec, timeout_s=None)
        assert grammars.constraint(spec) is not None
        return (time.perf_counter() - started) * 1e3

    first = StructuredOutput(json_schema=json.dumps(SCHEMA))
    other = StructuredOutput(json_schema=json.dumps(SCHEMA | {"required": ["story"]}))
    costs = {
        "first_schema_ms": ready_ms(first),  # loads xgrammar, prepares the tokenizer, compiles
        "new_schema_ms": ready_ms(other),
        "same_schema_again_ms": ready_ms(first),
    }
    grammars.close()
    return costs


def model_source(tiny: bool, scratch: Path) -> tuple[str, str]:
    """The model to measure and where it is staged from: SmolLM2 (the default), or a tiny random llama."""
    if not tiny:
        from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE

        return DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
    sys.path.insert(0, str(REPO))
    from tests.support import make_chat_model

    return "tiny/llama-structured", f"file://{make_chat_model(scratch / 'tiny-src', hidden=128)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_engines = ",".join(e for e in ENGINES if installed(ENGINE_MODULES[e]))
    parser.add_argument("--engines", default=default_engines, help="comma separated")
    parser.add_argument("--concurrency", default="1,8", help="concurrent streams, comma separated")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds per concurrency")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    engines = [e for e in args.engines.split(",") if e]

    from fleet_local import stack

    os.environ["FLEET_CALIBRATION"] = "off"  # nothing but the measured requests on the CPUs
    scratch = scratch_dir("fleet-bench-structured-")
    model, source = model_source(args.tiny, scratch)
    result: dict = {"model": model, "schema": SCHEMA, "args": vars(args) | {"out": str(args.out)}}
    try:
        manifest = stack.up(scratch / "state", gateway_port=0, auth=False)
        try:
            url = manifest.gateway_url
            asyncio.run(stage(url, model, source, nodes=1))
            result["engines"] = {}
            for engine in engines:
                instance_id = asyncio.run(place_instance(url, model, engine))
                try:
                    if "compile" not in result:  # the worker has fetched the model's files now
                        result["compile"] = compile_costs(scratch / "state" / "models" / model / "main")
                        print(f"grammar compile (worker code): {result['compile']}")
                    print(f"  {engine}:")
                    result["engines"][engine] = asyncio.run(measure(url, model, args))
                finally:
                    asyncio.run(delete(url, instance_id))
        finally:
            stack.down(scratch / "state")
    finally:
        discard(scratch)
    write_result(args.out, "structured", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
