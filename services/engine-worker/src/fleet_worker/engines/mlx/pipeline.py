"""One rank of a pipeline-parallel MLX model: layers [start, end) on this process, the other ranks
in other processes (other machines), joined by mx.distributed's ring backend over TCP.

Every rank runs the same MlxEngine on the same requests in the same order (lock-step): rank 0 takes
the worker's commands and shares them with the others before each step (`Ring.share_bytes`), so the
ranks' batches have the same rows and shapes and their collective operations pair up. The engine's
`Pipeline` stepping (stepping.py) makes every choice a rank would make alone a shared one. The forward
pass of a rank runs its layers only: the first of them receives the hidden state from the previous
rank, the last sends it on; the last rank's output is gathered to every rank, which applies the
final norm and head itself (as mlx-lm's own pipelined models do). Sampled tokens are rank 0's,
shared with the others, so ranks on unlike hardware (float rounding of the head) never diverge.

Unlike mlx-lm's PipelineMixin (rank 0 holds the last layers), rank 0 here holds the first layers:
Fleet's shards list ranks in layer order. Layers are wrapped, not re-implemented, so any model
whose forward is "embed, each layer, norm, head" works; those known to be are in SUPPORTED.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, load_tokenizer

from fleet_proto import StructuredOutput
from fleet_store.handoff import (
    AssembledKV,
    HandoffError,
    HandoffWriter,
    assemble,
    frame,
    layer_range,
    read_folder,
    split_frames,
)
from fleet_store.layers import read_safetensors_header, tensor_layer
from fleet_worker.engines.base import KVExport, KVImport
from fleet_worker.engines.grammar import Grammars
from fleet_worker.engines.mlx.handoff import RankWriter
from fleet_worker.engines.mlx.kv import MlxPrefixStore
from fleet_worker.engines.mlx.sampling import Sampler

# model_type -> how its inner model marks which cache a layer's attention mask comes from
SUPPORTED = frozenset({"llama", "qwen3"})
JOIN_RETRY_S = 1.0


class PipelineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """This process's place in the pipeline: its rank, every rank's ring address (host:port, rank
    order; each rank listens on its own), and its layers [start_layer, end_layer)."""

    rank: int
    addresses: tuple[str, ...]
    start_layer: int
    end_layer: int

    @property
    def size(self) -> int:
        return len(self.addresses)


class PipelineError(RuntimeError):
    pass


class Ring:
    """The ring group of one pipeline, with the two things ranks share besides activations."""

    def __init__(self, group: mx.distributed.Group, stream: mx.Stream) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.stream = stream

    def share_bytes(self, payload: bytes) -> bytes:
        """Rank 0's payload on every rank (the others pass b""): a length, then the bytes, summed
        with zeros from every other rank. Blocks until rank 0 calls it."""
        with mx.stream(self.stream):
            length = mx.array([len(payload) if self.rank == 0 else 0], dtype=mx.int32)
            n = int(mx.distributed.all_sum(length, group=self.group).item())
            if n == 0:
                return b""
            if self.rank == 0:
                data = mx.array(np.frombuffer(payload, dtype=np.uint8))
            else:
                data = mx.zeros((n,), dtype=mx.uint8)
            shared = mx.distributed.all_sum(data, group=self.group)
            mx.eval(shared)
            return bytes(np.array(shared, copy=False))

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's payload, in rank order, on every rank (lengths first, then the bytes padded
        to the longest: all_gather wants one shape)."""
        with mx.stream(self.stream):
            length = mx.array([len(payload)], dtype=mx.int32)
            lengths = mx.distributed.all_gather(length, group=self.group).tolist()
            longest = max(lengths)
            if longest == 0:
                return [b""] * self.size
            padded = np.zeros(longest, dtype=np.uint8)
            padded[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            every = mx.distributed.all_gather(mx.array(padded), group=self.group)
            mx.eval(every)
            flat = np.array(every, copy=False)
            return [bytes(flat[r * longest : r * longest + n]) for r, n in enumerate(lengths)]

    def fewest(self, counts: list[int]) -> list[int]:
        """Each position's smallest count over all ranks (every rank passes as many counts)."""
        if not counts:
            return []
        with mx.stream(self.stream):
            mine = mx.array(counts, dtype=mx.int32)
            every = mx.distributed.all_gather(mine, group=self.group).reshape(self.size, len(counts))
            return [int(n) for n in every.min(axis=0).tolist()]

    def share_tokens(self, tokens: mx.array) -> mx.array:
        """Rank 0's sampled tokens on every rank (lazy: part of the step's graph)."""
        mine = tokens.astype(mx.int32) if self.rank == 0 else mx.zeros(tokens.shape, dtype=mx.int32)
        return mx.distributed.all_sum(mine, group=self.group).astype(tokens.dtype)


def join_ring(spec: PipelineSpec, stream: mx.Stream, timeout_s: float) -> Ring:
    """Connect to the other ranks; they may start minutes apart (each fetches its own files), and
    MLX gives up connecting after about 30 s, so joining is retried until timeout_s."""
    if not 0 <= spec.rank < spec.size or spec.size < 2:
        raise PipelineError(f"rank {spec.rank} of {spec.size} is not a pipeline rank")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="fleet-ring-", delete=False) as file:
        json.dump([[address] for address in spec.addresses], file)
    os.environ["MLX_RANK"] = str(spec.rank)
    os.environ["MLX_HOSTFILE"] = file.name
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                group = mx.distributed.init(backend="ring", strict=True)
                break
            except RuntimeError as error:
                if time.monotonic() >= deadline:
                    where = ", ".join(spec.addresses)
                    raise PipelineError(f"could not join the pipeline ring {where}: {error}") from None
                time.sleep(JOIN_RETRY_S)
    finally:
        os.unlink(file.name)
    if group.size() != spec.size or group.rank() != spec.rank:
        raise PipelineError(f"joined as rank {group.rank()} of {group.size()}, expected {spec.rank}")
    return Ring(group, stream)


class _RingLayer(nn.Module):
    """A local layer at the edge of the rank: it exchanges activations with the next ranks."""

    def __init__(self, layer: nn.Module, ring: Ring) -> None:
        super().__init__()
        self.layer = layer
        self._ring = ring
        if hasattr(layer, "use_sliding"):  # llama's forward picks each layer's mask by it
            self.use_sliding = layer.use_sliding


class _ReceiveFirst(_RingLayer):
    """The first local layer: its input is the previous rank's output."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        x = mx.distributed.recv_like(x, self._ring.rank - 1, group=self._ring.group)
        return self.layer(x, mask, cache)


class _SendLast(_RingLayer):
    """The last local layer: sends its output on, then every rank gets the last rank's output.

    The result is tied into the layer's cache too: a prefill chunk evaluates only the caches, and
    the ranks' collectives must run all the same."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ring = self._ring
        x = self.layer(x, mask, cache)
        if ring.rank < ring.size - 1:
            x = mx.distributed.send(x, ring.rank + 1, group=ring.group)
        rows = x.shape[0]
        x = mx.distributed.all_gather(x, group=ring.group)[(ring.size - 1) * rows :]
        if cache is not None and getattr(cache, "keys", None) is not None:
            cache.keys = mx.depends(cache.keys, x)
        return x


def keep_layers(model: nn.Module, spec: PipelineSpec) -> None:
    """Drop every layer outside [start, end) from the model."""
    inner = model.model
    layers = list(inner.layers)
    if not 0 <= spec.start_layer < spec.end_layer <= len(layers):
        raise PipelineError(f"layers [{spec.start_layer}, {spec.end_layer}) of a {len(layers)}-layer model")
    inner.layers = layers[spec.start_layer : spec.end_layer]
    if hasattr(inner, "fa_idx"):  # llama: the masks come from the first full / sliding layer's cache
        sliding = [getattr(layer, "use_sliding", False) for layer in inner.layers]
        inner.fa_idx = sliding.index(False) if False in sliding else 0
        inner.swa_idx = sliding.index(True) if True in sliding else None


def connect_layers(model: nn.Module, spec: PipelineSpec, ring: Ring) -> None:
    """Wrap the first and last local layer so activations flow from rank to rank."""
    local = list(model.model.layers)
    if spec.rank > 0:
        local[0] = _ReceiveFirst(local[0], ring)
    local[-1] = _SendLast(local[-1], ring)
    model.model.layers = local


def missing_weights(model: nn.Module, model_dir: Path, spec: PipelineSpec) -> list[str]:
    """Parameters of this rank (its layers' and the non-layer ones) that no weight file names: a
    load without strict checks (the other ranks' layers are absent on purpose) must not leave any
    of ours at random values. Names come from the safetensors headers (llama and qwen3 files use
    the model's own names)."""
    present: set[str] = set()
    for path in sorted(Path(model_dir).glob("model*.safetensors")):
        present.update(k for k in read_safetensors_header(path) if k != "__metadata__")
    names = [name for name, _ in tree_flatten(model.parameters())]
    names = [
        n for n in names if (layer := tensor_layer(n)) is None or spec.start_layer <= layer < spec.end_layer
    ]
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    return [n for n in names if n not in present and not (tied and n.startswith("lm_head."))]


def load_shard(model_dir: Path, spec: PipelineSpec) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The model with only this rank's layers loaded (the folder may hold only their weight files,
    plus embeddings and head), its tokenizer and config; `connect_layers` joins it to the ring."""
    model, config = load_model(model_dir, lazy=True, strict=False)
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED:
        raise PipelineError(
            f"pipeline parallel is not supported for model_type {model_type!r} "
            f"(supported: {', '.join(sorted(SUPPORTED))})"
        )
    if missing := missing_weights(model, model_dir, spec):
        raise PipelineError(f"the shard's files lack {len(missing)} weights of its layers, e.g. {missing[0]}")
    keep_layers(model, spec)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config


class Pipeline:
    """The engine's stepping (stepping.py) as one rank of the ring: what a rank would decide by itself
    is decided alike on every rank (rank 0's choice, or the choice every rank can follow)."""

    # the ranks' prefixes are in no index a decoder could ask
    suffix_handoff_problem = "a pipeline takes whole-prompt handoffs only"

    def __init__(self, ring: Ring, spec: PipelineSpec) -> None:
        self.lockstep = ring
        self.spec = spec

    @property
    def reports_progress(self) -> bool:
        return self.lockstep.rank == 0  # rank 0 reports for the whole pipeline

    def kv_tier(self, fingerprint: str, kv_dir: str) -> tuple[str, str]:
        """A rank's blocks hold only its layers: they stay in its memory, named apart from the whole
        model's, and never go to a KV folder (the shared tier)."""
        return fingerprint and f"{fingerprint}/layers-{self.spec.start_layer}-{self.spec.end_layer}", ""

    def agree(self, ok: bool) -> bool:
        return self.lockstep.fewest([int(ok)]) == [1]

    def shared_sampler(self, sampler: Sampler) -> Sampler:
        """Every rank samples, and all take rank 0's tokens."""
        ring = self.lockstep
        return lambda logprobs: ring.share_tokens(sampler(logprobs))

    def on_step_error(self, error: Exception) -> None:
        raise error  # the other ranks are inside the same step: all must stop

    def wait_for_grammar(self, grammars: Grammars, spec: StructuredOutput) -> None:
        grammars.wait(spec, timeout_s=None)

    def handoff_writer(self, spec: KVExport) -> HandoffWriter | RankWriter:
        """Rank 0's writer of the folder gathers every rank's rows (rank 0's worker asked for the
        handoff; the folder is on rank 0's machine)."""
        ring = self.lockstep
        writer = HandoffWriter(spec.folder, spec.handoff_id) if ring.rank == 0 else None
        return RankWriter(ring, spec.handoff_id, self.spec.start_layer, writer)

    def handoff_kv(self, spec: KVImport) -> AssembledKV:
        """The handoff arrived at rank 0's worker: rank 0 shares its chunks over the ring and every
        rank takes its own layers' part."""
        ring = self.lockstep
        frames, problem = b"", "rank 0 could not read the handoff"
        if ring.rank == 0:
            try:
                frames = b"".join(frame(blob) for blob in read_folder(spec.folder))
            except (OSError, HandoffError) as error:
                problem = f"{problem}: {error}"
        shared = ring.share_bytes(frames)
        if not shared:
            raise HandoffError(problem)
        kv = assemble(split_frames(shared), spec.handoff_id, spec.start_pos)
        return layer_range(kv, self.spec.start_layer, self.spec.end_layer)

    def reusable_limits(
        self, prompts: Sequence[Sequence[int]], store: MlxPrefixStore | None
    ) -> list[int | None]:
        """What every rank holds (each rank's memory evicts by its own blocks' sizes), so all
        prefill alike."""
        held = [store.reusable_tokens(prompt) if store else 0 for prompt in prompts]
        return list(self.lockstep.fewest(held))
