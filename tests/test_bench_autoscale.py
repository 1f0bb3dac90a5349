"""`fleet bench autoscale`'s arithmetic (bench/autoscale.py), on made-up timelines: which requests
count as served by one instance or two, when the instance count changed, and what the report says."""

from __future__ import annotations

import math
import sys

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import autoscale

pytestmark = pytest.mark.unit


def test_ttfts_split_into_one_and_two_instance_phases_with_their_ratio():
    timeline = autoscale.Timeline(
        ttfts=[(1.0, 0.4), (2.0, 0.6), (9.0, 5.0), (12.0, 0.2), (13.0, 0.3), (30.0, 9.0)]
    )
    phases = autoscale.phase_ttfts(timeline, one_until=5.0, two_from=11.0, two_until=20.0)
    assert phases["one_instance"] == {"requests": 2, "p50": 0.5, "p90": pytest.approx(0.58)}
    assert phases["two_instances"]["requests"] == 2 and phases["two_instances"]["p50"] == 0.25
    assert phases["p50_two_over_one"] == pytest.approx(0.5)
    empty = autoscale.phase_ttfts(autoscale.Timeline(), 1.0, 2.0, 3.0)
    assert math.isnan(empty["p50_two_over_one"])


def test_the_first_time_a_count_is_reached_after_a_moment():
    seen = [(0.0, 1, 1), (4.0, 2, 1), (6.0, 2, 2), (20.0, 1, 1)]
    assert autoscale.first_at(seen, 1.0, live=2) == 4.0
    assert autoscale.first_at(seen, 1.0, ready=2) == 6.0
    assert autoscale.first_at(seen, 10.0, live=1) == 20.0
    assert math.isnan(autoscale.first_at(seen, 1.0, live=3))


def test_the_report_names_each_number_and_decision():
    result = {
        "ttft": {
            "one_instance": {"requests": 10, "p50": 1.0, "p90": 2.0},
            "two_instances": {"requests": 20, "p50": 0.5, "p90": 1.0},
            "p50_two_over_one": 0.5,
        },
        "second_instance_placed_after_join_s": 3.0,
        "second_instance_ready_after_join_s": 9.5,
        "scaled_down_after_load_s": 7.0,
        "cold_start": {"ttft_s": 6.2, "progress_comments": 1},
        "error_count": 0,
        "decisions": [{"kind": "scale_up", "instance_id": "auto-1-0", "reason": "1 -> 2 instances: ..."}],
    }
    text = "\n".join(autoscale.report_lines(result))
    assert "0.50x" in text and "ready 9.5 s" in text and "first token after 6.2 s" in text
    assert "scale_up   auto-1-0" in text
