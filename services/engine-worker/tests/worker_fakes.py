"""Fakes of the worker's collaborators, for unit tests of its request and lifecycle logic (no
engine process, NATS, S3 or Redis): each is named a fake and does only what the tests drive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from fleet_proto import GenerateTask, HandoffStats, Instance, SamplingParams, TokenChunk
from fleet_proto.messages import GenerationOutput
from fleet_worker.engine_process import EngineProcessExited
from fleet_worker.engines.base import EngineRequest, KVImport
from fleet_worker.handoff_transport import HandoffFailed


class FakeEngine:
    """Records what it is sent; the test feeds its outputs (`emit`) and its death (`die`). With
    `answers`, each request it is sent ends at once with one token (for warm-ups)."""

    def __init__(self, pid: int = 4242, answers: bool = False) -> None:
        self.answers = answers
        self.submitted: list[EngineRequest] = []
        self.cancelled: list[str] = []
        self.exit_reason = ""
        self.max_batch_size = 8
        self.on_kv_changes: Callable | None = None
        self.stopped = False
        self._pid = pid
        self._alive = True
        self._exitcode: int | None = None
        self._queue: asyncio.Queue[GenerationOutput | None] = asyncio.Queue()

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    @property
    def alive(self) -> bool:
        return self._alive

    def submit(self, request: EngineRequest) -> None:
        if not self._alive:
            raise EngineProcessExited(self.exit_reason)
        self.submitted.append(request)
        if self.answers:
            self.emit(GenerationOutput(request_id=request.request_id, token_ids=(1,), finish_reason="length"))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def emit(self, *outputs: GenerationOutput) -> None:
        for output in outputs:
            self._queue.put_nowait(output)

    def die(self, reason: str = "killed by signal 9", exitcode: int = -9) -> None:
        if self._alive:
            self._alive, self.exit_reason, self._exitcode = False, reason, exitcode
            self._queue.put_nowait(None)

    async def outputs(self) -> AsyncIterator[GenerationOutput]:
        while (output := await self._queue.get()) is not None:
            yield output

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped = True
        self.die("engine process stopped", 0)


class FakeKV:
    """The shared KV tier's worker side: prefetch gives one path per hash, after `gate` opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.released: list[Path] = []
        self.forgotten: list[str] = []
        self.held_blocks = 0

    async def prefetch(self, fingerprint: str, hashes: Sequence[str]) -> list[Path]:
        await self.gate.wait()
        return [Path(f"/kv/{h}") for h in hashes]

    def release(self, paths: Sequence[Path]) -> None:
        self.released.extend(paths)

    def held_run(self, fingerprint: str, hashes: Sequence[str]) -> int:
        return self.held_blocks

    def on_engine_changes(self, fingerprint: str, changes: object) -> None:
        pass

    async def forget(self, fingerprint: str) -> None:
        self.forgotten.append(fingerprint)


class FakeHandoffs:
    """A prefill worker's answer: optionally a first token at once (or `progress` lines), then the KV
    when `arrived` is set, or `failure` (HandoffFailed) instead."""

    def __init__(self, first_token: int = -1, failure: str = "", progress: tuple[int, ...] = ()) -> None:
        self.first_token = first_token
        self.failure = failure
        self.progress = progress
        self.layers = -1  # what the decoder said its model has
        self.arrived = asyncio.Event()
        self.asked: list[tuple[str, int, str]] = []  # request, start position, wire dtype

    async def fetch(
        self,
        request_id,
        plan,
        prompt,
        start_pos,
        wire_dtype,
        sampling=None,
        on_first_token=None,
        on_progress=None,
        layers=0,
    ):
        self.asked.append((request_id, start_pos, wire_dtype))
        self.layers = layers
        for prefilled in self.progress:
            await on_progress(prefilled)
        if self.first_token >= 0 and on_first_token is not None:
            await on_first_token(self.first_token)
        await self.arrived.wait()
        if self.failure:
            raise HandoffFailed(self.failure)
        stats = HandoffStats(prefill_worker_id=plan.worker_id, bytes=1000, transport="stream")
        return KVImport(folder=f"/handoff/{request_id}", handoff_id="h1", first_token=self.first_token), stats


class Chunks:
    """What a worker published, by request."""

    def __init__(self) -> None:
        self.sent: list[TokenChunk] = []

    async def publish(self, chunk: TokenChunk) -> None:
        self.sent.append(chunk)

    def of(self, request_id: str) -> list[TokenChunk]:
        return [c for c in self.sent if c.request_id == request_id]


def task(request_id: str = "r1", instance_id: str = "i1", prompt: int = 8, **fields) -> GenerateTask:
    return GenerateTask(
        request_id=request_id,
        instance_id=instance_id,
        prompt_token_ids=tuple(range(1, prompt + 1)),
        sampling=fields.pop("sampling", SamplingParams(max_tokens=4)),
        **fields,
    )


def instance(instance_id: str = "i1", engine: str = "mlx", **fields) -> Instance:
    return Instance(
        instance_id=instance_id, model_id=fields.pop("model_id", "m"), node_id="n1", engine=engine, **fields
    )


def output(request_id: str, *tokens: int, done: int = 0, finish: str = "", **fields) -> GenerationOutput:
    return GenerationOutput(
        request_id=request_id, token_ids=tokens, finish_reason=finish, completion_tokens=done, **fields
    )


async def settle() -> None:
    """Let every task that can run, run (the pump, a handoff's receiver)."""
    for _ in range(20):
        await asyncio.sleep(0)
