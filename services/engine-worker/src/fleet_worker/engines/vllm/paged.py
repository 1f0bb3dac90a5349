"""Rows in and out of vLLM's paged KV cache, for each attention backend's block interior.

Every backend's per-layer cache is vLLM's standardized view [blocks, kv_heads, block_size, C]; what
lies inside a (block, head) differs:

- CUDA backends (FLASH_ATTN, TRITON_ATTN): C = 2 * head_dim, each token's key then its value
  (`SplitLastDim`; NHD or HND strides are hidden by the logical view).
- CPU_ATTN: the (block, head) region holds the keys in an ISA-specific order (transposed to
  [head_dim, block_size] for the AVX2 "vec" kernel) and then the values; AMX and NEON pack
  differently. Rather than hard-code each, `ProbedPositions` writes marked rows through the backend's
  own cache-write op into a scratch block once and reads back where each (token, dim) landed.

Both give [tokens, kv_heads, head_dim] rows, the wire layout (fleet_store.kv).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

# key, value [tokens, heads, dim]; key_cache, value_cache [blocks, heads, block_size, dim] views; slots
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_CODE = 251  # codes below 256 are exact in bf16 and fp16, so a probe survives any cache dtype


class PagedLayout(Protocol):
    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def scatter(
        self, kv_layer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None: ...


class SplitLastDim:
    def _views(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = kv_layer.shape[-1] // 2
        return kv_layer[..., :half], kv_layer[..., half:]

    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block_size = kv_layer.shape[2]
        keys, values = self._views(kv_layer)
        index = (slots // block_size, slice(None), slots % block_size)
        return keys[index], values[index]

    def scatter(
        self, kv_layer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        block_size = kv_layer.shape[2]
        key_view, value_view = self._views(kv_layer)
        index = (slots // block_size, slice(None), slots % block_size)
        key_view[index] = keys.to(kv_layer.device, kv_layer.dtype)
        value_view[index] = values.to(kv_layer.device, kv_layer.dtype)


@dataclass(frozen=True)
class ProbedPositions:
    """Where row t, dim d of a (block, head) lands in that region's flat memory, for keys and values."""

    key_positions: torch.Tensor  # [block_size, head_dim] of offsets into the region
    value_positions: torch.Tensor

    @classmethod
    def probe(
        cls, write: CacheWrite, heads: int, block_size: int, head_dim: int, dtype: torch.dtype
    ) -> ProbedPositions:
        index = (
            torch.arange(block_size * head_dim)
            .view(block_size, 1, head_dim)
            .expand(block_size, heads, head_dim)
        )
        slots = torch.arange(block_size, dtype=torch.long)

        def landed(codes: torch.Tensor, as_key: bool) -> torch.Tensor:
            cache = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
            key_cache, value_cache = cache.view(1, heads, 2 * block_size, head_dim).chunk(2, dim=2)
            marked, blank = (codes + 1).to(dtype), torch.zeros(block_size, heads, head_dim, dtype=dtype)
            write(*((marked, blank) if as_key else (blank, marked)), key_cache, value_cache, slots)
            return cache.view(heads, -1).to(torch.long)  # per head: each position's code + 1, 0 unwritten

        def positions(as_key: bool) -> torch.Tensor:
            low, high = landed(index % _CODE, as_key), landed(index // _CODE, as_key)
            written = low > 0
            if not torch.equal(written, written[:1].expand_as(written)):
                raise RuntimeError("KV cache probe: heads are laid out differently")
            where = written[0].nonzero().flatten()
            codes = (high[0, where] - 1) * _CODE + (low[0, where] - 1)
            found = torch.full((block_size * head_dim,), -1, dtype=torch.long)
            found[codes] = where
            if where.numel() != block_size * head_dim or bool((found < 0).any()):
                raise RuntimeError("KV cache probe: not every (token, dim) landed exactly once")
            return found.view(block_size, head_dim)

        return cls(positions(as_key=True), positions(as_key=False))

    def _index(self, kv_layer: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor):
        blocks, heads, block_size, _ = kv_layer.shape
        region = kv_layer.view(blocks, heads, -1)
        offsets = positions.to(kv_layer.device)[slots % block_size]  # [tokens, dim]
        head = torch.arange(heads, device=kv_layer.device)
        return region, ((slots // block_size)[:, None, None], head[None, :, None], offsets[:, None, :])

    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        region, keys_at = self._index(kv_layer, slots, self.key_positions)
        _, values_at = self._index(kv_layer, slots, self.value_positions)
        return region[keys_at], region[values_at]

    def scatter(
        self, kv_layer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        region, keys_at = self._index(kv_layer, slots, self.key_positions)
        _, values_at = self._index(kv_layer, slots, self.value_positions)
        region[keys_at] = keys.to(kv_layer.device, kv_layer.dtype)
        region[values_at] = values.to(kv_layer.device, kv_layer.dtype)
