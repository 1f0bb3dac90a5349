"""`fleet bench embed`'s pure parts: the fixed texts and each round's requests, the sides' turns,
statistics and Fleet / peer ratios, the goals, the printed table, vLLM's server flags and replies."""

from __future__ import annotations

import base64
import json
import math
import sys

import numpy as np
import pytest

from fleet_proto import EmbeddingFacts
from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import embed
from embed import Round

pytestmark = pytest.mark.unit


def test_the_texts_are_fixed_and_of_mixed_length() -> None:
    texts = embed.text_set()
    assert texts == embed.text_set() and len(texts) == embed.TEXT_COUNT == len(set(texts))
    sentences = [t.count(". ") + 1 for t in texts]
    assert sentences[1:4] == [1, 1, 1] and sum(n == 1 for n in sentences) == 3 * len(texts) // 4
    assert min(sentences[::4]) == 2 and max(sentences[::4]) == 12
    assert max(len(t.split()) for t in texts) < 128  # words: the tokens stay under MiniLM's 256


def test_a_round_sends_its_inputs_in_batches_and_the_next_repeat_goes_on_from_there() -> None:
    assert embed.round_requests(1, 0, 4, 512) == [[0], [1], [2], [3]]
    assert embed.round_requests(32, 0, 64, 512) == [list(range(32)), list(range(32, 64))]
    assert embed.round_requests(32, 1, 64, 512)[0][0] == 64
    whole = embed.round_requests(256, 2, 64, 512)  # a batch over the round's inputs: one request
    assert len(whole) == 1 and whole[0][:2] == [0, 1] and len(whole[0]) == 256  # 512 wraps to 0


def test_every_side_goes_first_in_turn() -> None:
    sides = ["fleet-mlx", "sentence-transformers", "vllm-server"]
    assert [embed.rotated(sides, r)[0] for r in range(4)] == [*sides, sides[0]]
    assert sorted(embed.rotated(sides, 2)) == sorted(sides) and embed.rotated([], 3) == []


def test_statistics_take_median_rounds_and_ratios_of_the_same_repeat() -> None:
    fleet = [Round(32, [0.1, 0.1], 0.9999), Round(32, [0.2, 0.2], 0.9995), Round(32, [0.05, 0.05])]
    peer = [Round(32, [0.2, 0.2], 1.0), Round(32, [0.2, 0.2], 1.0), Round(32, [0.1, 0.1], 1.0)]
    assert fleet[0].inputs_per_s == pytest.approx(160) and math.isnan(Round().inputs_per_s)
    summary = embed.summarize(fleet)
    assert summary["inputs_per_s"] == pytest.approx(160)
    assert summary["latency_s_p50"] == pytest.approx(0.1) and summary["requests"] == 6
    assert summary["cosine_min"] == 0.9995  # the round without a reference does not count
    ratio = embed.pair_ratio(fleet, peer)
    assert ratio["inputs_per_s"] == pytest.approx(2.0) and ratio["range"] == pytest.approx([1.0, 2.0])
    assert math.isnan(embed.pair_ratio([], peer)["inputs_per_s"])
    entry = embed.point({"fleet-vllm": fleet, "vllm-server": peer}, "fleet-vllm")
    assert set(entry["sides"]) == {"fleet-vllm", "vllm-server"} and list(entry["ratios"]) == ["vllm-server"]


def result_of(st_ratio: float, vllm_ratio: float) -> dict:
    def side(ips: float) -> dict:
        return {"inputs_per_s": ips, "latency_s_p50": 32 / ips, "rounds": 5, "requests": 5, "cosine_min": 1.0}

    def point(batch: int) -> dict:
        ratios = {"sentence-transformers": {"inputs_per_s": st_ratio, "range": [st_ratio - 0.1, st_ratio]},
                  "vllm-server": {"inputs_per_s": vllm_ratio, "range": []}}  # fmt: skip
        return {"sides": {"fleet-vllm": side(100), "sentence-transformers": side(100 / st_ratio),
                          "vllm-server": side(100 / vllm_ratio)}, "ratios": ratios}  # fmt: skip

    return {"model": "m", "repeats": 5, "stacks": {"fleet-vllm": {"1": point(1), "32": point(32)}},
            "unavailable": {"fleet-mlx": "mlx is not installed"}}  # fmt: skip


def test_goals_apply_at_their_batch_sizes() -> None:
    lines = embed.goal_lines(result_of(1.2, 0.85)["stacks"])
    assert lines == [
        "fleet-vllm at batch 1: 0.85x vllm-server (goal >= 0.9): MISSED",
        "fleet-vllm at batch 32: 1.20x sentence-transformers (goal >= 1.0): met",
        "fleet-vllm at batch 32: 0.85x vllm-server (goal >= 0.9): MISSED",
    ]


def test_the_table_shows_each_side_and_the_fleet_sides_ratios() -> None:
    lines = embed.table(result_of(1.25, 1.0))
    assert lines[0].startswith("m: medians of 5 alternating rounds")
    fleet_row = next(line for line in lines if line.startswith("fleet-vllm    32 fleet-vllm"))
    assert "100.0" in fleet_row and "3,125.0" not in fleet_row
    assert fleet_row.endswith("vs sentence-transformers 1.25 [1.15-1.25], vs vllm-server 1.00")
    peer_row = next(line for line in lines if line.startswith("fleet-vllm    32 sentence-transformers"))
    assert peer_row.split()[3:] == ["80.0", "400.0", "1.0000"]  # inputs/s, p50 ms, cosine; no ratios
    assert lines[-1] == "not run: fleet-mlx: mlx is not installed"


def test_vllms_server_gets_the_embedders_settings() -> None:
    facts = EmbeddingFacts(dimensions=384, pooling="mean", normalize=True, max_tokens=256)
    flags = embed.vllm_embed_flags(facts, "MEAN", 8192, 512 << 20, 32)

    def option(name: str, given: list[str] = flags) -> str:
        return given[given.index(name) + 1]

    assert option("--runner") == "pooling" and option("--convert") == "embed"
    assert json.loads(option("--pooler-config")) == {"seq_pooling_type": "MEAN", "use_activation": True}
    assert option("--dtype") == "float32" and "--enforce-eager" in flags
    assert option("--kv-cache-memory-bytes") == str(512 << 20) and option("--max-num-seqs") == "32"
    assert option("--max-model-len") == "256" and option("--max-num-batched-tokens") == "8192"
    # a step fits the longest input, as the embedder's does
    assert option("--max-num-batched-tokens", embed.vllm_embed_flags(facts, "MEAN", 100, 1, 1)) == "256"
    command = embed.vllm_server_command(REPO, "org/m", 8123, flags)
    assert option("--host", command) == "127.0.0.1" and command[-len(flags) :] == flags


def test_replies_decode_in_input_order_and_cosines_compare_rows() -> None:
    vectors = np.array([[1, 0, 0], [0, 2, 0]], dtype="<f4")
    data = [{"index": i, "embedding": base64.b64encode(v.tobytes()).decode()} for i, v in enumerate(vectors)]
    assert np.array_equal(embed.vectors_of({"data": data[::-1]}), vectors)
    assert embed.worst_cosine(vectors, vectors * 3) == pytest.approx(1.0)
    assert embed.worst_cosine(vectors, np.array([[1, 0, 0], [1, 1, 0]], dtype="<f4")) == pytest.approx(
        math.sqrt(0.5)
    )


def test_bad_batches_are_refused_and_a_dry_run_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert embed.parse_batches("1, 32,256") == [1, 32, 256]
    for bad in ("", "0", "8,-1"):
        with pytest.raises(ValueError):
            embed.parse_batches(bad)
    assert embed.main(["--dry-run", "--sides", "fleet-vllm,vllm-server", "--batches", "32"]) == 0
    out = capsys.readouterr().out
    assert "texts: 512 fixed" in out
    with pytest.raises(SystemExit):
        embed.main(["--sides", "nope"])
