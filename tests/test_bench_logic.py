"""The benchmarks' pure parts: sweeps, prompts of a given length, statistics, the README table, and
`fleet bench disagg`'s options, plan (its dry run), rows and checks of pinned instances."""

from __future__ import annotations

import math
import sys

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import compare
import disagg
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


# -- fleet bench disagg --------------------------------------------------------------------------------
def test_disagg_modes_put_overlapping_and_batch_transfers_side_by_side() -> None:
    modes = disagg.disagg_modes()
    assert list(modes) == ["colocated", "stream", "stream_batch", "staged", "staged_batch"]
    assert modes["colocated"] == {"disaggregated": False}
    assert modes["stream"] == {"disaggregated": True, "transport": "stream"}  # overlapping: the default
    assert modes["staged_batch"] == {"disaggregated": True, "transport": "staged", "overlap": False}
    assert list(disagg.disagg_modes(batch_only=True, transports=["stream"])) == ["colocated", "stream_batch"]
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        disagg.disagg_modes(transports=["tcp"])


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--decode-model", "m"], "--decode-model name parts of a running cluster: add --url"),
        (["--url", "http://g", "--tiny", "--decode-model", "m"], "--tiny starts its own stack"),
        (["--url", "http://g"], "--url needs --decode-model"),
        (
            ["--url", "http://g", "--model", "m", "--prefill-model", "p", "--prefill-instance", "i"],
            "not both",
        ),
        (["--url", "http://g", "--model", "m", "--repeat", "0"], "--repeat must be at least 1"),
    ],
)
def test_disagg_refuses_options_that_do_not_fit(argv: list[str], error: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        disagg.parse_args(argv)
    assert exited.value.code == 2 and error in capsys.readouterr().err


def test_a_disagg_plan_lists_every_request_in_the_order_sent() -> None:
    args = disagg.parse_args(["--url", "http://g/", "--decode-model", "m", "--pp", "64,128", "--tg", "4",
                              "--batch", "--repeat", "2"])  # fmt: skip
    plan = disagg.plan_of(args)
    assert (plan.gateway, plan.model, plan.pps, plan.tgs, plan.repeat) == ("http://g", "m", [64, 128], [4], 2)
    requests = plan.requests()
    assert [(pp, rep, mode) for pp, _, rep, mode, _ in requests[:6]] == [
        (64, 0, "colocated"), (64, 0, "stream_batch"), (64, 0, "staged_batch"),
        (64, 1, "colocated"), (64, 1, "stream_batch"), (64, 1, "staged_batch"),
    ]  # fmt: skip
    body = requests[1][4]
    assert body["model"] == "m" and body["max_tokens"] == 4 and body["temperature"] == 0
    assert (body["disaggregated"], body["transport"], body["overlap"]) == (True, "stream", False)
    text = disagg.describe_plan(plan)
    assert text.startswith(
        "plan: 2 prompt lengths x 1 generation lengths x 3 modes x 2 repeats = 12 requests"
    )
    assert text.count("  POST http://g/bench/chat/completions ") == 12 and "probe requests" in text
    own = disagg.plan_of(disagg.parse_args(["--tiny"]))
    assert own.model == "tiny/llama-disagg" and own.gateway == "" and "prefill-only mlx on w2" in own.notes[0]


def test_a_live_runs_prompts_are_sized_by_two_probes() -> None:
    count = disagg.linear_count({110: 1110, 10: 110})  # 10 tokens of template, 10 a sentence
    assert count(0) == 10 and count(50) == 510
    assert disagg.units_for(515, count) == 50 and disagg.units_for(5, count) == 1


def stats(ttft: float, node: str = "") -> dict:
    handoff = {"prefill_worker_id": node} if node else None
    return {"ttft_s": ttft, "handoff": handoff}


def test_a_disagg_row_keeps_median_runs_their_ratios_and_prefills_off_the_pinned_nodes() -> None:
    runs = {
        "colocated": [stats(2.0), stats(1.0), stats(3.0)],
        "stream": [stats(0.5, "w2"), stats(0.4, "w2"), stats(0.6, "w3")],
        "stream_batch": [stats(0.8, "w2")],
    }
    row = disagg.point_row(512, 8, runs, {"w2"})
    assert row["colocated"]["ttft_s"] == 2.0 and row["stream"]["ttft_s"] == 0.5  # the medians
    assert len(row["colocated_runs"]) == 3 and "stream_batch_runs" not in row
    assert row["ttft_stream_over_colocated"] == 0.25
    assert row["ttft_stream_batch_over_overlap"] == pytest.approx(1.6)
    assert row["prefilled_elsewhere"] == ["stream"]
    assert "prefilled_elsewhere" not in disagg.point_row(512, 8, runs)  # nothing pinned
    assert disagg.median_run([stats(1.0), stats(3.0)])["ttft_s"] == 1.0


def test_pinned_instances_are_checked_against_the_clusters_state() -> None:
    instances = {
        "d": {"model_id": "m", "node_id": "w1", "status": "ready", "role": "decode"},
        "p": {"model_id": "m", "node_id": "w2", "status": "ready", "role": "prefill"},
        "q": {"model_id": "m-bf16", "node_id": "w3", "status": "ready", "role": "both"},
        "l": {"model_id": "m", "node_id": "w4", "status": "loading", "role": "both"},
    }
    state = {"instances": instances, "partners": {"d": [{"instance_id": "p"}]}}

    def plan(**pins: str) -> object:
        return disagg.Plan(gateway="http://g", model="m", pps=[64], tgs=[8], modes={}, **pins)

    assert disagg.pinned_problems(state, plan(decode_instance="d", prefill_instance="p")) == []
    assert disagg.prefill_nodes(state, plan(prefill_instance="p")) == {"w2"}
    assert disagg.prefill_nodes(state, plan(prefill_model="m-bf16")) == {"w3"}
    assert disagg.pinned_problems(state, plan(decode_instance="p")) == [
        "instance p is a prefill instance: it does not decode"
    ]
    assert disagg.pinned_problems(state, plan(decode_instance="d", prefill_instance="q")) == [
        "instance q is not a prefill partner of d (its partners: p)"
    ]
    assert disagg.pinned_problems(state, plan(prefill_instance="l")) == ["instance l is loading, not ready"]
    assert disagg.pinned_problems(state, plan(prefill_model="x")) == ["no ready instance of x prefills"]
    assert (
        disagg.pinned_problems({"instances": instances}, plan(decode_instance="d", prefill_instance="q"))
        == []
    )
