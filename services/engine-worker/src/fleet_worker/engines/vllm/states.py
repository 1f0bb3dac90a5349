"""vLLM tensors in Fleet's wire format, and the non-positional layer states of a handoff.

A handoff (fleet_store.handoff) carries a sliding-window layer not as rows but as its decoder's
whole cache state, in the form MLX reads back (mlx handoff.py `_set_state`): mlx-lm's
RotatingKVCache state is (keys, values, offset, keep, max_size, write index), keys and values
[1, kv_heads, slots, head_dim]. vLLM keeps every row of such a layer in its pages (Fleet's
connector turns vLLM's hybrid allocator off, so sliding specs are promoted to full ones); the
state is built from the window's last rows in temporal order, which is the ring buffer mlx-lm
itself holds after a prefill, trimmed to the window: its next token overwrites the oldest row
(write index = max_size wraps to keep = 0), as it would have.

A gated-delta-net layer (Qwen3-Next) goes as mlx-lm's ArraysCache: [conv state, recurrent state],
conv [1, kernel - 1, conv_dim] (channels last) and recurrent [1, v_heads, v_dim, k_dim]; vLLM keeps
one slot of each per request (conv as [conv_dim, kernel - 1] or its transpose).
"""

from __future__ import annotations

import torch

from fleet_store.handoff import LayerState
from fleet_store.kv import KVBlobError, WireTensor

TORCH_TO_WIRE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
WIRE_TO_TORCH = {name: dtype for dtype, name in TORCH_TO_WIRE.items()}


def to_wire(tensor: torch.Tensor) -> WireTensor:
    tensor = tensor.detach().contiguous().cpu()
    data = tensor.view(torch.uint8).numpy().tobytes()
    return WireTensor(TORCH_TO_WIRE[tensor.dtype], tuple(tensor.shape), data)


def from_wire(tensor: WireTensor) -> torch.Tensor:
    try:
        dtype = WIRE_TO_TORCH[tensor.dtype]
    except KeyError:
        raise KVBlobError(f"dtype {tensor.dtype} cannot go into a vLLM cache") from None
    return torch.frombuffer(bytearray(tensor.data), dtype=dtype).view(tensor.shape)


def narrowed(tensor: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """`tensor` in the dtype the decoder asked for ("" keeps the cache's)."""
    return tensor.to(WIRE_TO_TORCH[wire_dtype]) if wire_dtype else tensor


def window_span(end: int, window: int) -> tuple[int, int]:
    """The prompt rows a sliding window of `window` tokens still sees once `end` tokens are in."""
    return max(0, end - window), end


def window_state(
    keys: torch.Tensor, values: torch.Tensor, end: int, window: int, wire_dtype: str = ""
) -> LayerState:
    """A sliding layer's RotatingKVCache state as of `end`, from its rows `window_span(end, window)`
    ([tokens, kv_heads, head_dim], oldest first)."""
    start, _ = window_span(end, window)
    if keys.shape[0] != end - start or values.shape[0] != end - start:
        raise ValueError(f"a window of {window} at {end} holds {end - start} rows, not {keys.shape[0]}")

    def ring(rows: torch.Tensor) -> WireTensor:
        return to_wire(narrowed(rows, wire_dtype).permute(1, 0, 2).unsqueeze(0))

    # offset, keep (mlx-lm's sliding layers keep no sink tokens), max_size, write index
    meta = tuple(str(v) for v in (end, 0, window, end - start))
    return LayerState("RotatingKVCache", (ring(keys), ring(values)), meta)


def gdn_state(conv: torch.Tensor, recurrent: torch.Tensor, conv_dim_first: bool) -> LayerState:
    """A gated-delta-net layer's ArraysCache state from vLLM's slot of it: conv [conv_dim,
    kernel - 1] (or [kernel - 1, conv_dim] when not `conv_dim_first`), recurrent [v_heads, v_dim,
    k_dim]. Kept in the cache's dtype: mlx-lm sets these arrays as they come."""
    if conv.ndim != 2 or recurrent.ndim != 3:
        raise ValueError(f"conv {tuple(conv.shape)} / recurrent {tuple(recurrent.shape)} is no GDN state")
    channels_last = conv.transpose(0, 1) if conv_dim_first else conv
    return LayerState("ArraysCache", (to_wire(channels_last.unsqueeze(0)), to_wire(recurrent.unsqueeze(0))))


def state_slot(block_ids: list[int], computed: int, block_size: int, aligned: bool) -> int:
    """Which of a request's Mamba-group blocks holds its state after `computed` tokens: the one
    block without vLLM's Mamba prefix caching, else the block of the last computed token
    (mamba_cache_mode "align")."""
    if not block_ids:
        raise ValueError("the request holds no state block")
    return block_ids[(computed - 1) // block_size] if aligned else block_ids[0]
