"""An engine in a child process, so that its crash or out-of-memory kill never takes the worker down.

Parent and child exchange msgspec structs (engine_messages), msgpack-encoded, over a multiprocessing
Pipe. The child (a "spawn" process: a fresh interpreter, nothing inherited from the worker's event
loop or threads) runs engine_child.run_child: it loads the engine, reports Loaded or LoadFailed, then
steps it and sends the outputs. This module is the parent side; it lives on the asyncio loop: it
reads with loop.add_reader on the pipe and watches the process sentinel, so a dead child is noticed
at once and every request still in flight gets a final "error" output.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec

from fleet_proto.messages import UNAVAILABLE
from fleet_worker.engine_child import run_child
from fleet_worker.engine_messages import (
    Cancel,
    Failed,
    FromChild,
    Loaded,
    LoadFailed,
    LoadProgressed,
    Outputs,
    Shutdown,
    Submit,
)
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVChanges


class EngineLoadError(RuntimeError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineProcessExited(RuntimeError):
    """A command was sent to an engine process that has already exited."""


def describe_exit(code: int | None) -> str:
    """A child's exit code in words: a negative code is the signal that killed it."""
    if code is None:
        return "engine process is gone"
    if code >= 0:
        return f"engine process exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (out of memory? the kernel's OOM killer sends it)" if -code == signal.SIGKILL else ""
    return f"engine process was killed by {name}{hint}"


class EngineProcess:
    """The parent's handle on one engine child; all methods run on the event loop's thread."""

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self._process = process
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromChild)
        self._in_flight: set[str] = set()
        # One output per item, so a reader that stops iterating mid-step loses nothing; None ends.
        self._queue: asyncio.Queue[EngineOutput | None] = asyncio.Queue()
        self._exited = asyncio.Event()
        self._stopping = False
        self.load_time_s = 0.0
        self.max_batch_size = 0  # from the engine once loaded
        self.exit_reason = ""  # why the child exited, once it has
        self._failure = ""  # what the child said went wrong before it exited
        # Called on the loop with each step's KV changes (set by whoever indexes this engine's blocks).
        self.on_kv_changes: Callable[[KVChanges], None] | None = None

    @classmethod
    async def start(
        cls,
        engine_name: str,
        model_dir: Path,
        options: Mapping[str, Any] | None = None,
        load_timeout_s: float = 600.0,
        on_progress: Callable[[int, int], None] | None = None,
        stream_interval_s: float = 0.0,
    ) -> EngineProcess:
        """Start the child and return once its engine has loaded; EngineLoadError otherwise.

        on_progress(layers loaded, total) is called on the loop as the child reports weight loading;
        stream_interval_s > 0 lets the child hold a stream's tokens that long (OutputHold).
        """
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        # daemon: multiprocessing's exit handler then kills a child the worker forgot to stop.
        process = context.Process(
            target=run_child,
            args=(child_conn, engine_name, str(model_dir), dict(options or {}), stream_interval_s),
            name=f"fleet-engine-{engine_name}",
            daemon=True,
        )
        process.start()
        child_conn.close()  # the child holds the only other end: its death reads as EOF here
        self = cls(process, conn)
        try:
            await self._wait_loaded(engine_name, load_timeout_s, on_progress)
        except BaseException:
            self._kill_and_close()
            raise
        self._loop.add_reader(conn.fileno(), self._on_readable)
        self._loop.add_reader(process.sentinel, self._on_exit)
        return self

    async def _wait_loaded(
        self, engine_name: str, timeout_s: float, on_progress: Callable[[int, int], None] | None
    ) -> None:
        readable = asyncio.Event()
        fds = (self._conn.fileno(), self._process.sentinel)
        for fd in fds:
            self._loop.add_reader(fd, readable.set)
        try:
            async with asyncio.timeout(timeout_s):
                while (message := self._read_while_loading(on_progress)) is None:
                    await readable.wait()
                    readable.clear()
        except TimeoutError:
            raise EngineLoadError(f"engine {engine_name!r} did not load within {timeout_s:g} s") from None
        finally:
            for fd in fds:
                self._loop.remove_reader(fd)
        if isinstance(message, Loaded):
            self.load_time_s = message.load_time_s
            self.max_batch_size = message.max_batch_size
            return
        if isinstance(message, LoadFailed):
            raise EngineLoadError(message.reason)
        self._process.join(5)
        raise EngineLoadError(f"engine process exited with code {self._process.exitcode} while loading")

    def _read_while_loading(self, on_progress: Callable[[int, int], None] | None = None) -> FromChild | None:
        """The load's outcome once known (Loaded, LoadFailed, or Outputs([]) for a dead child), else None."""
        try:
            while self._conn.poll():
                message = self._decoder.decode(self._conn.recv_bytes())
                if not isinstance(message, LoadProgressed):
                    return message
                if on_progress is not None:
                    on_progress(message.layers_loaded, message.layers_total)
        except (EOFError, OSError):
            return Outputs(outputs=[])
        return Outputs(outputs=[]) if not self._process.is_alive() else None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    @property
    def alive(self) -> bool:
        return not self._exited.is_set() and self._process.is_alive()

    def submit(self, request: EngineRequest) -> None:
        if not self.alive:
            raise EngineProcessExited(f"engine process {self.pid} is not running")
        self._in_flight.add(request.request_id)
        self._send(Submit(request=request))

    def cancel(self, request_id: str) -> None:
        if request_id in self._in_flight and self.alive:
            self._send(Cancel(request_id=request_id))

    def _send(self, command: Submit | Cancel | Shutdown) -> None:
        # A blocking write of a small message: the child drains its commands before every step, so
        # a full pipe buffer could hold the loop for at most one step.
        try:
            self._conn.send_bytes(self._encoder.encode(command))
        except OSError:
            pass  # the child is gone; _on_exit reports what was in flight

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        """Every output in arrival order; ends after the child has exited (and errors were yielded)."""
        while (output := await self._queue.get()) is not None:
            yield output
        self._queue.put_nowait(None)  # a later call ends at once too

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the child to shut down; kill it if it has not exited within timeout_s."""
        if self._exited.is_set():
            return
        self._stopping = True
        self._send(Shutdown())
        try:
            async with asyncio.timeout(timeout_s):
                await self._exited.wait()
        except TimeoutError:
            self._process.kill()
            await self._exited.wait()

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                message = self._decoder.decode(self._conn.recv_bytes())
                if isinstance(message, Outputs):
                    self._deliver(message.outputs)
                    if message.kv and self.on_kv_changes is not None:
                        self.on_kv_changes(message.kv)
                elif isinstance(message, Failed):
                    self._failure = message.reason
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())  # _on_exit finishes up on the sentinel

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            if output.finish_reason:
                self._in_flight.discard(output.request_id)
            self._queue.put_nowait(output)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._process.sentinel)
        if not self._conn.closed:
            self._on_readable()  # what the child sent before it went
            self._loop.remove_reader(self._conn.fileno())
        self._process.join(1)  # the sentinel fired: this only reaps
        reason = "engine process stopped" if self._stopping else describe_exit(self._process.exitcode)
        if self._failure:
            reason = f"engine failed: {self._failure}"
        self.exit_reason = reason
        for request_id in sorted(self._in_flight):
            self._queue.put_nowait(  # the requests are fine: their gateways resume them elsewhere
                EngineOutput(
                    request_id=request_id, finish_reason="error", error=reason, error_kind=UNAVAILABLE
                )
            )
        self._in_flight.clear()
        self._queue.put_nowait(None)
        self._conn.close()
        self._exited.set()

    def _kill_and_close(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5)
        self._conn.close()
