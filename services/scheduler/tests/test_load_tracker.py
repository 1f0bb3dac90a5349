"""The scheduler's load term (LoadTracker): what a new request waits behind, in prompt tokens. Pure:
NodeMetrics built here, no NATS."""

from __future__ import annotations

import pytest

from fleet_proto import NodeMetrics
from fleet_scheduler.main import LoadTracker

pytestmark = pytest.mark.unit


def metrics(**fields) -> NodeMetrics:
    return NodeMetrics(
        node_id="n1", at=1.0, memory_used_bytes=0, memory_available_bytes=0, cpu_percent=0.0,
        disk_free_bytes=0, **fields,
    )  # fmt: skip


def test_a_request_decoding_weighs_one_token_not_its_context() -> None:
    """A conversation's last turn still streaming must not weigh as its whole history, or its next
    turn is sent away from that history's KV."""
    tracker = LoadTracker()
    tracker.on_metrics(metrics(active_requests={"i1": 1}, running_tokens={"i1": 1800}))
    assert tracker.load() == {"i1": 1}


def test_prompt_tokens_still_to_prefill_and_routed_work_since_the_report_count() -> None:
    tracker = LoadTracker()
    tracker.on_metrics(metrics(active_requests={"i1": 3, "i2": 0}, queued_tokens={"i1": 500}))
    tracker.on_routed("i2", 120)
    tracker.on_routed("i2", 30)
    assert tracker.load() == {"i1": 503, "i2": 150}
    tracker.on_metrics(metrics(active_requests={"i1": 0, "i2": 2}, queued_tokens={"i2": 40}))
    assert tracker.load() == {"i1": 0, "i2": 42}  # the report takes in what was routed before it
