"""What OpenAI chat and text completions share (pure): the sampling fields, OpenAI's and the vLLM
extras clients send in `extra_body` (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, structured_outputs, guided_*), their checks, and the SamplingAsk they make.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fleet_gateway import structured
from fleet_gateway.errors import ApiError
from fleet_gateway.sampling import SamplingAsk, check_sampling

MAX_STOP_STRINGS = 4


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The fields chat and text completion requests name alike."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1: off
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    ignore_eos: bool = False  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]
    min_tokens: int | None = None  # extension
    stop_token_ids: list[int] | None = None  # extension
    response_format: structured.ResponseFormat | None = None
    structured_outputs: structured.StructuredOutputsAsk | None = None  # extension
    guided_json: str | dict[str, Any] | None = None  # extension (vLLM's older names)
    guided_regex: str | None = None  # extension
    guided_choice: list[str] | None = None  # extension
    guided_grammar: str | None = None  # extension
    user: str | None = None


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, message, param=param, code="invalid_value")


def validate_sampling(req: SamplingFields) -> None:
    """The checks chat and text completions share; n's upper bound is the operator's (Turns checks it)."""
    check_sampling(sampling_ask(req))
    if req.max_completion_tokens is not None and req.max_tokens is not None:
        _check(
            req.max_tokens >= 1,
            "max_tokens",
            f"Invalid 'max_tokens': {req.max_tokens}; expected an integer >= 1.",
        )
    if req.n is not None:
        _check(req.n >= 1, "n", f"Invalid 'n': {req.n}; expected an integer >= 1.")
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            param="stream_options",
        )
    if isinstance(req.stop, list):
        _check(
            len(req.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"Invalid 'stop': {len(req.stop)} strings given; at most {MAX_STOP_STRINGS} are allowed.",
        )


def constraint(req: SamplingFields) -> structured.Constraint | None:
    """The one structured output asked for in response_format, structured_outputs or guided_*."""
    asked = [structured.response_format(req.response_format, "response_format")]
    asked += structured.structured_outputs(req.structured_outputs)
    asked += structured.guided(req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    return structured.one_constraint([c for c in asked if c is not None])


def sampling_ask(req: SamplingFields, logprobs: int | None = None) -> SamplingAsk:
    """What a chat or text completion asks of sampling; `logprobs` as each API counts it."""
    uses_new_name = req.max_completion_tokens is not None
    return SamplingAsk(
        max_tokens=req.max_completion_tokens if uses_new_name else req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        max_tokens_param="max_completion_tokens" if uses_new_name else "max_tokens",
        logprobs=logprobs,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias,
        min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        constraint=constraint(req),
    )
