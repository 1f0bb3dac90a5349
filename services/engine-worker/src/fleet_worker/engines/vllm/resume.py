"""A vLLM logits processor that gives a continuation the penalties of the run it continues.

vLLM sees a continuation's generated tokens (g) as part of its prompt, so its frequency and presence
penalties would forget them. For such a request (sampling.RESUMED_PENALTIES in its extra_args, vLLM's
own penalties set to no-ops) this processor applies all three penalties with vLLM's own function,
`apply_penalties`, over the prompt and g + its output: the same arithmetic on the same counts as the
uninterrupted run, in the same place (vLLM runs custom processors after its min_tokens and
logit_bias ones, where its penalties would come next). Loaded by vLLM from `logits_processors`
(vLLM's public extension point for custom processors); requests without the key pass untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from fleet_worker.engines.vllm.sampling import RESUMED_PENALTIES


class _Penalties:
    """One continuation's penalties, called by vLLM with its prompt (prompt + g), output so far and
    logits row."""

    def __init__(self, generated: int, repetition: float, frequency: float, presence: float) -> None:
        self.generated = generated
        self.values = (presence, frequency, repetition)  # apply_penalties' order

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        split = len(prompt_ids) - self.generated
        device = logits.device
        prompt = torch.tensor([prompt_ids[:split]], dtype=torch.long, device=device)
        completion = torch.tensor([prompt_ids[split:] + list(output_ids)], dtype=torch.long, device=device)
        presence, frequency, repetition = (
            torch.tensor([value], dtype=torch.float32, device=device) for value in self.values
        )
        # in place on the row (a view of vLLM's batch), as vLLM applies it to the batch
        apply_penalties(logits.unsqueeze(0), prompt, completion, presence, frequency, repetition)
        return logits


class ResumedPenalties(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False  # penalties move the argmax

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        spec = (params.extra_args or {}).get(RESUMED_PENALTIES)
        if not spec:
            return None
        values = (float(spec[name]) for name in ("repetition", "frequency", "presence"))
        return _Penalties(int(spec["generated"]), *values)
