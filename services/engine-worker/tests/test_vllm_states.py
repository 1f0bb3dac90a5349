"""Non-positional layer states of a vLLM handoff (states.py), without vLLM: a sliding window's
ring buffer as mlx-lm's RotatingKVCache holds it, a gated-delta-net slot as its ArraysCache does.
The ring buffer is checked against mlx-lm itself where MLX is installed: decoding on from the
exported state attends to exactly what decoding on from mlx-lm's own prefill does."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fleet_worker.engines.vllm.states import (
    from_wire,
    gdn_state,
    state_slot,
    to_wire,
    window_span,
    window_state,
)

pytestmark = pytest.mark.unit


def rows(start: int, end: int, heads: int = 2, dim: int = 4) -> torch.Tensor:
    """Row t holds t everywhere: where each position lands is visible."""
    return (
        torch.arange(start, end, dtype=torch.float32)[:, None, None].expand(end - start, heads, dim).clone()
    )


def test_a_window_holds_its_last_rows_once_the_prompt_is_longer() -> None:
    assert window_span(99, 16) == (83, 99)
    assert window_span(10, 16) == (0, 10)


def test_the_window_state_is_the_ring_buffer_in_temporal_order() -> None:
    state = window_state(rows(83, 99), rows(83, 99) + 1000, end=99, window=16)
    assert state.cache_class == "RotatingKVCache"
    assert state.meta == ("99", "0", "16", "16")  # offset, keep, max_size, write index
    keys, values = (from_wire(a) for a in state.arrays if a is not None)
    assert keys.shape == (1, 2, 16, 4)  # [1, kv_heads, slots, head_dim]
    assert keys[0, 0, :, 0].tolist() == list(range(83, 99))
    assert values[0, 1, 0, 3].item() == 1083


def test_a_short_prompt_leaves_the_window_part_empty_and_narrowing_applies() -> None:
    state = window_state(rows(0, 5), rows(0, 5), end=5, window=16, wire_dtype="BF16")
    assert state.meta == ("5", "0", "16", "5")
    assert [a.shape for a in state.arrays if a is not None] == [(1, 2, 5, 4)] * 2
    assert {a.dtype for a in state.arrays if a is not None} == {"BF16"}
    with pytest.raises(ValueError, match="holds 5 rows"):
        window_state(rows(0, 4), rows(0, 4), end=5, window=16)


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")
@pytest.mark.parametrize(("end", "step"), [(99, 1), (99, 2), (10, 1), (10, 2)])
def test_mlx_decodes_on_from_the_state_as_from_its_own_prefill(end: int, step: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    def positions(cache: RotatingKVCache) -> list[int]:
        keys, _ = cache.keys_and_values()
        return sorted(int(v) for v in np.array(keys[0, 0, :, 0]))

    def as_mlx(t: torch.Tensor) -> mx.array:
        return mx.array(t.numpy())

    own = RotatingKVCache(max_size=16)
    prompt = as_mlx(rows(0, end).permute(1, 0, 2)[None])
    own.update_and_fetch(prompt, prompt)
    state = window_state(rows(*window_span(end, 16)), rows(*window_span(end, 16)), end=end, window=16)
    exported = RotatingKVCache(max_size=16)
    keys, values = (as_mlx(from_wire(a)) for a in state.arrays if a is not None)
    offset, keep, max_size, index = (int(v) for v in state.meta)
    exported.state = (keys, values, offset, keep, max_size, index)
    for t in range(end, end + 20, step):  # one token at a time (in place) or two (concatenated)
        new = as_mlx(rows(t, t + step).permute(1, 0, 2)[None])
        own.update_and_fetch(new, new)
        exported.update_and_fetch(new, new)
        seen = [p for p in positions(own) if p > t + step - 1 - 16]  # what the window lets through
        assert [p for p in positions(exported) if p > t + step - 1 - 16] == seen
        assert exported.offset == own.offset


def test_a_gdn_slot_goes_channels_last_with_a_batch_axis() -> None:
    conv = torch.arange(12, dtype=torch.float32).view(4, 3)  # [conv_dim, kernel - 1]
    recurrent = torch.ones(2, 5, 6, dtype=torch.bfloat16)
    state = gdn_state(conv, recurrent, conv_dim_first=True)
    assert state.cache_class == "ArraysCache" and state.meta == ()
    conv_out, recurrent_out = (from_wire(a) for a in state.arrays if a is not None)
    assert conv_out.shape == (1, 3, 4) and torch.equal(conv_out[0], conv.T)
    assert recurrent_out.shape == (1, 2, 5, 6) and recurrent_out.dtype == torch.bfloat16
    same = gdn_state(conv.T.contiguous(), recurrent, conv_dim_first=False)
    assert same.arrays[0] == state.arrays[0]
    with pytest.raises(ValueError, match="no GDN state"):
        gdn_state(conv[None], recurrent, conv_dim_first=True)


def test_the_state_slot_is_the_one_block_or_the_last_tokens_block() -> None:
    assert state_slot([7], computed=99, block_size=544, aligned=False) == 7
    assert state_slot([3, 8, 9], computed=64, block_size=32, aligned=True) == 8
    assert state_slot([3, 8, 9], computed=65, block_size=32, aligned=True) == 9
    with pytest.raises(ValueError):
        state_slot([], computed=1, block_size=32, aligned=False)


def test_wire_round_trip() -> None:
    tensor = torch.randn(3, 2, 4)
    assert torch.equal(from_wire(to_wire(tensor)), tensor)
