"""The bounded trace store: by trace or request id, newest first, eviction, span cap, delete."""

import pytest

from fleet_metrics.traces import TraceStore
from fleet_proto.traces import REQUEST_ID_ATTRIBUTE, SpanRecord

pytestmark = pytest.mark.unit


def span(trace: int, n: int, root: bool = False) -> SpanRecord:
    return SpanRecord(
        trace_id=f"{trace:032x}",
        span_id=f"{n:016x}",
        parent_id="" if root else f"{0:016x}",
        name=f"s{n}",
        service="gateway",
        start_ns=1000 * trace + n,
        end_ns=1000 * trace + n + 10,
        attributes={REQUEST_ID_ATTRIBUTE: f"req-{trace}"} if root else {},
    )


def test_traces_are_found_by_trace_or_request_id_and_listed_newest_first() -> None:
    store = TraceStore()
    store.add([span(1, 0, root=True), span(2, 0, root=True), span(1, 1)])
    assert [s.span_id for s in store.get(f"{1:032x}")] == [f"{0:016x}", f"{1:016x}"]
    assert store.get("req-2") and store.get("nope") == []
    assert [t.request_id for t in store.summaries()] == ["req-2", "req-1"]
    assert [t.request_id for t in store.summaries(limit=1)] == ["req-2"]


def test_the_oldest_trace_goes_first_and_a_trace_keeps_at_most_max_spans() -> None:
    store = TraceStore(max_traces=2, max_spans=3)
    store.add([span(t, 0, root=True) for t in (1, 2, 3)])
    assert store.trace_id("req-1") == "" and store.trace_id("req-3") == f"{3:032x}"
    store.add([span(3, n) for n in range(1, 6)])
    assert len(store.get("req-3")) == 3 and store.dropped_spans == 3


def test_delete_one_trace_or_all() -> None:
    store = TraceStore()
    store.add([span(t, 0, root=True) for t in (1, 2, 3)])
    assert store.delete("req-1") == 1 and store.delete("req-1") == 0
    assert store.delete() == 2 and store.summaries() == []
