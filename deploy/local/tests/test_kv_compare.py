"""`fleet kv compare`'s pure parts: per-layer K/V differences of two handoffs (max abs, mean abs,
cosine; any wire dtype; positional layers and non-positional state), which instance a target names,
and the prompt's token ids."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fleet_local.kv_compare import (
    KVCompareError,
    compare,
    exporting_instance,
    folder_kv,
    prompt_ids,
    record,
    table,
    worst,
)
from fleet_proto import Instance, InstanceStatus, State
from fleet_store.handoff import HandoffWriter, LayerState
from fleet_store.kv import WireTensor

pytestmark = pytest.mark.unit

TOKENS, HEADS, DIM = 6, 2, 4


def wire(array: np.ndarray, dtype: str = "F32") -> WireTensor:
    if dtype == "BF16":  # exact for the values these tests use (few mantissa bits)
        data = (np.asarray(array, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        data = np.asarray(array, {"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()
    return WireTensor(dtype, tuple(array.shape), data)


def kv_values(layer: int, rows: int = TOKENS, heads: int = HEADS) -> tuple[np.ndarray, np.ndarray]:
    keys = np.arange(rows * heads * DIM, dtype=np.float32).reshape(rows, heads, DIM) / 8 - layer
    return keys, -keys + 0.5


def handoff(
    folder: Path,
    layers: dict[int, tuple[np.ndarray, np.ndarray]],
    dtype: str = "F32",
    split: int = 0,
    states: dict[int, LayerState] | None = None,
) -> Path:
    """A complete handoff folder: each layer's rows in one chunk, or two chunks cut at `split`."""
    writer = HandoffWriter(folder, f"h-{folder.name}")
    end = next(iter(layers.values()))[0].shape[0]
    cuts = [(0, split), (split, end)] if split else [(0, end)]
    for start, stop in cuts:
        writer.kv(start, stop, {i: (wire(k[start:stop], dtype), wire(v[start:stop], dtype))
                                for i, (k, v) in layers.items()})  # fmt: skip
    if states:
        writer.states(end, states)
    writer.done(0, end)
    return folder


def test_the_same_kv_in_another_dtype_and_chunking_agrees_exactly(tmp_path: Path) -> None:
    layers = {i: kv_values(i) for i in range(3)}
    a = folder_kv(handoff(tmp_path / "a", layers, "F32"))
    b = folder_kv(handoff(tmp_path / "b", layers, "BF16", split=2))
    rows = compare(a, b)
    assert [(r.layer, r.part) for r in rows] == [(i, p) for i in range(3) for p in ("keys", "values")]
    for row in rows:
        assert row.shape_a == row.shape_b == (TOKENS, HEADS, DIM)
        assert row.max_abs == row.mean_abs == 0.0 and row.cosine == pytest.approx(1.0) and not row.note


def test_differences_are_max_mean_and_cosine_over_the_whole_layer(tmp_path: Path) -> None:
    keys, values = kv_values(0)
    shifted = keys.copy()
    shifted[0, 0, 0] += 2.0  # one element far off
    a = folder_kv(handoff(tmp_path / "a", {0: (keys, values)}))
    b = folder_kv(handoff(tmp_path / "b", {0: (shifted, -values)}, "F16"))
    key_row, value_row = compare(a, b)
    assert key_row.max_abs == pytest.approx(2.0)
    assert key_row.mean_abs == pytest.approx(2.0 / keys.size)
    x, y = keys.ravel().astype(np.float64), shifted.ravel().astype(np.float64)
    assert key_row.cosine == pytest.approx(x @ y / np.linalg.norm(x) / np.linalg.norm(y))
    assert value_row.cosine == pytest.approx(-1.0)  # opposite values point the opposite way
    assert value_row.max_abs == pytest.approx(2 * np.abs(values).max())
    assert worst([key_row, value_row]) == value_row


def test_other_shapes_are_named_and_rows_compare_as_far_as_both_reach(tmp_path: Path) -> None:
    a = folder_kv(handoff(tmp_path / "a", {0: kv_values(0), 1: kv_values(1)}))
    fewer_heads = {0: kv_values(0, heads=1), 1: kv_values(1)}
    b = folder_kv(handoff(tmp_path / "b", fewer_heads))
    rows = compare(a, b)
    assert rows[0].note == "shapes differ" and math.isnan(rows[0].cosine)
    assert rows[2].note == "" and rows[2].max_abs == 0.0
    longer = folder_kv(handoff(tmp_path / "c", {0: kv_values(0, rows=TOKENS + 3)}))
    shorter = folder_kv(handoff(tmp_path / "d", {0: kv_values(0)}))
    key_row = compare(longer, shorter)[0]
    assert key_row.note == f"first {TOKENS} rows" and key_row.max_abs == 0.0
    only_a = compare(a, shorter)
    assert [r.note for r in only_a if r.layer == 1] == ["side B has no such layer"] * 2


def test_non_positional_state_compares_array_by_array(tmp_path: Path) -> None:
    conv = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    state_a = {1: LayerState("ArraysCache", (wire(conv), None))}
    state_b = {1: LayerState("ArraysCache", (wire(conv * 2), wire(conv)))}
    layers = {0: kv_values(0)}
    rows = compare(
        folder_kv(handoff(tmp_path / "a", layers, states=state_a)),
        folder_kv(handoff(tmp_path / "b", layers, states=state_b)),
    )
    conv_row, missing = rows[-2:]
    assert (conv_row.layer, conv_row.part) == (1, "state.0")
    assert conv_row.cosine == pytest.approx(1.0) and conv_row.max_abs == pytest.approx(1.0)
    assert missing.part == "state.1" and missing.note == "only one side holds it"


def test_the_table_has_a_line_per_layer_part(tmp_path: Path) -> None:
    a = folder_kv(handoff(tmp_path / "a", {0: kv_values(0)}))
    text = table(compare(a, a))
    header, keys, values = text.splitlines()
    assert header.split() == [
        "layer",
        "part",
        "shape",
        "A",
        "shape",
        "B",
        "max",
        "abs",
        "mean",
        "abs",
        "cosine",
    ]
    assert keys.split()[:4] == ["0", "keys", "6x2x4", "6x2x4"] and values.split()[1] == "values"
    assert keys.split()[-1] == "1.000000"


def test_a_failed_or_unfinished_handoff_is_refused_with_why(tmp_path: Path) -> None:
    writer = HandoffWriter(tmp_path / "failed", "h")
    writer.error("out of memory")
    with pytest.raises(KVCompareError, match="out of memory"):
        folder_kv(tmp_path / "failed")
    with pytest.raises(KVCompareError, match="no handoff chunks"):
        folder_kv(tmp_path / "nothing")


def instance(instance_id: str, **fields: object) -> Instance:
    values = {"model_id": "m", "node_id": "w1", "engine": "mlx", "status": InstanceStatus.READY} | fields
    return Instance(instance_id=instance_id, **values)  # type: ignore[arg-type]


def test_a_target_is_an_instance_that_exports_or_a_model_with_one() -> None:
    state = State(
        instances={
            "both": instance("both"),
            "pre": instance("pre", engine="vllm", role="prefill", node_id="w2"),
            "dec": instance("dec", role="decode"),
            "echo": instance("echo", engine="echo", model_id="e"),
            "loading": instance("loading", model_id="l", status=InstanceStatus.LOADING),
        }
    )
    assert exporting_instance(state, "both").instance_id == "both"
    assert exporting_instance(state, "m").instance_id == "pre"  # a prefill instance first
    with pytest.raises(KVCompareError, match="only decodes"):
        exporting_instance(state, "dec")
    with pytest.raises(KVCompareError, match="engine echo cannot export"):
        exporting_instance(state, "echo")
    with pytest.raises(KVCompareError, match="not ready"):
        exporting_instance(state, "loading")
    with pytest.raises(KVCompareError, match="neither an instance nor a model"):
        exporting_instance(state, "l")


def test_the_prompt_is_the_text_repeated_to_the_asked_length() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["the", "quick", "brown", "fox", "."]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    ids = prompt_ids(tokenizer.to_str().encode(), "the quick brown fox. ", 11)
    assert ids == [0, 1, 2, 3, 4] * 2 + [0]
    with pytest.raises(KVCompareError, match="no tokens"):
        prompt_ids(tokenizer.to_str().encode(), "   ", 4)


def test_records_carry_null_where_nothing_was_compared(tmp_path: Path) -> None:
    a = folder_kv(handoff(tmp_path / "a", {0: kv_values(0)}))
    b = folder_kv(handoff(tmp_path / "b", {0: kv_values(0, heads=1)}))
    keys = record(compare(a, b)[0])
    assert keys["cosine"] is None and keys["note"] == "shapes differ" and keys["shape_b"] == (TOKENS, 1, DIM)
