"""The inside of an engine process (engine_process.EngineProcess starts it, "spawn": a fresh
interpreter, nothing inherited from the worker's event loop or threads): load the engine, report
Loaded or LoadFailed, then loop: take every pending command (waiting for one only when idle), step
the engine, send the step's outputs. A pipeline rank steps in lock-step with the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from fleet_runtime.logs import describe_error
from fleet_worker.engine_messages import (
    Cancel,
    Failed,
    Loaded,
    LoadFailed,
    LoadProgressed,
    Outputs,
    Shutdown,
    ToChild,
)
from fleet_worker.engines.base import Engine, EngineOutput, Lockstep, load_engine


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
    # Ctrl-C, or a SIGTERM sent to the whole group, reaches the child too: the parent decides (it
    # drains its requests first, then stops the engine)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
        conn.send_bytes(encoder.encode(LoadFailed(reason=describe_error(error))))
        return
    loaded = Loaded(load_time_s=time.perf_counter() - started, max_batch_size=engine.max_batch_size)
    conn.send_bytes(encoder.encode(loaded))
    lockstep = getattr(engine, "lockstep", None)
    try:
        if lockstep is None:
            _serve(conn, engine, encoder, OutputHold(stream_interval_s))
        else:
            _serve_lockstep(conn, engine, encoder, lockstep)
    except (EOFError, OSError):
        pass  # the parent closed its end or died: nobody is left to read outputs
    except Exception as error:
        conn.send_bytes(encoder.encode(Failed(reason=describe_error(error))))
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
            EngineOutput(
                request_id=command.request.request_id, finish_reason="error", error=describe_error(error)
            )
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
