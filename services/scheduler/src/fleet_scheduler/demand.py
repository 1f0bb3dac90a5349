"""What each model is asked for, folded from what the scheduler hears on the bus: the workers'
NodeMetrics (per instance: requests in flight, request slots, prompt tokens still to prefill), the
gateways' AdmissionSample (requests waiting, per model, a model with no instance included), finished
requests' RequestStats (TTFT) and route decisions (when a model was last asked for). The autoscaler
(autoscale.py) reads `demand(now)` once a tick. Times are the caller's clock (`now` arguments), so it
is tested without one."""

from __future__ import annotations

from collections import deque

from fleet_proto import NodeMetrics, RequestStats, RouteDecided
from fleet_proto.messages import AdmissionSample
from fleet_scheduler.autoscale import InstanceDemand, ModelDemand

TTFT_WINDOW_S = 60.0  # TTFT p90 over the requests finished this recently
SAMPLE_STALE_S = 5.0  # a gateway or worker silent this long no longer counts (it died or left)
TTFT_KEPT = 512  # per model: enough for a p90, bounded memory


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (-1 for none)."""
    if not values:
        return -1.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class DemandFeed:
    """The latest report of each worker and gateway, recent TTFTs and last demand, per model."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[float, NodeMetrics]] = {}  # node id -> (heard at, metrics)
        self._gateways: dict[str, tuple[float, dict[str, int]]] = {}  # gateway -> (heard at, waiting)
        self._ttfts: dict[str, deque[tuple[float, float]]] = {}  # model -> (heard at, TTFT s)
        self._last_demand: dict[str, float] = {}  # model -> when last asked for

    def on_metrics(self, metrics: NodeMetrics, now: float) -> None:
        self._nodes[metrics.node_id] = (now, metrics)

    def on_admission(self, sample: AdmissionSample, now: float) -> None:
        self._gateways[sample.gateway_id] = (now, dict(sample.waiting))
        for model_id, waiting in sample.waiting.items():
            if waiting:
                self._last_demand[model_id] = now

    def on_route(self, decided: RouteDecided, now: float) -> None:
        """A request was routed, or found no instance: either way its model was asked for."""
        self._last_demand[decided.model_id] = now

    def on_stats(self, stats: RequestStats, now: float) -> None:
        # The wait for a cold start is not the serving instances' latency: one more instance would
        # not have shortened it.
        ttft = stats.ttft_s - stats.cold_start_s
        if stats.finish_reason == "error" or ttft < 0:
            return
        kept = self._ttfts.setdefault(stats.model_id, deque(maxlen=TTFT_KEPT))
        kept.append((now, ttft))
        self._last_demand[stats.model_id] = now

    def demand(self, now: float, instance_models: dict[str, str]) -> dict[str, ModelDemand]:
        """Per model asked for or serving: its demand now. `instance_models`: instance id -> model id
        of the instances State has (reports of instances it no longer has are left out)."""
        instances: dict[str, dict[str, InstanceDemand]] = {}
        for heard_at, metrics in self._nodes.values():
            if now - heard_at > SAMPLE_STALE_S:
                continue
            for instance_id, in_flight in metrics.active_requests.items():
                if (model_id := instance_models.get(instance_id)) is None:
                    continue
                instances.setdefault(model_id, {})[instance_id] = InstanceDemand(
                    in_flight=in_flight,
                    request_slots=metrics.request_slots.get(instance_id, 0),
                    queued_tokens=metrics.queued_tokens.get(instance_id, 0),
                )
                if in_flight:
                    self._last_demand[model_id] = now
        waiting: dict[str, int] = {}
        for heard_at, per_model in self._gateways.values():
            if now - heard_at <= SAMPLE_STALE_S:
                for model_id, count in per_model.items():
                    waiting[model_id] = waiting.get(model_id, 0) + count
        ttft: dict[str, float] = {}
        for model_id, kept in self._ttfts.items():
            while kept and now - kept[0][0] > TTFT_WINDOW_S:
                kept.popleft()
            ttft[model_id] = percentile([t for _, t in kept], 0.9)
        models = instances.keys() | waiting.keys() | self._last_demand.keys()
        return {
            model_id: ModelDemand(
                instances=instances.get(model_id, {}),
                waiting_requests=waiting.get(model_id, 0),
                ttft_p90_s=ttft.get(model_id, -1.0),
                last_demand_at=self._last_demand.get(model_id),
            )
            for model_id in models
        }
