"""Writing a run's events as a streamed HTTP response, one write per event."""

from __future__ import annotations

from aiohttp import web

from fleet_gateway.frames import SSE, Event, Progress, StreamFormat, progress_frame
from fleet_gateway.turns import Failed, Finished, Run


def event_frames(stream_format: StreamFormat, event: Event) -> list[bytes]:
    """What one of a run's events writes in a stream format."""
    if isinstance(event, Failed):
        return stream_format.fail(event.message)
    if isinstance(event, Finished):
        return stream_format.finish(event)
    if isinstance(event, Progress):  # NDJSON clients (Ollama's) parse every line: none for them
        return [progress_frame(event)] if stream_format.content_type == SSE else []
    return stream_format.delta(event)


async def stream_run(request: web.Request, run: Run, stream_format: StreamFormat) -> web.StreamResponse:
    headers = {"Content-Type": stream_format.content_type, "Cache-Control": "no-cache"}
    if stream_format.content_type == SSE:
        headers["X-Accel-Buffering"] = "no"
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    frames = stream_format.start()
    if frames:
        await response.write(b"".join(frames))
    writes = 0
    async for event in run.events():
        frames = event_frames(stream_format, event)
        if not frames:
            continue
        with run.tracing.output_leaf(writes, "stream write", "stream", {"fleet.frames": len(frames)}):
            await response.write(b"".join(frames))
        writes += 1
    return response
