"""A request's spans on the worker that decodes it, recorded when it ends.

The engine runs in its own process and reports times, not spans, so the worker notes when each
stage began and ended (RequestTrace) and records the spans in one go at the request's end, under
the gateway's generate span (GenerateTask.traceparent):

    queue (published -> taken), then worker task: kv prefetch, transfer (a disaggregated
    request's KV, with its bytes), prefill (submitted -> first token, with the prompt tokens the
    engine found cached), decode (-> last token), and under decode the engine's steps between two
    of its outputs (one output carries the tokens of stream_interval_ms), for sampled outputs
    (fleet_runtime.tracing.detailed)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import set_span_in_context

from fleet_proto.messages import GenerationOutput
from fleet_runtime.tracing import Tracing, detailed

MAX_STEP_SPANS = 64  # per request: a very long stream keeps its first sampled steps


@dataclass
class RequestTrace:
    parent: Context
    sent_at_ns: int  # the gateway's clock
    received_ns: int
    kv_fetch: tuple[int, int, int] | None = None  # start, end, blobs fetched
    transfer: tuple[int, int] | None = None
    submitted_ns: int = 0
    first_output_ns: int = 0
    last_output_ns: int = 0
    outputs: int = 0  # outputs with tokens after the first
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # sampled: start, end, tokens

    def on_output(self, at_ns: int, tokens: int) -> None:
        """An engine output with `tokens` new tokens arrived at `at_ns`."""
        if not self.first_output_ns:
            self.first_output_ns = self.last_output_ns = at_ns
            return
        if detailed(self.outputs) and len(self.steps) < MAX_STEP_SPANS:
            self.steps.append((self.last_output_ns, at_ns, tokens))
        self.outputs += 1
        self.last_output_ns = at_ns


def record_request(
    tracing: Tracing,
    trace: RequestTrace,
    end_ns: int,
    final: GenerationOutput,
) -> None:
    """The spans of a finished request; `final`: its last output (tokens, handoff stats, error)."""
    handoff = final.handoff
    if trace.sent_at_ns:  # clocks of two machines: a negative wait is skew, shown as none
        queued = min(trace.sent_at_ns, trace.received_ns)
        tracing.record("queue wait", "queue", queued, trace.received_ns, trace.parent)
    task = tracing.record("worker task", "other", trace.received_ns, end_ns, trace.parent, error=final.error)
    under = set_span_in_context(task)
    if trace.kv_fetch is not None:
        start, end, blobs = trace.kv_fetch
        tracing.record("kv prefetch (object storage)", "kv", start, end, under, {"fleet.blobs": blobs})
    if trace.transfer is not None and handoff is not None:
        attributes = {
            "fleet.bytes": handoff.bytes,
            "fleet.chunks": handoff.chunks,
            "fleet.tokens": handoff.tokens,
            "fleet.transport": handoff.transport,
            "fleet.prefill_worker_id": handoff.prefill_worker_id,
            "fleet.fallback": handoff.fallback,
            "fleet.prefill_s": handoff.prefill_s,
        }
        tracing.record("kv transfer", "transfer", *trace.transfer, under, attributes)
    if trace.submitted_ns:
        first = trace.first_output_ns or end_ns
        cached = {"fleet.prefix_cached_tokens": final.prefix_cached_tokens}
        tracing.record("prefill", "prefill", trace.submitted_ns, first, under, cached)
        if trace.first_output_ns:
            tokens = {"fleet.tokens": final.completion_tokens}
            decode = tracing.record("decode", "decode", first, end_ns, under, tokens)
            for start, end, step_tokens in trace.steps:
                tracing.record("decode steps", "decode", start, end, decode, {"fleet.tokens": step_tokens})
