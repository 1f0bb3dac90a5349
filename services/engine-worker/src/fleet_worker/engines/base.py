"""The engine interface: token-in, token-out, one schedule -> execute -> update step at a time.

An engine is driven by exactly one thread (MLX streams are per thread): add() and cancel() queue
work, step() advances every running request by one token (a newly admitted request is prefilled and
gets its first token in the step that admits it) and returns what changed.

Contract: add() never raises for a bad request (empty prompt, token id out of range...): the request
ends with an "error" output at the next step(). Every added request gets exactly one final output
(finish_reason set). SamplingParams.logprobs is not produced yet (the gateway refuses it).
Engines are named in a lazy registry so the worker never imports an engine it does not run.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

import msgspec

from fleet_proto import SamplingParams
from fleet_proto.messages import GenerationOutput


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()


# What step() returns per request: the wire TokenChunk without its sequence number.
EngineOutput = GenerationOutput


class Engine(Protocol):
    def add(self, request: EngineRequest) -> None: ...

    def cancel(self, request_id: str) -> None:
        """Stop a request; its next step() output has finish_reason "cancelled"."""
        ...

    def step(self) -> list[EngineOutput]: ...

    def has_work(self) -> bool: ...

    def close(self) -> None: ...


# name -> "module:Class"; the class is constructed as Class(model_dir, **options).
ENGINES: dict[str, str] = {"mlx": "fleet_worker.engines.mlx_engine:MlxEngine"}


class UnknownEngineError(ValueError):
    pass


def load_engine(name: str, model_dir: Path, **options: object) -> Engine:
    try:
        target = ENGINES[name]
    except KeyError:
        raise UnknownEngineError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    module_name, class_name = target.split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(model_dir, **options)
