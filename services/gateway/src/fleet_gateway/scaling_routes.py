"""Per-model autoscaling over HTTP (admin): read and set how a model's instances follow its demand.

    PUT    /scaling/<model>   {"min_instances": 0, "max_instances": 2, ...}   -> 202
    GET    /scaling[/<model>]                                              -> policy + recent decisions
    DELETE /scaling/<model>                                                -> 202 (policy disabled)

A PUT names only what it changes: the rest keeps the model's current policy (or the defaults), and
it enables the policy unless it says `"enabled": false`. The scheduler's leader records the policy
(ScalingPolicySet) and applies it from its next tick (fleet_scheduler.scaler).
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from fleet_bus import Bus, StateFollower
from fleet_gateway.errors import ApiError, decode_json_body
from fleet_proto import ModelScaling, ScalingPolicy, SetScaling, State


class ScalingBody(msgspec.Struct, forbid_unknown_fields=True):
    """ScalingPolicy's fields, each optional (None: as it is now)."""

    enabled: bool | None = None
    min_instances: int | None = None
    max_instances: int | None = None
    target_utilization: float | None = None
    target_queued_tokens: int | None = None
    target_ttft_p90_s: float | None = None
    scale_down_ratio: float | None = None
    scale_up_window_s: float | None = None
    scale_up_cooldown_s: float | None = None
    scale_down_delay_s: float | None = None
    idle_s: float | None = None


def merged_policy(current: ScalingPolicy, body: ScalingBody) -> ScalingPolicy:
    """`current` with the body's fields over it, enabled unless the body says otherwise."""
    changes = {k: v for k, v in msgspec.structs.asdict(body).items() if v is not None}
    return msgspec.structs.replace(current, **{"enabled": True, **changes})


def _staged(state: State, model: str) -> None:
    if model not in state.models:
        raise ApiError(404, f"model {model!r} is not staged: POST /models first", param="model")


def scaling_routes(bus: Bus, follower: StateFollower) -> list[web.RouteDef]:
    def answer(model: str, scaling: ModelScaling, status: int = 200) -> web.Response:
        body = msgspec.json.encode({"model": model, **msgspec.to_builtins(scaling)})
        return web.Response(body=body, status=status, content_type="application/json")

    async def set_policy(request: web.Request, body: ScalingBody) -> web.Response:
        model = request.match_info["model"]
        state = follower.state
        _staged(state, model)
        current = state.scaling.get(model, ModelScaling())
        policy = merged_policy(current.policy, body)
        if problems := policy.problems():
            raise ApiError(400, f"The scaling policy is not usable: {'; '.join(problems)}.")
        command = SetScaling(command_id=f"cmd-{uuid.uuid4().hex[:12]}", model_id=model, policy=policy)
        await bus.publish_command(command)
        return answer(model, msgspec.structs.replace(current, policy=policy), 202)

    async def put_scaling(request: web.Request) -> web.Response:
        return await set_policy(request, decode_json_body(await request.read(), ScalingBody))

    async def delete_scaling(request: web.Request) -> web.Response:
        return await set_policy(request, ScalingBody(enabled=False))

    async def get_model_scaling(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        state = follower.state
        _staged(state, model)
        return answer(model, state.scaling.get(model, ModelScaling()))

    async def list_scaling(_: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(follower.state.scaling), content_type="application/json")

    return [
        web.get("/scaling", list_scaling),
        web.get("/scaling/{model:.+}", get_model_scaling),
        web.put("/scaling/{model:.+}", put_scaling),
        web.delete("/scaling/{model:.+}", delete_scaling),
    ]
