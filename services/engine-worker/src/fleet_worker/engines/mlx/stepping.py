"""How an MLX engine keeps in step with other processes: `Alone`, or as one rank of a pipeline-parallel
model (pipeline.Pipeline), whose ranks run the same engine on the same requests in lock-step.

The engine asks its Stepping wherever a rank would otherwise decide by itself something every rank
must decide alike: what to load, which tokens to sample, whether a handoff or a cached prefix is
usable, whether a fault ends one request or the whole step. Alone, each answer is the plain one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx_lm
import msgspec

from fleet_proto import StructuredOutput
from fleet_store.handoff import AssembledKV, HandoffWriter, assemble, read_folder
from fleet_worker.engines.base import KVExport, KVImport, Lockstep
from fleet_worker.engines.grammar import Grammars
from fleet_worker.engines.mlx.handoff import RankWriter
from fleet_worker.engines.mlx.kv import MlxPrefixStore
from fleet_worker.engines.mlx.pipeline import Pipeline, PipelineSpec, connect_layers, join_ring, load_shard
from fleet_worker.engines.mlx.sampling import Sampler


class Stepping(Protocol):
    @property
    def lockstep(self) -> Lockstep | None:
        """What the engine process serves in lock-step (engine_child); None alone."""
        ...

    @property
    def reports_progress(self) -> bool:
        """Whether on_prefill_progress goes to this process's worker."""
        ...

    @property
    def suffix_handoff_problem(self) -> str:
        """Why a handoff that starts after token 0 is refused, or ""."""
        ...

    def kv_tier(self, fingerprint: str, kv_dir: str) -> tuple[str, str]:
        """The prefix store's fingerprint and KV folder ("" for none) for the engine's blocks."""
        ...

    def agree(self, ok: bool) -> bool:
        """Whether `ok` holds everywhere (every rank asks at the same point)."""
        ...

    def shared_sampler(self, sampler: Sampler) -> Sampler:
        """`sampler` as this process draws with it: every rank takes the same tokens."""
        ...

    def on_step_error(self, error: Exception) -> None:
        """A fault inside a step: returns when the engine may fail only the requests at fault."""
        ...

    def wait_for_grammar(self, grammars: Grammars, spec: StructuredOutput) -> None:
        """Called before a request's grammar is asked for, so all ranks admit it in the same step."""
        ...

    def handoff_writer(self, spec: KVExport) -> HandoffWriter | RankWriter:
        """Where a prefill-only request's chunks go."""
        ...

    def handoff_kv(self, spec: KVImport) -> AssembledKV:
        """A received handoff's KV for this process's layers (raises HandoffError)."""
        ...

    def reusable_limits(
        self, prompts: Sequence[Sequence[int]], store: MlxPrefixStore | None
    ) -> list[int | None]:
        """How much of each prompt's cached prefix to reuse (None: all the store holds)."""
        ...


class Alone:
    """One process runs the whole model: nothing to share."""

    lockstep: Lockstep | None = None
    reports_progress = True
    suffix_handoff_problem = ""

    def kv_tier(self, fingerprint: str, kv_dir: str) -> tuple[str, str]:
        return fingerprint, kv_dir

    def agree(self, ok: bool) -> bool:
        return ok

    def shared_sampler(self, sampler: Sampler) -> Sampler:
        return sampler

    def on_step_error(self, error: Exception) -> None:
        pass  # the engine fails the requests of the broken batch and goes on

    def wait_for_grammar(self, grammars: Grammars, spec: StructuredOutput) -> None:
        pass  # a request whose grammar compiles waits; the others go first

    def handoff_writer(self, spec: KVExport) -> HandoffWriter | RankWriter:
        return HandoffWriter(spec.folder, spec.handoff_id)

    def handoff_kv(self, spec: KVImport) -> AssembledKV:
        return assemble(read_folder(spec.folder), spec.handoff_id, spec.start_pos)

    def reusable_limits(
        self, prompts: Sequence[Sequence[int]], store: MlxPrefixStore | None
    ) -> list[int | None]:
        return [None] * len(prompts)


def load_stepping(
    model_dir: Path, pipeline: dict[str, Any] | None, stream: mx.Stream, ring_timeout_s: float
) -> tuple[Stepping, Any, Any, dict[str, Any]]:
    """The model, its tokenizer and config, and how the engine keeps in step: alone, or as the rank
    `pipeline` (a PipelineSpec's fields) names, with only its layers, once it has joined the other
    ranks' ring (within ring_timeout_s)."""
    if pipeline is None:
        model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True)
        return Alone(), model, tokenizer, config
    spec = msgspec.convert(pipeline, PipelineSpec)
    model, tokenizer, config = load_shard(model_dir, spec)
    ring = join_ring(spec, stream, ring_timeout_s)
    connect_layers(model, spec, ring)
    return Pipeline(ring, spec), model, tokenizer, config
