"""Writing a run's events (or n choices' events) as a streamed HTTP response, one write per event."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from functools import partial
from typing import TypeVar

from aiohttp import web

from fleet_gateway.fanout import Choice, merge_runs
from fleet_gateway.frames import (
    SSE,
    ChoicesFormat,
    Event,
    Progress,
    StreamFormat,
    Waiting,
    progress_frame,
    waiting_frame,
)
from fleet_gateway.parsing.output import Delta
from fleet_gateway.turns import Failed, Finished, Run
from fleet_runtime.tracing import Tracing

T = TypeVar("T")


def event_frames(stream_format: StreamFormat, event: Event) -> list[bytes]:
    """What one of a run's events writes in a stream format."""
    if isinstance(event, Failed):
        return stream_format.fail(event.message)
    if isinstance(event, Finished):
        return stream_format.finish(event)
    if isinstance(event, Progress):  # NDJSON clients (Ollama's) parse every line: none for them
        return [progress_frame(event)] if stream_format.content_type == SSE else []
    if isinstance(event, Waiting):
        return [waiting_frame(event)] if stream_format.content_type == SSE else []
    return stream_format.delta(event)


def choice_frames(stream_format: ChoicesFormat, choice: Choice) -> list[bytes]:
    """What one choice's event writes: deltas and finishes are the choice's, the rest as one run's."""
    event = choice.event
    if isinstance(event, Delta):
        return stream_format.delta(event, choice.index)
    if isinstance(event, Finished):
        return stream_format.finish(event, choice.index)
    return event_frames(stream_format, event)


async def write_stream(
    request: web.Request,
    stream_format: StreamFormat,
    events: AsyncGenerator[T, None],
    frames_of: Callable[[T], list[bytes]],
    tracing: Tracing,
) -> web.StreamResponse:
    """Start the response, then write each event's frames; `events` is closed however this ends, so
    a failed write cancels the generation too."""
    headers = {"Content-Type": stream_format.content_type, "Cache-Control": "no-cache"}
    if stream_format.content_type == SSE:
        headers["X-Accel-Buffering"] = "no"
    async with contextlib.aclosing(events):
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        frames = stream_format.start()
        if frames:
            await response.write(b"".join(frames))
        writes = 0
        async for event in events:
            frames = frames_of(event)
            if not frames:
                continue
            with tracing.output_leaf(writes, "stream write", "stream", {"fleet.frames": len(frames)}):
                await response.write(b"".join(frames))
            writes += 1
    return response


async def stream_run(request: web.Request, run: Run, stream_format: StreamFormat) -> web.StreamResponse:
    frames_of = partial(event_frames, stream_format)
    return await write_stream(request, stream_format, run.events(), frames_of, run.tracing)


async def stream_choices(
    request: web.Request, runs: Sequence[Run], stream_format: ChoicesFormat
) -> web.StreamResponse:
    """n choices of one prompt in one stream, their events interleaved as they come."""
    frames_of = partial(choice_frames, stream_format)
    return await write_stream(request, stream_format, merge_runs(runs), frames_of, runs[0].tracing)
