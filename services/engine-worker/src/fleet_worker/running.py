"""An instance loaded on this worker: its engine and what is in flight on it.

Three kinds of work run on an instance's engine, each in its own table: clients' requests (one
`RequestStream` each), prefills exported for another worker's decoder (`Export`), and the worker's
own requests (warm-up, calibration), whose final output is awaited.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fleet_proto import GenerateTask, Instance
from fleet_worker.engines.base import EngineOutput, EngineRequest
from fleet_worker.request_stream import RequestStream


class EngineHandle(Protocol):
    """What the worker needs of an engine (engine_process.EngineProcess; tests use fakes)."""

    exit_reason: str
    on_kv_changes: Callable | None
    max_batch_size: int  # requests its engine runs at once (Engine.max_batch_size)

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    def submit(self, request: EngineRequest) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def outputs(self) -> AsyncIterator[EngineOutput]: ...

    async def stop(self, timeout_s: float = 10.0) -> None: ...


def reusable_hashes(task: GenerateTask, block_size: int) -> tuple[str, ...]:
    """The prompt's block hashes whose KV can be reused: full blocks before its last token (which
    the engine always computes, to sample from)."""
    return task.block_hashes[: (len(task.prompt_token_ids) - 1) // block_size]


@dataclass(frozen=True)
class Export:
    """A prefill this instance runs for another worker's decoder: its KV goes to `folder`."""

    folder: Path
    handoff_id: str
    prompt_tokens: int


class RunningInstance:
    def __init__(
        self, instance: Instance, engine: EngineHandle, kv_fingerprint: str = "", rank: int = 0
    ) -> None:
        self.instance = instance
        self.engine = engine
        self.rank = rank  # in a pipeline; rank 0 takes the tasks, the others only step along
        self.kv_fingerprint = kv_fingerprint  # "" when its KV is not in the shared tier
        self.streams: dict[str, RequestStream] = {}
        self.exports: dict[str, Export] = {}  # engine request id -> export
        self.internal: dict[str, asyncio.Future[EngineOutput]] = {}
        self.pump: asyncio.Task[None] | None = None
        self.draining: asyncio.Task[None] | None = None  # deleted: its requests move on, it unloads
        self.leaving = False  # its worker is stopping
        self.idle = asyncio.Event()  # set while no client request or export is in flight
        self.idle.set()

    @property
    def accepting(self) -> bool:
        return self.draining is None and not self.leaving

    def add_stream(self, stream: RequestStream) -> None:
        self.streams[stream.request_id] = stream
        self.idle.clear()

    def remove_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self._settle()

    def add_export(self, request_id: str, export: Export) -> None:
        self.exports[request_id] = export
        self.idle.clear()

    def remove_export(self, request_id: str) -> Export | None:
        export = self.exports.pop(request_id, None)
        self._settle()
        return export

    def _settle(self) -> None:
        if not self.streams and not self.exports:
            self.idle.set()

    def in_flight(self) -> int:
        return len(self.streams) + len(self.exports)

    def running_tokens(self) -> int:
        """The KV context of the requests decoding (prompt + generated): memory, not waiting work."""
        return sum(s.prompt_tokens + s.generated for s in self.streams.values() if s.generated)

    def queued_tokens(self) -> int:
        """Prompt tokens still to prefill: of requests before their first token (queued or
        prefilling), what routing expected them to compute (the prompt less its expected prefix
        hit); exports' prompts. What a new request waits behind, and the scheduler's load term."""
        queued = sum(s.to_prefill for s in self.streams.values() if not s.generated)
        return queued + sum(e.prompt_tokens for e in self.exports.values())
