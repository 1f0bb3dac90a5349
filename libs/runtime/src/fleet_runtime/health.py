"""GET /health for every service: 200 with the checks when all pass, 503 naming the failing ones."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

HealthCheck = Callable[[], Awaitable[None]]  # raises when unhealthy; the message says why


async def run_checks(checks: dict[str, HealthCheck], timeout_s: float = 2.0) -> tuple[bool, dict[str, str]]:
    async def one(check: HealthCheck) -> str:
        try:
            await asyncio.wait_for(check(), timeout_s)
        except TimeoutError:
            return f"error: no answer within {timeout_s} s"
        except Exception as exc:
            return f"error: {exc}"
        return "ok"

    results = dict(zip(checks, await asyncio.gather(*(one(c) for c in checks.values())), strict=True))
    return all(v == "ok" for v in results.values()), results


def health_handler(
    service_id: str, checks: dict[str, HealthCheck]
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(_: web.Request) -> web.Response:
        healthy, results = await run_checks(checks)
        body = {"status": "ok" if healthy else "unhealthy", "service_id": service_id, "checks": results}
        return web.json_response(body, status=200 if healthy else 503)

    return handle


async def start_http(
    app: web.Application, host: str, port: int, cancel_on_disconnect: bool = False
) -> web.AppRunner:
    """Serve `app`; with cancel_on_disconnect, a handler is cancelled when its client goes away."""
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, handler_cancellation=cancel_on_disconnect
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
