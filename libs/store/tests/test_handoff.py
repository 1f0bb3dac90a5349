"""The KV handoff chunk format: round trips, checks, and assembling a handoff from its chunks."""

from __future__ import annotations

import struct

import pytest
from safetensors import safe_open

from fleet_store.handoff import (
    AssembledKV,
    HandoffChunk,
    HandoffError,
    HandoffWriter,
    LayerState,
    append_error,
    assemble,
    chunk_kind,
    decode_chunk,
    frame,
    frame_length,
    handoff_blocks,
    layer_range,
    read_folder,
    split_frames,
)
from fleet_store.kv import WireTensor

pytestmark = pytest.mark.unit


def rows(count: int, value: float = 1.0, heads: int = 2, dim: int = 4) -> WireTensor:
    return WireTensor(
        "F32", (count, heads, dim), struct.pack(f"<{count * heads * dim}f", *[value] * (count * heads * dim))
    )


def write_handoff(folder, start: int, end: int, split: int) -> HandoffWriter:
    writer = HandoffWriter(folder, "h1")
    for layer in (0, 1):  # layer by layer, as vLLM's save_kv_layer emits them
        writer.kv(start, split, {layer: (rows(split - start, layer), rows(split - start, -layer))})
    writer.kv(
        split, end, {0: (rows(end - split), rows(end - split)), 1: (rows(end - split), rows(end - split))}
    )
    state = LayerState("RotatingKVCache", (rows(3), None), ("0", "16", "20", "4"))
    writer.states(end, {2: state})
    writer.done(start, end)
    return writer


def test_a_chunk_round_trips_and_is_a_safetensors_file(tmp_path):
    chunk = HandoffChunk("h1", 0, "kv", 4, 7, kv={3: (rows(3, 2.0), rows(3, 3.0))})
    data = chunk.encode()
    assert decode_chunk(data, "h1") == chunk
    path = tmp_path / "c.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="numpy") as opened:
        assert opened.get_tensor("layers.3.keys").shape == (3, 2, 4)
        assert opened.metadata()["kind"] == "kv"


def test_state_chunks_keep_missing_arrays_and_meta():
    state = LayerState("ArraysCache", (None, rows(1)), ())
    chunk = HandoffChunk("h1", 1, "state", 9, 9, states={0: state})
    assert decode_chunk(chunk.encode()).states == {0: state}


def test_a_flipped_byte_or_a_foreign_chunk_is_refused():
    data = bytearray(HandoffChunk("h1", 0, "kv", 0, 1, kv={0: (rows(1), rows(1))}).encode())
    with pytest.raises(HandoffError, match="handoff 'h1', expected 'h2'"):
        decode_chunk(bytes(data), "h2")
    data[-1] ^= 0xFF
    with pytest.raises(HandoffError, match="sha256"):
        decode_chunk(bytes(data))
    with pytest.raises(HandoffError, match="corrupt"):
        decode_chunk(b"\x01\x02")


def test_frames_are_length_prefixed():
    blob = b"x" * 10
    framed = frame(blob)
    assert frame_length(framed[:4]) == 10 and framed[4:] == blob
    with pytest.raises(HandoffError):
        frame_length(b"\xff\xff\xff\xff")


def test_a_folder_handoff_assembles_per_layer_in_order(tmp_path):
    writer = write_handoff(tmp_path, start=5, end=12, split=9)
    assert writer.next_seq == 5
    kv = assemble(read_folder(tmp_path), "h1", start_pos=5)
    assert (kv.start_pos, kv.end) == (5, 12)
    assert [sum(k.shape[0] for k, _ in kv.rows[layer]) for layer in (0, 1)] == [7, 7]
    assert kv.states[2].meta == ("0", "16", "20", "4")


def test_framed_bytes_split_back_into_chunks_and_a_rank_takes_its_layers(tmp_path):
    # a pipeline's rank 0 shares a received handoff as framed bytes; rank 1 (layers 1-3) takes its part
    write_handoff(tmp_path, start=5, end=12, split=9)
    framed = b"".join(frame(blob) for blob in read_folder(tmp_path))
    assert list(split_frames(framed)) == list(read_folder(tmp_path))
    with pytest.raises(HandoffError, match="cut short"):
        list(split_frames(framed[:-1]))
    mine = layer_range(assemble(split_frames(framed), "h1", 5), 1, 3)
    assert (mine.start_pos, mine.end) == (5, 12)
    assert sorted(mine.rows) == [0] and sorted(mine.states) == [1]  # model layers 1 and 2, renumbered
    assert mine.states[1].meta == ("0", "16", "20", "4")


def test_gaps_missing_layers_errors_and_truncation_are_refused(tmp_path):
    write_handoff(tmp_path, start=0, end=6, split=3)
    blobs = list(read_folder(tmp_path))
    with pytest.raises(HandoffError, match="rows from 0 do not continue at 2"):
        assemble(blobs, "h1", start_pos=2)
    with pytest.raises(HandoffError, match="arrived where chunk 1 belongs"):
        assemble([blobs[0], *blobs[2:]], "h1", 0)
    with pytest.raises(HandoffError, match="without its done chunk"):
        assemble(blobs[:-1], "h1", 0)
    short = HandoffWriter(tmp_path / "short", "h1")
    short.kv(0, 3, {0: (rows(3), rows(3)), 1: (rows(3), rows(3))})
    short.kv(3, 6, {0: (rows(3), rows(3))})
    short.done(0, 6)
    with pytest.raises(HandoffError, match=r"layers \[1\] do not reach token 6"):
        assemble(read_folder(tmp_path / "short"), "h1", 0)
    failed = HandoffWriter(tmp_path / "failed", "h1")
    failed.error("engine process exited")
    with pytest.raises(HandoffError, match="the prefill failed: engine process exited"):
        assemble(read_folder(tmp_path / "failed"), "h1", 0)


def test_a_handoff_becomes_the_full_kv_blocks_it_covers(tmp_path):
    from fleet_store.kv import decode_block, encode_block, prompt_blocks

    prompt = list(range(10, 23))  # 13 tokens: the handoff covers rows 0..12
    writer = HandoffWriter(tmp_path, "h1")
    for layer in (0, 1):
        writer.kv(0, 5, {layer: (rows(5, 1.0), rows(5, 2.0))})
        writer.kv(5, 12, {layer: (rows(7, 1.0), rows(7, 2.0))})
    writer.done(0, 12)
    kv = assemble(read_folder(tmp_path), "h1", 0)
    blocks = handoff_blocks(kv, "fp", prompt, block_size=4)
    assert [b.block_hash for b in blocks] == [h for h, *_ in prompt_blocks("fp", prompt, 4)]
    assert [(b.token_start, b.token_ids) for b in blocks] == [
        (0, (10, 11, 12, 13)),
        (4, (14, 15, 16, 17)),
        (8, (18, 19, 20, 21)),
    ]
    again = decode_block(encode_block(blocks[1]), blocks[1].block_hash, prompt[4:8])
    assert again.layers[1][0] == rows(4, 1.0) and again.layers[1][1] == rows(4, 2.0)
    stateful = AssembledKV(0, 12, kv.rows, {2: LayerState("ArraysCache", (None,))})
    with pytest.raises(HandoffError, match="non-positional state"):
        handoff_blocks(stateful, "fp", prompt, 4)


def test_a_handoff_announces_its_first_token_ahead_of_its_last_kv(tmp_path):
    writer = HandoffWriter(tmp_path, "h1")
    writer.kv(0, 2, {0: (rows(2), rows(2))})
    writer.first(318)
    writer.kv(2, 4, {0: (rows(2), rows(2))})
    writer.done(0, 4, first_token=318)
    append_error(tmp_path, "h1", "too late: the handoff has ended")
    chunks = [decode_chunk(blob, "h1") for blob in read_folder(tmp_path)]
    assert [(c.seq, c.kind, c.first_token) for c in chunks] == [
        (0, "kv", -1),
        (1, "first", 318),
        (2, "kv", -1),
        (3, "done", 318),
    ]
    assembled = assemble(read_folder(tmp_path), "h1", 0)
    assert assembled.end == 4 and len(assembled.rows[0]) == 2
    plain = HandoffChunk("h1", 0, "done", 0, 4)  # a done chunk without a first token says -1
    assert decode_chunk(plain.encode()).first_token == -1 and chunk_kind(plain.encode()) == "done"
