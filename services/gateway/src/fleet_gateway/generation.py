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

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from opentelemetry.trace import get_current_span, set_span_in_context

from fleet_bus import Bus, RequestFailed, StateFollower, StreamBroken, TokenStreamReader
from fleet_bus.trace_context import traceparent
from fleet_proto import (
    CancelRequest,
    EmbedTask,
    GenerateTask,
    NodeMetrics,
    PrefillPlan,
    RequestStats,
    RouteReply,
    RouteRequest,
    SamplingParams,
    TokenChunk,
)
from fleet_proto.messages import EMBED_TASK, WorkerTask
from fleet_proto.routing import DEFAULT_DISAGG_MIN_TOKENS, route
from fleet_proto.subjects import REQUEST_STATS_SUBJECT, ROUTE_SUBJECT, TASK_STREAM, cancel_subject
from fleet_proto.traces import REQUEST_ID_ATTRIBUTE
from fleet_runtime.tracing import Tracing
from fleet_store.kv import DEFAULT_BLOCK_SIZE, block_hashes

log = logging.getLogger("fleet_gateway")

ROUTE_TIMEOUT_S = 1.0
# A live worker may be silent this long (a long prefill on a slow CPU); a dead one is noticed by
# its missing 1 Hz metrics within NODE_SILENCE_S.
STALL_TIMEOUT_S = 600.0
NODE_SILENCE_S = 3.5
# A task whose worker died before taking it is sent to another instance, at most this many times.
MAX_REROUTES = 2


class NoInstance(Exception):
    """No ready instance can take the request."""


class NodeLiveness:
    """When each node last published its metrics (they come every second)."""

    def __init__(self) -> None:
        self._last_seen: dict[str, float] = {}
        self._latest: dict[str, NodeMetrics] = {}
        self._decoder = msgspec.json.Decoder(NodeMetrics)

    async def on_metrics(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError):
            sample = self._decoder.decode(msg.data)
            self._last_seen[sample.node_id] = time.monotonic()
            self._latest[sample.node_id] = sample

    def live_samples(self) -> list[NodeMetrics]:
        """The latest metrics of every node heard from recently."""
        return [s for node_id, s in self._latest.items() if self.alive(node_id)]

    def alive(self, node_id: str) -> bool:
        seen = self._last_seen.get(node_id)
        return seen is None or time.monotonic() - seen < NODE_SILENCE_S


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
    ) -> None:
        self._tracing = tracing
        self._kv_block_size = kv_block_size
        self._disagg_min_tokens = disagg_min_tokens
        self._bus = bus
        self._follower = follower
        self._liveness = liveness

    async def _route(self, request: RouteRequest) -> RouteReply:
        try:
            return await self._bus.request(ROUTE_SUBJECT, request, RouteReply, ROUTE_TIMEOUT_S)
        except RequestFailed as exc:
            log.warning("scheduler did not route %s (%s); choosing locally", request.request_id, exc)
            return route(self._follower.state, request, {}, disagg_min_tokens=self._disagg_min_tokens)

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
        hashes = (
            tuple(block_hashes(kv_fingerprint, prompt_token_ids, self._kv_block_size))
            if kv_fingerprint
            else ()
        )
        route_request = RouteRequest(
            request_id=request_id,
            model_id=model_id,
            prompt_tokens=len(prompt_token_ids),
            block_hashes=hashes,
            kv_fingerprint=kv_fingerprint,
            disaggregate=choice.disaggregate,
        )

        def task(decision: RouteReply, parent: str) -> GenerateTask:
            return GenerateTask(
                request_id=request_id,
                instance_id=decision.instance_id,
                prompt_token_ids=tuple(prompt_token_ids),
                sampling=sampling,
                block_hashes=hashes,
                kv_fingerprint=kv_fingerprint,
                prefill=prefill_plan(decision, choice),
                traceparent=parent,
                sent_at_ns=time.time_ns(),
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

        def task(decision: RouteReply, parent: str) -> EmbedTask:
            return EmbedTask(
                request_id=request_id,
                instance_id=decision.instance_id,
                inputs=tuple(inputs),
                traceparent=parent,
                sent_at_ns=time.time_ns(),
            )

        chunks = [chunk async for chunk in self._run(route_request, task)]
        return chunks[-1]

    async def _run(
        self, route_request: RouteRequest, make_task: Callable[[RouteReply, str], WorkerTask]
    ) -> AsyncGenerator[TokenChunk, None]:
        """Route, publish the task, stream its chunks (the last has finish_reason set).
        A worker that dies before taking the task (it is still in the work queue) does not fail the
        request: the task is withdrawn from the queue and routed to another node."""
        started = time.monotonic()
        request_id, model_id = route_request.request_id, route_request.model_id
        get_current_span().set_attributes({REQUEST_ID_ATTRIBUTE: request_id, "fleet.model": model_id})
        with self._tracing.span(
            "route", "route", {"fleet.prompt_tokens": route_request.prompt_tokens}
        ) as span:
            decision = await self._route(route_request)
            span.set_attributes(decision_attributes(decision))
        if not decision.instance_id:
            raise NoInstance(decision.error)
        target = [decision.worker_id]  # the worker the task is with now (re-routing changes it)
        reader = TokenStreamReader(
            self._bus, request_id, STALL_TIMEOUT_S, producer_alive=lambda: self._liveness.alive(target[0])
        )
        await reader.open()
        finished = False
        first_token_at = 0.0
        # publish -> last chunk; the worker's spans hang from it (the task's traceparent)
        running = self._tracing.start_span(
            route_request.task, "stream", {"fleet.instance_id": decision.instance_id}
        )
        try:
            for attempt in range(MAX_REROUTES + 1):
                task = make_task(decision, traceparent(set_span_in_context(running)))
                seq = await self._bus.publish_task(decision.worker_id, task)
                received = False
                try:
                    async for chunk in reader.chunks():
                        received = True
                        finished = bool(chunk.finish_reason)
                        if chunk.token_ids and not first_token_at:
                            first_token_at = time.monotonic()
                        if finished:  # before the last chunk goes out: a streaming reader stops at it
                            await self._publish_stats(route_request, decision, started, first_token_at, chunk)
                        yield chunk
                    return
                except StreamBroken:
                    dead = decision.worker_id
                    if received or attempt == MAX_REROUTES or self._liveness.alive(dead):
                        raise
                    if not await self._withdraw(seq):  # the worker took it before dying: it ran there
                        raise
                route_request = msgspec.structs.replace(
                    route_request, avoid_nodes=(*route_request.avoid_nodes, dead)
                )
                decision = await self._route(route_request)
                if not decision.instance_id:
                    raise StreamBroken(
                        f"the worker for request {request_id} died before starting it, and {decision.error}"
                    )
                log.warning(
                    "request %s: worker %s died before taking the task; re-routed to %s",
                    request_id, dead, decision.worker_id,
                )  # fmt: skip
                target[0] = decision.worker_id
        finally:
            running.end()
            try:
                if not finished:  # client gone or stream broken: stop the engine's work too
                    with contextlib.suppress(Exception):
                        await asyncio.shield(
                            self._bus.publish(
                                cancel_subject(request_id), CancelRequest(request_id=request_id)
                            )
                        )
            finally:  # even when cancelled again while cancelling: no subscription outlives its request
                await asyncio.shield(reader.close())

    async def _withdraw(self, seq: int) -> bool:
        """Take a task back from its work queue; False when it is gone (a worker acked it: started)."""
        try:
            return bool(await self._bus.js.delete_msg(TASK_STREAM.name, seq))
        except NotFoundError:
            return False

    async def _publish_stats(
        self,
        route_request: RouteRequest,
        decision: RouteReply,
        started: float,
        first_token_at: float,
        last: TokenChunk,
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
        )
        with contextlib.suppress(Exception):  # stats are advisory: never fail a request over them
            await self._bus.publish(REQUEST_STATS_SUBJECT, stats)
