"""`fleet bench migrate`'s pure parts: the trials' order, the prompts, the blocks a prompt leaves in the
tier, the client's gap (in-flight tokens of the dead worker do not end it), the hops of a request, the
timeline read from its trace, each trial's problems, the sides' summaries and goals, and its options
and dry run (`fleet bench migrate --dry-run` starts nothing)."""

from __future__ import annotations

import math
import sys

import pytest

from fleet_local.cli import bench_script
from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import migrate
from migrate import Trial

pytestmark = pytest.mark.unit


def fake_encode(text: str) -> list[int]:
    """One id per word, by the word's characters (no special tokens)."""
    return [sum(map(ord, word)) for word in text.split()]


def test_the_bench_is_registered_and_its_sides_alternate() -> None:
    assert bench_script("migrate") == REPO / "bench" / "migrate.py"
    assert migrate.trial_sides(2) == ["tier", "no_tier", "tier", "no_tier"]


def test_prompts_have_the_asked_length_and_start_with_their_nonce() -> None:
    first = migrate.prompt_ids(fake_encode, "Trial a1:", 2048)
    second = migrate.prompt_ids(fake_encode, "Trial b2:", 2048)
    assert len(first) == len(second) == 2048
    assert first[1] != second[1] and first[2:] == second[2:]  # the nonce alone tells them apart
    assert migrate.prompt_ids(fake_encode, "x", 3) == fake_encode("x the river")


def test_a_prompts_stored_blocks_never_hold_its_last_token() -> None:
    assert migrate.stored_blocks(2048, 256) == 7  # the 8th block holds the last token
    assert migrate.stored_blocks(2049, 256) == 8
    assert migrate.stored_blocks(255, 256) == migrate.stored_blocks(0, 256) == 0


def test_the_gap_runs_from_the_last_token_before_the_kill_to_the_continuations_first() -> None:
    # tokens every 0.1 s, the kill at 1.05, one token the dead worker had in flight at 1.06,
    # the continuation's first token at the tap at 2.5 (the client's text a little earlier), then a stall
    events = [0.1 * i for i in range(1, 11)] + [1.06, 2.49, 2.6, 4.6, 4.7]
    gap, later = migrate.client_gap(events, killed_at=1.05, resumed_at=2.5)
    assert gap == pytest.approx(2.49 - 1.0) and later == pytest.approx(2.0)
    assert all(math.isnan(v) for v in migrate.client_gap([0.5], killed_at=1.0, resumed_at=2.0))
    assert all(math.isnan(v) for v in migrate.client_gap([1.5], killed_at=1.0, resumed_at=1.5))


def test_a_requests_hops_are_its_own_streams_only() -> None:
    assert migrate.hop("cmpl-1", "cmpl-1") == 0
    assert migrate.hop("cmpl-1-m1", "cmpl-1") == 1 and migrate.hop("cmpl-1-m12", "cmpl-1") == 12
    assert migrate.hop("cmpl-2", "cmpl-1") == migrate.hop("cmpl-1-mx", "cmpl-1") == -1


def span(name: str, span_id: str, start: float, end: float, parent: str = "", **extra) -> dict:
    category = extra.pop("category", "other")
    return {"name": name, "span_id": span_id, "parent_id": parent, "category": category,
            "start_ns": int(start * 1e9), "end_ns": int(end * 1e9), "attributes": extra}  # fmt: skip


TRACE = [
    span("route", "r0", 0.0, 0.01, category="route"),
    span("generate", "s0", 0.01, 10.5, "root", category="stream", **{"fleet.hop": 0}),
    span("route", "r1", 10.5, 10.52, category="route"),
    span("generate", "s1", 10.52, 30.0, "root", category="stream", **{"fleet.hop": 1}),
    span("queue wait", "q1", 10.52, 10.53, "s1"),
    span("worker task", "t1", 10.53, 30.0, "s1"),
    span("kv prefetch (object storage)", "k1", 10.53, 10.8, "t1"),
    span("prefill", "p1", 10.8, 12.0, "t1"),
    span("prefill", "p0", 1.0, 9.0, "t0"),  # the dead worker's: never recorded, but not taken for hop 1's
]


def test_the_timeline_after_the_kill_is_read_from_the_continuations_spans() -> None:
    offsets = migrate.timeline(TRACE, killed_at_ns=10 * 10**9)
    assert offsets == pytest.approx(
        {"noticed": 0.5, "routed": 0.52, "taken": 0.53, "fetched": 0.8, "first_token": 2.0}
    )
    assert migrate.timeline(TRACE[:2], 0) == {}  # no second hop: nothing to say
    no_fetch = [s for s in TRACE if s["span_id"] != "k1"]
    assert "fetched" not in migrate.timeline(no_fetch, 10 * 10**9)


def moved_trial(side: str = "tier", cached: int = 1792) -> Trial:
    return Trial(
        side=side,
        request_id="cmpl-1",
        node="w1",
        event_times=[1.0, 1.1, 1.2, 3.0, 3.1],
        killed_at=1.25,
        killed_at_ns=10 * 10**9,
        resumed_at=3.0,
        tokens_at_kill=3,
        tier_blocks=7,
        hops={
            0: {"prompt_time_s": 10.0, "prefix_cached_tokens": 0, "prompt_tokens": 2048, "tokens": 3},
            1: {"prompt_time_s": 2.0, "prefix_cached_tokens": cached, "prompt_tokens": 2048, "tokens": 2},
        },
        completion_tokens=5,
        migrations=1,
        spans=TRACE,
    )


def test_a_trial_row_has_its_gap_ratio_and_what_the_continuation_prefilled() -> None:
    row = migrate.trial_row(moved_trial(), max_tokens=5)
    assert row["problems"] == [] and row["flags"] == []
    assert row["gap_s"] == pytest.approx(1.8) and row["later_stall_s"] == pytest.approx(0.1)
    assert row["resumed_over_cold"] == pytest.approx(0.2)
    assert row["resumed_prefilled_tokens"] == 2048 + 3 - 1792
    assert row["timeline_s"]["client"] == pytest.approx(1.75) and row["timeline_s"][
        "noticed"
    ] == pytest.approx(0.5)


def test_trials_that_do_not_measure_what_they_should_are_named() -> None:
    leaked = migrate.trial_row(moved_trial("no_tier", cached=1792), max_tokens=5)
    assert leaked["problems"] == ["the continuation reused 1792 tokens without the tier"]
    assert migrate.trial_row(moved_trial("tier", cached=0), 5)["flags"] == [
        "the continuation reused no block"
    ]
    assert migrate.trial_row(moved_trial(), max_tokens=6)["problems"] == ["5 of 6 tokens"]
    unmoved = moved_trial()
    unmoved.migrations, unmoved.hops = 0, {0: unmoved.hops[0]}
    assert "the request did not move" in migrate.trial_row(unmoved, 5)["problems"]
    never = Trial(side="tier", errors=["stream over before the kill"], completion_tokens=5)
    assert migrate.trial_row(never, 5)["problems"] == ["stream over before the kill", "no kill"]


def test_the_summary_counts_good_trials_per_side_and_checks_the_goals() -> None:
    good = migrate.trial_row(moved_trial(), 5)
    slow = migrate.trial_row(moved_trial("no_tier", cached=0), 5) | {"gap_s": 12.0, "resumed_over_cold": 1.1}
    broken = migrate.trial_row(moved_trial(), 6)
    summary = migrate.summarize([good, slow, broken])
    assert summary["tier"]["trials"] == 1 and summary["tier"]["failed"] == 1
    assert summary["tier"]["gap_p99_s"] == pytest.approx(1.8) and summary["no_tier"]["gap_p50_s"] == 12.0
    assert summary["goals"] == {"gap_p99_with_tier_le_2s": True, "resumed_over_cold_with_tier_le_0.3": True}
    lines = migrate.report_lines(summary)
    assert lines[0].startswith("with the tier  gap p50 1.80 s") and "n=1, 1 failed" in lines[0]
    assert "after the kill (p50): noticed 0.50 s" in lines[1]
    assert lines[-2] == "with / without the tier: gap p50 0.15x, resumed prefill p50 1.00x"
    assert lines[-1] == "goals (with the tier): gap p99 <= 2 s met; resumed <= 0.3 x cold met"
    assert migrate.summarize([slow])["goals"]["gap_p99_with_tier_le_2s"] is False  # no tier trial counted


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--trials", "0"], "--trials must be at least 1"),
        (["--kill-after", "96"], "--kill-after must be between 1"),
        (["--engine", "llamacpp"], "invalid choice"),
    ],
)
def test_options_that_do_not_fit_are_refused(argv: list[str], error: str, capsys) -> None:
    with pytest.raises(SystemExit):
        migrate.parse_args(argv)
    assert error in capsys.readouterr().err


def test_a_dry_run_prints_the_plan_and_starts_nothing(capsys) -> None:
    assert migrate.main(["--dry-run", "--trials", "2", "--engine", "mlx"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "plan: 4 trials (2 a side, alternating: tier, no_tier, tier, no_tier, ...)"
    assert "w1 and w2 each a mlx instance of HuggingFaceTB/SmolLM2-135M-Instruct" in out[1]
    assert '"max_tokens": 96' in out[2] and '"ignore_eos": true' in out[2] and "SIGKILL" in out[3]
    assert migrate.parse_args(["--tiny"]).max_tokens == migrate.TINY_MAX_TOKENS
