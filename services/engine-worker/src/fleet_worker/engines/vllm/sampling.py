"""Fleet SamplingParams -> the keyword arguments of vLLM's SamplingParams (pure: no vLLM import).

As the seed maps them: temperature, top_p, top_k (0 is off in both), min_p, seed, the penalties,
logit_bias, min_tokens and logprobs pass through (Fleet's SamplingParams has vLLM's meanings);
max_tokens is clamped to what the context has room for; the stop token ids are the request's plus
the model's EOS ids (config.json and generation_config.json may list several, e.g. Llama 3's
<|eot_id|>). A StructuredOutput reaches vLLM as the EBNF Fleet's own samplers compile (grammar.py),
through vLLM's xgrammar backend. Engines are token-in, token-out,
so vLLM never detokenizes (the gateway does) and stop strings never reach it.

A continuation (EngineRequest.generated_token_ids, g: n tokens) reaches vLLM as the prompt + g, with
max_tokens and min_tokens less n. What that leaves as the uninterrupted run left it:
- greedy tokens (up to the rounding of a prefill against decode steps), the repetition penalty
  (vLLM applies it over prompt and output alike), logit_bias, min_tokens, stop tokens;
- frequency and presence penalties: vLLM would count g as prompt, not completion, so a continuation
  with either takes all three penalties from Fleet's logits processor instead (resume.py: vLLM's own
  penalty arithmetic over g + its output), vLLM's own set to no-ops.
What differs, for want of an API:
- seeded draws: vLLM draws from a per-request torch.Generator, which no public hook can move past
  the n draws g took. A continuation is seeded with resumed_seed(seed, n) instead: the same request
  continued at the same point repeats its tokens, but they are not the uninterrupted run's.
- structured output: vLLM's grammar starts at the first output token and StructuredOutputsParams
  cannot say it accepted g, so a restarted grammar would constrain the wrong text: a structured
  continuation ends with an error instead (RESUME_STRUCTURED_PROBLEM).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from fleet_proto import SamplingParams, StructuredOutput
from fleet_proto.messages import TokenLogprob


def structured_outputs_fields(spec: StructuredOutput) -> dict[str, Any]:
    """The keyword arguments of vLLM's StructuredOutputsParams for a Fleet spec: the EBNF Fleet's own
    samplers compile (grammar.ebnf_of), or the structural tag; GrammarError when it does not convert."""
    from fleet_worker.engines.grammar import ebnf_of, spec_kind

    if spec_kind(spec) == "structural_tag":
        return {"structural_tag": spec.structural_tag}
    return {"grammar": ebnf_of(spec)}


RESUME_STRUCTURED_PROBLEM = (
    "the vLLM engine cannot resume a structured output: its grammar would start again after the "
    "tokens generated so far (MLX and llama.cpp instances can)"
)
RESUMED_PENALTIES = "fleet_resumed_penalties"  # the extra_args key resume.ResumedPenalties reads


def resumed_seed(seed: int | None, generated: int) -> int | None:
    """The seed of a continuation after `generated` tokens: the request's own when there are none,
    else one derived from both (vLLM cannot skip a generator's draws; see the module)."""
    if seed is None or not generated:
        return seed
    digest = hashlib.sha256(f"fleet-resume:{seed}:{generated}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits, as torch's manual_seed takes


def vllm_sampling_kwargs(
    params: SamplingParams,
    *,
    prompt_tokens: int,
    max_model_len: int,
    eos_token_ids: Iterable[int],
    generated: Sequence[int] = (),
) -> dict[str, Any]:
    """prompt_tokens: the prompt's; generated: a continuation's tokens so far (vLLM's prompt holds
    them after the prompt's)."""
    eos = () if params.ignore_eos else eos_token_ids
    stop_ids = sorted(set(eos) | set(params.stop_token_ids))
    n = len(generated)
    # g counts as completion for these only through Fleet's processor (the module says why)
    resumed = bool(n and (params.frequency_penalty or params.presence_penalty))
    kwargs: dict[str, Any] = {
        "max_tokens": max(1, min(params.max_tokens - n, max_model_len - prompt_tokens - n)),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": 1.0 if resumed else params.repetition_penalty,
        "presence_penalty": 0.0 if resumed else params.presence_penalty,
        "frequency_penalty": 0.0 if resumed else params.frequency_penalty,
        "logit_bias": {token: bias for token, bias in params.logit_bias} or None,
        "min_tokens": max(0, params.min_tokens - n),
        "seed": resumed_seed(params.seed, n),
        "stop_token_ids": stop_ids,
        "ignore_eos": params.ignore_eos,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if resumed:
        kwargs["extra_args"] = {
            RESUMED_PENALTIES: {
                "generated": n,
                "repetition": params.repetition_penalty,
                "frequency": params.frequency_penalty,
                "presence": params.presence_penalty,
            }
        }
    if params.logprobs is not None:  # vLLM: 0 = the sampled token's only
        kwargs["logprobs"] = params.logprobs
    return kwargs


def emitted_tokens(new_tokens: list[int], finish_reason: str, stop_ids: frozenset[int]) -> list[int]:
    """vLLM keeps the stop token in the output; Fleet's engines never emit it (it is still counted)."""
    if finish_reason == "stop" and new_tokens and new_tokens[-1] in stop_ids:
        return new_tokens[:-1]
    return new_tokens


def token_logprobs(tokens: list[int], positions: Any, k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's sample logprobs (one {token id: Logprob} per position: the sampled token and the top
    k, each with its rank) for the tokens emitted, as Fleet's TokenLogprob, most likely first."""
    result = []
    for token, position in zip(tokens, positions or (), strict=False):
        top = sorted(
            (
                (entry.logprob, token_id)
                for token_id, entry in position.items()
                if entry.rank and entry.rank <= k
            ),
            reverse=True,
        )[:k]
        chosen = position[token].logprob if token in position else float("-inf")
        result.append(
            TokenLogprob(
                token_id=token,
                logprob=chosen,
                top_ids=tuple(token_id for _, token_id in top),
                top_logprobs=tuple(logprob for logprob, _ in top),
            )
        )
    return tuple(result)
