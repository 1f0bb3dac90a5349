"""A request's sampling asks, in any API, -> the engine's SamplingParams (pure).

Every adapter fills a `SamplingAsk` from its own field names; the limits are checked here once, and
errors name the client's field (`max_tokens_param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet_gateway.errors import ApiError
from fleet_proto.messages import SamplingParams

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class SamplingAsk:
    """None: the engine's default. `default_max_tokens` applies when max_tokens is None (capped by
    the room left in the context)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens_param: str = "max_tokens"
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    logprobs: int | None = None  # None: none; k: each token's and the k likeliest
    ignore_eos: bool = False  # generate max_tokens whatever end-of-sequence tokens come (as vLLM)


def _finite(value: float) -> bool:
    return math.isfinite(value)


def check_sampling(ask: SamplingAsk, names: dict[str, str] | None = None) -> None:
    """Value checks every API shares; `names` maps a field to the client's name for it in errors."""
    checks = (
        ("temperature", lambda v: _finite(v) and v >= 0, "a number >= 0"),
        ("top_p", lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", lambda v: v >= -1, "-1, 0 (off) or > 0"),
        ("min_p", lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
        ("repetition_penalty", lambda v: _finite(v) and v > 0, "a number > 0"),
        ("max_tokens", lambda v: v >= 1, "an integer >= 1"),
    )
    for field, valid, expected in checks:
        value = getattr(ask, field)
        if value is not None and not valid(value):
            name = ask.max_tokens_param if field == "max_tokens" else (names or {}).get(field, field)
            raise ApiError(
                400, f"Invalid '{name}': {value}; expected {expected}.", param=name, code="invalid_value"
            )


@dataclass(frozen=True)
class RequestLimits:
    """What the gateway's operator allows one request (FLEET_MAX_PROMPT_TOKENS,
    FLEET_MAX_COMPLETION_TOKENS); 0: only the model's context limits it."""

    max_prompt_tokens: int = 0
    max_completion_tokens: int = 0


NO_LIMITS = RequestLimits()


def check_limits(ask: SamplingAsk, prompt_len: int, max_model_len: int, limits: RequestLimits) -> None:
    """400 naming the operator's limit (and the model's context, so the client knows which bound hit)."""
    if limits.max_prompt_tokens and prompt_len > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"The prompt has {prompt_len} tokens; this server accepts at most {limits.max_prompt_tokens} "
            f"prompt tokens per request (the model's context is {max_model_len}).",
            param="messages",
            code="prompt_too_long",
        )
    if limits.max_completion_tokens and ask.max_tokens and ask.max_tokens > limits.max_completion_tokens:
        raise ApiError(
            400,
            f"Invalid '{ask.max_tokens_param}': {ask.max_tokens}; this server generates at most "
            f"{limits.max_completion_tokens} tokens per request.",
            param=ask.max_tokens_param,
            code="max_tokens_too_large",
        )


def to_sampling(
    ask: SamplingAsk,
    eos_ids: tuple[int, ...] | list[int],
    max_model_len: int,
    prompt_len: int,
    limits: RequestLimits = NO_LIMITS,
) -> SamplingParams:
    """SamplingParams for the worker; 400 when the prompt plus the completion exceed the context or
    the request exceeds the operator's limits."""
    check_limits(ask, prompt_len, max_model_len, limits)
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your messages "
            f"resulted in {prompt_len} tokens. Please reduce the length of the messages.",
            param="messages",
            code="context_length_exceeded",
        )
    requested = ask.max_tokens
    if requested is None:
        max_tokens = min(ask.default_max_tokens, room, limits.max_completion_tokens or room)
    elif requested > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param=ask.max_tokens_param,
            code="context_length_exceeded",
        )
    else:
        max_tokens = requested
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if ask.temperature is None else ask.temperature,
        top_p=1.0 if ask.top_p is None else ask.top_p,
        top_k=max(ask.top_k or 0, 0),
        min_p=ask.min_p or 0.0,
        repetition_penalty=1.0 if ask.repetition_penalty is None else ask.repetition_penalty,
        seed=ask.seed,
        stop_token_ids=() if ask.ignore_eos else tuple(dict.fromkeys(eos_ids)),
        logprobs=ask.logprobs,
        ignore_eos=ask.ignore_eos,
    )


def engine_finish_reason(reason: str) -> str:
    """Fleet's TokenChunk.finish_reason -> "length" or "stop" (a stop string or EOS is "stop")."""
    return "length" if reason == "length" else "stop"
