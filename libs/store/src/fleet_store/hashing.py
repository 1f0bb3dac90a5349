"""Chunked sha256 of files and streams, so no file is ever read whole into memory."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

CHUNK_SIZE = 1024 * 1024

Progress = Callable[[int, int], None]
"""Called with (done_bytes, total_bytes) as bytes move."""


def sha256_file(path: str | Path, chunk_size: int = CHUNK_SIZE) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


class HashingReader:
    """A read-only binary stream that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO, total: int = -1, progress: Progress | None = None) -> None:
        self._raw = raw
        self._digest = hashlib.sha256()
        self._total = total
        self._progress = progress
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        if data:
            self._digest.update(data)
            self.bytes_read += len(data)
            if self._progress is not None:
                self._progress(self.bytes_read, self._total)
        return data

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
