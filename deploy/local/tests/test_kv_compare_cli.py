"""`fleet kv compare --folders A B`: two handoff folders compared offline, as a table or JSON; with
--min-cosine the exit status says whether every layer part agrees that well. Without a running
stack or --env-file the live comparison says what it needs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fleet_local.cli import main
from fleet_store.handoff import HandoffWriter
from fleet_store.kv import WireTensor


def handoff(folder: Path, scale: float) -> str:
    keys = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    values = keys * scale
    writer = HandoffWriter(folder, "h")
    pair = (WireTensor("F32", keys.shape, keys.tobytes()), WireTensor("F32", values.shape, values.tobytes()))
    writer.kv(0, 3, {0: pair})
    writer.done(0, 3)
    return str(folder)


def test_two_folders_compare_as_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = handoff(tmp_path / "a", 1.0), handoff(tmp_path / "b", -1.0)
    assert main(["kv", "compare", "--folders", a, b]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"A {a}: F32, tokens 0..3\nB {b}: F32, tokens 0..3\n")
    assert "    0  keys" in out and "    0  values" in out
    assert "least alike: layer 0 values, cosine -1.000000" in out
    assert main(["kv", "compare", "--folders", a, b, "--min-cosine", "0.99"]) == 1
    assert main(["kv", "compare", "--folders", a, a, "--min-cosine", "0.99"]) == 0


def test_json_has_a_record_per_layer_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = handoff(tmp_path / "a", 1.0)
    assert main(["kv", "compare", "--folders", a, a, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [(r["layer"], r["part"], r["cosine"]) for r in body["layers"]] == [
        (0, "keys", 1.0),
        (0, "values", 1.0),
    ]


def test_a_live_comparison_needs_a_stack_or_an_env_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["kv", "compare", "inst-a", "inst-b", "--state-dir", str(tmp_path)]) == 1
    assert "no stack is running here" in capsys.readouterr().err
    bad = tmp_path / "bad.env"
    bad.write_text("not a setting\n")
    assert main(["kv", "compare", "inst-a", "inst-b", "--env-file", str(bad)]) == 1
    assert "expected NAME=VALUE" in capsys.readouterr().err
