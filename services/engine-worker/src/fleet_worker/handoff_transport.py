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
HandoffFailed: the decoder then prefills locally. A receiver hears of the request's first token
(a "first" chunk, or the done chunk) through `on_first_token` the moment it arrives.
"""

from __future__ import annotations

import asyncio
import builtins
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fleet_store import KV_BUCKET, ObjectNotFound, ObjectStore, StoreError
from fleet_store.handoff import (
    FRAME_HEADER,
    FRAMES_FILE,
    HandoffError,
    chunk_layers,
    chunk_metadata,
    chunk_name,
    frame_length,
)
from fleet_worker.handoff_progress import HandoffProgress

POLL_S = 0.002  # how often a chunk folder is looked at for the next file
STAGED_POLL_S = 0.02
SOCKET_BUFFER_BYTES = 4 << 20
TERMINAL_KINDS = ("done", "error")
FIRST_TOKEN_KINDS = ("first", "done")

FirstTokenHook = Callable[[int], Awaitable[None]]
ProgressHook = Callable[[int], Awaitable[None]]  # prompt tokens whose KV has arrived


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
    first_token: int = -1  # the request's first token, when the prefill sampled it
    on_first_token: FirstTokenHook | None = None
    progress: HandoffProgress | None = None  # told of each KV chunk until the first token
    on_progress: ProgressHook | None = None

    async def took(self, blob: builtins.bytes) -> bool:  # plain `bytes` would name the field above
        """Count an arrived chunk (telling on_first_token of the first token the first time it
        comes); True when it is the last one."""
        self.last_at = time.perf_counter()
        self.first_at = self.first_at or self.last_at
        self.chunks += 1
        self.bytes += len(blob)
        meta = chunk_metadata(blob)
        kind = meta.get("kind")
        if (
            kind == "kv"
            and self.first_token < 0
            and self.progress is not None
            and self.on_progress is not None
        ):
            start, end = int(meta.get("token_start", "0")), int(meta.get("token_end", "0"))
            done = self.progress.arrived(start, end, chunk_layers(blob))
            if done is not None:
                await self.on_progress(done)
        if kind in FIRST_TOKEN_KINDS and self.first_token < 0:
            self.first_token = int(meta.get("first_token", "-1") or -1)
            if self.first_token >= 0 and self.on_first_token is not None:
                await self.on_first_token(self.first_token)
        if kind not in TERMINAL_KINDS:
            return False
        self.tail_s = max(time.time() - float(meta.get("written_at", "0") or 0), 0.0)
        return True


def staged_prefix(handoff_id: str) -> str:
    return f"handoff/{handoff_id}"


def _header_of(path: Path) -> tuple[dict[str, str], int]:
    """A chunk file's metadata (from its header alone) and its size."""
    with path.open("rb") as file:
        head = file.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        meta = chunk_metadata(head + file.read(length))
        return meta, path.stat().st_size


async def follow_folder(folder: Path, stall_s: float) -> AsyncIterator[tuple[Path, int]]:
    """The chunk files (path, size) of a handoff being written, in order, up to its done or error
    chunk. Files are small and in the page cache: they are looked at without a thread hop."""
    seq, waited_since = 0, time.monotonic()
    while True:
        path = folder / chunk_name(seq)
        if not path.is_file():
            if time.monotonic() - waited_since > stall_s:
                raise HandoffFailed(f"no chunk {seq} within {stall_s:g} s")
            await asyncio.sleep(POLL_S)
            continue
        meta, size = _header_of(path)
        yield path, size
        if meta.get("kind") in TERMINAL_KINDS:
            return
        seq, waited_since = seq + 1, time.monotonic()


async def handoff_files(
    folder: Path, stall_s: float, overlap: bool = True
) -> AsyncIterator[tuple[Path, int]]:
    """follow_folder's chunks; with overlap False (batch mode) none until the last was written."""
    if overlap:
        async for chunk in follow_folder(folder, stall_s):
            yield chunk
        return
    for chunk in [chunk async for chunk in follow_folder(folder, stall_s)]:
        yield chunk


def tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


async def send_folder(
    writer: asyncio.StreamWriter, folder: Path, stall_s: float, overlap: bool = True
) -> int:
    """Stream a handoff folder's chunks as they appear, or all at the end when not `overlap` (the
    kernel copies the files: sendfile); returns the bytes sent."""
    loop = asyncio.get_running_loop()
    sent = 0
    async for path, size in handoff_files(folder, stall_s, overlap):
        writer.write(FRAME_HEADER.pack(size))
        await writer.drain()
        with path.open("rb") as file:
            await loop.sendfile(writer.transport, file)
        sent += size
    return sent


@contextmanager
def frames_file(folder: Path) -> Iterator[BinaryIO]:
    """The received handoff's one file of framed chunks (fleet_store.handoff.FRAMES_FILE)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / FRAMES_FILE).open("wb") as file:
        yield file


async def receive_stream(
    endpoints: tuple[str, ...],
    handoff_id: str,
    folder: Path,
    stall_s: float,
    connect_s: float = 3.0,
    received: Received | None = None,
) -> Received:
    """Connect to the first endpoint that answers, ask for the handoff, write its chunks to folder
    (counted in `received`, whose hooks hear of the first token and the progress)."""
    reader, writer = await _connect(endpoints, connect_s)
    received = received or Received()
    try:
        tune(writer)
        writer.write(f"{handoff_id}\n".encode())
        await writer.drain()
        with frames_file(folder) as frames:
            while True:
                async with asyncio.timeout(stall_s):
                    header = await reader.readexactly(FRAME_HEADER.size)
                    blob = await reader.readexactly(frame_length(header))
                frames.write(header)  # into the page cache: no thread hop
                frames.write(blob)
                if await received.took(blob):
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


async def upload_folder(
    store: ObjectStore, folder: Path, handoff_id: str, stall_s: float, overlap: bool = True
) -> int:
    """Stage a handoff folder's chunks in object storage as they appear (or all at the end when not
    `overlap`); returns the bytes."""
    sent, prefix = 0, staged_prefix(handoff_id)
    seq = 0
    async for path, size in handoff_files(folder, stall_s, overlap):
        await asyncio.to_thread(store.put_file, KV_BUCKET, f"{prefix}/{chunk_name(seq)}", path)
        sent += size
        seq += 1
    return sent


async def download_staged(
    store: ObjectStore,
    prefix: str,
    folder: Path,
    stall_s: float,
    received: Received | None = None,
) -> Received:
    """Read a staged handoff's chunks in order as they are uploaded, into folder; then delete them."""
    received = received or Received()
    try:
        with frames_file(folder) as frames:
            while True:
                blob = await _next_staged(store, f"{prefix}/{chunk_name(received.chunks)}", stall_s)
                frames.write(FRAME_HEADER.pack(len(blob)))
                frames.write(blob)
                if await received.took(blob):
                    return received
    finally:
        try:
            await asyncio.to_thread(store.delete_prefix, KV_BUCKET, prefix + "/")
        except StoreError:
            pass  # a leftover handoff object costs space only


async def _next_staged(store: ObjectStore, key: str, stall_s: float) -> bytes:
    waited_since = time.monotonic()
    while True:
        try:
            return await asyncio.to_thread(store.get_bytes, KV_BUCKET, key)
        except ObjectNotFound:
            if time.monotonic() - waited_since > stall_s:
                raise HandoffFailed(f"staged chunk {key} did not appear within {stall_s:g} s") from None
            await asyncio.sleep(STAGED_POLL_S)
        except StoreError as error:
            raise HandoffFailed(f"staged chunk {key} unreadable: {error}") from None
