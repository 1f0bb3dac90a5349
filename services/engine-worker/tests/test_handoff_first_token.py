"""The decoder hears of the first token when its chunk arrives, before the rest of the handoff:
a real TCP stream (on 127.0.0.1) whose producer holds its last chunks until the hook has run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fleet_store.handoff import FRAME_HEADER, HandoffChunk
from fleet_store.kv import WireTensor
from fleet_worker.handoff_transport import Received, receive_stream

pytestmark = pytest.mark.unit


def rows(n: int) -> WireTensor:
    return WireTensor("F16", (n, 1, 2), np.ones((n, 1, 2), dtype=np.float16).tobytes())


async def test_the_first_token_is_told_ahead_of_the_last_kv(tmp_path: Path) -> None:
    told = asyncio.Event()
    heard: list[int] = []

    async def producer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert (await reader.readline()).strip() == b"h1"
        chunks = [
            HandoffChunk("h1", 0, "kv", 0, 2, kv={0: (rows(2), rows(2))}),
            HandoffChunk("h1", 1, "first", first_token=7),
        ]
        later = [
            HandoffChunk("h1", 2, "kv", 2, 4, kv={0: (rows(2), rows(2))}),
            HandoffChunk("h1", 3, "done", 0, 4, first_token=7),
        ]
        for chunk in chunks:
            blob = chunk.encode()
            writer.write(FRAME_HEADER.pack(len(blob)) + blob)
        await writer.drain()
        await asyncio.wait_for(told.wait(), 10)  # the rest only once the decoder has the token
        for chunk in later:
            blob = chunk.encode()
            writer.write(FRAME_HEADER.pack(len(blob)) + blob)
        await writer.drain()
        writer.close()

    async def on_first_token(token: int) -> None:
        heard.append(token)
        told.set()

    server = await asyncio.start_server(producer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        received = await receive_stream(
            (f"127.0.0.1:{port}",), "h1", tmp_path, 10.0, received=Received(on_first_token=on_first_token)
        )
    assert heard == [7] and (received.chunks, received.first_token) == (4, 7)
