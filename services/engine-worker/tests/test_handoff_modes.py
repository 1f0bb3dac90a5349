"""A handoff's two transfer modes over a real loopback socket (layer streaming, and batch: nothing
until the prefill is done) and the progress the decoder reports as the layers arrive."""

from __future__ import annotations

import asyncio
import struct

import pytest

from fleet_store.handoff import HandoffWriter, chunk_layers
from fleet_store.kv import WireTensor
from fleet_worker.handoff_progress import HandoffProgress
from fleet_worker.handoff_transport import Received, receive_stream, send_folder


def rows(count: int) -> WireTensor:
    return WireTensor("F32", (count, 1, 2), struct.pack(f"<{count * 2}f", *[1.0] * (count * 2)))


@pytest.mark.unit
def test_progress_counts_the_layers_of_a_step_and_reports_in_steps() -> None:
    progress = HandoffProgress(prompt_tokens=3001, layers=4)
    # a first step of 400 rows: layer 0 of 4 has a quarter of them, under 5% of the prompt
    assert progress.arrived(0, 400, (0,)) is None
    assert progress.arrived(0, 400, (1,)) == 200
    assert progress.arrived(0, 400, (3,)) == 400
    assert progress.arrived(400, 3000, (3,)) is None  # the last step: the first token follows
    unknown = HandoffProgress(prompt_tokens=1001, layers=0)
    assert unknown.arrived(0, 400, (0, 1)) == 400
    assert unknown.arrived(400, 400, ()) is None


@pytest.mark.unit
def test_a_chunks_layers_are_read_from_its_header(tmp_path) -> None:
    writer = HandoffWriter(tmp_path, "h")
    writer.kv(0, 3, {2: (rows(3), rows(3)), 5: (rows(3), rows(3))})
    writer.done(0, 3)
    first, done = sorted(tmp_path.iterdir())
    assert chunk_layers(first.read_bytes()) == (2, 5)
    assert chunk_layers(done.read_bytes()) == ()
    assert chunk_layers(b"not a chunk") == ()


async def serve_handoff(tmp_path, overlap: bool) -> tuple[list[float], float, list[int]]:
    """A prefill that writes two layers 0.3 s apart, sent over loopback: arrival times, the done
    chunk's write time, and the progress the receiving side reported."""
    source, loop = tmp_path / f"source-{overlap}", asyncio.get_running_loop()
    writer = HandoffWriter(source, "h")

    async def produce() -> float:
        for layer in (0, 1):
            writer.kv(0, 40, {layer: (rows(40), rows(40))})
            await asyncio.sleep(0.3)
        writer.done(0, 40)
        return loop.time()

    async def serve(reader: asyncio.StreamReader, stream: asyncio.StreamWriter) -> None:
        await reader.readline()
        await send_folder(stream, source, 10.0, overlap)
        stream.close()

    arrivals: list[float] = []
    reported: list[int] = []

    async def on_progress(done: int) -> None:
        reported.append(done)

    class Timed(Received):
        async def took(self, blob: bytes) -> bool:
            arrivals.append(loop.time())
            return await super().took(blob)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        received = Timed(progress=HandoffProgress(prompt_tokens=100, layers=2), on_progress=on_progress)
        receiving = asyncio.create_task(
            receive_stream((f"127.0.0.1:{port}",), "h", tmp_path / f"into-{overlap}", 10.0, received=received)
        )
        done_at = await produce()
        await receiving
    return arrivals, done_at, reported


async def test_layer_streaming_sends_each_layer_as_it_is_written(tmp_path) -> None:
    arrivals, done_at, reported = await serve_handoff(tmp_path, overlap=True)
    assert len(arrivals) == 3 and arrivals[0] < done_at - 0.4  # layer 0 came during the prefill
    assert reported == [20, 40]  # half of the 40 rows, then all (of a 100-token prompt)


async def test_batch_mode_sends_nothing_until_the_prefill_is_done(tmp_path) -> None:
    arrivals, done_at, _ = await serve_handoff(tmp_path, overlap=False)
    assert len(arrivals) == 3 and min(arrivals) >= done_at
