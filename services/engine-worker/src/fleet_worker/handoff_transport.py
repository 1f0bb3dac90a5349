"""Moving a handoff's chunks between workers: a direct TCP stream, or staged in object storage.

Engines write a handoff as numbered chunk files in a folder (fleet_store.handoff); these functions
carry them without looking inside (only the kind, to know the last one):

- stream: the prefill worker sends each chunk as soon as its file appears, length-prefixed, on a
  TCP connection the decode worker opened (after a line naming the handoff); the decoder writes
  them into its own folder. Transfer overlaps the prefill: chunks leave while later layers or
  later prompt chunks are computed.
- staged: the prefill worker uploads each chunk to `fleet-kv/handoff/<handoff>/<seq>`, the decoder
  reads them in order (each object verified by its sha256), then deletes them.

A stall (no new chunk within `stall_s`), a broken connection or a missing chunk raises
HandoffFailed: the decoder then prefills locally.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fleet_store import KV_BUCKET, ObjectNotFound, ObjectStore, StoreError
from fleet_store.handoff import (
    FRAME_HEADER,
    HandoffError,
    chunk_kind,
    chunk_metadata,
    chunk_name,
    frame_length,
)

POLL_S = 0.002  # how often a chunk folder is looked at for the next file
STAGED_POLL_S = 0.02
SOCKET_BUFFER_BYTES = 4 << 20
TERMINAL_KINDS = ("done", "error")


class HandoffFailed(RuntimeError):
    pass


class HandoffUnreachable(HandoffFailed):
    """No endpoint of the prefill worker accepted a connection (staging may still work)."""


@dataclass
class Received:
    chunks: int = 0
    bytes: int = 0
    first_at: float = 0.0  # perf_counter of the first chunk's arrival
    last_at: float = 0.0
    tail_s: float = 0.0  # the last chunk's write (producer's wall clock) -> its arrival

    def took(self, blob: bytes) -> bool:
        """Count an arrived chunk; True when it is the last one."""
        self.last_at = time.perf_counter()
        self.first_at = self.first_at or self.last_at
        self.chunks += 1
        self.bytes += len(blob)
        meta = chunk_metadata(blob)
        if meta.get("kind") not in TERMINAL_KINDS:
            return False
        self.tail_s = max(time.time() - float(meta.get("written_at", "0") or 0), 0.0)
        return True


def staged_prefix(handoff_id: str) -> str:
    return f"handoff/{handoff_id}"


async def follow_folder(folder: Path, stall_s: float) -> AsyncIterator[bytes]:
    """The chunk files of a handoff being written, in order, until its done or error chunk."""
    seq, waited_since = 0, time.monotonic()
    while True:
        path = folder / chunk_name(seq)
        if not path.is_file():
            if time.monotonic() - waited_since > stall_s:
                raise HandoffFailed(f"no chunk {seq} within {stall_s:g} s")
            await asyncio.sleep(POLL_S)
            continue
        blob = await asyncio.to_thread(path.read_bytes)
        yield blob
        if chunk_kind(blob) in TERMINAL_KINDS:
            return
        seq, waited_since = seq + 1, time.monotonic()


def tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


async def send_folder(writer: asyncio.StreamWriter, folder: Path, stall_s: float) -> int:
    """Stream a handoff folder's chunks as they appear; returns the bytes sent."""
    sent = 0
    async for blob in follow_folder(folder, stall_s):
        writer.write(FRAME_HEADER.pack(len(blob)))
        writer.write(blob)
        await writer.drain()
        sent += len(blob)
    return sent


def _write_chunk(folder: Path, seq: int, blob: bytes) -> None:
    (folder / chunk_name(seq)).write_bytes(blob)


async def receive_stream(
    endpoints: tuple[str, ...], handoff_id: str, folder: Path, stall_s: float, connect_s: float = 3.0
) -> Received:
    """Connect to the first endpoint that answers, ask for the handoff, write its chunks to folder."""
    reader, writer = await _connect(endpoints, connect_s)
    received = Received()
    try:
        tune(writer)
        writer.write(f"{handoff_id}\n".encode())
        await writer.drain()
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        while True:
            async with asyncio.timeout(stall_s):
                length = frame_length(await reader.readexactly(FRAME_HEADER.size))
                blob = await reader.readexactly(length)
            await asyncio.to_thread(_write_chunk, folder, received.chunks, blob)
            if received.took(blob):
                return received
    except (asyncio.IncompleteReadError, ConnectionError, HandoffError) as error:
        raise HandoffFailed(f"the handoff stream broke after {received.chunks} chunks: {error!r}") from None
    except TimeoutError:
        raise HandoffFailed(f"the handoff stream stalled for {stall_s:g} s") from None
    finally:
        writer.close()


async def _connect(
    endpoints: tuple[str, ...], timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    problems = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.open_connection(host, int(port), limit=SOCKET_BUFFER_BYTES)
        except (OSError, TimeoutError, ValueError) as error:
            problems.append(f"{endpoint}: {error!r}")
    raise HandoffUnreachable("no handoff endpoint answered: " + ("; ".join(problems) or "none offered"))


async def upload_folder(store: ObjectStore, folder: Path, handoff_id: str, stall_s: float) -> int:
    """Stage a handoff folder's chunks in object storage as they appear; returns the bytes."""
    sent, prefix = 0, staged_prefix(handoff_id)
    seq = 0
    async for blob in follow_folder(folder, stall_s):
        await asyncio.to_thread(store.put_bytes, KV_BUCKET, f"{prefix}/{chunk_name(seq)}", blob)
        sent += len(blob)
        seq += 1
    return sent


async def download_staged(store: ObjectStore, prefix: str, folder: Path, stall_s: float) -> Received:
    """Read a staged handoff's chunks in order as they are uploaded, into folder; then delete them."""
    received, waited_since = Received(), time.monotonic()
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    try:
        while True:
            key = f"{prefix}/{chunk_name(received.chunks)}"
            try:
                blob = await asyncio.to_thread(store.get_bytes, KV_BUCKET, key)
            except ObjectNotFound:
                if time.monotonic() - waited_since > stall_s:
                    raise HandoffFailed(
                        f"staged chunk {received.chunks} did not appear within {stall_s:g} s"
                    ) from None
                await asyncio.sleep(STAGED_POLL_S)
                continue
            except StoreError as error:
                raise HandoffFailed(f"staged chunk {received.chunks} unreadable: {error}") from None
            await asyncio.to_thread(_write_chunk, folder, received.chunks, blob)
            waited_since = time.monotonic()
            if received.took(blob):
                return received
    finally:
        try:
            await asyncio.to_thread(store.delete_prefix, KV_BUCKET, prefix + "/")
        except StoreError:
            pass  # a leftover handoff object costs space only
