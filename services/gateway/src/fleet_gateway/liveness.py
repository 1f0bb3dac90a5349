"""Whether a stream's worker is still there: its 1 Hz metrics, and a probe it answers at once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg

from fleet_bus import Bus, NoResponders, RequestFailed
from fleet_proto import LivenessProbe, LivenessReply, NodeMetrics
from fleet_proto.subjects import alive_subject

NODE_SILENCE_S = 3.5
PROBE_TIMEOUT_S = 0.5  # a worker answers its liveness probe from its event loop: at once


class NodeLiveness:
    """When each node last published its metrics (they come every second), and whether a worker
    answers when asked (`answers`: a dead one is known at once)."""

    def __init__(
        self, bus: Bus | None = None, on_sample: Callable[[NodeMetrics], None] | None = None
    ) -> None:
        self._bus = bus
        self._on_sample = on_sample
        self._last_seen: dict[str, float] = {}
        self._latest: dict[str, NodeMetrics] = {}
        self._decoder = msgspec.json.Decoder(NodeMetrics)

    async def on_metrics(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError):
            sample = self._decoder.decode(msg.data)
            self._last_seen[sample.node_id] = time.monotonic()
            self._latest[sample.node_id] = sample
            if self._on_sample is not None:
                self._on_sample(sample)

    def live_samples(self) -> list[NodeMetrics]:
        """The latest metrics of every node heard from recently."""
        return [s for node_id, s in self._latest.items() if self.alive(node_id)]

    def alive(self, node_id: str) -> bool:
        seen = self._last_seen.get(node_id)
        return seen is None or time.monotonic() - seen < NODE_SILENCE_S

    async def probe(self, node_id: str, request_id: str = "") -> LivenessReply | None:
        """Ask the worker (and whether it runs the request): None when NATS answers "no
        responders", at once when its process is gone (its subscription went with its connection).
        No answer in time leaves it to the metrics: taken for running while they come."""
        if self._bus is None:
            return LivenessReply(node_id=node_id, running=True) if self.alive(node_id) else None
        try:
            probe = LivenessProbe(node_id=node_id, request_id=request_id)
            return await self._bus.request(alive_subject(node_id), probe, LivenessReply, PROBE_TIMEOUT_S)
        except NoResponders:
            return None
        except RequestFailed:
            return LivenessReply(node_id=node_id, running=True) if self.alive(node_id) else None

    async def answers(self, node_id: str) -> bool:
        return await self.probe(node_id) is not None
