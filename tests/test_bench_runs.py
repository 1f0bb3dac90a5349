"""`fleet bench serve`, `compare`, `control-plane` and `grammar-mask` run for real on a tiny random
model (small counts) and write results that say what was measured; the suite's report reads them.
Speed itself is not asserted: that is what the benchmarks are for."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import report

pytestmark = pytest.mark.timeout(600)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(name: str, out: Path, *args: str) -> dict:
    run = subprocess.run(
        [str(Path(sys.executable).with_name("fleet")), "bench", name, *args, "--out", str(out)],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = [p for p in out.glob("*.json")]
    return json.loads(result.read_text())


def positive(value: float) -> bool:
    return value > 0 and not math.isnan(value)


def test_serve_sweeps_a_fleet_stack_and_plots_it(tmp_path: Path) -> None:
    result = bench("serve", tmp_path, "--fleet", "--tiny", "--engine", "mlx", "--prompt-lens", "16,48",
                   "--gen-lens", "6", "--concurrency", "1,3", "--repeats", "1")  # fmt: skip
    assert list(result["workloads"]) == ["16x6@1", "16x6@3", "48x6@1", "48x6@3"]
    assert result["prompt_lengths_counted_by"] == "tokenizer"
    for label, entry in result["workloads"].items():
        assert entry["errors"] == 0, entry["error_examples"]
        assert entry["requests"] == entry["workload"]["concurrency"]
        assert entry["completion_tokens_p50"] == 6  # the random model does not stop early
        for metric in ("ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "aggregate_tps_p50", "prompt_tps_p50"):
            assert positive(entry[metric]), (label, metric)
        assert entry["peak_rss_bytes"] > 50 << 20  # the whole stack's processes
        # The chat template adds its own tokens around the asked-for prompt length.
        assert entry["prompt_tokens_p50"] >= entry["workload"]["prompt_tokens"]
    assert len(result["plots"]) == 2
    assert all(Path(p).read_bytes().startswith(PNG_MAGIC) for p in result["plots"])


def test_compare_runs_fleet_and_mlx_peers_alternating_with_ratios(tmp_path: Path) -> None:
    result = bench("compare", tmp_path, "--tiny", "--peers", "fleet-mlx,mlx-lm,mlx_lm.server,llama.cpp",
                   "--workloads", "16x6@1,16x6@2", "--repeats", "2")  # fmt: skip
    assert list(result["sides"]) == ["fleet-mlx", "mlx-lm", "mlx_lm.server"]
    assert "llama.cpp" in result["unavailable"]  # the tiny model has no GGUF
    for entry in result["workloads"].values():
        assert set(entry["sides"]) == {"fleet-mlx", "mlx-lm", "mlx_lm.server"}
        for name, summary in entry["sides"].items():
            assert summary["errors"] == 0, (name, summary["error_examples"])
            assert summary["rounds"] == 2
            assert summary["completion_tokens_p50"] == 6, name  # same greedy work on every side
        assert set(entry["ratios"]) == {"mlx-lm", "mlx_lm.server"}
        for ratio in entry["ratios"].values():
            assert ratio["vs"] == "fleet-mlx"
            assert all(positive(ratio[k]) for k in ("aggregate_tps", "ttft_s", "decode_tps_per_stream"))
    table = report.compare_table(result)
    assert table.count("\n") == 4 and "(" in table.splitlines()[3]


def test_control_plane_measures_routing_nats_and_the_gateway_on_the_echo_engine(tmp_path: Path) -> None:
    result = bench("control-plane", tmp_path, "--quick")
    routing, nats, gateway = result["routing"], result["nats"], result["gateway"]
    for value in (*routing.values(), *nats.values()):
        if isinstance(value, float):
            assert positive(value)
    assert gateway["engine"].startswith("echo")
    assert positive(gateway["chat_1_token_ms_p50"]) and positive(gateway["requests_per_s_16_in_flight"])
    assert positive(gateway["stream_tokens_per_s_8_streams"])
    assert report.other_lines({"control_plane": result})[0].startswith("- **Control plane**")


def test_control_plane_overhead_splits_each_requests_wait_and_counts_cpu_on_one_and_two_gateways(
    tmp_path: Path,
) -> None:
    """--overhead --quick: two low open-loop rates on one gateway, then over two; every request
    answered, nearly all traced whole, the wait split, each gateway's CPU counted (~30 s)."""
    result = bench("control-plane", tmp_path, "--overhead", "--quick")["overhead"]
    one, two = result["one_gateway"], result["two_gateways"]
    assert one and two and all(s["gateways"] == 1 for s in one) and all(s["gateways"] == 2 for s in two)
    for s in (*one, *two):
        assert s["errors"] == 0, s["error_examples"]
        assert s["traced"] >= 0.9 * s["requests"]
        assert 0 < s["overhead_ms_p50"] < s["client_ms_p50"]
        assert all(positive(s[f"{part}_ms_p50"]) for part in ("gateway", "bus", "client_http", "worker"))
        assert positive(s["gateway_cpu_ms_per_request"]) and positive(s["cores_busy"])
    assert positive(sum(s["cpu_ms_per_request"]["gateway-2"] for s in two))  # the replica took its share
    implied = result["implied"]
    assert implied["gateway_replicas_for_1000_rps"] >= 1 and positive(
        implied["routes_per_s_per_scheduler_core"]
    )
    assert [r["offered_rps"] for r in result["two_over_one"]] == [s["offered_rps"] for s in two]
    assert set(result["state_scans"]) == {"16", "100"}
    assert len(result["verdict"]) >= 5 and "NaN" not in json.dumps(result["implied"])


def test_grammar_mask_walks_a_document_with_both_libraries(tmp_path: Path) -> None:
    from tests.support import make_chat_model

    result = bench(
        "grammar-mask", tmp_path / "out", "--tokenizer", str(make_chat_model(tmp_path)), "--repeats", "2"
    )
    assert result["document_tokens"] > 10
    assert set(result["libraries"]) == {"xgrammar", "llguidance"}
    for side in result["libraries"].values():
        assert set(side["grammars"]) == {"json_schema", "json_object"}
        for grammar in side["grammars"].values():  # every token of the valid document was accepted
            assert positive(grammar["compile_ms"]) and positive(grammar["mask"]["p50_us"])
    assert positive(result["apply_mask"]["numpy_us"])


def test_structured_pairs_constrained_and_free_rounds_with_ratios(tmp_path: Path) -> None:
    result = bench("structured", tmp_path, "--tiny", "--engines", "mlx", "--concurrency", "1,2",
                   "--rounds", "2", "--prompt-tokens", "16", "--gen-tokens", "8")  # fmt: skip
    assert all(positive(ms) for ms in result["compile"].values())
    mlx = result["engines"]["mlx"]
    assert positive(mlx["cold_first_constrained_ttft_s"])
    for label in ("1 streams", "2 streams"):
        entry = mlx[label]
        for side in ("free", "constrained"):
            assert entry[side]["errors"] == 0, entry[side]["error_examples"]
            assert entry[side]["rounds"] == 2
        assert positive(entry["decode_tps_ratio"]["median"]) and positive(entry["ttft_ratio"]["median"])


def test_replay_runs_a_trace_through_fleet_and_finds_the_history_cached(tmp_path: Path) -> None:
    """The quick trace (chats and an agent loop, a few turns each) on one llama.cpp worker: every turn
    answered, and the later turns mostly found their history in the engine's prefix cache (not all:
    a conversation sharing a system prompt with another may take over that one's slot, as llama.cpp
    keeps one sequence's KV per slot)."""
    result = bench("replay", tmp_path, "--quick")
    ((name, side),) = result["sides"].items()
    assert name == "fleet-kv-1w" and side["errors"] == 0
    assert side["requests"] == result["trace"]["requests"] == len(result["turns"][name])
    assert positive(side["ttft_p50_ms"]) and positive(side["output_tokens_per_s"])
    later = [t for t in result["turns"][name] if t["turn"] > 0]
    assert later and sum(t["cached_tokens"] > 0 for t in later) >= len(later) / 2
    assert 0 < side["cache_hit"] < 1
    assert side["stayed_with_history"] == 1.0  # one worker: every later turn ran where its history is


def test_control_plane_scale_routes_on_a_synthetic_cluster_over_a_filled_kv_index(tmp_path: Path) -> None:
    """--scale --quick: 100 simulated workers, 100k blocks in a real Redis: every figure measured."""
    scale = bench("control-plane", tmp_path, "--scale", "--quick")["scale"]
    assert (scale["workers"], scale["blocks"]) == (100, 100_000)
    assert set(scale["routing"]) == set(scale["state"]) == {"16", "100"}
    assert scale["index"]["used_memory_bytes_per_block"] > 0 and scale["index"]["fill_blocks_per_s"] > 0
    assert set(scale["decision"]) == {"4", "16", "64"}
    assert scale["verdict"][0].startswith("decision p99") and "NaN" not in json.dumps(scale)
