"""fleet bench replay's pure parts: reading a streamed response's events, the per-side summary and
its ratios, a trace's sessions in turn order."""

from __future__ import annotations

import sys

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
from replay import TurnResult, ratios, read_event, sessions_of, stayed_share, summarize
from workload import TraceParams, generate

pytestmark = pytest.mark.unit


def test_the_first_content_sets_ttft_and_the_usage_chunk_the_counts():
    result = TurnResult("chat-0000", 0, "chat", 0.0)
    read_event({"choices": [{"delta": {"role": "assistant"}}]}, result, sent=10.0, now=10.1)
    assert result.ttft_s == 0.0  # a role alone is no token yet
    read_event({"choices": [{"delta": {"content": "Hi"}}]}, result, sent=10.0, now=10.25)
    read_event({"choices": [{"delta": {"content": "!"}}]}, result, sent=10.0, now=10.5)
    usage = {"prompt_tokens": 400, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 256}}
    read_event({"choices": [], "usage": usage}, result, sent=10.0, now=10.6)
    assert result.ttft_s == pytest.approx(0.25)
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (400, 256, 2)
    # a server that reports no prompt details (llama.cpp's, vLLM's without the flag): nothing cached
    bare = TurnResult("chat-0000", 1, "chat", 0.0)
    read_event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}, bare, 0.0, 1.0)
    assert bare.cached_tokens == 0 and bare.prompt_tokens == 9 and not bare.cache_reported
    assert summarize([bare], wall_s=1.0)["cache_hit"] is None  # unknown, not 0%
    silent = TurnResult("chat-0000", 2, "chat", 0.0)  # llama.cpp's server streams no usage
    for _ in range(3):
        read_event({"choices": [{"delta": {"content": "a"}}]}, silent, 0.0, 1.0)
    assert silent.content_chunks == 3 and summarize([silent], wall_s=1.0)["output_tokens_per_s"] == 3


def turn(kind: str, ttft: float, prompt: int, cached: int, error: str = "") -> TurnResult:
    return TurnResult("s", 0, kind, 0.0, ttft, ttft + 1, prompt, cached, 10, cache_reported=True, error=error)


def test_a_side_summary_counts_what_was_answered_and_the_cache_share():
    results = [turn("chat", 0.1, 1000, 800), turn("chat", 0.3, 1000, 0), turn("agent", 0.2, 2000, 1800)]
    results.append(turn("chat", 0.0, 0, 0, error="503: no instance"))
    summary = summarize(results, wall_s=10.0)
    assert summary["requests"] == 4 and summary["errors"] == 1
    assert summary["first_errors"] == ["503: no instance"]
    assert summary["cache_hit"] == pytest.approx(2600 / 4000)
    assert summary["recomputed"] == pytest.approx(1400 / 4000)
    assert summary["ttft_p50_ms"] == pytest.approx(200)
    assert summary["output_tokens_per_s"] == pytest.approx(3.0)
    assert summary["by_kind"]["chat"]["cache_hit"] == pytest.approx(0.4)
    assert summary["by_kind"]["agent"]["requests"] == 1


def test_ratios_are_to_the_baseline():
    sides = {
        "rr": {"ttft_p50_ms": 400.0, "ttft_p99_ms": 1000.0, "e2e_p50_ms": 800.0},
        "kv": {"ttft_p50_ms": 100.0, "ttft_p99_ms": 500.0, "e2e_p50_ms": 600.0},
    }
    assert ratios(sides, "rr") == {"kv": {"ttft_p50_ms": 0.25, "ttft_p99_ms": 0.5, "e2e_p50_ms": 0.75}}
    assert ratios(sides, "absent") == {}


def test_a_trace_replays_as_sessions_in_turn_order():
    requests = generate(TraceParams(sessions=6))
    sessions = sessions_of(list(reversed(requests)))
    assert sum(len(turns) for turns in sessions.values()) == len(requests)
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert turns[0].think_s == 0


def test_stayed_counts_later_turns_routed_where_the_previous_turn_ran():
    def routed(session: str, turn: int, worker: str) -> TurnResult:
        return TurnResult(session, turn, "chat", 0.0, worker=worker)

    results = [routed("a", 0, "w1"), routed("a", 1, "w1"), routed("a", 2, "w2"), routed("b", 0, "w2")]
    results.append(routed("b", 1, "w2"))
    assert stayed_share(results) == pytest.approx(2 / 3)
    assert stayed_share([TurnResult("a", 0, "chat", 0.0), TurnResult("a", 1, "chat", 0.0)]) is None
