"""Demand-driven instances: a model's scaling policy and the decisions made under it, as the State
keeps them (events ScalingPolicySet and ScalingDecided). The policy itself is applied by the
scheduler's leader (fleet_scheduler.autoscale, pure)."""

from __future__ import annotations

from fleet_proto.common import Frozen


class ScalingPolicy(Frozen):
    """How one model's instance count follows its demand. The defaults change nothing (disabled): a
    model keeps the instances an admin made. Set per model by the admin API (PUT
    /models/<model>/scaling), which the scheduler turns into a ScalingPolicySet event, so that every
    replica and gateway folds the same settings."""

    enabled: bool = False
    min_instances: int = 1  # 0: scale to zero after idle_s without demand
    max_instances: int = 1
    target_utilization: float = 0.8  # (in flight + waiting) / request slots per instance
    target_queued_tokens: int = 8192  # prompt tokens waiting to prefill per instance (0: not a signal)
    target_ttft_p90_s: float = 0.0  # above it, one more instance (0: not a signal)
    scale_down_ratio: float = 0.5  # one fewer only when demand fits it at this share of the targets
    scale_up_window_s: float = 10.0  # demand above target this long before adding
    scale_up_cooldown_s: float = 60.0  # after any change, before adding again
    scale_down_delay_s: float = 300.0  # demand fitting one fewer this long (and since any change)
    idle_s: float = 900.0  # no demand this long: down to min_instances

    def problems(self) -> list[str]:
        """What makes the policy unusable (empty: none), in the admin API's words."""
        found = []
        if self.min_instances < 0 or self.max_instances < 1:
            found.append("min_instances must be >= 0 and max_instances >= 1")
        if self.min_instances > self.max_instances:
            found.append(f"min_instances {self.min_instances} is over max_instances {self.max_instances}")
        if not 0 < self.target_utilization <= 1:
            found.append("target_utilization must be in (0, 1]")
        if not 0 < self.scale_down_ratio < 1:
            found.append("scale_down_ratio must be in (0, 1)")
        numbers = (self.target_queued_tokens, self.target_ttft_p90_s, self.scale_up_window_s)
        times = (self.scale_up_cooldown_s, self.scale_down_delay_s, self.idle_s)
        if min(*numbers, *times) < 0:
            found.append("targets, windows and delays must be >= 0")
        return found


class ScalingDecision(Frozen):
    """One decision of the policy: `scale_up` (instance_id placed), `scale_down` (instance_id
    drains) or `hold` (a change wanted and not made yet), and why, in words."""

    kind: str
    reason: str
    instance_id: str = ""
    at: float = 0.0  # unix time


class ModelScaling(Frozen):
    """A model's policy and the last decisions made under it (newest last, at most KEPT_DECISIONS)."""

    policy: ScalingPolicy = ScalingPolicy()
    decisions: tuple[ScalingDecision, ...] = ()


KEPT_DECISIONS = 8


def scales_to_zero_now(scaling: ModelScaling | None) -> bool:
    """Whether a request for a model with no instance should wait for one: its policy places
    instances on demand (a gateway queues the request and the scheduler sees it waiting)."""
    return scaling is not None and scaling.policy.enabled and scaling.policy.max_instances > 0
