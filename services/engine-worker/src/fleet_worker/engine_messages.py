"""What an engine process and its parent say over their pipe (msgspec structs, msgpack-encoded):
the commands the child takes (ToChild) and what it reports (FromChild)."""

from __future__ import annotations

import msgspec

from fleet_worker.engines.base import EngineOutput, EngineRequest, KVChanges


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
    max_batch_size: int = 0  # the engine's (Engine.max_batch_size)


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
