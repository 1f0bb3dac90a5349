"""Fleet SamplingParams -> the keyword arguments of vLLM's SamplingParams (pure: no vLLM import).

As the seed maps them: temperature, top_p, top_k (0 is off in both), min_p, seed, the penalties,
logit_bias, min_tokens and logprobs pass through (Fleet's SamplingParams has vLLM's meanings);
max_tokens is clamped to what the context has room for; the stop token ids are the request's plus
the model's EOS ids (config.json and generation_config.json may list several, e.g. Llama 3's
<|eot_id|>). A StructuredOutput reaches vLLM as the EBNF Fleet's own samplers compile (grammar.py),
through vLLM's xgrammar backend. Engines are token-in, token-out,
so vLLM never detokenizes (the gateway does) and stop strings never reach it.
"""

from __future__ import annotations

from collections.abc import Iterable
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


def vllm_sampling_kwargs(
    params: SamplingParams, *, prompt_tokens: int, max_model_len: int, eos_token_ids: Iterable[int]
) -> dict[str, Any]:
    eos = () if params.ignore_eos else eos_token_ids
    stop_ids = sorted(set(eos) | set(params.stop_token_ids))
    kwargs: dict[str, Any] = {
        "max_tokens": max(1, min(params.max_tokens, max_model_len - prompt_tokens)),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logit_bias": {token: bias for token, bias in params.logit_bias} or None,
        "min_tokens": params.min_tokens,
        "seed": params.seed,
        "stop_token_ids": stop_ids,
        "ignore_eos": params.ignore_eos,
        "detokenize": False,
        "skip_special_tokens": False,
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
