"""A finished request's spans on its worker (pure timings in, spans out through a real Tracing):
the stages hang from the gateway's span in order, sampled decode steps hang from decode, and the
categories add up to the worker task plus its queue wait."""

from __future__ import annotations

from itertools import pairwise

import pytest
from opentelemetry.trace import set_span_in_context

from fleet_proto import HandoffStats
from fleet_proto.messages import GenerationOutput
from fleet_proto.traces import trace_stats
from fleet_runtime.tracing import DETAIL_EVERY, Tracing
from fleet_worker.request_trace import (
    BURST_GAP_NS,
    MAX_STEP_SPANS,
    RequestTrace,
    end_transfer,
    record_cancelled_transfer,
    record_request,
    start_request_trace,
    start_transfer,
)

pytestmark = pytest.mark.unit

MS = 1_000_000


def traced_request(outputs: int) -> tuple[Tracing, RequestTrace, object]:
    """A trace whose request was sent at 1 ms, taken at 2 ms, submitted at 5 ms, and gave `outputs`
    outputs of 4 tokens 10 ms apart from 20 ms on."""
    tracing = Tracing("engine-worker", "w1")
    generate = tracing.record("generate", "stream", 0, 1000 * MS)
    trace = start_request_trace(tracing, set_span_in_context(generate), sent_at_ns=1 * MS, received_ns=2 * MS)
    trace.submitted_ns = 5 * MS
    for n in range(outputs):
        trace.on_output((20 + 10 * n) * MS, 4)
    return tracing, trace, generate


def test_the_stages_hang_from_the_gateway_span_in_order() -> None:
    tracing, trace, _ = traced_request(outputs=3)
    handoff = HandoffStats(bytes=4096, chunks=3, tokens=40, transport="stream", prefill_worker_id="w2")
    end_transfer(start_transfer(tracing, trace, 3 * MS), handoff, 4 * MS)
    final = GenerationOutput(request_id="r", completion_tokens=12, prefix_cached_tokens=16)
    record_request(tracing, trace, 45 * MS, final)
    spans = {s.name: s for s in tracing.processor.take()}
    task, decode = spans["worker task"], spans["decode"]
    assert spans["queue wait"].parent_id == task.parent_id == spans["generate"].span_id
    assert {spans[n].parent_id for n in ("kv transfer", "prefill", "decode")} == {task.span_id}
    assert (spans["queue wait"].start_ns, spans["queue wait"].end_ns) == (1 * MS, 2 * MS)
    assert (spans["prefill"].start_ns, spans["prefill"].end_ns) == (5 * MS, 20 * MS)
    assert spans["prefill"].attributes["fleet.prefix_cached_tokens"] == 16
    assert spans["kv transfer"].attributes["fleet.bytes"] == 4096
    assert (spans["kv transfer"].start_ns, spans["kv transfer"].end_ns) == (3 * MS, 4 * MS)
    assert (task.start_ns, task.end_ns) == (2 * MS, 45 * MS)
    assert (decode.start_ns, decode.end_ns, decode.attributes["fleet.tokens"]) == (20 * MS, 45 * MS, 12)
    assert spans["decode steps"].parent_id == decode.span_id
    # two outputs after the first token: one open window, closed at the request's end
    assert (spans["decode steps"].start_ns, spans["decode steps"].end_ns) == (20 * MS, 40 * MS)
    assert (
        spans["decode steps"].attributes["fleet.tokens"],
        spans["decode steps"].attributes["fleet.outputs"],
    ) == (8, 2)


def test_decode_steps_cover_windows_of_outputs_back_to_back_and_are_bounded() -> None:
    outputs = 1 + DETAIL_EVERY * (MAX_STEP_SPANS + 5)
    tracing, trace, _ = traced_request(outputs)
    final = GenerationOutput(request_id="r", completion_tokens=4 * outputs)
    record_request(tracing, trace, (30 + 10 * outputs) * MS, final)
    steps = [s for s in tracing.processor.take() if s.name == "decode steps"]
    assert len(steps) == MAX_STEP_SPANS
    window = 10 * MS * DETAIL_EVERY
    assert [s.start_ns for s in steps[:2]] == [20 * MS, 20 * MS + window]  # from the first token on
    assert all(b.start_ns == a.end_ns for a, b in pairwise(steps))  # no gaps between windows
    assert all(s.end_ns - s.start_ns == window for s in steps)
    assert all(s.attributes["fleet.outputs"] == DETAIL_EVERY for s in steps)
    assert all(s.attributes["fleet.tokens"] == 4 * DETAIL_EVERY for s in steps)


def test_a_burst_of_outputs_is_one_window_never_split_inside() -> None:
    """The engine process sends the outputs it held (stream_interval_ms) together: bursts of a few
    more than DETAIL_EVERY outputs of one token, 10 us apart, every 50 ms; each window is one burst,
    50 ms wide."""
    burst_outputs = DETAIL_EVERY + 4
    tracing = Tracing("engine-worker", "w1")
    trace = start_request_trace(tracing, None, sent_at_ns=1 * MS, received_ns=2 * MS)
    trace.submitted_ns = 5 * MS
    trace.on_output(20 * MS, 1)  # the first token leaves at once
    for burst in range(4):
        for n in range(burst_outputs):
            trace.on_output((70 + 50 * burst) * MS + n * BURST_GAP_NS // 100, 1)
    final = GenerationOutput(request_id="r", completion_tokens=1 + 4 * burst_outputs)
    record_request(tracing, trace, 300 * MS, final)
    steps = [s for s in tracing.processor.take() if s.name == "decode steps"]
    assert [s.attributes["fleet.outputs"] for s in steps] == [burst_outputs] * 4
    assert all(s.attributes["fleet.tokens"] == burst_outputs for s in steps)
    assert steps[0].start_ns == 20 * MS
    assert all(b.start_ns == a.end_ns for a, b in pairwise(steps))
    widths = [(s.end_ns - s.start_ns) / MS for s in steps]
    assert all(49 < w < 51 for w in widths), widths


def test_the_categories_add_up_to_the_span_they_hang_from() -> None:
    tracing, trace, _ = traced_request(outputs=20)
    record_request(tracing, trace, 300 * MS, GenerationOutput(request_id="r", completion_tokens=80))
    spans = tracing.processor.take()
    stats = trace_stats(spans[0].trace_id, spans)
    assert stats.duration_ns == 1000 * MS  # the generate span is the root here
    assert sum(c.self_ns for c in stats.categories) == stats.duration_ns
    by_category = {c.category: c.self_ns for c in stats.categories}
    assert (by_category["queue"], by_category["prefill"], by_category["decode"]) == (
        1 * MS,
        15 * MS,
        280 * MS,
    )


def test_a_request_that_never_reached_its_engine_has_no_prefill() -> None:
    tracing = Tracing("engine-worker", "w1")
    trace = start_request_trace(tracing, None, sent_at_ns=5 * MS, received_ns=2 * MS)  # sender's clock ahead
    record_request(tracing, trace, 3 * MS, GenerationOutput(request_id="r", error="no KV"))
    spans = {s.name: s for s in tracing.processor.take()}
    assert set(spans) == {"queue wait", "worker task"}
    assert spans["queue wait"].end_ns == spans["queue wait"].start_ns  # skew shows as no wait
    assert spans["worker task"].error == "no KV"


def test_a_request_cancelled_while_its_kv_travels_ends_its_live_spans_marked_cancelled() -> None:
    tracing = Tracing("engine-worker", "w1")
    generate = tracing.record("generate", "stream", 0, 1000 * MS)
    trace = start_request_trace(tracing, set_span_in_context(generate), sent_at_ns=1 * MS, received_ns=2 * MS)
    record_cancelled_transfer(tracing, trace, start_transfer(tracing, trace, 3 * MS), 9 * MS)
    spans = {s.name: s for s in tracing.processor.take()}
    assert set(spans) == {"generate", "queue wait", "worker task", "kv transfer"}
    assert spans["kv transfer"].parent_id == spans["worker task"].span_id
    assert (spans["kv transfer"].end_ns, spans["worker task"].end_ns) == (9 * MS, 9 * MS)
    assert spans["kv transfer"].error == spans["worker task"].error == "cancelled"
