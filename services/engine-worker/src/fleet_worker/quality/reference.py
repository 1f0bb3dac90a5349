"""The float32 reference of a model's weights, computed in its own process (torch, transformers).

`python -m fleet_worker.quality.reference MODEL_DIR OUT.json` writes a QualityReference: the
evaluation text's token ids, the reference's top log-probabilities at each scored position, and its
greedy answers to the chat prompts. A child process, so torch's memory and import time never stay
in the worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fleet_worker.quality.measure import (
    CHAT_PROMPTS,
    EVAL_TOKENS,
    FIRST_POSITION,
    GREEDY_TOKENS,
    TOP_K,
    PositionLogprobs,
    QualityReference,
    eval_text,
    write_reference,
)


def compute(model_dir: Path) -> QualityReference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(eval_text(), add_special_tokens=False)["input_ids"][:EVAL_TOKENS]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        positions = []
        for i in range(FIRST_POSITION, len(ids) - 1):
            top = torch.topk(logprobs[i], TOP_K)
            positions.append(
                PositionLogprobs(
                    top_ids=tuple(top.indices.tolist()),
                    top_logprobs=tuple(top.values.tolist()),
                    target_logprob=float(logprobs[i, ids[i + 1]]),
                )
            )
        prompts, answers = [], []
        for text in CHAT_PROMPTS:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )  # rendered, then tokenized as the gateway does
            prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
            )
            prompts.append(tuple(prompt))
            answers.append(tuple(out[0, len(prompt) :].tolist()))
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return QualityReference(
        eval_token_ids=tuple(ids),
        positions=tuple(positions),
        chat_prompts=tuple(prompts),
        greedy_answers=tuple(answers),
        eos_token_ids=eos_ids,
    )


def main(argv: list[str]) -> int:
    model_dir, out = Path(argv[1]), Path(argv[2])
    write_reference(out, compute(model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
