"""Disaggregated prefill/decode between workers: both ends of the handoff protocol.

1. The decode worker asks on `fleet.prefill.<prefill worker>` (request/reply): prefill these
   prompt tokens from start_pos (what it does not hold itself), transport "stream" or "staged".
2. The prefill worker starts a prefill-only request in the instance's engine, which writes the
   KV as handoff chunks into a folder, and replies with its TCP endpoints (fastest first) or the
   staged object prefix.
3. stream: the decoder connects and reads the chunks as the engine writes them; staged: the
   prefill worker uploads each chunk, the decoder reads them from object storage.
4. The decoder hands the complete folder to its engine (EngineRequest.kv_import) and decodes.
   Asked with the request's sampling, a vLLM prefill also samples the first token, which the done
   chunk carries: the decoder sends it at once, and its engine goes on from it.

Whatever goes wrong on the way (no reply, refused, unreachable, stalled, broken, corrupt) ends in
HandoffFailed and the decoder prefills the prompt itself: the request is answered either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from nats.aio.subscription import Subscription
from opentelemetry.trace import Span, StatusCode, set_span_in_context

from fleet_bus import Bus, RequestFailed
from fleet_proto import HandoffStats, PrefillPlan, PrefillReply, PrefillRequest, SamplingParams
from fleet_proto.subjects import prefill_subject
from fleet_runtime.tracing import Tracing
from fleet_store import ObjectStore
from fleet_worker.engines.base import KVImport
from fleet_worker.handoff_progress import HandoffProgress
from fleet_worker.handoff_transport import (
    FirstTokenHook,
    HandoffFailed,
    HandoffUnreachable,
    ProgressHook,
    Received,
    download_staged,
    receive_stream,
    send_folder,
    staged_prefix,
    tune,
    upload_folder,
)
from fleet_worker.probe import Interface, fastest_addresses

log = logging.getLogger("fleet_worker.handoff")
REQUEST_TIMEOUT_S = 5.0
CONNECT_WAIT_S = 30.0  # a stream handoff nobody connects to within this is cancelled

# (prefill request, chunk folder) -> why it cannot be prefilled here ("" when it started)
StartExport = Callable[[PrefillRequest, Path], str]
CancelExport = Callable[[PrefillRequest], None]


def advertised_endpoints(
    host: str, port: int, configured: str, interfaces: Sequence[Interface]
) -> tuple[str, ...]:
    """The endpoints decoders try, fastest network path first; loopback only when alone."""
    if configured.strip():
        return tuple(e.strip() for e in configured.split(",") if e.strip())
    if host not in ("0.0.0.0", ""):
        return (f"{host}:{port}",)
    return tuple(f"{address}:{port}" for address in fastest_addresses(interfaces))


class PrefillServer:
    """The prefill side: answers prefill requests for this node's instances and serves the chunks."""

    def __init__(
        self,
        bus: Bus,
        tracing: Tracing,
        node_id: str,
        store: ObjectStore,
        root: Path,
        start_export: StartExport,
        cancel_export: CancelExport,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str = "",
        interfaces: Sequence[Interface] = (),
        stall_s: float = 30.0,
    ) -> None:
        self._bus = bus
        self._tracing = tracing
        self._node_id = node_id
        self._store = store
        self._root = root
        self._start_export = start_export
        self._cancel_export = cancel_export
        self._host, self._port = host, port
        self._advertise = advertise
        self._interfaces = interfaces
        self._stall_s = stall_s
        self._waiting: dict[str, Handoff] = {}  # stream handoffs not connected yet
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._subscription: Subscription | None = None
        self.endpoints: tuple[str, ...] = ()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connection, self._host, self._port)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoints = advertised_endpoints(self._host, port, self._advertise, self._interfaces)
        self._subscription = await self._bus.serve(
            prefill_subject(self._node_id), PrefillRequest, self._on_request
        )
        log.info("prefill handoffs served on %s", ", ".join(self.endpoints))

    async def close(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work, name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_request(self, request: PrefillRequest) -> PrefillReply:
        # under the decoder's kv transfer span (the request's trace context): ended on delivery
        span = self._tracing.start_span(
            "remote prefill",
            "prefill",
            {
                "fleet.handoff_id": request.handoff_id,
                "fleet.transport": request.transport,
                "fleet.tokens": len(request.prompt_token_ids) - 1 - request.start_pos,
            },
        )
        handoff = Handoff(request, self._root / request.handoff_id, span)
        problem = self._start_export(request, handoff.folder)
        if problem:
            handoff.end(problem)
            return PrefillReply(error=problem)
        if request.transport == "staged":
            self._spawn(self._stage(handoff), f"stage-{request.handoff_id}")
            return PrefillReply(staged_prefix=staged_prefix(request.handoff_id))
        self._waiting[request.handoff_id] = handoff
        self._spawn(self._expire(request.handoff_id), f"expire-{request.handoff_id}")
        return PrefillReply(endpoints=self.endpoints)

    async def _expire(self, handoff_id: str) -> None:
        await asyncio.sleep(CONNECT_WAIT_S)
        handoff = self._waiting.pop(handoff_id, None)
        if handoff is not None:
            log.warning("handoff %s: the decoder never connected; prefill cancelled", handoff_id)
            self._abandon(handoff, "the decoder never connected")

    def _abandon(self, handoff: Handoff, why: str) -> None:
        self._cancel_export(handoff.request)
        shutil.rmtree(handoff.folder, ignore_errors=True)
        handoff.end(why)

    async def _stage(self, handoff: Handoff) -> None:
        request = handoff.request
        error = ""
        try:
            with self._tracing.span("kv upload (object storage)", "transfer", parent=handoff.context):
                await upload_folder(
                    self._store, handoff.folder, request.handoff_id, self._stall_s, request.overlap
                )
        except Exception as failure:  # the decoder sees the stall and prefills itself
            log.warning("handoff %s: staging failed: %s", request.handoff_id, failure)
            self._cancel_export(request)
            error = f"staging failed: {failure}"
        finally:
            shutil.rmtree(handoff.folder, ignore_errors=True)
            handoff.end(error)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tune(writer)
        handoff, why = None, "cancelled"
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                handoff_id = (await reader.readline()).decode(errors="replace").strip()
            handoff = self._waiting.pop(handoff_id, None)
            if handoff is None:
                return  # unknown or expired: closing tells the decoder
            with self._tracing.span("kv send (stream)", "transfer", parent=handoff.context) as send:
                sent = await send_folder(writer, handoff.folder, self._stall_s, handoff.request.overlap)
                send.set_attribute("fleet.bytes", sent)
            handoff.end()  # delivered: the cleanup below is not the decoder's wait
            log.info("handoff %s: %d bytes streamed", handoff_id, sent)
            shutil.rmtree(handoff.folder, ignore_errors=True)
            handoff = None  # nothing to cancel
        except (HandoffFailed, OSError, TimeoutError) as error:
            log.warning("handoff stream ended early: %r", error)
            why = f"the stream ended early: {error!r}"
        finally:
            if handoff is not None:
                self._abandon(handoff, why)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class Handoff:
    """One prefill this worker runs for a decoder: its request, its folder of chunks, and its span."""

    def __init__(self, request: PrefillRequest, folder: Path, span: Span) -> None:
        self.request = request
        self.folder = folder
        self.span = span
        self.context = set_span_in_context(span)

    def end(self, error: str = "") -> None:
        if error:
            self.span.set_status(StatusCode.ERROR, error)
        self.span.end()


class HandoffClient:
    """The decode side: asks for a remote prefill and receives its chunks into a local folder."""

    def __init__(self, bus: Bus, store: ObjectStore, root: Path, stall_s: float = 30.0) -> None:
        self._bus = bus
        self._store = store
        self._root = root
        self._stall_s = stall_s

    async def fetch(
        self,
        request_id: str,
        plan: PrefillPlan,
        prompt: tuple[int, ...],
        start_pos: int,
        wire_dtype: str,
        sampling: SamplingParams | None = None,
        on_first_token: FirstTokenHook | None = None,
        on_progress: ProgressHook | None = None,
        layers: int = 0,
    ) -> tuple[KVImport, HandoffStats]:
        """The received handoff and its numbers; HandoffFailed when the decoder must prefill itself.
        With `sampling`, the prefill may sample the first token too (KVImport.first_token), told to
        `on_first_token` as soon as it arrives, ahead of the rest of the KV. `on_progress` hears how
        much of the prompt has arrived (`layers`: the decoder's model's, to count partial steps)."""
        transports = ("stream", "staged") if plan.transport == "auto" else (plan.transport,)
        for transport in transports:
            handoff_id = uuid.uuid4().hex
            folder = self._root / handoff_id
            request = PrefillRequest(
                handoff_id=handoff_id,
                request_id=request_id,
                instance_id=plan.instance_id,
                prompt_token_ids=prompt,
                start_pos=start_pos,
                transport=transport,
                wire_dtype=wire_dtype,
                sampling=sampling,
                overlap=plan.overlap,
            )
            started = time.perf_counter()
            received = Received(
                on_first_token=on_first_token if sampling is not None else None,
                progress=HandoffProgress(len(prompt), layers, reported=start_pos),
                on_progress=on_progress,
            )
            try:
                await self._receive(plan.worker_id, request, folder, received)
            except HandoffUnreachable:
                shutil.rmtree(folder, ignore_errors=True)
                if transport == transports[-1]:
                    raise
                log.info("request %s: prefill worker unreachable by TCP, staging instead", request_id)
                continue
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            first_token = received.first_token if sampling is not None else -1
            stats = HandoffStats(
                prefill_worker_id=plan.worker_id,
                transport=transport,
                start_pos=start_pos,
                tokens=len(prompt) - 1 - start_pos,
                chunks=received.chunks,
                bytes=received.bytes,
                prefill_s=received.first_at - started,
                transfer_s=received.last_at - started,
                tail_s=received.tail_s,
                first_token=first_token >= 0,
                overlap=plan.overlap,
            )
            kv_import = KVImport(
                folder=str(folder), handoff_id=handoff_id, start_pos=start_pos, first_token=first_token
            )
            return kv_import, stats
        raise HandoffFailed(f"no transport in {transports}")

    async def _receive(
        self, worker_id: str, request: PrefillRequest, folder: Path, received: Received
    ) -> Received:
        try:
            reply = await self._bus.request(
                prefill_subject(worker_id), request, PrefillReply, REQUEST_TIMEOUT_S
            )
        except RequestFailed as error:
            raise HandoffFailed(f"prefill worker {worker_id}: {error}") from None
        if reply.error:
            raise HandoffFailed(f"prefill worker {worker_id} refused: {reply.error}")
        if request.transport == "staged":
            return await download_staged(self._store, reply.staged_prefix, folder, self._stall_s, received)
        return await receive_stream(
            reply.endpoints, request.handoff_id, folder, self._stall_s, received=received
        )
