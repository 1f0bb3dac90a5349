"""Request traces: the spans every service records for a request, and what they add up to (pure).

A span is one timed piece of a request's work in one service (HTTP receive, tokenize, route
decision, queue wait, KV lookup and fetch per tier, transfer, prefill, decode steps, detokenize,
stream write). Spans of one request share its W3C trace id; each names its parent span, so a trace
is a tree rooted at the gateway's HTTP span. Services publish finished spans in batches
(SpanBatch); the metrics-collector keeps the recent traces and answers the queries below.

`trace_stats` is exo's compute_stats in this shape: time per category counts each span's *self*
time (its duration less the time its children cover), so the categories of a trace add up to the
root span's duration and nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fleet_proto.common import Frozen

# What each span's time was spent on (fleet.category); the route, kv and transfer spans carry the
# reason, tier and bytes as attributes.
SPAN_CATEGORIES = (
    "http",
    "tokenize",
    "route",
    "queue",
    "kv",
    "transfer",
    "prefill",
    "decode",
    "detokenize",
    "stream",
    "other",
)
CATEGORY_ATTRIBUTE = "fleet.category"
REQUEST_ID_ATTRIBUTE = "fleet.request_id"

AttributeValue = str | int | float | bool


class SpanRecord(Frozen):
    trace_id: str  # 32 hex digits (W3C trace-id)
    span_id: str  # 16 hex digits
    name: str
    service: str  # the service kind: gateway, scheduler, engine-worker...
    start_ns: int  # wall clock, ns since the epoch
    end_ns: int
    parent_id: str = ""  # "" for the trace's root
    service_id: str = ""
    category: str = "other"
    error: str = ""
    attributes: dict[str, AttributeValue] = {}

    @property
    def duration_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)


class SpanBatch(Frozen):
    """Finished spans of one service, published together (fleet.traces.spans)."""

    spans: tuple[SpanRecord, ...]


class TraceSummary(Frozen):
    trace_id: str
    request_id: str
    name: str  # the root span's
    start_ns: int
    duration_ns: int
    spans: int
    services: tuple[str, ...]
    error: str = ""


class CategoryStats(Frozen):
    category: str
    count: int
    self_ns: int  # time in spans of this category not covered by their children
    share: float  # of the trace's duration


class ServiceStats(Frozen):
    service: str
    count: int
    self_ns: int


class TraceStats(Frozen):
    trace_id: str
    duration_ns: int
    categories: tuple[CategoryStats, ...]  # largest first
    services: tuple[ServiceStats, ...]


def root_span(spans: Sequence[SpanRecord]) -> SpanRecord | None:
    """The span with no parent in the trace (the earliest if several), else the earliest span."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if not s.parent_id or s.parent_id not in ids]
    candidates = roots or list(spans)
    return min(candidates, key=lambda s: (s.start_ns, -s.end_ns)) if candidates else None


def _covered(start: int, end: int, intervals: Iterable[tuple[int, int]]) -> int:
    """How much of [start, end) the union of `intervals` covers."""
    total, reach = 0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def windows(spans: Sequence[SpanRecord]) -> dict[str, tuple[int, int]]:
    """Span id -> the part of it inside its ancestors: a remote child that outlives its parent (a
    prefill worker cleaning up after the decoder has its bytes) is not time the parent waited for."""
    by_id = {s.span_id: s for s in spans}
    found: dict[str, tuple[int, int]] = {}

    def window(span: SpanRecord, below: frozenset[str]) -> tuple[int, int]:
        if span.span_id not in found:
            parent = by_id.get(span.parent_id)
            outer = (
                window(parent, below | {span.span_id})
                if parent is not None and parent.span_id not in below
                else (span.start_ns, span.end_ns)
            )
            start = min(max(span.start_ns, outer[0]), outer[1])
            found[span.span_id] = (start, max(start, min(span.end_ns, outer[1])))
        return found[span.span_id]

    return {s.span_id: window(s, frozenset()) for s in spans}


def self_times(spans: Sequence[SpanRecord]) -> dict[str, int]:
    """Span id -> its window (its part inside its ancestors) less the union of its children's."""
    inside = windows(spans)
    children: dict[str, list[tuple[int, int]]] = {}
    for span in spans:
        if span.parent_id:
            children.setdefault(span.parent_id, []).append(inside[span.span_id])
    own = {}
    for span in spans:
        start, end = inside[span.span_id]
        own[span.span_id] = end - start - _covered(start, end, children.get(span.span_id, ()))
    return own


def trace_stats(trace_id: str, spans: Sequence[SpanRecord]) -> TraceStats:
    root = root_span(spans)
    duration = root.duration_ns if root is not None else 0
    own = self_times(spans)
    by_category: dict[str, list[int]] = {}
    by_service: dict[str, list[int]] = {}
    for span in spans:
        for table, key in ((by_category, span.category), (by_service, span.service)):
            entry = table.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += own[span.span_id]
    categories = sorted(
        (
            CategoryStats(category=c, count=n, self_ns=t, share=t / duration if duration else 0.0)
            for c, (n, t) in by_category.items()
        ),
        key=lambda c: (-c.self_ns, c.category),
    )
    services = sorted(
        (ServiceStats(service=s, count=n, self_ns=t) for s, (n, t) in by_service.items()),
        key=lambda s: (-s.self_ns, s.service),
    )
    return TraceStats(
        trace_id=trace_id, duration_ns=duration, categories=tuple(categories), services=tuple(services)
    )


def request_id_of(spans: Iterable[SpanRecord]) -> str:
    return next((str(v) for s in spans if (v := s.attributes.get(REQUEST_ID_ATTRIBUTE))), "")


def summarize(trace_id: str, spans: Sequence[SpanRecord]) -> TraceSummary:
    root = root_span(spans)
    return TraceSummary(
        trace_id=trace_id,
        request_id=request_id_of(spans),
        name=root.name if root is not None else "",
        start_ns=root.start_ns if root is not None else 0,
        duration_ns=root.duration_ns if root is not None else 0,
        spans=len(spans),
        services=tuple(sorted({s.service for s in spans})),
        error=next((s.error for s in spans if s.error), ""),
    )


# -- queries, gateway -> metrics-collector (request/reply) ------------------------------------------
class TraceListRequest(Frozen):
    limit: int = 100


class TraceListReply(Frozen):
    traces: tuple[TraceSummary, ...] = ()


class TraceRequest(Frozen):
    key: str  # a trace id or a request id


class TraceReply(Frozen):
    trace_id: str = ""  # "": no such trace
    spans: tuple[SpanRecord, ...] = ()
    stats: TraceStats | None = None


class TraceDeleteRequest(Frozen):
    key: str = ""  # "": every trace


class TraceDeleteReply(Frozen):
    deleted: int = 0
