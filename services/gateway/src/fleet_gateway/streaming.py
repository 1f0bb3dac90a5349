"""Writing a run's events as a streamed HTTP response, one write per event."""

from __future__ import annotations

from aiohttp import web

from fleet_gateway.frames import SSE, StreamFormat
from fleet_gateway.turns import Failed, Finished, Run


async def stream_run(request: web.Request, run: Run, stream_format: StreamFormat) -> web.StreamResponse:
    headers = {"Content-Type": stream_format.content_type, "Cache-Control": "no-cache"}
    if stream_format.content_type == SSE:
        headers["X-Accel-Buffering"] = "no"
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    frames = stream_format.start()
    if frames:
        await response.write(b"".join(frames))
    async for event in run.events():
        if isinstance(event, Failed):
            frames = stream_format.fail(event.message)
        elif isinstance(event, Finished):
            frames = stream_format.finish(event)
        else:
            frames = stream_format.delta(event)
        if frames:
            await response.write(b"".join(frames))
    return response
