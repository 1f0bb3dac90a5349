"""One client request this worker serves: the only place its chunks are numbered and published.

A request's life on the worker: taken from the work queue (its prompt queued), perhaps receiving
its KV from a prefill worker (a disaggregated request, whose first token may come with the KV),
submitted to the engine, streamed, ended. Everything the worker keeps about it lives on its
`RequestStream` and ends with it: the chunk index, its trace, the KV blobs fetched for it, a
received handoff's folder and numbers, and whether a cancel goes to the handoff or the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from fleet_proto import HandoffStats, TokenChunk
from fleet_proto.messages import GenerateTask, GenerationOutput, WorkerTask, task_tokens
from fleet_runtime.tracing import now_ns
from fleet_worker.request_trace import RequestTrace

Publish = Callable[[TokenChunk], Awaitable[None]]


def merged_stats(transport: HandoffStats | None, engine: HandoffStats | None) -> HandoffStats | None:
    """The worker's transfer numbers with the engine's verdict (a fallback when it could not use them)."""
    if transport is None or engine is None:
        return transport or engine
    return msgspec.structs.replace(transport, fallback=engine.fallback)


class RequestStream:
    """A request's chunks, in order, from the first token (the engine's, or a prefill worker's) to
    the last; `on_end` is told once, with the last output, when the stream ends for any reason."""

    def __init__(
        self,
        task: WorkerTask,
        publish: Publish,
        on_end: Callable[[RequestStream, GenerationOutput], None],
        trace: RequestTrace | None = None,
    ) -> None:
        self.task = task
        self.request_id = task.request_id
        self.prompt_tokens = task_tokens(task)
        # what it brings to prefill, as routing counted it: the prompt less the expected prefix hit
        expected = task.expected_cached_tokens if isinstance(task, GenerateTask) else 0
        self.to_prefill = max(self.prompt_tokens - expected, 0)
        self.trace = trace  # None unless the gateway sampled the request for tracing
        self.generated = 0  # tokens so far
        self.started = False  # the engine (or the prefill) has produced: no longer queued
        self.fetched: list[Path] = []  # shared-tier KV blobs fetched for it, released at its end
        self.kv_folder: Path | None = None  # a received handoff's KV, removed at its end
        self.handoff: HandoffStats | None = None  # what its handoff did
        self.receiving: asyncio.Task[None] | None = None  # its KV on the way: a cancel stops this
        self.submitted = False  # the engine has it: a cancel goes to the engine
        self.cancel_asked = False  # before the engine had it: it is not submitted, it ends
        self.ended = False
        self._next_index = 0
        self._publish = publish
        self._on_end = on_end

    async def send(self, output: GenerationOutput) -> None:
        """An engine output as the next chunk; the one with a finish_reason ends the stream."""
        if self.ended:
            return
        if self.trace is not None and output.token_ids:
            self.trace.on_output(now_ns(), len(output.token_ids))
        if output.finish_reason:
            output = msgspec.structs.replace(output, handoff=merged_stats(self.handoff, output.handoff))
            self._end(output)
        else:
            self.started, self.generated = True, output.completion_tokens
        await self._publish_next(output)

    async def send_first_token(self, token: int) -> None:
        """The first token a prefill worker sampled, ahead of the engine: chunk 0; the engine's
        outputs follow it (it goes on from that token)."""
        self.started, self.generated = True, 1
        first = GenerationOutput(
            request_id=self.request_id,
            token_ids=(token,),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=1,
        )
        await self._publish_next(first)

    async def end(self, finish_reason: str, error: str = "", error_kind: str = "") -> None:
        """End the stream without the engine: cancelled while its KV travelled, the engine gone, or
        moved off a draining instance."""
        if self.ended:
            return
        last = GenerationOutput(
            request_id=self.request_id, finish_reason=finish_reason, error=error, error_kind=error_kind
        )
        self._end(last)
        await self._publish_next(last)

    def _end(self, last: GenerationOutput) -> None:
        self.ended = True
        self._on_end(self, last)

    async def _publish_next(self, output: GenerationOutput) -> None:
        index = self._next_index
        if not output.finish_reason:
            self._next_index += 1
        await self._publish(TokenChunk(**msgspec.structs.asdict(output), index=index))
