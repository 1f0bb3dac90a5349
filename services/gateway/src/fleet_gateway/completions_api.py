"""OpenAI (legacy) text completions adapter, pure: POST /v1/completions request and response shapes.

One prompt per request (a string, or token ids), `n` choices of it, logprobs up to 5; no echo /
suffix / best_of yet: each of those is a clear 400. Sampling fields and their checks are
`openai_sampling`'s, as chat's.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from fleet_gateway.errors import ApiError, decode_json_body, error_body
from fleet_gateway.frames import SSE, Finished, sse_data
from fleet_gateway.openai_api import SSE_DONE, choices_usage
from fleet_gateway.openai_sampling import SamplingFields, validate_sampling
from fleet_gateway.openai_sampling import sampling_ask as shared_sampling_ask
from fleet_gateway.parsing.output import Delta, TokenScore
from fleet_gateway.sampling import SamplingAsk

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint


class CompletionRequest(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """max_completion_tokens (chat's name) is accepted here too: the shared checks apply as they are."""

    model: str
    prompt: str | list[int | str]  # a string, token ids, or a list holding one string
    max_tokens: int | None = DEFAULT_COMPLETION_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def parse_completion_request(body: bytes) -> CompletionRequest:
    req = decode_json_body(body, CompletionRequest)
    if not req.model.strip():
        raise ApiError(400, "'model' must be a non-empty string.", param="model")
    if (
        isinstance(req.prompt, list)
        and req.prompt
        and isinstance(req.prompt[0], str)
        and len(req.prompt) != 1
    ):
        raise ApiError(400, "Only one prompt per request is supported.", param="prompt")
    if not req.prompt or req.prompt == [""]:
        raise ApiError(400, "'prompt' must not be empty.", param="prompt")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(
            400,
            f"Invalid 'logprobs': {req.logprobs}; expected an integer in [0, {MAX_LOGPROBS}].",
            param="logprobs",
        )
    for name, unsupported in (
        ("echo", req.echo),
        ("suffix", req.suffix),
        ("best_of", (req.best_of or 1) != 1),
    ):
        if unsupported:
            raise ApiError(400, f"'{name}' is not supported yet.", param=name)
    validate_sampling(req)
    return req


def sampling_ask(req: CompletionRequest) -> SamplingAsk:
    """The shared mapping, with the legacy `logprobs` (the number of top tokens)."""
    return shared_sampling_ask(req, req.logprobs)


def text_logprobs(scores: list[TokenScore], offset: int = 0) -> dict[str, Any]:
    """The legacy logprobs object: parallel lists, text offsets counted from `offset`."""
    offsets = []
    for score in scores:
        offsets.append(offset)
        offset += len(score.token)
    return {
        "tokens": [s.token for s in scores],
        "token_logprobs": [s.logprob for s in scores],
        "top_logprobs": [{t.token: t.logprob for t in s.top} for s in scores],
        "text_offset": offsets,
    }


class PromptEncoder(Protocol):
    """What a prompt needs of a tokenizer (fleet_gateway.tokenizer.ChatTokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...


def prompt_token_ids(req: CompletionRequest, tokenizer: PromptEncoder) -> list[int]:
    """The prompt's token ids: given as ids, or the text encoded without added special tokens."""
    prompt = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    first = prompt[0]
    if isinstance(first, str):
        return tokenizer.encode(first)
    outside = next((t for t in prompt if t not in range(tokenizer.vocab_size)), None)
    if outside is not None:
        raise ApiError(400, f"Token id {outside} is outside the vocabulary.", param="prompt")
    return [t for t in prompt if isinstance(t, int)]  # all of them (a string is outside)


def new_text_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _body(id: str, model: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices}


def text_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion_response(
    id: str, model: str, created: int, results: list[tuple[Delta, Finished]]
) -> dict[str, Any]:
    """The non-streamed body: one choice per (text, finish) of the n choices."""
    choices = [
        text_choice(i, text.content, finished.reason, text_logprobs(text.logprobs) if text.logprobs else None)
        for i, (text, finished) in enumerate(results)
    ]
    usage = choices_usage([finished for _, finished in results])
    return _body(id, model, created, choices) | {"usage": usage, "system_fingerprint": None}


def text_chunk(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return _body(id, model, created, [text_choice(index, text, finish_reason, logprobs)])


def text_usage_chunk(id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    return _body(id, model, created, []) | {"usage": usage}


class TextChunks:
    """The `text_completion` stream of n choices (a ChoicesFormat): text chunks of each choice as
    they come, each choice's last chunk with its finish reason; after the last, the usage chunk
    when asked and `[DONE]`."""

    content_type = SSE

    def __init__(self, id: str, model: str, created: int, include_usage: bool, n: int = 1) -> None:
        self.id, self.model, self.created, self.include_usage = id, model, created, include_usage
        self.n = n
        self._finished: dict[int, Finished] = {}
        self._offsets = [0] * n  # characters of each choice's text so far (its tokens' text offsets)

    def start(self) -> list[bytes]:
        return []

    def delta(self, delta: Delta, index: int = 0) -> list[bytes]:
        if not (delta.content or delta.logprobs):
            return []
        offset = self._offsets[index]
        logprobs = text_logprobs(delta.logprobs, offset) if delta.logprobs else None
        added = sum(len(s.token) for s in delta.logprobs) if delta.logprobs else len(delta.content)
        self._offsets[index] = offset + added
        body = text_chunk(self.id, self.model, self.created, delta.content, logprobs=logprobs, index=index)
        return [sse_data(body)]

    def finish(self, finished: Finished, index: int = 0) -> list[bytes]:
        self._finished[index] = finished
        last = sse_data(text_chunk(self.id, self.model, self.created, "", finished.reason, index=index))
        return [last, *self._end()] if len(self._finished) == self.n else [last]

    def fail(self, message: str) -> list[bytes]:
        return [sse_data(error_body(503, message)), *self._end()]

    def _end(self) -> list[bytes]:
        finishes = [self._finished[i] for i in sorted(self._finished)]
        usage = text_usage_chunk(self.id, self.model, self.created, choices_usage(finishes))
        return [*([sse_data(usage)] if self.include_usage else []), SSE_DONE]
