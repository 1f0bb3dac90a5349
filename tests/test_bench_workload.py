"""bench/workload.py: traces are deterministic, each turn's prompt extends the previous one, sessions
share system prompts, kinds and arrivals follow the params, the JSONL format round-trips and rejects
malformed lines, and describe() computes the ideal prefix-cache share by hand."""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import workload
from workload import TraceParams, TraceRequest

pytestmark = pytest.mark.unit

# Short prompts keep the larger traces fast; the shape is what is tested.
SMALL = {"system_tokens": 20, "document_tokens": 50, "tool_result_tokens": (5, 10), "answer_tokens": (3, 6)}


def by_session(requests: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    sessions: dict[str, list[TraceRequest]] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    return sessions


def as_json(requests: list[TraceRequest]) -> str:
    return json.dumps([r.to_json() for r in requests])


def test_the_same_params_give_the_same_trace_and_another_seed_another() -> None:
    params = TraceParams(sessions=12)
    assert as_json(workload.generate(params)) == as_json(workload.generate(TraceParams(sessions=12)))
    assert as_json(workload.generate(params)) != as_json(workload.generate(TraceParams(sessions=12, seed=1)))


def test_requests_are_sorted_and_each_session_counts_its_turns_from_zero() -> None:
    requests = workload.generate(TraceParams(sessions=20, **SMALL))
    assert requests == sorted(requests, key=lambda r: (r.arrival_s, r.session, r.turn))
    for turns in by_session(requests).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert len({(r.kind, r.arrival_s) for r in turns}) == 1


def test_each_turn_extends_the_previous_turns_messages_exactly() -> None:
    params = TraceParams(sessions=30, agent_share=0.4, document_share=0.1, **SMALL)
    sessions = by_session(workload.generate(params))
    for turns in sessions.values():
        for before, after in pairwise(turns):
            assert after.messages[: len(before.messages)] == before.messages
            assert len(after.messages) == len(before.messages) + 2  # a reply (or call), then the new turn
    kinds = {turns[0].kind for turns in sessions.values()}
    assert kinds == {"chat", "agent", "document"}


def test_chats_agents_and_documents_have_their_shape() -> None:
    params = TraceParams(sessions=30, agent_share=0.4, document_share=0.2, **SMALL)
    for name, turns in by_session(workload.generate(params)).items():
        first, last = turns[0], turns[-1]
        assert first.messages[0]["role"] == "system"
        assert [m["role"] for m in last.messages[1:]] == ["user", "assistant"] * (len(turns) - 1) + ["user"]
        if first.kind == "chat":
            assert name.startswith("chat-") and params.chat_turns[0] <= len(turns) <= params.chat_turns[1]
        elif first.kind == "agent":
            assert name.startswith("agent-") and params.agent_steps[0] <= len(turns) <= params.agent_steps[1]
            assert first.messages[1]["content"].startswith("Task: ")
            assert all(m["content"].startswith("call ") for m in last.messages[2::2])
            assert all(m["content"].startswith("Tool result: ") for m in last.messages[3::2])
        else:
            assert name.startswith("doc-") and len(turns) == 1
            assert len(first.messages[1]["content"].split()) > params.document_tokens


def test_words_stand_for_tokens() -> None:
    params = TraceParams(sessions=4, agent_share=0, document_share=0, system_tokens=123)
    for r in workload.generate(params):
        words = r.messages[0]["content"].split()
        assert len(words) == 123 and set(words) <= set(workload.VOCABULARY)
    assert len(set(workload.VOCABULARY)) == len(workload.VOCABULARY) >= 200


def test_sessions_share_the_system_prompts_of_the_pool() -> None:
    params = TraceParams(sessions=12, system_prompts=3, **SMALL)
    requests = workload.generate(params)
    firsts = [turns[0].messages[0]["content"] for turns in by_session(requests).values()]
    assert set(firsts) <= set(workload.system_prompts(params))
    assert len(set(firsts)) < len(firsts)  # 12 sessions, 3 prompts: some share one


def test_kinds_come_in_the_asked_shares() -> None:
    params = TraceParams(sessions=200, agent_share=0.25, document_share=0.1)
    assert Counter(workload.session_kinds(params)) == {"agent": 50, "document": 20, "chat": 130}
    small = TraceParams(sessions=40, agent_share=0.25, document_share=0.1, **SMALL)
    assert workload.describe(workload.generate(small))["sessions"] == {"chat": 26, "agent": 10, "document": 4}


def test_only_later_turns_wait_to_think() -> None:
    requests = workload.generate(TraceParams(sessions=30, **SMALL))
    assert all((r.think_s == 0) == (r.turn == 0) for r in requests)
    assert all(r.think_s >= 0 for r in requests)


def test_poisson_sessions_arrive_in_order_about_one_rate_apart() -> None:
    times = workload.arrivals(TraceParams(sessions=2000, rate=0.4))
    gaps = [b - a for a, b in pairwise(times)]
    assert times[0] == 0 and all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 0.4, rel=0.1)


def test_bursty_sessions_arrive_in_groups_at_multiples_of_the_period() -> None:
    params = TraceParams(sessions=10, arrival="bursty", burst_size=4, burst_every_s=7.5, **SMALL)
    starts = [r.arrival_s for r in workload.generate(params) if r.turn == 0]
    assert Counter(starts) == {0.0: 4, 7.5: 4, 15.0: 2}


def test_a_trace_round_trips_through_jsonl(tmp_path: Path) -> None:
    params = TraceParams(sessions=8, **SMALL)
    requests = workload.generate(params)
    path = tmp_path / "trace.jsonl"
    workload.write_trace(path, params, requests)
    header = json.loads(path.read_text().splitlines()[0])
    assert header["fleet_trace"] == 1
    read_params, read_requests = workload.read_trace(path)
    assert read_requests == requests
    assert (
        TraceParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in read_params.items()}) == params
    )
    first = path.read_bytes()
    workload.write_trace(path, params, workload.generate(params))
    assert path.read_bytes() == first


def test_a_malformed_line_is_named(tmp_path: Path) -> None:
    params = TraceParams(sessions=3, **SMALL)
    path = tmp_path / "trace.jsonl"
    workload.write_trace(path, params, workload.generate(params))
    lines = path.read_text().splitlines()
    broken = json.loads(lines[2])
    del broken["think_s"]
    for bad, message in [("{not json", "trace.jsonl:3: not JSON"), (json.dumps(broken), ":3: malformed")]:
        path.write_text("\n".join([*lines[:2], bad, *lines[3:]]) + "\n")
        with pytest.raises(ValueError, match=message):
            workload.read_trace(path)
    path.write_text(json.dumps({"fleet_trace": 2, "params": {}}) + "\n")
    with pytest.raises(ValueError, match=":1: not a fleet trace"):
        workload.read_trace(path)
    path.write_text("")
    with pytest.raises(ValueError, match=":1:"):
        workload.read_trace(path)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sessions", 0),
        ("agent_share", 1.5),
        ("agent_share", -0.1),
        ("burst_size", 0),
        ("agent_share", 0.8),  # with document_share 0.3: over 1
        ("chat_turns", (4, 2)),
        ("user_tokens", (0, 5)),
        ("think_s", -1.0),
        ("arrival", "steady"),
        ("rate", 0.0),
        ("burst_every_s", 0.0),
        ("system_prompts", 0),
    ],
)
def test_bad_params_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TraceParams(document_share=0.3, **{field: value})  # type: ignore[arg-type]


def request(session: str, turn: int, *messages: tuple[str, str]) -> TraceRequest:
    return TraceRequest(
        session, turn, "chat", 0.0, 0.0, tuple({"role": r, "content": c} for r, c in messages), 8
    )


def test_describe_counts_the_prefixes_earlier_requests_share() -> None:
    system = ("system", "be brief and kind")  # 4 words
    first = request("chat-0000", 0, system, ("user", "hello there"))  # 6 words, nothing cached
    other = request(
        "chat-0001", 0, system, ("user", "hello again friend")
    )  # 7 words, the system prompt cached
    summary = workload.describe([first, other])
    assert summary["cached_share"] == pytest.approx(4 / 13)
    assert summary["prompt_words_total"] == 13 and summary["prompt_words_max"] == 7
    assert summary["sessions"] == {"chat": 2, "agent": 0, "document": 0} and summary["requests"] == 2
    # The first session's next turn: its whole previous prompt (6 words) is cached, the rest (3) is new.
    second = request(
        "chat-0000", 1, system, ("user", "hello there"), ("assistant", "hi"), ("user", "how are you")
    )
    assert workload.describe([first, other, second])["cached_share"] == pytest.approx((4 + 6) / (13 + 10))
    assert workload.describe([])["cached_share"] == 0.0
