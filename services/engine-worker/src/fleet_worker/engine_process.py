"""An engine in a child process, so that its crash or out-of-memory kill never takes the worker down.

Parent and child exchange msgspec structs, msgpack-encoded, over a multiprocessing Pipe. The child
(a "spawn" process: a fresh interpreter, nothing inherited from the worker's event loop or threads)
loads the engine, reports Loaded or LoadFailed, then loops: take every pending command (waiting for
one only when idle), step the engine, send the step's outputs. The parent side lives on the asyncio
loop: it reads with loop.add_reader on the pipe and watches the process sentinel, so a dead child is
noticed at once and every request still in flight gets a final "error" output.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec

from fleet_worker.engines.base import Engine, EngineOutput, EngineRequest, KVChanges, Lockstep, load_engine


class Submit(msgspec.Struct, frozen=True, tag=True):
    request: EngineRequest


class Cancel(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class LoadProgressed(msgspec.Struct, frozen=True, tag=True):
    layers_loaded: int
    layers_total: int


class Loaded(msgspec.Struct, frozen=True, tag=True):
    load_time_s: float


class LoadFailed(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Outputs(msgspec.Struct, frozen=True, tag=True):
    outputs: list[EngineOutput]
    kv: KVChanges = KVChanges()


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The engine raised out of a step (e.g. a pipeline rank lost its ring): the child exits."""

    reason: str


ToChild = Submit | Cancel | Shutdown
FromChild = LoadProgressed | Loaded | LoadFailed | Outputs | Failed


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


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@dataclass
class OutputHold:
    """A step's outputs held up to `interval_s`, so the worker, NATS and the gateway wake once per burst
    of tokens rather than per token (vLLM's stream interval). On a CPU those wake-ups preempt the
    engine's compute threads mid-step: measured 1.5 ms of their CPU per token while one stream
    decoded at ~65 tokens/s. A request's first tokens and its last output, and everything when the
    engine goes idle, leave at once: time to first token and the end of a stream are not delayed."""

    interval_s: float
    held: list[EngineOutput] = field(default_factory=list)
    streaming: set[str] = field(default_factory=set)  # requests whose first tokens have gone out
    oldest_at: float = 0.0
    urgent: bool = False

    def add(self, outputs: list[EngineOutput], now: float) -> None:
        for output in outputs:
            if output.finish_reason or (output.token_ids and output.request_id not in self.streaming):
                self.urgent = True
        if outputs and not self.held:
            self.oldest_at = now
        self.held += outputs

    def due(self, now: float, idle: bool) -> bool:
        return bool(self.held) and (self.urgent or idle or now - self.oldest_at >= self.interval_s)

    def take(self) -> list[EngineOutput]:
        outputs, self.held, self.urgent = self.held, [], False
        for output in outputs:
            if output.finish_reason:
                self.streaming.discard(output.request_id)
            elif output.token_ids:
                self.streaming.add(output.request_id)
        return outputs


def run_child(
    conn: Connection,
    engine_name: str,
    model_dir: str,
    options: dict[str, Any],
    stream_interval_s: float = 0.0,
) -> None:
    """The child's main: load, then serve commands until Shutdown or until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    encoder = msgspec.msgpack.Encoder()
    started = time.perf_counter()

    def report(done: int, total: int) -> None:
        conn.send_bytes(encoder.encode(LoadProgressed(layers_loaded=done, layers_total=total)))

    def progress(output: EngineOutput) -> None:  # from inside a step: sent at once, not with its outputs
        conn.send_bytes(encoder.encode(Outputs(outputs=[output])))

    try:
        engine = load_engine(
            engine_name, Path(model_dir), on_load_progress=report, on_prefill_progress=progress, **options
        )
    except Exception as error:
        conn.send_bytes(encoder.encode(LoadFailed(reason=_describe(error))))
        return
    conn.send_bytes(encoder.encode(Loaded(load_time_s=time.perf_counter() - started)))
    lockstep = getattr(engine, "lockstep", None)
    try:
        if lockstep is None:
            _serve(conn, engine, encoder, OutputHold(stream_interval_s))
        else:
            _serve_lockstep(conn, engine, encoder, lockstep)
    except (EOFError, OSError):
        pass  # the parent closed its end or died: nobody is left to read outputs
    except Exception as error:
        conn.send_bytes(encoder.encode(Failed(reason=_describe(error))))
        raise
    finally:
        engine.close()


def _apply(engine: Engine, command: ToChild, outputs: list[EngineOutput]) -> bool:
    """Hand one command to the engine; False on Shutdown."""
    if isinstance(command, Shutdown):
        return False
    if isinstance(command, Cancel):
        engine.cancel(command.request_id)
        return True
    try:
        engine.add(command.request)
    except Exception as error:
        outputs.append(
            EngineOutput(request_id=command.request.request_id, finish_reason="error", error=_describe(error))
        )
    return True


def _pending_commands(conn: Connection, engine: Engine, decoder: msgspec.msgpack.Decoder) -> list[ToChild]:
    """Block only when idle; with work in hand take just what has already arrived."""
    commands: list[ToChild] = []
    while conn.poll(0 if commands or engine.has_work() else None):
        commands.append(decoder.decode(conn.recv_bytes()))
    return commands


def _serve(conn: Connection, engine: Engine, encoder: msgspec.msgpack.Encoder, hold: OutputHold) -> None:
    decoder = msgspec.msgpack.Decoder(ToChild)
    while True:
        outputs: list[EngineOutput] = []
        if not all(_apply(engine, c, outputs) for c in _pending_commands(conn, engine, decoder)):
            return
        outputs += engine.step()
        now = time.monotonic()
        hold.add(outputs, now)
        if hold.due(now, idle=not engine.has_work()):
            conn.send_bytes(encoder.encode(Outputs(outputs=hold.take())))
        # after the tokens: an engine may write the step's KV blocks only now (vLLM's connector)
        if kv := engine.take_kv_changes():
            conn.send_bytes(encoder.encode(Outputs(outputs=hold.take(), kv=kv)))


def _serve_lockstep(
    conn: Connection, engine: Engine, encoder: msgspec.msgpack.Encoder, lockstep: Lockstep
) -> None:
    """One rank of a pipeline: rank 0 takes the worker's commands and shares them before each step,
    so every rank adds, cancels and steps alike; only rank 0's outputs go to its worker. Another
    rank waits in the ring, so its worker's Shutdown (or death) is watched on a thread."""
    decoder = msgspec.msgpack.Decoder(ToChild)
    batch_decoder = msgspec.msgpack.Decoder(list[ToChild])
    if lockstep.rank > 0:
        threading.Thread(target=_exit_on_shutdown, args=(conn, decoder), daemon=True).start()
    while True:
        payload = b""
        if lockstep.rank == 0:
            commands = _pending_commands(conn, engine, decoder)
            payload = encoder.encode(commands) if commands else b""
        shared = lockstep.share_bytes(payload)
        outputs: list[EngineOutput] = []
        if shared and not all(_apply(engine, c, outputs) for c in batch_decoder.decode(shared)):
            return
        outputs += engine.step()
        engine.take_kv_changes()  # a rank's blocks are its own, never indexed: only drained
        if lockstep.rank == 0 and outputs:
            conn.send_bytes(encoder.encode(Outputs(outputs=outputs)))


def _exit_on_shutdown(conn: Connection, decoder: msgspec.msgpack.Decoder) -> None:
    with contextlib.suppress(EOFError, OSError):
        while not isinstance(decoder.decode(conn.recv_bytes()), Shutdown):
            pass
    os._exit(0)  # the main thread may be blocked in the ring: nothing else would end it


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
            self._queue.put_nowait(EngineOutput(request_id=request_id, finish_reason="error", error=reason))
        self._in_flight.clear()
        self._queue.put_nowait(None)
        self._conn.close()
        self._exited.set()

    def _kill_and_close(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5)
        self._conn.close()
