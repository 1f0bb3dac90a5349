"""The KV wire format: block hashes, blob round trips, and refusal of corrupt or mismatched blobs."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_store.kv import (
    KVBlobError,
    KVBlock,
    KVFolder,
    WireTensor,
    block_hashes,
    decode_block,
    encode_block,
    model_fingerprint,
    prompt_blocks,
)

pytestmark = pytest.mark.unit


def f32(values: list[float], shape: tuple[int, ...]) -> WireTensor:
    return WireTensor("F32", shape, struct.pack(f"<{len(values)}f", *values))


def sample_block(tokens: tuple[int, ...] = (5, 6, 7, 8), layers: int = 2) -> KVBlock:
    rows, heads, dim = len(tokens), 2, 3
    count = rows * heads * dim
    pairs = tuple(
        (
            f32([float(i + j) for j in range(count)], (rows, heads, dim)),
            f32([-1.0] * count, (rows, heads, dim)),
        )
        for i in range(layers)
    )
    return KVBlock("fp", "h1", "", 0, tokens, pairs)


def test_hashes_chain_over_full_blocks_only() -> None:
    hashes = block_hashes("fp", list(range(10)), block_size=4)
    assert len(hashes) == 2  # tokens 8, 9 form no full block
    assert block_hashes("fp", list(range(8)), 4) == hashes
    # the second hash depends on the first block: change token 0 and both change
    other = block_hashes("fp", [99, *range(1, 10)], 4)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert block_hashes("other-model", list(range(10)), 4) != hashes


@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=64), st.integers(1, 16))
def test_prefix_hashes_are_a_prefix(tokens: list[int], block_size: int) -> None:
    full = block_hashes("fp", tokens, block_size)
    half = block_hashes("fp", tokens[: len(tokens) // 2], block_size)
    assert full[: len(half)] == half


def test_prompt_blocks_carry_parents_and_ranges() -> None:
    blocks = prompt_blocks("fp", list(range(9)), 4)
    assert [(start, tokens) for _, _, start, tokens in blocks] == [(0, (0, 1, 2, 3)), (4, (4, 5, 6, 7))]
    assert blocks[0][1] == "" and blocks[1][1] == blocks[0][0]
    assert prompt_blocks("fp", [1, 2, 3], 4) == []  # shorter than a block


def test_fingerprint_ignores_file_order_but_not_content() -> None:
    a = model_fingerprint({"a.safetensors": "1", "b.safetensors": "2"})
    assert a == model_fingerprint({"b.safetensors": "2", "a.safetensors": "1"})
    assert a != model_fingerprint({"a.safetensors": "1", "b.safetensors": "3"})


def test_round_trip_keeps_every_tensor_and_field() -> None:
    block = sample_block()
    assert decode_block(encode_block(block), expected_hash="h1", expected_tokens=(5, 6, 7, 8)) == block


def test_blob_is_plain_safetensors_with_named_layers() -> None:
    import safetensors  # the reference reader accepts what Fleet writes

    names = [name for name, _ in safetensors.deserialize(encode_block(sample_block()))]
    assert sorted(names) == [
        "layers.0.keys",
        "layers.0.values",
        "layers.1.keys",
        "layers.1.values",
        "token_ids",
    ]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:100], "header|corrupt|incomplete"),
        (lambda b: b"\x00" * 8 + b[8:], "corrupt safetensors header"),
        (lambda b: b.replace(b"fleet-kv", b"fleet-xx"), "not a fleet-kv"),
        (lambda b: b[:-4], "outside the blob"),
        (lambda b: b[:-4] + b"\0\0\0\1", "do not match their sha256"),
    ],
)
def test_corrupt_blobs_are_refused(mutate, message: str) -> None:
    with pytest.raises(KVBlobError, match=message):
        decode_block(mutate(encode_block(sample_block())))


def test_a_blob_for_other_tokens_or_hash_is_refused() -> None:
    data = encode_block(sample_block())
    with pytest.raises(KVBlobError, match="expected"):
        decode_block(data, expected_hash="h2")
    with pytest.raises(KVBlobError, match="other tokens"):
        decode_block(data, expected_tokens=(5, 6, 7, 9))


def test_wire_tensor_checks_its_size() -> None:
    with pytest.raises(KVBlobError, match="needs 24 bytes"):
        WireTensor("F32", (2, 3), b"\x00" * 20)


def test_folder_counts_only_an_unbroken_prefix(tmp_path) -> None:
    folder = KVFolder(tmp_path)
    first = sample_block()
    folder.write(first)
    third = KVBlock("fp", "h3", "h2", 8, first.token_ids, first.layers)
    folder.write(third)
    assert folder.leading_hits("fp", ["h1", "h2", "h3"]) == 1
    assert decode_block(folder.read("fp", "h1")) == first
    assert folder.read("fp", "missing") is None
    assert not list(tmp_path.rglob("*.part"))
