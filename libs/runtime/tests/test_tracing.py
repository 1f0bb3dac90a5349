"""A service's Tracing: spans become SpanRecords with their parents and categories, a traceparent
carries a trace into another service's Tracing, sampling at the root decides for the whole trace."""

from __future__ import annotations

import pytest

from fleet_bus.trace_context import is_sampled, remote_context, traceparent
from fleet_proto.traces import REQUEST_ID_ATTRIBUTE
from fleet_runtime.tracing import DETAIL_EVERY, Tracing

pytestmark = pytest.mark.unit


def test_spans_nest_and_carry_their_category_and_attributes() -> None:
    tracing = Tracing("gateway", "gateway-1")
    with tracing.span("http", "http", {REQUEST_ID_ATTRIBUTE: "chatcmpl-1"}) as root:
        with tracing.span("tokenize", "tokenize"):
            pass
        tracing.record("prefill", "prefill", 10, 5, parent=root, error="engine exited")
    records = {r.name: r for r in tracing.processor.take()}
    http, tokenize, prefill = records["http"], records["tokenize"], records["prefill"]
    assert http.parent_id == "" and tokenize.parent_id == prefill.parent_id == http.span_id
    assert {r.trace_id for r in records.values()} == {http.trace_id} and len(http.trace_id) == 32
    assert (tokenize.category, http.attributes, http.service_id) == (
        "tokenize",
        {REQUEST_ID_ATTRIBUTE: "chatcmpl-1"},
        "gateway-1",
    )
    assert (prefill.start_ns, prefill.end_ns, prefill.error) == (10, 10, "engine exited")
    assert tracing.processor.take() == ()


def test_a_leaf_span_hangs_from_the_current_span_without_becoming_it() -> None:
    tracing = Tracing("gateway", "gateway-1")
    with tracing.span("http", "http"):
        with tracing.leaf("detokenize", "detokenize", {"fleet.tokens": 3}):
            tracing.record("inside", "other", 1, 2)  # its parent is the current span: http
        try:
            with tracing.leaf("stream write", "stream"):
                raise ConnectionResetError("client went away")
        except ConnectionResetError:
            pass
    records = {r.name: r for r in tracing.processor.take()}
    http = records["http"]
    assert records["detokenize"].parent_id == records["inside"].parent_id == http.span_id
    assert records["detokenize"].attributes == {"fleet.tokens": 3}
    assert records["detokenize"].end_ns >= records["detokenize"].start_ns > 0
    assert records["stream write"].error == "client went away"


def test_per_output_work_gets_a_span_for_the_first_and_then_every_detail_every_th_output() -> None:
    tracing = Tracing("gateway", "gateway-1")
    with tracing.span("http", "http"):
        for n in range(2 * DETAIL_EVERY + 1):
            with tracing.output_leaf(n, "detokenize", "detokenize", {"fleet.output": n}):
                pass
    leaves = [r for r in tracing.processor.take() if r.name == "detokenize"]
    assert [r.attributes["fleet.output"] for r in leaves] == [0, DETAIL_EVERY, 2 * DETAIL_EVERY]


def test_a_traceparent_continues_the_trace_in_another_service() -> None:
    gateway, worker = Tracing("gateway", "g"), Tracing("engine-worker", "w")
    with gateway.span("generate", "stream"):
        header = traceparent()
    with worker.span("decode", "decode", parent=remote_context(header)):
        pass
    (sent,), (received,) = gateway.processor.take(), worker.processor.take()
    assert (received.trace_id, received.parent_id, received.service) == (
        sent.trace_id,
        sent.span_id,
        "engine-worker",
    )
    assert remote_context("") is None and remote_context({"other": "x"}) is None


def test_the_root_samples_and_the_rest_follow() -> None:
    unsampled, follower = Tracing("gateway", "g", sample_rate=0.0), Tracing("scheduler", "s")
    with unsampled.span("http", "http"):
        header = traceparent()
    with follower.span("route", "route", parent=remote_context(header)):
        pass
    assert unsampled.processor.take() == () and follower.processor.take() == ()
    assert not is_sampled(remote_context(header)) and not is_sampled(None)
    with follower.span("route", "route"):
        assert is_sampled(remote_context(traceparent()))
