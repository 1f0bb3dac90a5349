"""MLX prompt caches <-> KV handoff chunks (fleet_store.handoff): the MLX edge of disaggregation.

Export: a prefill-only request runs the model over its prompt in chunks of `step_size` tokens on
its own single-sequence cache (one chunk per engine step, so running decodes keep going), and
after each chunk writes the new rows of every plain KVCache layer as one "kv" chunk: the transfer
of chunk i overlaps the compute of chunk i + 1. The logits are never evaluated (MLX is lazy: only
the cache is asked for), so the prefill costs the layers alone. Layers whose cache is not
position-addressed go last, as "state" chunks of their whole state: a sliding-window layer's ring
buffer (RotatingKVCache: keys, values, offset, keep, max_size, write index) and SSM / linear
attention layers' arrays (ArraysCache: conv and recurrent state).

Import: the rows are appended to the decoder's own cache (which already holds the first
start_pos tokens when it asked for a suffix only), the states are set as they came.

In a pipeline (pipeline.py) each rank computes only its layers' KV: an export's rows go through a
RankWriter, which gathers every rank's part to rank 0 to be written as one chunk, and an import is
shared by rank 0 with the others, each taking its layers' part (`layer_range`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from fleet_store.handoff import (
    AssembledKV,
    HandoffChunk,
    HandoffError,
    HandoffWriter,
    LayerState,
    decode_chunk,
)
from fleet_store.kv import KVBlobError, WireTensor
from fleet_worker.engines.mlx.kv import WIRE_TO_MLX, from_wire, to_wire

MOVABLE_STATES = (RotatingKVCache, ArraysCache)
# An mlx_lm cache layer (KVCache, RotatingKVCache, ArraysCache ...), used by its attributes: mypy does
# not read mlx_lm (pyproject's [tool.mypy]), so it cannot tell the kinds apart.
CacheLayer = Any


def movable_problem(cache: Sequence[object]) -> str:
    """Why this cache's state cannot be handed over, or "" when it can."""
    kinds = {type(layer).__name__ for layer in cache if type(layer) is not KVCache}
    unknown = sorted(k for k in kinds if k not in {c.__name__ for c in MOVABLE_STATES})
    return f"cache layers {unknown} cannot be handed over" if unknown else ""


def _wire(array: mx.array, wire_dtype: str) -> WireTensor:
    if wire_dtype:
        try:
            array = array.astype(WIRE_TO_MLX[wire_dtype])
        except KeyError:
            raise HandoffError(f"wire dtype {wire_dtype!r} is not one MLX can write") from None
    return to_wire(array)


def layer_rows(layer: KVCache, start: int, end: int, wire_dtype: str = "") -> tuple[WireTensor, WireTensor]:
    """Rows [start, end) of a plain layer, as [tokens, kv_heads, head_dim]."""
    keys = layer.keys[0, :, start:end].transpose(1, 0, 2)
    values = layer.values[0, :, start:end].transpose(1, 0, 2)
    return _wire(keys, wire_dtype), _wire(values, wire_dtype)


def layer_state(layer: object, wire_dtype: str = "") -> LayerState:
    if isinstance(layer, RotatingKVCache):
        # its public state: the ring buffer and where in it the window writes next
        keys, values, offset, keep, max_size, index = layer.state
        meta = tuple(str(v) for v in (offset, keep, max_size, index))
        return LayerState("RotatingKVCache", (_wire(keys, wire_dtype), _wire(values, wire_dtype)), meta)
    if isinstance(layer, ArraysCache):
        if layer.left_padding is not None or layer.lengths is not None:
            raise HandoffError("a batched ArraysCache cannot be handed over")
        return LayerState("ArraysCache", tuple(None if a is None else to_wire(a) for a in layer.cache))
    raise HandoffError(f"a {type(layer).__name__} layer has no movable state")


def _set_state(layer: CacheLayer, state: LayerState, dtype: mx.Dtype) -> None:
    if type(layer).__name__ != state.cache_class:
        raise HandoffError(f"a {state.cache_class} state cannot go into a {type(layer).__name__} layer")
    if isinstance(layer, RotatingKVCache):
        offset, keep, max_size, index = (int(v) for v in state.meta)
        if max_size != layer.max_size:
            raise HandoffError(f"sliding window of {max_size} tokens, this model's is {layer.max_size}")
        keys, values = (from_wire(a).astype(dtype) for a in state.arrays if a is not None)
        layer.state = (keys, values, offset, keep, max_size, index)
    else:
        arrays = [None if a is None else from_wire(a) for a in state.arrays]
        if len(arrays) != len(layer.cache):
            raise HandoffError(f"{len(arrays)} state arrays for a cache of {len(layer.cache)}")
        layer.state = (arrays, None, None)


def apply_handoff(cache: list[CacheLayer], kv: AssembledKV, dtype: mx.Dtype) -> list[CacheLayer]:
    """`cache` (holding tokens [0, kv.start_pos) of its plain layers) extended by the handoff."""
    expected_states = {i for i, layer in enumerate(cache) if type(layer) is not KVCache}
    if set(kv.states) != expected_states or any(i in kv.states for i in kv.rows):
        raise HandoffError(
            f"handoff has states for layers {sorted(kv.states)}, the model needs {sorted(expected_states)}"
        )
    try:
        for i, layer in enumerate(cache):
            if i in expected_states:
                _set_state(layer, kv.states[i], dtype)
                continue
            pairs = kv.rows.get(i, ())
            if kv.end > kv.start_pos and not pairs:
                raise HandoffError(f"no rows for layer {i}")
            if not pairs:
                continue
            keys = mx.concatenate([from_wire(k) for k, _ in pairs], axis=0).transpose(1, 0, 2)[None]
            values = mx.concatenate([from_wire(v) for _, v in pairs], axis=0).transpose(1, 0, 2)[None]
            keys, values = keys.astype(dtype), values.astype(dtype)
            assert isinstance(layer, KVCache)
            if kv.start_pos:
                if layer.offset < kv.start_pos:
                    raise HandoffError(
                        f"the decoder holds {layer.offset} tokens, the handoff starts at {kv.start_pos}"
                    )
                keys = mx.concatenate([layer.keys[..., : kv.start_pos, :], keys], axis=2)
                values = mx.concatenate([layer.values[..., : kv.start_pos, :], values], axis=2)
            layer.state = (keys, values, keys.shape[2])
    except KVBlobError as error:
        raise HandoffError(str(error)) from None
    mx.eval([layer.state for layer in cache])
    return cache


class Gathering(Protocol):
    def gather_bytes(self, payload: bytes) -> list[bytes]: ...


class RankWriter:
    """One pipeline rank's side of a handoff's chunks. A rank holds its own layers only: their rows
    are renumbered to the model's layer indices and gathered over the ring to rank 0, which writes
    every rank's part as one chunk (rank 0 is the pipeline's one handoff endpoint, so a decoder
    reads what one process would have written). Every rank calls kv and states at the same points,
    even with nothing of its own to add: the gathers are collective."""

    def __init__(
        self, ring: Gathering, handoff_id: str, first_layer: int, writer: HandoffWriter | None
    ) -> None:
        self.handoff_id = handoff_id
        self._ring = ring
        self._first_layer = first_layer
        self._writer = writer  # rank 0's; None on the others

    def _gathered(self, chunk: HandoffChunk) -> list[HandoffChunk]:
        parts = self._ring.gather_bytes(chunk.encode())
        return [decode_chunk(part, self.handoff_id) for part in parts] if self._writer else []

    def kv(
        self, token_start: int, token_end: int, layers: Mapping[int, tuple[WireTensor, WireTensor]]
    ) -> None:
        mine = {self._first_layer + i: pair for i, pair in layers.items()}
        parts = self._gathered(HandoffChunk(self.handoff_id, 0, "kv", token_start, token_end, kv=mine))
        if self._writer is not None:
            self._writer.kv(token_start, token_end, {i: p for part in parts for i, p in part.kv.items()})

    def states(self, token_end: int, states: Mapping[int, LayerState]) -> None:
        mine = {self._first_layer + i: state for i, state in states.items()}
        parts = self._gathered(HandoffChunk(self.handoff_id, 0, "state", token_end, token_end, states=mine))
        merged = {i: state for part in parts for i, state in part.states.items()}
        if self._writer is not None and merged:
            self._writer.states(token_end, merged)

    def done(self, token_start: int, token_end: int) -> None:
        if self._writer is not None:
            self._writer.done(token_start, token_end)

    def error(self, reason: str) -> None:
        if self._writer is not None:
            self._writer.error(reason)


@dataclass(eq=False)
class Export:
    """One prefill-only request: its cache, how far it has got, and where its chunks go."""

    request_id: str
    prompt: list[int]
    start_pos: int  # the first row to hand over
    end: int  # rows up to here (the prompt but its last token)
    writer: HandoffWriter | RankWriter
    wire_dtype: str
    cache: list[CacheLayer]
    position: int  # tokens already in the cache
    cached_tokens: int = 0
    started_at: float = 0.0
    sent_until: int = field(default=0)

    def __post_init__(self) -> None:
        self.sent_until = self.start_pos

    @property
    def done(self) -> bool:
        return self.position >= self.end

    def advance(self, model: Callable[..., object], step_size: int) -> None:
        """Compute the next chunk of the prompt and write the rows it made (and any older ones owed)."""
        if self.position < self.end:
            stop = min(self.position + step_size, self.end)
            model(mx.array(self.prompt[self.position : stop])[None], cache=self.cache)
            mx.eval([layer.state for layer in self.cache])
            self.position = stop
        plain = {i: layer for i, layer in enumerate(self.cache) if type(layer) is KVCache}
        collective = isinstance(self.writer, RankWriter)
        if self.position > self.sent_until and (plain or collective):
            rows = {
                i: layer_rows(layer, self.sent_until, self.position, self.wire_dtype)
                for i, layer in plain.items()
            }
            self.writer.kv(self.sent_until, self.position, rows)
        self.sent_until = max(self.sent_until, self.position)
        if self.done:
            states = {
                i: layer_state(layer, self.wire_dtype) for i, layer in enumerate(self.cache) if i not in plain
            }
            if states or collective:
                self.writer.states(self.end, states)
            self.writer.done(self.start_pos, self.end)
