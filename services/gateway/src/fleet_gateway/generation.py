"""The core path every API adapter shares: route, publish the task, read the chunks.

Adapters turn a client request into prompt token ids + SamplingParams, then consume TokenChunks
from `generate()` (or send inputs to `embed()` and get one final chunk with the vectors);
cancelling the iteration (client gone) cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial

import msgspec
from nats.js.errors import APIError
from opentelemetry.trace import get_current_span, set_span_in_context

from fleet_bus import Bus, RequestFailed, StateFollower, StreamBroken, TokenStreamReader
from fleet_bus.trace_context import traceparent
from fleet_gateway.admission import CALLER, Admission, Ticket
from fleet_gateway.liveness import NodeLiveness
from fleet_proto import (
    CancelRequest,
    EmbedTask,
    GenerateTask,
    PrefillPlan,
    RequestStats,
    RouteReply,
    RouteRequest,
    SamplingParams,
    TokenChunk,
)
from fleet_proto.messages import EMBED_TASK, PREFIX_BLOCK_TOKENS, TASK_TTL_S, UNAVAILABLE, WorkerTask
from fleet_proto.routing import DEFAULT_DISAGG_MIN_TOKENS, route
from fleet_proto.routing_view import KeptView, RoutingView
from fleet_proto.subjects import (
    REQUEST_STATS_SUBJECT,
    ROUTE_SUBJECT,
    TASK_STREAM,
    cancel_subject,
)
from fleet_proto.traces import REQUEST_ID_ATTRIBUTE
from fleet_runtime.tracing import Tracing
from fleet_store.kv import DEFAULT_BLOCK_SIZE, block_hashes

log = logging.getLogger("fleet_gateway")

ROUTE_TIMEOUT_S = 1.0
# A live worker may be silent this long (a long prefill on a slow CPU); a dead one is noticed by
# its missing 1 Hz metrics within liveness.NODE_SILENCE_S.
STALL_TIMEOUT_S = TASK_TTL_S
STREAM_POLL_S = 0.5  # a stream without chunks this long asks whether its worker is there
MAX_MIGRATIONS = 3  # Settings.max_migrations


@dataclass(frozen=True)
class Waited:
    """How long a request waited in admission, and whether for a model with no instance to get one."""

    seconds: float
    cold_start: bool


def hop_stream_id(request_id: str, hop: int) -> str:
    """The id a request's task and token stream have on its hop'th instance: each hop streams on its
    own subject, so a worker taken for dead that still sends cannot mix its tokens in."""
    return f"{request_id}-m{hop}" if hop else request_id


@dataclass
class SentTask:
    """One hop's task: to which worker, under which id, and its sequence in the work queue once
    published (0 before)."""

    worker_id: str
    request_id: str
    seq: int = 0


class Unavailable(Exception):
    """The instance serving a request cannot finish it (GenerationOutput.error_kind UNAVAILABLE)."""


# (route decision, traceparent, the task's request id, tokens generated so far) -> the task to send
MakeTask = Callable[[RouteReply, str, str, tuple[int, ...]], WorkerTask]


class NoInstance(Exception):
    """No ready instance can take the request."""


@dataclass(frozen=True)
class SplitChoice:
    """What a request asks of remote prefill (the bench endpoint's options)."""

    disaggregate: str = "auto"  # "auto" (as routing decides) | "always" | "never"
    transport: str = "auto"  # "auto" | "stream" | "staged"
    overlap: bool = True  # False: batch mode, the KV goes out once the prefill is done


AS_ROUTED = SplitChoice()  # what every request but the bench endpoint's asks


def prefill_plan(decision: RouteReply, choice: SplitChoice) -> PrefillPlan | None:
    if not decision.prefill_instance_id:
        return None
    return PrefillPlan(
        instance_id=decision.prefill_instance_id,
        worker_id=decision.prefill_worker_id,
        transport=choice.transport,
        overlap=choice.overlap,
    )


def decision_attributes(decision: RouteReply) -> dict[str, str]:
    """A route span's attributes: where the request goes, and why."""
    attributes = {
        "fleet.instance_id": decision.instance_id,
        "fleet.worker_id": decision.worker_id,
        "fleet.reason": decision.reason or decision.error,
    }
    if decision.prefill_instance_id:
        attributes["fleet.prefill_worker_id"] = decision.prefill_worker_id
    return attributes


class Generator:
    def __init__(
        self,
        bus: Bus,
        follower: StateFollower,
        liveness: NodeLiveness,
        tracing: Tracing,
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        disagg_min_tokens: int = DEFAULT_DISAGG_MIN_TOKENS,
        max_migrations: int = MAX_MIGRATIONS,
        admission: Admission | None = None,
        view: Callable[[], RoutingView] | None = None,
    ) -> None:
        self._tracing = tracing
        # the follower's State indexed (the fallback route() reads it), shared with admission's
        self._view = view or KeptView(lambda: follower.state)
        self._admission = admission or Admission(self._view)
        self._max_migrations = max_migrations
        self._kv_block_size = kv_block_size
        self._disagg_min_tokens = disagg_min_tokens
        self._bus = bus
        self._liveness = liveness

    def starting(self, model_id: str) -> bool:
        """Whether a request for the model waits for an instance to start (Admission.starting)."""
        return self._admission.starting(model_id)

    def starting_status(self, model_id: str) -> str:
        return self._admission.starting_status(model_id)

    async def _route(self, request: RouteRequest) -> RouteReply:
        try:
            return await self._bus.request(ROUTE_SUBJECT, request, RouteReply, ROUTE_TIMEOUT_S)
        except RequestFailed as exc:
            log.warning("scheduler did not route %s (%s); choosing locally", request.request_id, exc)
            view = self._view()
            return route(view.state, request, {}, disagg_min_tokens=self._disagg_min_tokens, view=view)

    async def generate(
        self,
        request_id: str,
        model_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_fingerprint: str = "",
        choice: SplitChoice = AS_ROUTED,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Route, send the task, stream its chunks; with a KV fingerprint the prompt's block hashes go
        along, so the scheduler can route to cached prefixes and the worker can look them up.
        `choice` says what the request asks of remote prefill."""

        def hashed(block_size: int) -> tuple[str, ...]:
            return tuple(block_hashes(kv_fingerprint, prompt_token_ids, block_size)) if kv_fingerprint else ()

        hashes = hashed(self._kv_block_size)
        route_request = RouteRequest(
            request_id=request_id,
            model_id=model_id,
            prompt_tokens=len(prompt_token_ids),
            block_hashes=hashes,
            kv_fingerprint=kv_fingerprint,
            disaggregate=choice.disaggregate,
            prefix_hashes=hashed(PREFIX_BLOCK_TOKENS),
        )

        def task(
            decision: RouteReply, parent: str, stream_id: str, generated: tuple[int, ...]
        ) -> GenerateTask:
            return GenerateTask(
                request_id=stream_id,
                instance_id=decision.instance_id,
                prompt_token_ids=tuple(prompt_token_ids),
                sampling=sampling,
                block_hashes=hashes,
                kv_fingerprint=kv_fingerprint,
                # a continuation prefills here: its prompt's KV is in the shared tier by now
                prefill=None if generated else prefill_plan(decision, choice),
                traceparent=parent,
                sent_at_ns=time.time_ns(),
                generated_token_ids=generated,
                expected_cached_tokens=decision.cached_tokens,
            )

        async for chunk in self._run(route_request, task):
            yield chunk

    async def embed(self, request_id: str, model_id: str, inputs: list[tuple[int, ...]]) -> TokenChunk:
        """Route to an instance of the embedding model, send the inputs, return the final chunk
        (its `embeddings`: a vector per input, in order; an error chunk when the worker refused)."""
        route_request = RouteRequest(
            request_id=request_id,
            model_id=model_id,
            prompt_tokens=sum(len(i) for i in inputs),
            task=EMBED_TASK,
        )

        def task(decision: RouteReply, parent: str, stream_id: str, generated: tuple[int, ...]) -> EmbedTask:
            return EmbedTask(  # nothing partial to carry over: a moved embedding request runs again
                request_id=stream_id,
                instance_id=decision.instance_id,
                inputs=tuple(inputs),
                traceparent=parent,
                sent_at_ns=time.time_ns(),
            )

        chunks = [chunk async for chunk in self._run(route_request, task)]
        return chunks[-1]

    async def _run(
        self, route_request: RouteRequest, make_task: MakeTask
    ) -> AsyncGenerator[TokenChunk, None]:
        """Wait for room if every instance of the model is full (admission.py), then route, publish
        the task and stream its chunks (the last has finish_reason set)."""
        started = time.monotonic()
        get_current_span().set_attributes(
            {REQUEST_ID_ATTRIBUTE: route_request.request_id, "fleet.model": route_request.model_id}
        )
        cold = self._admission.starting(route_request.model_id)  # waits for an instance to start
        async with self._admission.entry(route_request.model_id, CALLER.get()) as ticket:
            waited = Waited(time.monotonic() - started, cold)
            async for chunk in self._hops(route_request, make_task, ticket, started, waited):
                yield chunk

    async def _hops(
        self,
        route_request: RouteRequest,
        make_task: MakeTask,
        ticket: Ticket,
        started: float,
        waited: Waited,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Route (off the instances that are full), publish the task, stream its chunks.

        Migration: when the worker dies (its stream breaks) or its instance cannot finish the request
        (an UNAVAILABLE error: the engine died, the instance drains), the request is routed again,
        off that node or instance, and goes on there as a continuation of the tokens this stream
        already carried (GenerateTask.generated_token_ids): the caller sees one unbroken stream.
        A hop's task still in a dead worker's queue is withdrawn, so it never runs there later."""
        request_id = route_request.request_id
        full = self._admission.full(route_request.model_id)
        decision = await self._routed(msgspec.structs.replace(route_request, avoid_instances=full))
        if not decision.instance_id and full:  # all full after all (a report since): one takes it
            decision = await self._routed(route_request)
        if not decision.instance_id:
            raise NoInstance(decision.error)
        generated: list[int] = []  # the tokens this request's stream carried so far, over every hop
        first_token_at = 0.0
        for hop in range(self._max_migrations + 1):
            stream_id = hop_stream_id(request_id, hop)
            worker = decision.worker_id
            sent = SentTask(worker, stream_id)
            reader = TokenStreamReader(
                self._bus,
                stream_id,
                STALL_TIMEOUT_S,
                producer_alive=partial(self._producing, sent),
                poll_s=STREAM_POLL_S,
            )
            await reader.open()
            finished = False
            # publish -> last chunk; the worker's spans hang from it (the task's traceparent)
            running = self._tracing.start_span(
                route_request.task, "stream", {"fleet.instance_id": decision.instance_id, "fleet.hop": hop}
            )
            try:
                parent = traceparent(set_span_in_context(running))
                sent.seq = await self._bus.publish_task(
                    worker, make_task(decision, parent, stream_id, tuple(generated))
                )
                ticket.sent(decision.instance_id)
                async for chunk in reader.chunks():
                    if chunk.finish_reason == "error" and chunk.error_kind == UNAVAILABLE:
                        raise Unavailable(chunk.error)
                    finished = bool(chunk.finish_reason)
                    generated.extend(chunk.token_ids)
                    if chunk.token_ids and not first_token_at:
                        first_token_at = time.monotonic()
                    if finished:  # before the last chunk goes out: a streaming reader stops at it
                        await self._publish_stats(
                            route_request, decision, started, first_token_at, chunk, hop, waited
                        )
                    yield chunk
                return
            except (StreamBroken, Unavailable) as exc:
                why = str(exc)
                running.set_attribute("fleet.moved", why)
            finally:
                running.end()
                ticket.ended()
                try:
                    if not finished:  # client gone or stream broken: stop the engine's work too
                        with contextlib.suppress(Exception):
                            await asyncio.shield(self._cancel(stream_id))
                finally:  # even when cancelled again while cancelling: no subscription outlives its request
                    await asyncio.shield(reader.close())
            dead = not await self._liveness.answers(worker)
            if sent.seq:  # a dead worker's queue may still hold it: it must not run when that worker is back
                await self._withdraw(sent.seq)
            route_request = msgspec.structs.replace(
                route_request,
                avoid_nodes=(*route_request.avoid_nodes, worker) if dead else route_request.avoid_nodes,
                avoid_instances=(*route_request.avoid_instances, decision.instance_id),
            )
            if hop == self._max_migrations:
                raise StreamBroken(f"request {request_id} was moved {hop} times; then {why}")
            moved_from = decision
            decision = await self._routed(route_request)
            if not decision.instance_id:
                raise StreamBroken(
                    f"{why}; no other instance can take request {request_id}: {decision.error}"
                )
            log.warning(
                "request %s moved off %s %s after %d tokens (%s) to %s %s",
                request_id, moved_from.worker_id, moved_from.instance_id, len(generated), why,
                decision.worker_id, decision.instance_id,
            )  # fmt: skip

    async def _producing(self, sent: SentTask) -> bool:
        """Whether the stream's worker still runs its task, or it waits in that worker's queue (a
        worker restarted under the same node id answers, but without the request)."""
        reply = await self._liveness.probe(sent.worker_id, sent.request_id)
        if reply is None:
            return False
        return reply.running or not sent.seq or await self._queued(sent.seq)

    async def _queued(self, seq: int) -> bool:
        try:
            await self._bus.js.get_msg(TASK_STREAM.name, seq)
        except APIError:  # taken (and lost with the process that took it)
            return False
        return True

    async def _routed(self, route_request: RouteRequest) -> RouteReply:
        with self._tracing.span(
            "route", "route", {"fleet.prompt_tokens": route_request.prompt_tokens}
        ) as span:
            decision = await self._route(route_request)
            span.set_attributes(decision_attributes(decision))
        return decision

    async def _cancel(self, stream_id: str) -> None:
        await self._bus.publish(cancel_subject(stream_id), CancelRequest(request_id=stream_id))

    async def _withdraw(self, seq: int) -> bool:
        """Take a task back from its work queue; False when it is gone (a worker acked it: started)."""
        try:
            return bool(await self._bus.js.delete_msg(TASK_STREAM.name, seq))
        except APIError:  # not found (taken; nats-server says so with a 500 "no message found")
            return False

    async def _publish_stats(
        self,
        route_request: RouteRequest,
        decision: RouteReply,
        started: float,
        first_token_at: float,
        last: TokenChunk,
        migrations: int,
        waited: Waited,
    ) -> None:
        """Timings for the metrics-collector (from routing to the gateway seeing the tokens)."""
        now = time.monotonic()
        ttft = (first_token_at or now) - started
        tokens = last.completion_tokens
        stats = RequestStats(
            request_id=route_request.request_id,
            model_id=route_request.model_id,
            instance_id=decision.instance_id,
            node_id=decision.worker_id,
            prompt_tokens=route_request.prompt_tokens,
            completion_tokens=tokens,
            ttft_s=ttft,
            tpot_s=(now - first_token_at) / (tokens - 1) if tokens > 1 and first_token_at else 0.0,
            total_s=now - started,
            finish_reason=last.finish_reason,
            prefix_cached_tokens=last.prefix_cached_tokens,
            task=route_request.task,
            inputs=len(last.embeddings),
            migrations=migrations,
            queued_s=waited.seconds,
            cold_start_s=waited.seconds if waited.cold_start else 0.0,
        )
        with contextlib.suppress(Exception):  # stats are advisory: never fail a request over them
            await self._bus.publish(REQUEST_STATS_SUBJECT, stats)
