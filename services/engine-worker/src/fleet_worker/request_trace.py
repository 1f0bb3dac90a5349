"""A request's spans on the worker that decodes it.

The engine runs in its own process and reports times, not spans, so the worker notes when each
stage began and ended (RequestTrace) and records most spans in one go at the request's end, under
the gateway's generate span (GenerateTask.traceparent):

    queue (published -> taken), then worker task: kv prefetch, transfer (a disaggregated
    request's KV, with its bytes), prefill (submitted -> first token, with the prompt tokens the
    engine found cached), decode (-> last token), and under decode "decode steps": back-to-back
    windows of at least DETAIL_EVERY engine outputs each, with the tokens and outputs they cover,
    for the first MAX_STEP_SPANS windows. A window ends only between two bursts: the engine process
    holds its outputs up to stream_interval_ms and sends them together, so a window is one burst
    (or DETAIL_EVERY single outputs when nothing holds them) and never a few microseconds wide.

The worker task and kv transfer spans are live (started when their stage starts) because the
prefill worker's own spans of a handoff hang from kv transfer: its PrefillRequest is sent under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import Span, StatusCode, set_span_in_context

from fleet_proto import HandoffStats
from fleet_proto.messages import GenerationOutput
from fleet_runtime.tracing import DETAIL_EVERY, Tracing

MAX_STEP_SPANS = 64  # per request: a very long stream's later outputs are only in its decode span
BURST_GAP_NS = 1_000_000  # outputs closer than this arrived together (one send of the engine process)


@dataclass
class RequestTrace:
    parent: Context  # the gateway's generate span
    sent_at_ns: int  # the gateway's clock
    received_ns: int
    task: Span  # "worker task", from received_ns to the request's end
    kv_fetch: tuple[int, int, int] | None = None  # start, end, blobs fetched
    submitted_ns: int = 0
    first_output_ns: int = 0
    last_output_ns: int = 0
    window: tuple[int, int, int] = (0, 0, 0)  # the open window of outputs: start, tokens, outputs
    steps: list[tuple[int, int, int, int]] = field(default_factory=list)  # start, end, tokens, outputs

    def on_output(self, at_ns: int, tokens: int) -> None:
        """An engine output with `tokens` new tokens arrived at `at_ns`."""
        if not self.first_output_ns:
            self.first_output_ns = self.last_output_ns = at_ns
            self.window = (at_ns, 0, 0)
            return
        if self.window[2] >= DETAIL_EVERY and at_ns - self.last_output_ns > BURST_GAP_NS:
            self.close_window()
            self.window = (self.last_output_ns, 0, 0)
        start, window_tokens, outputs = self.window
        self.window = (start, window_tokens + tokens, outputs + 1)
        self.last_output_ns = at_ns

    def close_window(self) -> None:
        start, tokens, outputs = self.window
        if outputs and len(self.steps) < MAX_STEP_SPANS:
            self.steps.append((start, self.last_output_ns, tokens, outputs))


def start_request_trace(tracing: Tracing, parent: Context, sent_at_ns: int, received_ns: int) -> RequestTrace:
    task = tracing.start_span("worker task", "other", parent=parent, start_ns=received_ns)
    return RequestTrace(parent, sent_at_ns, received_ns, task)


def start_transfer(tracing: Tracing, trace: RequestTrace, start_ns: int) -> Span:
    """The live kv transfer span: the PrefillRequest goes out under it (bus headers)."""
    return tracing.start_span(
        "kv transfer", "transfer", parent=set_span_in_context(trace.task), start_ns=start_ns
    )


def end_transfer(span: Span, stats: HandoffStats, end_ns: int) -> None:
    span.set_attributes(
        {
            "fleet.bytes": stats.bytes,
            "fleet.chunks": stats.chunks,
            "fleet.tokens": stats.tokens,
            "fleet.transport": stats.transport,
            "fleet.prefill_worker_id": stats.prefill_worker_id,
            "fleet.fallback": stats.fallback,
            "fleet.prefill_s": stats.prefill_s,
        }
    )
    if stats.fallback:
        span.set_status(StatusCode.ERROR, stats.fallback)
    span.end(end_time=end_ns)


def record_cancelled_transfer(tracing: Tracing, trace: RequestTrace, transfer: Span, end_ns: int) -> None:
    """A request cancelled while its KV was on the way: its live spans end there, marked cancelled
    (the engine never saw it: no prefill or decode spans)."""
    transfer.set_status(StatusCode.ERROR, "cancelled")
    transfer.end(end_time=end_ns)
    record_request(tracing, trace, end_ns, GenerationOutput(request_id="", error="cancelled"))


def record_request(
    tracing: Tracing,
    trace: RequestTrace,
    end_ns: int,
    final: GenerationOutput,
) -> None:
    """The spans of a finished request; `final`: its last output (tokens, error)."""
    if trace.sent_at_ns:  # clocks of two machines: a negative wait is skew, shown as none
        queued = min(trace.sent_at_ns, trace.received_ns)
        tracing.record("queue wait", "queue", queued, trace.received_ns, trace.parent)
    under = set_span_in_context(trace.task)
    if trace.kv_fetch is not None:
        start, end, blobs = trace.kv_fetch
        tracing.record("kv prefetch (object storage)", "kv", start, end, under, {"fleet.blobs": blobs})
    if trace.submitted_ns:
        first = trace.first_output_ns or end_ns
        cached = {"fleet.prefix_cached_tokens": final.prefix_cached_tokens}
        tracing.record("prefill", "prefill", trace.submitted_ns, first, under, cached)
        if trace.first_output_ns:
            tokens = {"fleet.tokens": final.completion_tokens}
            decode = tracing.record("decode", "decode", first, end_ns, under, tokens)
            trace.close_window()
            for start, end, step_tokens, outputs in trace.steps:
                counts = {"fleet.tokens": step_tokens, "fleet.outputs": outputs}
                tracing.record("decode steps", "decode", start, end, decode, counts)
    if final.error:
        trace.task.set_status(StatusCode.ERROR, final.error)
    trace.task.end(end_time=max(end_ns, trace.received_ns))
