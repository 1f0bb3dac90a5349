"""The engine interface: token-in, token-out, one schedule -> execute -> update step at a time.

An engine is driven by exactly one thread (MLX streams are per thread): add() and cancel() queue
work, step() advances every running request by at most one token (or one prefill chunk) and returns
what changed. Engines are named in a lazy registry so the worker never imports an engine it does
not run.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

import msgspec

from fleet_proto import SamplingParams


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()


class EngineOutput(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request after a step; finish_reason set on its last output."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ""  # "", "stop", "length", "cancelled", "error"
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_time_s: float = 0.0
    decode_time_s: float = 0.0


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
