"""W3C trace context on NATS messages: the `traceparent` header a request's spans hang from.

Publishing adds the current span's context to a message's headers; a subscriber makes it the
current context around its handler, so a span it opens there is a child of the publisher's. Task
messages carry the same string in a field (GenerateTask.traceparent): a JetStream work queue may
redeliver a message long after the publisher's span ended, and a field survives any re-publish.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_propagator = TraceContextTextMapPropagator()


def trace_headers(context: Context | None = None) -> dict[str, str]:
    """The `traceparent` (and `tracestate`) of `context` (default: the current one); {} outside a
    sampled span."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


def traceparent(context: Context | None = None) -> str:
    return trace_headers(context).get(TRACEPARENT, "")


def remote_context(carrier: Mapping[str, str] | str | None) -> Context | None:
    """The context a message's headers (or a bare traceparent string) name; None when none."""
    if not carrier:
        return None
    headers = {TRACEPARENT: carrier} if isinstance(carrier, str) else dict(carrier)
    if TRACEPARENT not in headers:
        return None
    return _propagator.extract(headers, context=otel_context.Context())


def is_sampled(context: Context | None) -> bool:
    """Whether spans under `context` are recorded (the root's sampling decision)."""
    return context is not None and get_current_span(context).get_span_context().trace_flags.sampled
