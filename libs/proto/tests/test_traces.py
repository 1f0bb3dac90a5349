"""Trace arithmetic: self times, per-category stats that add up to the root, summaries (pure)."""

import pytest

from fleet_proto.traces import REQUEST_ID_ATTRIBUTE, SpanRecord, root_span, self_times, summarize, trace_stats

pytestmark = pytest.mark.unit

MS = 1_000_000


def span(
    span_id: str, parent: str, start: int, end: int, category: str, service: str = "gateway"
) -> SpanRecord:
    attributes = {REQUEST_ID_ATTRIBUTE: "chatcmpl-1"} if not parent else {}
    return SpanRecord(
        trace_id="t1",
        span_id=span_id,
        parent_id=parent,
        name=span_id,
        service=service,
        start_ns=start * MS,
        end_ns=end * MS,
        category=category,
        attributes=attributes,
    )


# http 0-100 > route 5-10, generate 10-95 > (worker) queue 12-15, prefill 15-40, decode 40-90
# (two decode steps inside decode; a late child runs past the root)
SPANS = [
    span("http", "", 0, 100, "http"),
    span("route", "http", 5, 10, "route", "scheduler"),
    span("generate", "http", 10, 95, "stream"),
    span("queue", "generate", 12, 15, "queue", "engine-worker"),
    span("prefill", "generate", 15, 40, "prefill", "engine-worker"),
    span("decode", "generate", 40, 90, "decode", "engine-worker"),
    span("step1", "decode", 41, 60, "decode", "engine-worker"),
    span("step2", "decode", 60, 70, "decode", "engine-worker"),
    span("late", "http", 98, 130, "other"),  # a child past its parent's end is clipped to it
    span("later", "late", 110, 120, "other"),  # and so are its children: wholly past the root
]


def test_self_time_is_a_span_less_the_union_of_its_children() -> None:
    own = self_times(SPANS)
    assert own["http"] == (100 - 5 - 85 - 2) * MS  # route, generate, and 98-100 of the late child
    assert own["generate"] == (85 - 3 - 25 - 50) * MS
    assert own["decode"] == (50 - 29) * MS
    overlapping = [SPANS[5], SPANS[6], span("again", "decode", 55, 70, "decode")]
    assert self_times(overlapping)["decode"] == (50 - 29) * MS  # the union of children counts once
    assert own["late"] == 2 * MS and own["later"] == 0  # only what the root waited for counts


def test_categories_add_up_to_the_root_and_name_their_services() -> None:
    stats = trace_stats("t1", SPANS)
    assert stats.duration_ns == 100 * MS
    by = {c.category: c for c in stats.categories}
    assert by["decode"].count == 3 and by["decode"].self_ns == 50 * MS
    assert by["prefill"].self_ns == 25 * MS and by["route"].self_ns == 5 * MS
    assert stats.categories[0].category == "decode"
    # the late child's time past the root's end is nobody's: the categories add up to the root
    assert sum(c.self_ns for c in stats.categories) == 100 * MS
    services = {s.service: s.self_ns for s in stats.services}
    assert services["engine-worker"] == (3 + 25 + 50) * MS


def test_the_root_and_summary_of_a_trace() -> None:
    assert root_span(SPANS).span_id == "http"
    assert root_span([]) is None
    summary = summarize("t1", SPANS)
    assert (summary.request_id, summary.name, summary.duration_ns, summary.spans) == (
        "chatcmpl-1",
        "http",
        100 * MS,
        10,
    )
    assert summary.services == ("engine-worker", "gateway", "scheduler")
