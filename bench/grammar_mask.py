"""What constrained decoding costs per token with each grammar library vLLM ships: xgrammar and
llguidance, on one model's tokenizer, on one thread (the measurement issue 39 picks Fleet's library by).

    .venv/bin/fleet bench grammar-mask                 # SmolLM2-135M-Instruct's tokenizer
    .venv/bin/fleet bench grammar-mask --tokenizer DIR # any Hugging Face folder with a tokenizer

For each library and each grammar (a JSON schema with nested objects and arrays, and free-form JSON
as `response_format: json_object` asks), it times: preparing the tokenizer (once per model),
compiling the grammar cold and again (a cache hit where the library has one), then walking a valid
document token by token as a decoder would: filling the next-token bitmask, then accepting the
token. Each walk runs `--repeats` times; the percentiles are over every token of every walk. Also
the cost of applying a bitmask to one row of logits (torch, as the libraries do; numpy, as Fleet's
llama.cpp sampler would). Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, write_result

from fleet_downloader.defaults import DEFAULT_MODEL_SOURCE
from fleet_downloader.staging import local_model_folder

WORK_DIR = REPO / ".fleet" / "bench-quality"  # shares bench/quality.py's converted default model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
}
GRAMMARS = {"json_schema": SCHEMA, "json_object": {"type": "object"}}


def seconds(action: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    value = action()
    return time.perf_counter() - started, value


def percentiles_us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[max(0, round(len(ordered) * 0.99) - 1)] * 1e6,
        "max_us": ordered[-1] * 1e6,
    }


def walk(new_matcher: Callable[[], object], fill: Callable, accept: Callable, ids: list[int], repeats: int):
    """(fill seconds, accept seconds) of every token of `repeats` walks through the document."""
    fills, accepts = [], []
    for _ in range(repeats):
        matcher = new_matcher()
        for token in ids:
            fills.append(seconds(lambda m=matcher: fill(m))[0])
            took, accepted = seconds(lambda m=matcher, t=token: accept(m, t))
            if not accepted:
                raise RuntimeError(f"the grammar refused token {token} of a valid document")
            accepts.append(took)
    return fills, accepts


def timings(compile_s: float, again_s: float, fills: list[float], accepts: list[float]) -> dict:
    """One grammar's entry in the result: compile times, then the walk's per-token percentiles."""
    return {
        "compile_ms": compile_s * 1e3,
        "compile_again_ms": again_s * 1e3,
        "mask": percentiles_us(fills),
        "accept": percentiles_us(accepts),
    }


def xgrammar_side(tokenizer, vocab_size: int, ids: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    prepare_s, info = seconds(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    grammars = {}
    for name, schema in GRAMMARS.items():
        text = json.dumps(schema)
        cold_s, compiled = seconds(lambda t=text: compiler.compile_json_schema(t))
        cached_s, _ = seconds(lambda t=text: compiler.compile_json_schema(t))
        fills, accepts = walk(
            lambda c=compiled: xgr.GrammarMatcher(c),
            lambda m: m.fill_next_token_bitmask(mask),
            lambda m, t: m.accept_token(t),
            ids,
            repeats,
        )
        grammars[name] = timings(cold_s, cached_s, fills, accepts)
    return {"tokenizer_ms": prepare_s * 1e3, "grammars": grammars, "bitmask": mask}


def llguidance_side(tokenizer, vocab_size: int, ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    prepare_s, lltokenizer = seconds(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    mask = llguidance.torch.allocate_token_bitmask(1, lltokenizer.vocab_size)
    grammars = {}
    for name, schema in GRAMMARS.items():
        text = json.dumps(schema)

        def compile_(t: str = text) -> tuple[str, object]:  # the grammar text, then its matcher
            grammar = llguidance.LLMatcher.grammar_from_json_schema(t)
            return grammar, llguidance.LLMatcher(lltokenizer, grammar)

        cold_s, (grammar, first) = seconds(compile_)
        again_s, _ = seconds(compile_)  # no cache of its own: the same work again
        if first.is_error():
            raise RuntimeError(f"llguidance refused the {name} grammar: {first.get_error()}")
        fills, accepts = walk(
            lambda g=grammar: llguidance.LLMatcher(lltokenizer, g),
            lambda m: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
            lambda m, t: m.consume_token(t),
            ids,
            repeats,
        )
        grammars[name] = timings(cold_s, again_s, fills, accepts)
    return {"tokenizer_ms": prepare_s * 1e3, "grammars": grammars}


def apply_costs(bitmask, vocab_size: int, repeats: int = 200) -> dict[str, float]:
    """Microseconds to apply a packed bitmask to one row of float32 logits."""
    import numpy as np
    import torch
    import xgrammar as xgr

    logits = torch.randn(1, vocab_size)
    torch_s, _ = seconds(lambda: [xgr.apply_token_bitmask_inplace(logits, bitmask) for _ in range(repeats)])
    row, packed = logits.numpy()[0], bitmask.numpy().view(np.uint8)

    def numpy_mask() -> object:
        allowed = np.unpackbits(packed, bitorder="little")[:vocab_size].astype(bool)
        return np.where(allowed, row, -np.inf)

    numpy_s, _ = seconds(lambda: [numpy_mask() for _ in range(repeats)])
    return {"torch_us": torch_s / repeats * 1e6, "numpy_us": numpy_s / repeats * 1e6}


def run(folder: Path, repeats: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    vocab_size = int(config.get("vocab_size") or len(tokenizer))
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    xgrammar = xgrammar_side(tokenizer, vocab_size, ids, repeats)
    apply = apply_costs(xgrammar.pop("bitmask"), vocab_size)
    return {
        "tokenizer_folder": str(folder),
        "vocab_size": vocab_size,
        "document_tokens": len(ids),
        "repeats": repeats,
        "libraries": {
            "xgrammar": xgrammar,
            "llguidance": llguidance_side(tokenizer, vocab_size, ids, repeats),
        },
        "apply_mask": apply,
    }


def table(result: dict) -> str:
    lines = [
        f"vocab {result['vocab_size']}, a {result['document_tokens']}-token document, "
        f"{result['repeats']} walks",
        "library     grammar      tokenizer ms  compile ms  again ms  mask p50/p99/max us    accept p50 us",
    ]
    for library, side in result["libraries"].items():
        for name, g in side["grammars"].items():
            mask = g["mask"]
            lines.append(
                f"{library:11s} {name:12s} {side['tokenizer_ms']:12.0f} {g['compile_ms']:11.1f} "
                f"{g['compile_again_ms']:9.2f}  {mask['p50_us']:6.1f} / {mask['p99_us']:6.1f} / "
                f"{mask['max_us']:6.1f}  {g['accept']['p50_us']:12.1f}"
            )
    apply = result["apply_mask"]
    lines.append(
        f"applying a bitmask to one row of logits: torch {apply['torch_us']:.0f} us, "
        f"numpy {apply['numpy_us']:.0f} us"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", type=Path, help="a Hugging Face folder (default: the default model's)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    folder = args.tokenizer or local_model_folder(DEFAULT_MODEL_SOURCE, WORK_DIR)
    result = run(folder, args.repeats)
    print(table(result))
    write_result(args.out, "grammar-mask", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
