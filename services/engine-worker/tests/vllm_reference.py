"""vLLM's own offline generation (`LLM.generate`) on a model folder: the reference the tests compare to.

Run as a script in its own process (vLLM takes ~10 s and ~1.5 GB to start; the test process stays
light): `python vllm_reference.py MODEL_DIR '{"prompts": [[...], ...], "max_tokens": N}'` prints one
JSON list of token id lists, greedy.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams

    model_dir, request = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=512 << 20,  # SmolLM2 f32 needs 0.35 GiB for its 8192 context
    )
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], detokenize=False)
    prompts = [{"prompt_token_ids": prompt} for prompt in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps([list(output.outputs[0].token_ids) for output in outputs]))


if __name__ == "__main__":
    main()
