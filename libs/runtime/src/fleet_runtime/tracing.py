"""Tracing in a service: the OpenTelemetry SDK, its spans sent to the metrics-collector over NATS
(SpanBatch on fleet.traces.spans) and, when FLEET_OTLP_ENDPOINT is set, to an OTLP collector too.

Each service owns one `Tracing` (no global tracer provider is installed: tests run several
services in one process). Sampling is decided once, at the trace's root in the gateway
(FLEET_TRACE_SAMPLE_RATE); every other service follows the parent's decision (ParentBased), so a
trace is whole or absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context

from fleet_proto.subjects import TRACE_SPANS_SUBJECT
from fleet_proto.traces import CATEGORY_ATTRIBUTE, AttributeValue, SpanBatch, SpanRecord

if TYPE_CHECKING:
    from fleet_bus import Bus

PUBLISH_INTERVAL_S = 0.2
MAX_BATCH = 512
MAX_HELD = 20_000  # spans waiting to be published; beyond it the oldest are dropped
# Per-output work (decode steps, detokenize, stream writes) is traced for the 1st, then every 32nd
# output: the shape of a long stream stays visible at a few spans per 100 tokens (a span costs
# ~40 us of CPU in the SDK, and on a small machine the engine shares the cores with the services).
DETAIL_EVERY = 32
log = logging.getLogger("fleet_runtime.tracing")


def span_record(span: ReadableSpan, service: str, service_id: str) -> SpanRecord:
    context, parent = span.get_span_context(), span.parent
    attributes = dict(span.attributes or {})
    category = str(attributes.pop(CATEGORY_ATTRIBUTE, "other"))
    error = (span.status.description or "error") if span.status.status_code == StatusCode.ERROR else ""
    return SpanRecord(
        trace_id=f"{context.trace_id:032x}",
        span_id=f"{context.span_id:016x}",
        parent_id=f"{parent.span_id:016x}" if parent is not None else "",
        name=span.name,
        service=service,
        service_id=service_id,
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        category=category,
        error=error,
        attributes={k: v for k, v in attributes.items() if isinstance(v, str | int | float | bool)},
    )


class BusSpanProcessor(SpanProcessor):
    """Holds finished spans (the SDK may end them on any thread) until `publish` sends them."""

    def __init__(self, service: str, service_id: str) -> None:
        self._service, self._service_id = service, service_id
        self._held: deque[SpanRecord] = deque(maxlen=MAX_HELD)
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        if span.get_span_context().trace_flags.sampled:
            record = span_record(span, self._service, self._service_id)
            with self._lock:
                self._held.append(record)

    def take(self, limit: int = MAX_BATCH) -> tuple[SpanRecord, ...]:
        with self._lock:
            return tuple(self._held.popleft() for _ in range(min(limit, len(self._held))))

    async def publish(self, bus: Bus) -> int:
        """Send what is held, in batches; how many spans. Traces are advisory: a failed publish
        drops its batch (logged), never the request."""
        sent = 0
        while batch := self.take():
            try:
                await bus.publish(TRACE_SPANS_SUBJECT, SpanBatch(spans=batch))
            except Exception as error:  # any broker trouble costs spans, never a request
                log.debug("dropped %d spans: %s", len(batch), error)
                return sent
            sent += len(batch)
        return sent


class Tracing:
    def __init__(
        self, service: str, service_id: str, sample_rate: float = 1.0, otlp_endpoint: str = ""
    ) -> None:
        self.processor = BusSpanProcessor(service, service_id)
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": f"fleet-{service}", "service.instance.id": service_id}),
            sampler=ParentBased(TraceIdRatioBased(sample_rate)),
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(self.processor)
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("fleet")

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        category: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        parent: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Iterator[Span]:
        """A span around the block, the current span inside it (a child of `parent` when given,
        else of the current span); an exception marks it failed."""
        with self._tracer.start_as_current_span(
            name, context=parent, kind=kind, attributes={CATEGORY_ATTRIBUTE: category, **(attributes or {})}
        ) as span:
            yield span

    @contextlib.contextmanager
    def leaf(
        self, name: str, category: str, attributes: Mapping[str, AttributeValue] | None = None
    ) -> Iterator[None]:
        """A span around a block that no span hangs from: a child of the current span, not made
        current itself (a quarter cheaper than `span`, for per-output work); an exception marks it
        failed."""
        span = self.start_span(name, category, attributes)
        try:
            yield
        except BaseException as error:
            span.set_status(StatusCode.ERROR, str(error) or type(error).__name__)
            raise
        finally:
            span.end()

    def output_leaf(
        self,
        output_number: int,
        name: str,
        category: str,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> contextlib.AbstractContextManager:
        """`leaf` around the work on a stream's `output_number`-th output (from 0) when that output
        gets spans of its own (every DETAIL_EVERY-th), else nothing."""
        if output_number % DETAIL_EVERY:
            return contextlib.nullcontext()
        return self.leaf(name, category, attributes)

    def start_span(
        self,
        name: str,
        category: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        parent: Context | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """A span that is not made current (for one that outlives a block: the caller ends it), a
        child of `parent` when given, else of the current span; `start_ns` when it began earlier."""
        return self._tracer.start_span(
            name,
            context=parent,
            start_time=start_ns,
            attributes={CATEGORY_ATTRIBUTE: category, **(attributes or {})},
        )

    def record(
        self,
        name: str,
        category: str,
        start_ns: int,
        end_ns: int,
        parent: Context | Span | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
        error: str = "",
    ) -> Span:
        """A span timed elsewhere (an engine's prefill, a queue wait read off a message); it can
        still parent spans recorded after it."""
        context = set_span_in_context(parent) if isinstance(parent, Span) else parent
        span = self._tracer.start_span(
            name,
            context=context,
            start_time=start_ns,
            attributes={CATEGORY_ATTRIBUTE: category, **(attributes or {})},
        )
        if error:
            span.set_status(StatusCode.ERROR, error)
        span.end(end_time=max(end_ns, start_ns))
        return span

    async def run(self, bus: Bus) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            await self.processor.publish(bus)

    async def close(self, bus: Bus) -> None:
        await self.processor.publish(bus)
        self._provider.shutdown()


def now_ns() -> int:
    return time.time_ns()
