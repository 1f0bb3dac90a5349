"""Service bootstrap: settings, logging, NATS, the announce event, /health, and graceful shutdown.

A service is an async `main(ctx)` that sets up its work and returns; the runner keeps it alive until
SIGTERM/SIGINT, then cancels its tasks, announces ServiceStopped and closes connections in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from fleet_bus import Bus, NatsAuth, StateFollower, ensure_streams
from fleet_proto import ServiceInfo, ServiceKind, ServiceStarted, ServiceStopped
from fleet_runtime.health import HealthCheck, health_handler, start_http
from fleet_runtime.logs import setup_logging
from fleet_runtime.settings import Settings, load_settings
from fleet_runtime.tracing import Tracing

VERSION = "0.1.0"
SHUTDOWN_TASKS_S = 5.0
log = logging.getLogger("fleet_runtime")


class ServiceContext:
    """What a service's main() gets: its identity, settings, bus, State follower and task group."""

    def __init__(self, kind: ServiceKind, settings: Settings, bus: Bus, follower: StateFollower) -> None:
        self.kind = kind
        self.settings = settings
        self.bus = bus
        self.follower = follower
        self.service_id = f"{kind.value}-{uuid.uuid4().hex[:8]}"
        self.node_id = ""  # set by services that run on a node (the engine-worker)
        # "events": the State follower is subscribed (after a NATS restart it re-subscribes).
        self.health_checks: dict[str, HealthCheck] = {"nats": self._check_nats, "events": follower.check}
        self.routes: list[web.RouteDef] = []
        self.tracing = Tracing(
            kind.value, self.service_id, settings.trace_sample_rate, settings.otlp_endpoint
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._stopping: list[Callable[[], Awaitable[None]]] = []

    async def _check_nats(self) -> None:
        if not self.bus.nc.is_connected:
            raise ConnectionError("not connected to NATS")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run a background task for the service's lifetime; if it crashes, the service stops."""
        self._tasks.append(asyncio.create_task(coro, name=name))

    def on_shutdown(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        self._cleanups.append(cleanup)

    def on_stop(self, first: Callable[[], Awaitable[None]]) -> None:
        """Run at SIGTERM before the service's tasks are cancelled, while it still works (a worker
        leaves the cluster and drains there); cleanups come after."""
        self._stopping.append(first)

    def info(self) -> ServiceInfo:
        return ServiceInfo(
            service_id=self.service_id,
            kind=self.kind,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            version=VERSION,
            started_at=time.time(),
            node_id=self.node_id,
        )


def dump_tasks() -> None:
    """SIGUSR1: log every asyncio task with its stack, to see what a stuck service waits on."""
    for task in asyncio.all_tasks():
        frames = "".join(
            f"\n  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack()
        )
        log.warning("task %s%s", task.get_name(), frames)


async def _wait_for_stop(tasks: list[asyncio.Task[Any]]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task is not stopper and not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed; stopping", task.get_name(), exc_info=task.exception())
    stopper.cancel()


def nats_auth(settings: Settings) -> NatsAuth:
    return NatsAuth(
        user=settings.nats_user,
        password=settings.nats_password,
        nkey_seed_file=settings.nats_nkey_seed_file,
        credentials_file=settings.nats_credentials_file,
        tls_ca_file=settings.nats_tls_ca_file,
        tls_cert_file=settings.nats_tls_cert_file,
        tls_key_file=settings.nats_tls_key_file,
    )


async def serve(
    kind: ServiceKind,
    main: Callable[[ServiceContext], Awaitable[None]],
    settings: Settings,
    health_port: int | None = None,
) -> None:
    bus = await Bus.connect(
        settings.nats_url, kind.value, auth=nats_auth(settings), timeout_s=settings.bus_timeout_s
    )
    await ensure_streams(bus.js, settings.stream_replicas)
    follower = StateFollower(bus)
    await follower.start()
    ctx = ServiceContext(kind, settings, bus, follower)
    await main(ctx)
    ctx.spawn(ctx.tracing.run(bus), name="trace-publisher")
    port = settings.health_port if health_port is None else health_port
    runner = None
    if port:
        app = web.Application()
        app.router.add_get("/health", health_handler(ctx.service_id, ctx.health_checks))
        app.add_routes(ctx.routes)
        runner = await start_http(app, settings.health_host, port)
    await bus.publish_event(ServiceStarted(service=ctx.info(), origin=ctx.service_id, at=time.time()))
    log.info("%s %s started (health on %s)", kind.value, ctx.service_id, port or "none")
    try:
        await _wait_for_stop(ctx._tasks)
    finally:
        log.info("%s %s stopping", kind.value, ctx.service_id)
        for first in ctx._stopping:
            try:
                await first()
            except Exception:
                log.exception("stopping %s", ctx.service_id)
        for task in ctx._tasks:
            task.cancel()
        if ctx._tasks:
            _, stuck = await asyncio.wait(ctx._tasks, timeout=SHUTDOWN_TASKS_S)
            for task in stuck:  # say which, and go on: closing the connections below ends them
                log.error("task %s did not stop within %.0f s", task.get_name(), SHUTDOWN_TASKS_S)
        for cleanup in reversed(ctx._cleanups):
            with contextlib.suppress(Exception):
                await cleanup()
        with contextlib.suppress(Exception):
            await ctx.tracing.close(bus)  # the last spans, while the bus is up
        with contextlib.suppress(Exception):
            await bus.publish_event(
                ServiceStopped(service_id=ctx.service_id, origin=ctx.service_id, at=time.time())
            )
        if runner is not None:
            await runner.cleanup()
        await follower.stop()
        await bus.close()


def run(
    kind: ServiceKind, main: Callable[[ServiceContext], Awaitable[None]], health_port: int | None = None
) -> None:
    """Entry point of a service process: exits 0 on SIGTERM/SIGINT, 1 on a startup error."""
    settings = load_settings()
    setup_logging(kind.value, settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(kind, main, settings, health_port))
    except Exception as exc:  # a clear one-line reason, not a traceback, for the common startup errors
        log.error("%s failed: %s", kind.value, exc)
        raise SystemExit(1) from None
