"""Downloader service: owns the object-storage buckets and stages models into them.

It consumes DownloadModel commands and publishes DownloadProgressed events (downloading, converting,
uploading with speed and ETA, then done or failed), and DeleteModel commands (ModelDeleted). Before
"done" it publishes ModelStaged with the model's card, so whoever sees "done" finds the card in State.
A command is acked only after its final event is published; a failure (including a staged model whose
config.json yields no card) is reported as phase FAILED and acked, since a bad source would only fail
again on redelivery. Commands for one model are serialised across replicas by a KV lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

from fleet_bus import Bus, Delivery, consume_commands, kv_lock
from fleet_downloader.progress import MIN_INTERVAL_S, Throttle, TransferRate, eta_seconds
from fleet_downloader.sources import SourceError
from fleet_downloader.staging import stage_model_with_card
from fleet_proto import (
    Command,
    DeleteModel,
    DownloadModel,
    DownloadPhase,
    DownloadProgressed,
    ModelCard,
    ModelDeleted,
    ModelStaged,
    ServiceKind,
)
from fleet_runtime.service import ServiceContext, run
from fleet_store import MODELS_BUCKET, ObjectStore, ensure_buckets

log = logging.getLogger("fleet_downloader")
CONSUMER = "downloader"
MAX_REASON_CHARS = 2000


class StagingCancelled(Exception):
    """The service is stopping: abandon the upload at the next progress report."""


def failure_reason(exc: BaseException) -> str:
    reason = str(exc) if isinstance(exc, SourceError) else f"{type(exc).__name__}: {exc}"
    return reason[:MAX_REASON_CHARS]


class ProgressPublisher:
    """Turns progress reports from the staging thread into DownloadProgressed events, in order.

    The thread only enqueues (through the event loop); one task publishes, so events keep their order
    and `finish` publishes the final event after every earlier one.
    """

    def __init__(self, bus: Bus, model_id: str, origin: str, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.bus = bus
        self.model_id = model_id
        self.origin = origin
        self.cancelled = threading.Event()
        self._throttle = Throttle(min_interval_s)
        self._rate = TransferRate()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[DownloadProgressed | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._publish_all(), name=f"progress-{model_id}")

    def _event(self, phase: DownloadPhase, done: int, total: int, reason: str = "") -> DownloadProgressed:
        bytes_per_s = self._rate.update(phase, done, time.monotonic())
        return DownloadProgressed(
            model_id=self.model_id,
            phase=phase,
            done_bytes=done,
            total_bytes=total,
            reason=reason,
            bytes_per_s=bytes_per_s,
            eta_s=eta_seconds(done, total, bytes_per_s),
            origin=self.origin,
            at=time.time(),
        )

    def report(self, phase: DownloadPhase, done: int, total: int) -> None:
        """The staging callback; runs in the staging thread."""
        if self.cancelled.is_set():
            raise StagingCancelled(f"staging {self.model_id} cancelled: the downloader is stopping")
        if self._throttle.allow(phase, time.monotonic()):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, self._event(phase, done, total))

    async def _publish_all(self) -> None:
        while (event := await self._queue.get()) is not None:
            try:
                await self.bus.publish_event(event)
            except Exception as exc:  # progress is advisory; the final event is what must get out
                log.warning("could not publish progress of %s: %s", self.model_id, exc)

    async def finish(
        self, phase: DownloadPhase, done: int, total: int, reason: str = "", card: ModelCard | None = None
    ) -> None:
        """Publish the final event after every queued one; raises if it cannot be published.

        With a card, ModelStaged(card) goes out just before the final event (and must get out too).
        """
        self._queue.put_nowait(None)
        await self._task
        if card is not None:
            await self.bus.publish_event(ModelStaged(card=card, origin=self.origin, at=time.time()))
        await self.bus.publish_event(self._event(phase, done, total, reason))

    async def close(self) -> None:
        self.cancelled.set()
        if not self._task.done():
            self._task.cancel()


class Downloader:
    """Runs DownloadModel commands: stage_model in a thread, progress and outcome as events."""

    def __init__(
        self, bus: Bus, store: ObjectStore, work_dir: Path, origin: str, ack_wait_s: float = 30.0
    ) -> None:
        self.ack_wait_s = ack_wait_s
        self.bus = bus
        self.store = store
        self.work_dir = work_dir
        self.origin = origin

    async def handle(self, command: Command, delivery: Delivery) -> None:
        match command:
            case DownloadModel():
                # replicas share the work queue; the lock keeps two commands for one model apart, and
                # the second then finds the model staged
                async with kv_lock(self.bus, f"stage/{command.model_id}", self.origin):
                    await self.stage(command, delivery)
            case DeleteModel():
                async with kv_lock(self.bus, f"stage/{command.model_id}", self.origin):
                    await self.delete(command)
            case _:
                log.warning("ignoring %s", type(command).__name__)

    async def delete(self, command: DeleteModel) -> None:
        """Remove every revision of the model from object storage, then tell the workers."""
        removed = await asyncio.to_thread(self.store.delete_prefix, MODELS_BUCKET, f"{command.model_id}/")
        await self.bus.publish_event(
            ModelDeleted(model_id=command.model_id, origin=self.origin, at=time.time())
        )
        log.info("deleted %s (%d objects)", command.model_id, removed)

    async def stage(self, command: DownloadModel, delivery: Delivery) -> None:
        log.info(
            "staging %s from %s (command %s, attempt %d)",
            command.model_id,
            command.source,
            command.command_id,
            delivery.attempt,
        )
        publisher = ProgressPublisher(self.bus, command.model_id, self.origin)
        try:
            manifest, card = await asyncio.to_thread(
                stage_model_with_card,
                self.store,
                command.model_id,
                command.source,
                work_dir=self.work_dir,
                progress=publisher.report,
            )
        except asyncio.CancelledError:
            await publisher.close()
            raise
        except Exception as exc:
            log.warning("staging %s from %s failed: %s", command.model_id, command.source, exc)
            await publisher.finish(DownloadPhase.FAILED, 0, 0, failure_reason(exc))
            return
        size = manifest.total_size
        await publisher.finish(DownloadPhase.DONE, size, size, card=card)
        log.info("staged %s (%d files, %d bytes)", command.model_id, len(manifest.files), size)

    async def run(self) -> None:
        """Consume DownloadModel commands until cancelled."""
        await consume_commands(
            self.bus, CONSUMER, (DownloadModel, DeleteModel), self.handle, ack_wait_s=self.ack_wait_s
        )


async def main(ctx: ServiceContext) -> None:
    store = ObjectStore.from_settings(ctx.settings)
    await asyncio.to_thread(ensure_buckets, store)  # also fails fast on a wrong endpoint or key

    async def check_store() -> None:
        await asyncio.to_thread(store.check)

    ctx.health_checks["s3"] = check_store

    async def close_store() -> None:
        store.close()

    ctx.on_shutdown(close_store)
    work_dir = Path(ctx.settings.state_dir) / "downloader"
    work_dir.mkdir(parents=True, exist_ok=True)
    downloader = Downloader(ctx.bus, store, work_dir, ctx.service_id, ctx.settings.command_ack_wait_s)
    ctx.spawn(downloader.run(), name="download-commands")


def cli() -> None:
    # transformers' GGUF loader draws tqdm bars on stderr, which would break JSON log lines.
    os.environ.setdefault("TQDM_DISABLE", "1")
    run(ServiceKind.DOWNLOADER, main)
