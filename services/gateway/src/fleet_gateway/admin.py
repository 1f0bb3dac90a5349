"""Cluster administration over HTTP: stage models, create and delete instances.

Each endpoint validates, publishes a command and answers 202 with what to watch in /state.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from aiohttp import web

from fleet_bus import Bus, StateFollower
from fleet_gateway.errors import ApiError, decode_json_body
from fleet_proto import CreateInstance, DeleteInstance, DownloadModel
from fleet_store import MODELS_BUCKET, ObjectStore, manifest_key

DEFAULT_REVISION = "main"


class StageModelBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    source: str


class CreateInstanceBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    engine: str = ""


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def admin_routes(bus: Bus, follower: StateFollower, store: ObjectStore) -> list[web.RouteDef]:
    async def stage_model(request: web.Request) -> web.Response:
        body = decode_json_body(await request.read(), StageModelBody)
        command = DownloadModel(command_id=_new_id("cmd"), model_id=body.model, source=body.source)
        await bus.publish_command(command)
        return web.json_response({"model": body.model, "command_id": command.command_id}, status=202)

    async def create_instance(request: web.Request) -> web.Response:
        body = decode_json_body(await request.read(), CreateInstanceBody)
        staged = await asyncio.to_thread(
            store.exists, MODELS_BUCKET, manifest_key(body.model, DEFAULT_REVISION)
        )
        if not staged:
            raise ApiError(404, f"model {body.model!r} is not staged: POST /models first", param="model")
        instance_id = _new_id("inst")
        command = CreateInstance(
            command_id=_new_id("cmd"), model_id=body.model, instance_id=instance_id, engine=body.engine
        )
        await bus.publish_command(command)
        return web.json_response({"instance_id": instance_id, "model": body.model}, status=202)

    async def delete_instance(request: web.Request) -> web.Response:
        instance_id = request.match_info["instance_id"]
        if instance_id not in follower.state.instances:
            raise ApiError(404, f"no instance {instance_id!r}", param="instance_id")
        await bus.publish_command(DeleteInstance(command_id=_new_id("cmd"), instance_id=instance_id))
        return web.json_response({"instance_id": instance_id, "deleted": True}, status=202)

    async def list_instances(_: web.Request) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(follower.state.instances), content_type="application/json"
        )

    return [
        web.post("/models", stage_model),
        web.post("/instances", create_instance),
        web.get("/instances", list_instances),
        web.delete("/instances/{instance_id}", delete_instance),
    ]
