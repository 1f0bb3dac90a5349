"""What a full-precision prefill does for a quantised decoder: quality beside prefill time, in one run.

    .venv/bin/fleet bench cross-format                  # SmolLM2-135M-Instruct and its MLX 4-bit conversion
    .venv/bin/fleet bench cross-format --prompts 3 --tokens 32

The seeds' headline setup decodes on an MLX 4-bit conversion from KV that the full weights
prefilled (Fleet routes so by base model, fleet_proto.partners). For a few chat prompts it measures,
with MLX in this process: the full model's greedy answer (the reference); teacher-forced over that
answer, the top-1 agreement and mean KL(full || decoder) of the 4-bit model decoding from its own
prefill and from the full model's KV; and how long each prefill took here (what a split saves:
MLX's 4-bit matmuls have no fast CPU path, its bf16 ones run on BLAS). The stack's own TTFT with a
vLLM partner is in tests/test_cross_model_disagg_stack.py and the README. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, discard, scratch_dir, write_result

from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
from fleet_downloader.staging import local_model_folder

TOPICS = ("Station", "Tower", "Bridge", "Harbour", "Mill")


def convert_4bit(full: Path, out: Path) -> Path:
    script = (
        "import sys; from mlx_lm import convert; "
        "convert(sys.argv[1], mlx_path=sys.argv[2], quantize=True, q_bits=4, q_group_size=64)"
    )
    subprocess.run([sys.executable, "-c", script, str(full), str(out)], check=True, timeout=600)
    return out


def chat(tokenizer, topic: str, facts: int) -> list[int]:
    text = " ".join(f"{topic} {n} sits {n * 11 % 53} km east of the coast." for n in range(facts))
    message = {"role": "user", "content": f"{text} Which {topic.lower()} sits furthest east?"}
    return tokenizer.apply_chat_template([message], add_generation_prompt=True)


def measure(full_dir: Path, quantised_dir: Path, prompts: int, facts: int, tokens: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    full, tokenizer = load(str(full_dir))
    quantised, _ = load(str(quantised_dir))

    def prefilled(model, decoder, ids: list[int]) -> tuple[list, float]:
        """`decoder`'s cache holding the KV `model` computed for the prompt but its last token."""
        cache, started = make_prompt_cache(model), time.perf_counter()
        model(mx.array([ids[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        seconds = time.perf_counter() - started
        into = make_prompt_cache(decoder)
        for target, source in zip(into, cache, strict=True):
            target.update_and_fetch(
                source.keys[..., : source.offset, :], source.values[..., : source.offset, :]
            )
        return into, seconds

    def log_probs(model, cache, forced: list[int]):
        logits = model(mx.array([forced]), cache=cache)[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    rows = []
    for topic in TOPICS[:prompts]:
        ids = chat(tokenizer, topic, facts)
        cache, full_s = prefilled(full, full, ids)
        answer, last = [], ids[-1]
        for _ in range(tokens):
            last = int(mx.argmax(full(mx.array([[last]]), cache=cache)[0, -1]).item())
            answer.append(last)
        forced = [ids[-1], *answer[:-1]]
        reference = log_probs(full, prefilled(full, full, ids)[0], forced)
        row: dict = {"prompt_tokens": len(ids), "forced_tokens": tokens, "full_prefill_s": full_s}
        for side, prefill_model in (("alone", quantised), ("full_kv", full)):
            cache, seconds = prefilled(prefill_model, quantised, ids)
            ours = log_probs(quantised, cache, forced)
            top1 = mx.mean((mx.argmax(ours, -1) == mx.argmax(reference, -1)).astype(mx.float32)).item()
            kl = mx.mean(mx.sum(mx.exp(reference) * (reference - ours), axis=-1)).item()
            row[side] = {"top1_agreement": round(top1, 4), "mean_kl": round(kl, 4), "prefill_s": seconds}
        print(
            f"  {topic:8} {len(ids)} tokens: 4-bit alone top-1 {row['alone']['top1_agreement']:.3f} "
            f"KL {row['alone']['mean_kl']:.3f} (prefill {row['alone']['prefill_s']:.1f} s); from the full "
            f"model's KV top-1 {row['full_kv']['top1_agreement']:.3f} KL {row['full_kv']['mean_kl']:.3f} "
            f"(its prefill {full_s:.1f} s)",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=3, help=f"chat prompts (up to {len(TOPICS)})")
    parser.add_argument("--facts", type=int, default=20, help="sentences per prompt (20: ~300 tokens)")
    parser.add_argument("--tokens", type=int, default=32, help="teacher-forced answer tokens")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    scratch = scratch_dir("cross-format")
    full = local_model_folder(DEFAULT_MODEL_SOURCE, scratch)
    quantised = convert_4bit(full, scratch / "4bit")
    print(f"{DEFAULT_MODEL_ID}: full weights vs its MLX 4-bit conversion", flush=True)
    rows = measure(full, quantised, min(args.prompts, len(TOPICS)), args.facts, args.tokens)
    discard(scratch)
    summary = {
        side: {
            metric: statistics.mean(row[side][metric] for row in rows)
            for metric in ("top1_agreement", "mean_kl", "prefill_s")
        }
        for side in ("alone", "full_kv")
    }
    alone, from_full = summary["alone"], summary["full_kv"]
    print(
        f"mean: 4-bit alone top-1 {alone['top1_agreement']:.3f} KL {alone['mean_kl']:.3f}; "
        f"from the full model's KV top-1 {from_full['top1_agreement']:.3f} KL {from_full['mean_kl']:.3f}"
    )
    write_result(args.out, "cross_format", {"model": DEFAULT_MODEL_ID, "rows": rows, "mean": summary})


if __name__ == "__main__":
    main()
