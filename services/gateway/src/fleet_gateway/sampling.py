"""A request's sampling asks, in any API, -> the engine's SamplingParams (pure).

Every adapter fills a `SamplingAsk` from its own field names; the limits are checked here once, and
errors name the client's field (`max_tokens_param`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fleet_gateway.errors import ApiError
from fleet_gateway.structured import Constraint
from fleet_proto.messages import SamplingParams

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_N = 8
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None  # as JSON sends it: token id (text) -> bias
    min_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence ids
    constraint: Constraint | None = None  # structured output


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _invalid(name: str, value: object, expected: str) -> ApiError:
    return ApiError(400, f"Invalid '{name}': {value}; expected {expected}.", param=name, code="invalid_value")


def token_id(key: str) -> int | None:
    """A logit_bias key (JSON object keys are text) as a token id; None unless it is a non-negative
    integer that fits the wire's 64 bits."""
    return int(key) if key.isascii() and key.isdigit() and len(key) <= 18 else None


def _penalty(value: float) -> bool:
    return _finite(value) and -MAX_PENALTY <= value <= MAX_PENALTY


def check_sampling(ask: SamplingAsk, names: dict[str, str] | None = None) -> None:
    """Value checks every API shares; `names` maps a field to the client's name for it in errors."""
    checks = (
        ("temperature", lambda v: _finite(v) and v >= 0, "a number >= 0"),
        ("top_p", lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", lambda v: v >= -1, "-1, 0 (off) or > 0"),
        ("min_p", lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
        ("repetition_penalty", lambda v: _finite(v) and v > 0, "a number > 0"),
        ("presence_penalty", _penalty, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
        ("frequency_penalty", _penalty, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
        ("min_tokens", lambda v: v >= 0, "an integer >= 0"),
        ("max_tokens", lambda v: v >= 1, "an integer >= 1"),
    )
    names = names or {}
    for field, valid, expected in checks:
        value = getattr(ask, field)
        if value is not None and not valid(value):
            name = ask.max_tokens_param if field == "max_tokens" else names.get(field, field)
            raise _invalid(name, value, expected)
    _check_logit_bias(ask.logit_bias or {})
    negative = next((token for token in ask.stop_token_ids if token < 0), None)
    if negative is not None:
        raise _invalid("stop_token_ids", negative, "token ids >= 0")


def _check_logit_bias(bias: Mapping[str, float]) -> None:
    for key, value in bias.items():
        if token_id(key) is None:
            raise _invalid("logit_bias", repr(key), "token ids (non-negative integers) as keys")
        if not (_finite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            expected = f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            raise _invalid("logit_bias", f"{value} for token {key}", expected)


def check_n(n: int, max_n: int) -> None:
    """OpenAI's `n`: 1 up to the operator's FLEET_MAX_N choices of one prompt."""
    if not 1 <= n <= max_n:
        raise _invalid("n", n, f"an integer in [1, {max_n}] (this server's limit)")


@dataclass(frozen=True)
class RequestLimits:
    """What the gateway's operator allows one request (FLEET_MAX_PROMPT_TOKENS,
    FLEET_MAX_COMPLETION_TOKENS: 0, only the model's context limits it; FLEET_MAX_N: choices)."""

    max_prompt_tokens: int = 0
    max_completion_tokens: int = 0
    max_n: int = DEFAULT_MAX_N


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


def completion_budget(ask: SamplingAsk, max_model_len: int, prompt_len: int, limits: RequestLimits) -> int:
    """The completion's max_tokens: as asked, else the default capped by the room left and the
    operator's limit; 400 when the prompt plus the completion exceed the context."""
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
        return min(ask.default_max_tokens, room, limits.max_completion_tokens or room)
    if requested > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param=ask.max_tokens_param,
            code="context_length_exceeded",
        )
    return requested


def logit_bias_pairs(ask: SamplingAsk, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id; 400 for an id outside the vocabulary (when it is known)."""
    bias = {int(key): value for key, value in (ask.logit_bias or {}).items()}  # keys checked: ids
    _check_vocabulary(bias, vocab_size, "logit_bias")
    return tuple(sorted(bias.items()))


def _check_vocabulary(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    outside = next((token for token in token_ids if vocab_size and token >= vocab_size), None)
    if outside is not None:
        raise _invalid(param, outside, f"token ids below the vocabulary's size, {vocab_size}")


def to_sampling(
    ask: SamplingAsk,
    eos_ids: tuple[int, ...] | list[int],
    max_model_len: int,
    prompt_len: int,
    limits: RequestLimits = NO_LIMITS,
    vocab_size: int = 0,
) -> SamplingParams:
    """SamplingParams for the worker; 400 when the prompt plus the completion exceed the context,
    the request exceeds the operator's limits or names tokens outside the vocabulary (0: unknown)."""
    max_tokens = completion_budget(ask, max_model_len, prompt_len, limits)
    if ask.min_tokens and ask.min_tokens > max_tokens:
        raise _invalid("min_tokens", ask.min_tokens, f"at most max_tokens ({max_tokens})")
    _check_vocabulary(ask.stop_token_ids, vocab_size, "stop_token_ids")
    # vLLM's ignore_eos: EOS does not stop the completion, the request's own stop tokens still do
    stop_ids = (*(() if ask.ignore_eos else eos_ids), *ask.stop_token_ids)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if ask.temperature is None else ask.temperature,
        top_p=1.0 if ask.top_p is None else ask.top_p,
        top_k=max(ask.top_k or 0, 0),
        min_p=ask.min_p or 0.0,
        repetition_penalty=1.0 if ask.repetition_penalty is None else ask.repetition_penalty,
        presence_penalty=ask.presence_penalty or 0.0,
        frequency_penalty=ask.frequency_penalty or 0.0,
        logit_bias=logit_bias_pairs(ask, vocab_size),
        min_tokens=ask.min_tokens or 0,
        seed=ask.seed,
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        logprobs=ask.logprobs,
        ignore_eos=ask.ignore_eos,
        structured=ask.constraint.output if ask.constraint else None,
    )


def engine_finish_reason(reason: str) -> str:
    """Fleet's TokenChunk.finish_reason -> "length" or "stop" (a stop string or EOS is "stop")."""
    return "length" if reason == "length" else "stop"
