"""Gateway service: serves the HTTP APIs on FLEET_GATEWAY_HOST:FLEET_GATEWAY_PORT."""

from __future__ import annotations

from aiohttp import web

from fleet_gateway.app import state_routes
from fleet_proto import ServiceKind
from fleet_runtime.health import health_handler, start_http
from fleet_runtime.service import ServiceContext, run


async def main(ctx: ServiceContext) -> None:
    app = web.Application()
    app.router.add_get("/health", health_handler(ctx.service_id, ctx.health_checks))
    app.add_routes(state_routes(ctx.follower))
    runner = await start_http(app, ctx.settings.gateway_host, ctx.settings.gateway_port)
    ctx.on_shutdown(runner.cleanup)


def cli() -> None:
    run(ServiceKind.GATEWAY, main, health_port=0)  # /health is on the API port
