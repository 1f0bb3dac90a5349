"""A finished request's spans on its worker (pure timings in, spans out through a real Tracing):
the stages hang from the gateway's span in order, sampled decode steps hang from decode, and the
categories add up to the worker task plus its queue wait."""

from __future__ import annotations

from opentelemetry.trace import set_span_in_context

from fleet_proto import HandoffStats
from fleet_proto.messages import GenerationOutput
from fleet_proto.traces import trace_stats
from fleet_runtime.tracing import DETAIL_EVERY, Tracing
from fleet_worker.request_trace import MAX_STEP_SPANS, RequestTrace, record_request

MS = 1_000_000


def traced_request(outputs: int) -> tuple[Tracing, RequestTrace, object]:
    """A trace whose request was sent at 1 ms, taken at 2 ms, submitted at 5 ms, and gave `outputs`
    outputs of 4 tokens 10 ms apart from 20 ms on."""
    tracing = Tracing("engine-worker", "w1")
    generate = tracing.record("generate", "stream", 0, 1000 * MS)
    trace = RequestTrace(set_span_in_context(generate), sent_at_ns=1 * MS, received_ns=2 * MS)
    trace.submitted_ns = 5 * MS
    for n in range(outputs):
        trace.on_output((20 + 10 * n) * MS, 4)
    return tracing, trace, generate


def test_the_stages_hang_from_the_gateway_span_in_order() -> None:
    tracing, trace, _ = traced_request(outputs=3)
    trace.transfer = (3 * MS, 4 * MS)
    handoff = HandoffStats(bytes=4096, chunks=3, tokens=40, transport="stream", prefill_worker_id="w2")
    final = GenerationOutput(request_id="r", completion_tokens=12, prefix_cached_tokens=16, handoff=handoff)
    record_request(tracing, trace, 45 * MS, final)
    spans = {s.name: s for s in tracing.processor.take()}
    task, decode = spans["worker task"], spans["decode"]
    assert spans["queue wait"].parent_id == task.parent_id == spans["generate"].span_id
    assert {spans[n].parent_id for n in ("kv transfer", "prefill", "decode")} == {task.span_id}
    assert (spans["queue wait"].start_ns, spans["queue wait"].end_ns) == (1 * MS, 2 * MS)
    assert (spans["prefill"].start_ns, spans["prefill"].end_ns) == (5 * MS, 20 * MS)
    assert spans["prefill"].attributes["fleet.prefix_cached_tokens"] == 16
    assert spans["kv transfer"].attributes["fleet.bytes"] == 4096
    assert (decode.start_ns, decode.end_ns, decode.attributes["fleet.tokens"]) == (20 * MS, 45 * MS, 12)
    assert spans["decode steps"].parent_id == decode.span_id
    assert (spans["decode steps"].start_ns, spans["decode steps"].end_ns) == (20 * MS, 30 * MS)


def test_decode_steps_are_sampled_and_bounded() -> None:
    outputs = 1 + DETAIL_EVERY * (MAX_STEP_SPANS + 5)
    tracing, trace, _ = traced_request(outputs)
    final = GenerationOutput(request_id="r", completion_tokens=4 * outputs)
    record_request(tracing, trace, (30 + 10 * outputs) * MS, final)
    steps = [s for s in tracing.processor.take() if s.name == "decode steps"]
    assert len(steps) == MAX_STEP_SPANS
    # the 1st output after the first token, then every DETAIL_EVERY-th
    assert [s.start_ns for s in steps[:2]] == [20 * MS, (20 + 10 * DETAIL_EVERY) * MS]
    assert all(s.end_ns - s.start_ns == 10 * MS for s in steps)


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
    trace = RequestTrace(None, sent_at_ns=5 * MS, received_ns=2 * MS)  # the sender's clock runs ahead
    record_request(tracing, trace, 3 * MS, GenerationOutput(request_id="r", error="no KV"))
    spans = {s.name: s for s in tracing.processor.take()}
    assert set(spans) == {"queue wait", "worker task"}
    assert spans["queue wait"].end_ns == spans["queue wait"].start_ns  # skew shows as no wait
    assert spans["worker task"].error == "no KV"
