"""llama.cpp sequence state bytes <-> rows (pure): both V layouts, cells out of position order,
dtype conversion, the layouts refused, and K rows between llama.cpp's and Hugging Face's order of a
head's dimensions."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fleet_worker.engines.llamacpp.kv import (
    STATE_MAGIC,
    SeqKV,
    SeqStateError,
    converted,
    keys_from_wire_order,
    keys_to_wire_order,
    parse_seq_state,
    seq_state,
)

pytestmark = pytest.mark.unit


def state(v_trans: bool) -> SeqKV:
    rng = np.random.default_rng(1)
    keys = tuple(rng.standard_normal((5, 8)).astype(np.float16) for _ in range(2))
    values = tuple(rng.standard_normal((5, 8)).astype(np.float16) for _ in range(2))
    return SeqKV(np.arange(5, dtype=np.int32), keys, values, 1, 1, v_trans)


@pytest.mark.parametrize("v_trans", [False, True])
def test_rows_round_trip_through_the_state_bytes(v_trans: bool) -> None:
    kv = state(v_trans)
    data = seq_state(kv, seq_id=3)
    assert struct.unpack_from("<IiII", data) == (STATE_MAGIC, 3, 1, 5)
    back = parse_seq_state(data)
    assert back.v_trans == v_trans and back.positions.tolist() == [0, 1, 2, 3, 4]
    assert all(
        np.array_equal(a, b) for a, b in zip(back.keys + back.values, kv.keys + kv.values, strict=True)
    )
    assert seq_state(back, 3) == data


def test_cells_are_sorted_by_position() -> None:
    kv = state(False)
    shuffled = SeqKV(np.array([3, 0, 4, 1, 2], dtype=np.int32), kv.keys, kv.values, 1, 1, False)
    back = parse_seq_state(seq_state(shuffled, 0))
    assert back.positions.tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(back.keys[0][0], kv.keys[0][1])  # the cell at position 0 was second


def test_foreign_quantized_or_longer_states_are_refused() -> None:
    data = seq_state(state(False), 0)
    with pytest.raises(SeqStateError, match="magic"):
        parse_seq_state(b"\0" * 16)
    with pytest.raises(SeqStateError, match="ends early"):
        parse_seq_state(data[:-1])
    with pytest.raises(SeqStateError, match="more than this layout"):
        parse_seq_state(data + b"\0")
    q8 = data.replace(struct.pack("<iQ", 1, 16), struct.pack("<iQ", 8, 16), 1)  # a Q8_0 K cache
    with pytest.raises(SeqStateError, match="quantized"):
        parse_seq_state(q8)


def test_dtypes_convert_through_f32_and_bf16_rounds_to_nearest_even() -> None:
    values = np.array([1.0, -2.5, 3.140625, 1e-3], dtype=np.float16)
    assert np.array_equal(converted(converted(values, "F16", "F32"), "F32", "F16"), values)
    bf16 = converted(np.array([1.0, 1.00390625, 1.01171875], dtype=np.float32), "F32", "BF16")
    assert bf16.tolist() == [0x3F80, 0x3F80, 0x3F82]  # ties to even: 1+2^-8 -> 1, 1+3*2^-8 -> 1+2^-6
    assert converted(bf16, "BF16", "F32").tolist() == [1.0, 1.0, 1.015625]


def test_keys_go_from_rope_pairs_to_halves_and_back() -> None:
    row = np.array([[0, 1, 2, 3, 10, 11, 12, 13]], dtype=np.float16)  # 2 heads of 4 dims
    wire = keys_to_wire_order(row, heads=2)
    assert wire.tolist() == [[0, 2, 1, 3, 10, 12, 11, 13]]
    keys = np.random.default_rng(2).standard_normal((5, 3 * 64)).astype(np.float32)
    assert np.array_equal(keys_from_wire_order(keys_to_wire_order(keys, 3), 3), keys)


def rope_pairs(x: np.ndarray, pos: int) -> np.ndarray:
    """llama.cpp's rotation (LLAMA_ROPE_TYPE_NORM): dims (2i, 2i+1) by pos * theta_i."""
    half = x.shape[-1] // 2
    angle = pos * 10000.0 ** (-np.arange(half) / half)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = (
        a * np.cos(angle) - b * np.sin(angle),
        a * np.sin(angle) + b * np.cos(angle),
    )
    return out


def rope_halves(x: np.ndarray, pos: int) -> np.ndarray:
    """Hugging Face's rotate-half: dims (i, i + head_dim/2) by pos * theta_i."""
    half = x.shape[-1] // 2
    angle = pos * 10000.0 ** (-np.arange(half) / half)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)


def test_llamacpp_keys_in_wire_order_are_the_keys_hugging_face_rotates() -> None:
    # The GGUF converter's q/k permutation puts HF dims (i, i + D/2) at (2i, 2i + 1): rotating the
    # permuted key in pairs and reordering it gives HF's rotated key.
    hf_key = np.random.default_rng(3).standard_normal((1, 2 * 64))
    gguf_key = keys_from_wire_order(hf_key, heads=2)
    for pos in (0, 1, 7, 300):
        rotated = np.concatenate([rope_pairs(h, pos) for h in np.split(gguf_key, 2, axis=-1)], -1)
        expected = np.concatenate([rope_halves(h, pos) for h in np.split(hf_key, 2, axis=-1)], -1)
        assert np.allclose(keys_to_wire_order(rotated, heads=2), expected)
