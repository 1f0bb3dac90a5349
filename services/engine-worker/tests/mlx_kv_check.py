"""The MLX side of the cross-engine KV checks, run as a script in its own process.

`inject MODEL KV_DIR PROMPT BLOCK N`: load the prompt's leading blocks from the KV folder into a fresh
MLX cache, prefill the rest and decode N greedy tokens; also decode N after MLX's own full prefill,
and measure how far the loaded KV is from MLX's own. `export MODEL KV_DIR PROMPTS BLOCK N`: prefill
each prompt in MLX and write its full blocks to the folder. Prints one JSON report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from fleet_store.kv import KVFolder, decode_block, folder_fingerprint, prompt_blocks
from fleet_worker.engines.mlx.kv import blocks_to_cache, cache_to_blocks


def greedy(model, prompt: list[int], n: int, cache=None) -> list[int]:
    steps = generate_step(
        mx.array(prompt), model, prompt_cache=cache, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for (token, _), _ in zip(steps, range(n), strict=False)]


def inject(model, folder: KVFolder, fingerprint: str, prompt: list[int], block: int, n: int) -> dict:
    blocks = []
    for block_hash, _, _, tokens in prompt_blocks(fingerprint, prompt, block):
        data = folder.read(fingerprint, block_hash)
        if data is None:
            break
        blocks.append(decode_block(data, block_hash, tokens))
    injected = sum(len(b.token_ids) for b in blocks)
    cache = blocks_to_cache(model, blocks)
    own = make_prompt_cache(model)
    model(mx.array(prompt[:injected])[None], cache=own)
    difference = max(
        float(mx.abs(getattr(a, part)[..., :injected, :] - getattr(b, part)[..., :injected, :]).max())
        for a, b in zip(cache, own, strict=True)
        for part in ("keys", "values")
    )
    return {
        "injected_tokens": injected,
        "from_vllm_kv": greedy(model, prompt[injected:], n, cache),
        "own_prefill": greedy(model, prompt, n),
        "max_kv_difference": difference,
    }


def export(model, folder: KVFolder, fingerprint: str, prompts: list[list[int]], block: int) -> dict:
    count = 0
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        for kv_block in cache_to_blocks(cache, prompt, fingerprint, block):
            folder.write(kv_block)
            count += 1
    return {"exported_blocks": count}


def main() -> None:
    mode, model_dir, kv_dir, prompt, block, n = sys.argv[1:7]
    model, _ = load(model_dir)
    folder, fingerprint = KVFolder(kv_dir), folder_fingerprint(Path(model_dir))
    if mode == "inject":
        report = inject(model, folder, fingerprint, json.loads(prompt), int(block), int(n))
    else:
        report = export(model, folder, fingerprint, json.loads(prompt), int(block))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
