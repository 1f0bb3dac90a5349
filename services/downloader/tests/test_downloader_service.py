"""The downloader service through real NATS (JetStream) and S3: commands in, progress events out."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec

from fleet_bus import Bus, ensure_streams
from fleet_downloader.main import CONSUMER, Downloader, ProgressPublisher
from fleet_proto import DownloadModel, DownloadPhase, DownloadProgressed, ModelCard, ModelStaged
from fleet_proto.subjects import CMD_STREAM
from fleet_store import MODELS_BUCKET, fetch_model, load_manifest

FINAL = (DownloadPhase.DONE, DownloadPhase.FAILED)
DownloaderEvent = DownloadProgressed | ModelStaged


def unique_model_id() -> str:
    return f"test-org/tiny-{uuid.uuid4().hex[:8]}"


async def connected(url: str) -> Bus:
    bus = await Bus.connect(url, "downloader-test")
    await ensure_streams(bus.js)
    return bus


@asynccontextmanager
async def progress_events(bus: Bus) -> AsyncIterator[asyncio.Queue[DownloaderEvent]]:
    """Every DownloadProgressed and ModelStaged published while the block runs, in publish order.

    One subscription on all events keeps the order across the two subjects; other kinds are skipped.
    """
    queue: asyncio.Queue[DownloaderEvent] = asyncio.Queue()
    async with bus.subscription("fleet.evt.>", msgspec.Raw) as messages:

        async def pump() -> None:
            async for raw in messages:
                try:
                    queue.put_nowait(msgspec.json.decode(raw, type=DownloaderEvent))
                except msgspec.ValidationError:
                    continue

        task = asyncio.create_task(pump())
        try:
            yield queue
        finally:
            task.cancel()


def event_model_id(event: DownloaderEvent) -> str:
    return event.card.model_id if isinstance(event, ModelStaged) else event.model_id


async def until_final_events(queue: asyncio.Queue[DownloaderEvent], model_id: str) -> list[DownloaderEvent]:
    """The model's events (progress and ModelStaged) up to and including its final progress event."""
    seen: list[DownloaderEvent] = []
    async with asyncio.timeout(60):
        while not seen or not isinstance(seen[-1], DownloadProgressed) or seen[-1].phase not in FINAL:
            event = await queue.get()
            if event_model_id(event) == model_id:
                seen.append(event)
    return seen


async def until_final(queue: asyncio.Queue[DownloaderEvent], model_id: str) -> list[DownloadProgressed]:
    """The model's progress events up to its final one; fails if a ModelStaged came among them."""
    seen = await until_final_events(queue, model_id)
    assert not any(isinstance(event, ModelStaged) for event in seen), seen
    return [event for event in seen if isinstance(event, DownloadProgressed)]


def staged_then_done(seen: list[DownloaderEvent]) -> tuple[ModelCard, list[DownloadProgressed]]:
    """Exactly one ModelStaged, right before the final DONE; its card and the progress events."""
    staged = [index for index, event in enumerate(seen) if isinstance(event, ModelStaged)]
    assert staged == [len(seen) - 2], [type(event).__name__ for event in seen]
    final = seen[-1]
    assert isinstance(final, DownloadProgressed) and final.phase == DownloadPhase.DONE, final
    card_event = seen[-2]
    assert isinstance(card_event, ModelStaged)
    return card_event.card, [event for event in seen if isinstance(event, DownloadProgressed)]


def tiny_card(model_id: str, storage_bytes: int) -> ModelCard:
    """The card of conftest's tiny folder (TINY_CONFIG) staged as model_id."""
    return ModelCard(
        model_id=model_id,
        architecture="llama",
        num_layers=2,
        hidden_size=64,
        num_kv_heads=2,
        head_dim=16,
        dtype="bfloat16",
        storage_bytes=storage_bytes,
        quantization="",
        publisher="test-org",
        base_model=model_id.split("/")[1],
        has_tokenizer=False,  # no tokenizer.json
        has_chat_template=False,  # its tokenizer_config.json has none
        supported_engines=("mlx", "vllm"),
    )


async def command_acked(bus: Bus) -> None:
    """Wait until the downloader's consumer has nothing pending and the work queue is empty."""
    async with asyncio.timeout(10):
        while True:
            info = await bus.js.consumer_info(CMD_STREAM.name, CONSUMER)
            stream = await bus.js.stream_info(CMD_STREAM.name)
            if info.num_ack_pending == 0 and info.num_pending == 0 and stream.state.messages == 0:
                assert info.num_redelivered == 0
                return
            await asyncio.sleep(0.05)


def start_service(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fleet_downloader"], env=env, stdout=log, stderr=subprocess.STDOUT
        )


@asynccontextmanager
async def downloader_task(bus: Bus, store, work_dir: Path) -> AsyncIterator[Downloader]:
    downloader = Downloader(bus, store, work_dir, "downloader-test")
    task = asyncio.create_task(downloader.run())
    try:
        yield downloader
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_service_process_stages_a_folder_and_reports_done(
    fresh_nats, s3_server, store, tiny_folder, tmp_path
):
    bus = await connected(fresh_nats.url)
    env = os.environ | {
        "FLEET_NATS_URL": fresh_nats.url,
        "FLEET_S3_ENDPOINT": s3_server.url,
        "FLEET_HEALTH_PORT": "0",
        "FLEET_STATE_DIR": str(tmp_path / "state"),
        "FLEET_LOG_FORMAT": "text",
    }
    log_path = tmp_path / "downloader.log"
    proc = start_service(env, log_path)
    model_id = unique_model_id()
    try:
        async with progress_events(bus) as events:
            await bus.publish_command(
                DownloadModel(command_id="cmd-1", model_id=model_id, source=f"file://{tiny_folder}")
            )
            seen_events = await until_final_events(events, model_id)
        await command_acked(bus)
    finally:
        await bus.close()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            returncode = await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise

    log_text = log_path.read_text()
    assert returncode == 0, log_text
    final = seen_events[-1]
    assert isinstance(final, DownloadProgressed) and final.phase == DownloadPhase.DONE, (
        getattr(final, "reason", "") or log_text
    )
    card, seen = staged_then_done(seen_events)
    assert {e.phase for e in seen[:-1]} <= {DownloadPhase.UPLOADING}
    manifest = load_manifest(store, MODELS_BUCKET, model_id, "main")
    assert final.done_bytes == final.total_bytes == manifest.total_size
    assert all(e.origin.startswith("downloader-") for e in seen_events)
    assert seen_events[-2].origin == final.origin
    assert card == tiny_card(model_id, (tiny_folder / "model.safetensors").stat().st_size)
    fetched = fetch_model(store, MODELS_BUCKET, manifest, tmp_path / "fetched")
    assert len(fetched.downloaded) == 3
    for file in manifest.files:
        assert (tmp_path / "fetched" / file.path).read_bytes() == (tiny_folder / file.path).read_bytes()
    assert (tmp_path / "state" / "downloader").is_dir()


async def test_bad_sources_end_in_failed_with_a_reason_and_are_not_redelivered(fresh_nats, store, tmp_path):
    bus = await connected(fresh_nats.url)
    cases = {
        unique_model_id(): (
            "gguf:///nonexistent/model.gguf",
            "GGUF file /nonexistent/model.gguf does not exist",
        ),
        unique_model_id(): ("org/model@main", "cannot reach the hub"),
        unique_model_id(): ("pkg:fleet-no-such-package", "'fleet-no-such-package' is not installed"),
    }
    try:
        async with downloader_task(bus, store, tmp_path / "work"), progress_events(bus) as events:
            for index, (model_id, (source, _)) in enumerate(cases.items()):
                await bus.publish_command(
                    DownloadModel(command_id=f"bad-{index}", model_id=model_id, source=source)
                )
            for model_id, (_, reason) in cases.items():
                seen = await until_final(events, model_id)
                assert [e.phase for e in seen] == [DownloadPhase.FAILED]
                assert reason in seen[-1].reason
                assert seen[-1].origin == "downloader-test"
            await command_acked(bus)
            # Nothing more arrives for them: the commands were acked, not redelivered.
            await asyncio.sleep(1.0)
            assert events.empty()
    finally:
        await bus.close()
    for model_id in cases:
        assert store.list_keys(MODELS_BUCKET, f"{model_id}/") == []


async def test_an_already_staged_model_is_done_without_uploading_again(
    fresh_nats, store, tiny_folder, tmp_path
):
    bus = await connected(fresh_nats.url)
    model_id = unique_model_id()
    command = DownloadModel(command_id="first", model_id=model_id, source=f"file://{tiny_folder}")
    # a second command for the same model (the same command_id would be dropped as a duplicate)
    again = msgspec.structs.replace(command, command_id="second")
    try:
        async with downloader_task(bus, store, tmp_path / "work"), progress_events(bus) as events:
            await bus.publish_command(command)
            first_events = await until_final_events(events, model_id)
            await bus.publish_command(again)
            second_events = await until_final_events(events, model_id)
            await command_acked(bus)
    finally:
        await bus.close()
    first_card, first = staged_then_done(first_events)
    assert first[-1].phase == DownloadPhase.DONE
    assert DownloadPhase.UPLOADING in {e.phase for e in first}
    # The second time the card is derived from the stored files (the tokenizer config is fetched).
    second_card, second = staged_then_done(second_events)
    assert [(e.phase, e.done_bytes, e.total_bytes) for e in second] == [
        (DownloadPhase.DONE, first[-1].total_bytes, first[-1].total_bytes)
    ]
    assert (
        first_card == second_card == tiny_card(model_id, (tiny_folder / "model.safetensors").stat().st_size)
    )


async def test_a_chat_template_in_the_tokenizer_config_is_on_the_card(
    fresh_nats, store, tiny_folder, tmp_path
):
    (tiny_folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (tiny_folder / "tokenizer.json").write_text("{}")
    bus = await connected(fresh_nats.url)
    model_id = unique_model_id()
    command = DownloadModel(command_id="template", model_id=model_id, source=f"file://{tiny_folder}")
    try:
        async with downloader_task(bus, store, tmp_path / "work"), progress_events(bus) as events:
            await bus.publish_command(command)
            card, _ = staged_then_done(await until_final_events(events, model_id))
            await command_acked(bus)
    finally:
        await bus.close()
    assert card.has_chat_template and card.has_tokenizer


async def test_a_config_without_a_layer_count_fails_after_staging(fresh_nats, store, tiny_folder, tmp_path):
    config = json.loads((tiny_folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (tiny_folder / "config.json").write_text(json.dumps(config))
    bus = await connected(fresh_nats.url)
    model_id = unique_model_id()
    command = DownloadModel(command_id="no-layers", model_id=model_id, source=f"file://{tiny_folder}")
    try:
        async with downloader_task(bus, store, tmp_path / "work"), progress_events(bus) as events:
            await bus.publish_command(command)
            seen = await until_final(events, model_id)  # also asserts that no ModelStaged came
            await command_acked(bus)
    finally:
        await bus.close()
    assert seen[-1].phase == DownloadPhase.FAILED
    assert "CardError" in seen[-1].reason and "no layer count" in seen[-1].reason
    assert load_manifest(store, MODELS_BUCKET, model_id, "main").config == config  # the files stay staged


async def test_progress_is_rate_limited_and_ordered_before_the_final_event(fresh_nats):
    bus = await connected(fresh_nats.url)
    try:
        async with progress_events(bus) as events:
            publisher = ProgressPublisher(bus, "test-org/progress", "downloader-test", min_interval_s=0.5)

            def stage() -> None:  # a fast staging thread: 2,000 reports in well under 0.5 s per phase
                for done in range(1000):
                    publisher.report(DownloadPhase.CONVERTING, done, 1000)
                for done in range(1000):
                    publisher.report(DownloadPhase.UPLOADING, done, 1000)

            await asyncio.to_thread(stage)
            await publisher.finish(DownloadPhase.DONE, 1000, 1000)
            seen = await until_final(events, "test-org/progress")
    finally:
        await bus.close()
    assert [(e.phase, e.done_bytes) for e in seen] == [
        (DownloadPhase.CONVERTING, 0),
        (DownloadPhase.UPLOADING, 0),
        (DownloadPhase.DONE, 1000),
    ]
