"""MLX prompt caches <-> Fleet KV blocks (fleet_store.kv): the MLX edge of the wire format.

mlx-lm's KVCache holds keys (after RoPE) and values as [1, kv_heads, tokens, head_dim], allocated
in steps of 256 rows (its `state` is (keys, values, offset): rows past the offset are unused); the
wire layout is [tokens, kv_heads, head_dim] per layer. Only plain KVCache layers convert: a rotating
(sliding-window) or SSM cache cannot be cut into position-addressed blocks, so such a model refuses
rather than risk wrong output.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from fleet_store.kv import KVBlobError, KVBlock, KVFolder, WireTensor, decode_block, prompt_blocks
from fleet_worker.engines.base import KVChanges
from fleet_worker.engines.kv_memory import BlockMemory

MLX_TO_WIRE = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}
WIRE_TO_MLX = {name: dtype for dtype, name in MLX_TO_WIRE.items()}
# numpy has no bfloat16: its bytes travel as uint16 and are reinterpreted on the MLX side.
WIRE_TO_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def to_wire(array: mx.array) -> WireTensor:
    name = MLX_TO_WIRE[array.dtype]
    host = np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    return WireTensor(name, tuple(array.shape), host.tobytes())


def from_wire(tensor: WireTensor) -> mx.array:
    try:
        host = np.frombuffer(tensor.data, dtype=WIRE_TO_NUMPY[tensor.dtype]).reshape(tensor.shape)
    except KeyError:
        raise KVBlobError(f"dtype {tensor.dtype} cannot go into an MLX cache") from None
    array = mx.array(host)
    return array.view(mx.bfloat16) if tensor.dtype == "BF16" else array


def _plain_layers(cache: Sequence[object]) -> list[KVCache]:
    if not all(type(layer) is KVCache for layer in cache):
        kinds = sorted({type(layer).__name__ for layer in cache})
        raise ValueError(f"only plain KVCache layers convert to Fleet KV blocks, this cache has {kinds}")
    return list(cache)


def cache_to_blocks(
    cache: Sequence[object], token_ids: Sequence[int], fingerprint: str, block_size: int
) -> list[KVBlock]:
    """The full blocks of a prompt whose KV fills `cache` (positions 0 .. len(token_ids))."""
    layers = _plain_layers(cache)
    if any(layer.offset < len(token_ids) for layer in layers):
        raise ValueError(
            f"the cache holds {layers[0].offset} tokens, fewer than the prompt's {len(token_ids)}"
        )
    states = [(layer.keys, layer.values) for layer in layers]
    blocks = []
    for block_hash, parent, start, tokens in prompt_blocks(fingerprint, token_ids, block_size):
        end = start + len(tokens)
        pairs = tuple(
            (
                to_wire(keys[0, :, start:end].transpose(1, 0, 2)),
                to_wire(values[0, :, start:end].transpose(1, 0, 2)),
            )
            for keys, values in states
        )
        blocks.append(KVBlock(fingerprint, block_hash, parent, start, tuple(tokens), pairs))
    return blocks


def blocks_to_cache(model: object, blocks: Sequence[KVBlock], dtype: mx.Dtype | None = None) -> list[KVCache]:
    """A fresh prompt cache for `model` holding the consecutive `blocks` (from token 0)."""
    cache = _plain_layers(make_prompt_cache(model))
    expected = 0
    for block in blocks:
        if block.token_start != expected or len(block.layers) != len(cache):
            raise KVBlobError(f"block {block.block_hash} does not continue the prefix at token {expected}")
        expected += len(block.token_ids)
    if not blocks:
        return cache
    for i, layer in enumerate(cache):
        keys = mx.concatenate([from_wire(block.layers[i][0]) for block in blocks], axis=0)
        values = mx.concatenate([from_wire(block.layers[i][1]) for block in blocks], axis=0)
        keys, values = keys.transpose(1, 0, 2)[None], values.transpose(1, 0, 2)[None]
        if dtype is not None:
            keys, values = keys.astype(dtype), values.astype(dtype)
        layer.state = (keys, values, keys.shape[2])
    mx.eval([(layer.keys, layer.values) for layer in cache])
    return cache


class MlxPrefixStore:
    """An MLX engine's KV tiers: finished prompt blocks in memory (tier 1, LRU under a byte budget),
    and a local KV folder that blocks fetched from object storage arrive in and new blocks leave by.

    A prompt reuses its longest run of leading blocks (never its last token: the engine samples
    from it); the rest is prefilled. Models whose cache is not plain KVCache layers get no reuse.
    """

    def __init__(
        self, model: object, fingerprint: str, block_size: int, memory_bytes: int, folder: KVFolder | None
    ) -> None:
        self.model = model
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.folder = folder
        self.memory: BlockMemory[list[tuple[mx.array, mx.array]]] = BlockMemory(memory_bytes)
        self._written: list[str] = []
        self.supported = all(type(layer) is KVCache for layer in make_prompt_cache(model))

    def _usable(self, prompt: Sequence[int]) -> list[tuple[str, str, int, tuple[int, ...]]]:
        return prompt_blocks(self.fingerprint, prompt, self.block_size)[
            : (len(prompt) - 1) // self.block_size
        ]

    def _from_folder(
        self, block_hash: str, tokens: tuple[int, ...]
    ) -> list[tuple[mx.array, mx.array]] | None:
        data = self.folder.read(self.fingerprint, block_hash) if self.folder is not None else None
        if data is None:
            return None
        try:
            block = decode_block(data, block_hash, tokens)
        except KVBlobError:
            return None  # corrupt or foreign: recompute from here
        layers = [
            (from_wire(k).transpose(1, 0, 2)[None], from_wire(v).transpose(1, 0, 2)[None])
            for k, v in block.layers
        ]
        if len(layers) != len(make_prompt_cache(self.model)):
            return None
        self.memory.put(block_hash, layers, len(data))
        return layers

    def reusable_tokens(self, prompt: Sequence[int]) -> int:
        """How many leading prompt tokens cache_for would reuse now."""
        if not self.supported:
            return 0
        held = 0
        for block_hash, *_ in self._usable(prompt):
            in_folder = self.folder is not None and self.folder.contains(self.fingerprint, block_hash)
            if block_hash not in self.memory and not in_folder:
                break
            held += 1
        return held * self.block_size

    def cache_for(
        self, prompt: Sequence[int], dtype: mx.Dtype, limit: int | None = None
    ) -> tuple[list[KVCache], int]:
        """A prompt cache holding the prompt's longest reusable prefix (at most `limit` tokens), and
        that prefix's length."""
        cache = make_prompt_cache(self.model)
        if not self.supported:
            return cache, 0
        usable = self._usable(prompt)
        if limit is not None:
            usable = usable[: limit // self.block_size]
        found: list[list[tuple[mx.array, mx.array]]] = []
        for block_hash, _, _, tokens in usable:
            layers = self.memory.get(block_hash) or self._from_folder(block_hash, tokens)
            if layers is None:
                break
            found.append(layers)
        if not found:
            return cache, 0
        for i, layer in enumerate(cache):
            keys = mx.concatenate([block[i][0] for block in found], axis=2).astype(dtype)
            values = mx.concatenate([block[i][1] for block in found], axis=2).astype(dtype)
            layer.state = (keys, values, keys.shape[2])
        return cache, len(found) * self.block_size

    def has_new_blocks(self, prompt: Sequence[int]) -> bool:
        """Whether the prompt has full blocks this store does not hold yet."""
        return self.supported and any(h not in self.memory for h, *_ in self._usable(prompt))

    def store(self, cache: Sequence[KVCache], prompt: Sequence[int]) -> None:
        """Keep the prompt's full blocks that `cache` (holding all but the last token) computed."""
        if not self.supported:
            return
        for block_hash, parent, start, tokens in self._usable(prompt):
            if block_hash in self.memory:
                continue
            end = start + len(tokens)
            layers = [
                (mx.contiguous(layer.keys[..., start:end, :]), mx.contiguous(layer.values[..., start:end, :]))
                for layer in cache
            ]
            mx.eval(layers)
            size = sum(k.nbytes + v.nbytes for k, v in layers)
            self.memory.put(block_hash, layers, size)
            if self.folder is not None and not self.folder.contains(self.fingerprint, block_hash):
                wire = tuple(
                    (to_wire(k[0].transpose(1, 0, 2)), to_wire(v[0].transpose(1, 0, 2))) for k, v in layers
                )
                self.folder.write(KVBlock(self.fingerprint, block_hash, parent, start, tokens, wire))
                self._written.append(block_hash)

    def take_changes(self) -> KVChanges:
        in_memory, evicted = self.memory.take_changes()
        written, self._written = self._written, []
        return KVChanges(in_memory=tuple(in_memory), evicted=tuple(evicted), written=tuple(written))
