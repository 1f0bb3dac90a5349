"""The benchmarks' pure parts: sweeps, prompts of a given length, statistics, the README table."""

from __future__ import annotations

import math
import sys

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import compare
import loadgen
import report
import serve
import tracing
from loadgen import RoundResult, StreamResult, Workload

pytestmark = pytest.mark.unit


def test_tandem_sweeps_pair_lengths_and_broadcast_a_single_one() -> None:
    assert loadgen.sweep([128, 512], [32, 64], [1, 8]) == [
        Workload(128, 32, 1), Workload(128, 32, 8), Workload(512, 64, 1), Workload(512, 64, 8)
    ]  # fmt: skip
    assert loadgen.sweep([128, 512], [16], [1]) == [Workload(128, 16, 1), Workload(512, 16, 1)]
    with pytest.raises(ValueError, match="as many prompt lengths"):
        loadgen.sweep([1, 2, 3], [1, 2], [1])


def test_cartesian_sweeps_run_every_pair_at_every_concurrency() -> None:
    workloads = loadgen.sweep([128, 512], [16, 64], [1, 4], "cartesian")
    assert len(workloads) == 8
    assert {(w.prompt_tokens, w.gen_tokens) for w in workloads} == {
        (128, 16),
        (128, 64),
        (512, 16),
        (512, 64),
    }
    with pytest.raises(ValueError, match="tandem or cartesian"):
        loadgen.sweep([1], [1], [1], "zip")


def test_workload_specs_parse_and_bad_ones_are_named() -> None:
    assert loadgen.parse_workloads("64x32@1, 512x16@8") == [Workload(64, 32, 1), Workload(512, 16, 8)]
    assert Workload(64, 32, 8).label == "64x32@8"
    for bad in ("64x32", "64@1", "axb@c", "0x4@1"):
        with pytest.raises(ValueError):
            loadgen.parse_workloads(bad)
    with pytest.raises(ValueError):
        loadgen.parse_lengths("1,-2")


def test_prompts_count_the_asked_tokens_and_never_share_a_prefix() -> None:
    def fake_counter(text: str) -> int:  # a fake tokenizer: one token per 4 characters
        return math.ceil(len(text) / 4)

    for n in (8, 100, 1000):
        text = loadgen.filler(n, salt=3, count=fake_counter)
        assert n - 3 <= fake_counter(text) <= n
        assert loadgen.word_count(loadgen.filler(n, salt=3)) == n
    first, second = (loadgen.chat_prompt(64, salt)[0]["content"] for salt in (1, 2))
    assert first.split()[:2] != second.split()[:2]  # the salt leads


def test_percentile_interpolates_between_ranks() -> None:
    assert loadgen.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert loadgen.percentile([1.0, 2.0], 50) == 1.5
    assert loadgen.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert math.isnan(loadgen.percentile([], 50))


def round_of(*streams: StreamResult, wall_s: float, peak: int = 0) -> RoundResult:
    return RoundResult(list(streams), wall_s, peak)


def test_summaries_report_latency_rates_and_count_errors_apart() -> None:
    ok = StreamResult(first_s=0.5, last_s=1.5, tokens=11, prompt_tokens=100)
    slow = StreamResult(first_s=1.0, last_s=3.0, tokens=11, prompt_tokens=100)
    failed = StreamResult(error="HTTP 500: boom")
    summary = loadgen.summarize(
        [round_of(ok, slow, wall_s=3.0, peak=5), round_of(ok, failed, wall_s=2.0, peak=7)]
    )
    assert (summary["requests"], summary["errors"], summary["error_examples"]) == (4, 1, ["HTTP 500: boom"])
    assert summary["ttft_s_p50"] == 0.5
    assert summary["tpot_s_p50"] == pytest.approx(0.1)  # (1.5 - 0.5) / 10
    assert summary["decode_tps_per_stream_p50"] == pytest.approx(10.0)
    assert summary["aggregate_tps_p50"] == pytest.approx((22 / 3 + 11 / 2) / 2)
    assert summary["prompt_tps_p50"] == pytest.approx(200 / 1.0)  # only the round without errors
    assert summary["peak_rss_bytes"] == 7
    unsized = StreamResult(first_s=0.5, last_s=1.5, tokens=11)  # a server that reports no usage
    assert math.isnan(loadgen.summarize([round_of(unsized, wall_s=2.0)])["prompt_tps_p50"])


def test_paired_ratios_compare_rounds_that_ran_back_to_back() -> None:
    ours = [round_of(StreamResult(first_s=1.0, last_s=2.0, tokens=10), wall_s=2.0)] * 3
    theirs = [round_of(StreamResult(first_s=2.0, last_s=4.0, tokens=10), wall_s=w) for w in (4.0, 8.0, 4.0)]
    ratio = compare.fleet_vs_peer(ours, theirs, "peer")  # the median of the pairs, and their range
    assert ratio["aggregate_tps"] == pytest.approx(2.0)
    assert ratio["aggregate_tps_range"] == pytest.approx([2.0, 4.0])
    assert ratio["ttft_s"] == pytest.approx(0.5)
    assert ratio["vs"] == "peer"


def test_pairs_are_ratios_of_back_to_back_rounds_with_their_quartiles() -> None:
    # decode: 9 intervals over 0.9 s = 10 tok/s traced, 9 over 1.0 s = 9 tok/s untraced
    traced = [round_of(StreamResult(first_s=0.1, last_s=1.0, tokens=10), wall_s=w) for w in (1.0, 2.0)]
    untraced = [round_of(StreamResult(first_s=0.2, last_s=1.2, tokens=10), wall_s=2.0)] * 2
    assert loadgen.pair_ratios(traced, untraced, "ttft_s") == pytest.approx([0.5, 0.5])
    assert loadgen.pair_ratios(traced, untraced, "decode_tps") == pytest.approx([10 / 9, 10 / 9])
    assert loadgen.pair_ratios(traced, untraced, "aggregate_tps") == pytest.approx([2.0, 1.0])
    assert tracing.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"p25": 2.0, "p50": 3.0, "p75": 4.0}
    assert tracing.quartiles([0.9]) == {"p25": 0.9, "p50": 0.9, "p75": 0.9}


def side(ttft: float, decode: float, aggregate: float, peak: int = 2**30, tokens: int = 32) -> dict:
    return {"ttft_s_p50": ttft, "decode_tps_per_stream_p50": decode, "aggregate_tps_p50": aggregate,
            "peak_rss_bytes": peak, "completion_tokens_p50": tokens}  # fmt: skip


COMPARE = {
    "model": "m",
    "repeats": 2,
    "sides": {"fleet-vllm": "Fleet (vLLM)", "llama.cpp": "llama.cpp server"},
    "baselines": {"llama.cpp": "fleet-vllm"},
    "unavailable": {"mlx_lm.server": "mlx_lm is not installed"},
    "workloads": {
        "64x32@1": {"workload": {"prompt_tokens": 64, "gen_tokens": 32, "concurrency": 1},
                    "sides": {"fleet-vllm": side(0.2, 12.0, 11.0), "llama.cpp": side(0.5, 40.0, 38.0)},
                    "ratios": {"llama.cpp": {"vs": "fleet-vllm", "ttft_s": 0.4, "decode_tps_per_stream": 0.3,
                                             "aggregate_tps": 0.29}}},
        "64x32@8": {"workload": {"prompt_tokens": 64, "gen_tokens": 32, "concurrency": 8},
                    "sides": {"fleet-vllm": side(0.9, 8.0, 50.0), "llama.cpp": side(3.0, 30.0, 29.0)},
                    "ratios": {"llama.cpp": {"vs": "fleet-vllm", "ttft_s": 0.3, "decode_tps_per_stream": 0.27,
                                             "aggregate_tps": 1.72}}},
        "512x16@1": {"workload": {"prompt_tokens": 512, "gen_tokens": 16, "concurrency": 1},
                     "sides": {"fleet-vllm": side(1.2, 12.0, 10.0, tokens=16)}, "ratios": {}},
    },
}  # fmt: skip


def test_the_readme_table_has_a_row_per_side_with_ratios_in_parentheses() -> None:
    table = report.compare_table(COMPARE)
    header, rule, fleet, llama = table.splitlines()
    assert "64-token prompt, 1 stream" in header and "512-token prompt" in header
    assert rule.count("---") == 7
    assert fleet.split(" | ")[2:6] == ["200", "12.0", "50.0", "1,200"]
    assert llama.split(" | ")[1:6] == ["Fleet (vLLM)", "500 (0.40)", "40.0 (0.30)", "29.0 (1.72)", "—"]


def test_the_readme_block_is_replaced_between_its_markers_only() -> None:
    block = report.readme_block({"compare": COMPARE}, {"summary": "a test box"}, "2026-12-01 10:00 UTC")
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    assert "a test box" in block and "Not run: mlx_lm.server (mlx_lm is not installed)" in block
    readme = f"# Title\n\nbefore\n{report.BEGIN}\nold table\n{report.END}\nafter\n"
    replaced = report.replace_block(readme, block)
    assert replaced.startswith("# Title\n\nbefore\n") and replaced.endswith("\nafter\n")
    assert "old table" not in replaced and report.replace_block(replaced, block) == replaced
    with pytest.raises(ValueError, match="no bench block"):
        report.replace_block("# no markers", block)


def test_ensure_cuda_needs_a_cuda_node_that_offers_vllm() -> None:
    capabilities = {
        "engines": {"vllm": {"nodes": ["cpu-box", "gpu-box"]}, "mlx": {"nodes": ["mac"]}},
        "nodes": {"cpu-box": {"kind": "cpu"}, "gpu-box": {"kind": "cuda"}, "mac": {"kind": "apple"},
                  "gpu-no-vllm": {"kind": "cuda"}},
    }  # fmt: skip
    assert serve.cuda_vllm_nodes(capabilities) == ["gpu-box"]
    assert serve.cuda_vllm_nodes({"engines": {}, "nodes": {}}) == []


def test_the_table_says_whether_every_side_generated_the_full_count() -> None:
    assert report.generation_note(COMPARE) == "Every side generated every request's full token count."
    early = {**COMPARE, "workloads": {"64x32@1": {**COMPARE["workloads"]["64x32@1"]}}}
    early["workloads"]["64x32@1"]["sides"] = {"llama.cpp": side(0.5, 40.0, 38.0, tokens=20)}
    assert (
        report.generation_note(early)
        == "Sides stopped early (median tokens generated): llama.cpp 20 of 32 (64x32@1)."
    )


def test_keys_for_a_keyed_gateway_come_from_the_environment(monkeypatch):
    for name in ("FLEET_API_KEY", "OPENAI_API_KEY", "FLEET_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert loadgen.auth_headers() == {} == loadgen.auth_headers(admin=True)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-1")
    assert loadgen.auth_headers() == {"Authorization": "Bearer sk-1"}
    monkeypatch.setenv("FLEET_API_KEY", "fleet-1")
    monkeypatch.setenv("FLEET_ADMIN_KEY", "fleet-admin-1")
    assert loadgen.auth_headers() == {"Authorization": "Bearer fleet-1"}
    assert loadgen.auth_headers(admin=True) == {"Authorization": "Bearer fleet-admin-1"}
