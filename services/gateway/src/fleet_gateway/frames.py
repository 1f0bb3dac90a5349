"""A run's events, frames of streamed responses, and the shape of a stream format (pure).

Each adapter supplies a `StreamFormat`: an object turning a run's events into the frames its clients
expect (OpenAI SSE chunks, Anthropic and Responses SSE events, Ollama NDJSON lines);
`fleet_gateway.streaming.stream_run` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from fleet_gateway.parsing.output import Delta
from fleet_proto import TokenChunk

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


@dataclass(frozen=True)
class Finished:
    """The last event: why it ended ("stop" | "length" | "tool_calls"; the stop string when one was
    hit), token counts, and for the bench endpoint the engine's last chunk and first-token time."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None = None
    last: TokenChunk | None = None
    first_token_at: float = 0.0  # time.monotonic(), 0.0 when no token came
    finished_at: float = 0.0  # time.monotonic()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from a cache, as the engine's last chunk reported them."""
        return self.last.prefix_cached_tokens if self.last else 0


@dataclass(frozen=True)
class Failed:
    """The run failed: the server's failure (503), or the engine refused the request itself (400,
    naming the client's field, e.g. a grammar that does not compile)."""

    message: str
    status: int = 503
    param: str | None = None


@dataclass(frozen=True)
class Progress:
    """A long prompt's prefill so far: prompt tokens in the KV cache, of all the prompt's."""

    prefilled_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class Waiting:
    """The request waits for an instance of its model to start (scaled to zero): how long so far,
    and where the start is (placed, downloading, loading ...)."""

    model: str
    waited_s: float
    status: str


Event = Delta | Progress | Waiting | Finished | Failed


class StreamFormat(Protocol):
    content_type: str

    def start(self) -> list[bytes]: ...

    def delta(self, delta: Delta) -> list[bytes]: ...

    def finish(self, finished: Finished) -> list[bytes]: ...

    def fail(self, message: str) -> list[bytes]: ...


class ChoicesFormat(StreamFormat, Protocol):
    """A stream of several choices of one prompt (OpenAI's `n`): deltas and finishes name theirs."""

    def delta(self, delta: Delta, index: int = 0) -> list[bytes]: ...

    def finish(self, finished: Finished, index: int = 0) -> list[bytes]: ...


def sse_data(data: object) -> bytes:
    """`data: <json>` and a blank line (OpenAI's frames carry no event name)."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def sse_event(name: str, data: object) -> bytes:
    """A named server-sent event (Anthropic and the Responses API name every event)."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def sse_comment(name: str, data: object) -> bytes:
    """`: <name> <json>`: every SSE client skips comment lines, so no client's parser is surprised."""
    return b": " + name.encode() + b" " + msgspec.json.encode(data) + b"\n\n"


def progress_frame(progress: Progress) -> bytes:
    """Prefill progress on any SSE stream (exo's prefill_progress, as a comment)."""
    payload = {"processed_tokens": progress.prefilled_tokens, "total_tokens": progress.prompt_tokens}
    return sse_comment("prefill_progress", payload)


def waiting_frame(waiting: Waiting) -> bytes:
    """Cold-start progress on any SSE stream, as a comment: the client sees the wait move."""
    payload = {"model": waiting.model, "waited_s": round(waiting.waited_s, 1), "status": waiting.status}
    return sse_comment("waiting_for_instance", payload)


def ndjson_line(data: object) -> bytes:
    return msgspec.json.encode(data) + b"\n"
