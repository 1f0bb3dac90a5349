"""The gateway's HTTP app: /health, /state (State rebuilt from the event stream, with each ready
decoder's possible prefill partners, the first PARTNERS_LISTED of them, fleet_proto.partners),
/events (SSE)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from fleet_bus import StateFollower
from fleet_proto import encode
from fleet_proto.events import EventBase
from fleet_proto.partners import partner_table
from fleet_proto.routing_view import KeptView, RoutingView
from fleet_proto.subjects import event_subject

SSE_KEEPALIVE_S = 15.0


def sse_frame(seq: int, event: EventBase) -> bytes:
    """One SSE message: the event kind as `event:`, the stream sequence as `id:`, JSON as `data:`."""
    kind = event_subject(type(event)).rsplit(".", 1)[-1]
    return b"event: " + kind.encode() + b"\nid: " + str(seq).encode() + b"\ndata: " + encode(event) + b"\n\n"


def state_routes(
    follower: StateFollower, view: Callable[[], RoutingView] | None = None
) -> list[web.RouteDef]:
    """`view`: the follower's State indexed (the gateway's KeptView: its partner pools are routing's)."""
    kept = view or KeptView(lambda: follower.state)

    async def get_state(_: web.Request) -> web.Response:
        now = kept()
        body = msgspec.to_builtins(now.state) | {"partners": partner_table(now.state, now)}
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def get_events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        await response.write(f": fleet events from seq {follower.state.last_seq + 1}\n\n".encode())
        async with follower.listen() as live:
            iterator = aiter(live)
            while True:
                try:
                    seq, event = await asyncio.wait_for(anext(iterator), SSE_KEEPALIVE_S)
                except TimeoutError:
                    await response.write(b": keepalive\n\n")
                    continue
                except StopAsyncIteration:
                    break
                await response.write(sse_frame(seq, event))
        return response

    return [web.get("/state", get_state), web.get("/events", get_events)]
