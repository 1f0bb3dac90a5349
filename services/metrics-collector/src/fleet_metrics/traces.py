"""The in-cluster trace store: the recent traces' spans, bounded, looked up by trace or request id.

Bounded twice, so a burst of requests or a runaway decode loop cannot grow it without end: at most
`max_traces` traces (the oldest by first arrival go first) and `max_spans` spans per trace (later
ones are counted in `dropped_spans`, not kept).
"""

from __future__ import annotations

from collections import OrderedDict

from fleet_proto.traces import REQUEST_ID_ATTRIBUTE, SpanRecord, TraceSummary, summarize


class TraceStore:
    def __init__(self, max_traces: int = 1000, max_spans: int = 2000) -> None:
        self._max_traces = max_traces
        self._max_spans = max_spans
        self._traces: OrderedDict[str, list[SpanRecord]] = OrderedDict()
        self._by_request: dict[str, str] = {}  # request id -> trace id
        self.dropped_spans = 0

    def add(self, spans: tuple[SpanRecord, ...] | list[SpanRecord]) -> None:
        for span in spans:
            trace = self._traces.get(span.trace_id)
            if trace is None:
                trace = self._traces[span.trace_id] = []
                self._evict()
            if len(trace) >= self._max_spans:
                self.dropped_spans += 1
                continue
            trace.append(span)
            if request_id := span.attributes.get(REQUEST_ID_ATTRIBUTE):
                self._by_request[str(request_id)] = span.trace_id

    def _evict(self) -> None:
        while len(self._traces) > self._max_traces:
            trace_id, _ = self._traces.popitem(last=False)
            for request_id in [r for r, t in self._by_request.items() if t == trace_id]:
                del self._by_request[request_id]

    def trace_id(self, key: str) -> str:
        """The trace id `key` names: a trace id, or a request id (chatcmpl-...); "" if unknown."""
        if key in self._traces:
            return key
        return self._by_request.get(key, "")

    def get(self, key: str) -> list[SpanRecord]:
        """The trace's spans by start time ([] if unknown)."""
        return sorted(self._traces.get(self.trace_id(key), ()), key=lambda s: (s.start_ns, s.end_ns))

    def summaries(self, limit: int = 100) -> list[TraceSummary]:
        """The newest traces first."""
        newest = list(self._traces.items())[-limit:] if limit > 0 else []
        return [summarize(trace_id, spans) for trace_id, spans in reversed(newest)]

    def delete(self, key: str = "") -> int:
        """Forget one trace (by trace or request id), or every trace with no key; how many."""
        if not key:
            count = len(self._traces)
            self._traces.clear()
            self._by_request.clear()
            return count
        trace_id = self.trace_id(key)
        if not trace_id:
            return 0
        del self._traces[trace_id]
        for request_id in [r for r, t in self._by_request.items() if t == trace_id]:
            del self._by_request[request_id]
        return 1
