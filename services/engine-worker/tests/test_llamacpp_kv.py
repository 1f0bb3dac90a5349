"""llama.cpp sequence state bytes <-> rows (pure): both V layouts, cells out of position order,
dtype conversion, and the layouts refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fleet_worker.engines.llamacpp_kv import (
    STATE_MAGIC,
    SeqKV,
    SeqStateError,
    converted,
    parse_seq_state,
    seq_state,
)


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
