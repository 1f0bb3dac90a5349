"""Cluster administration over HTTP: stage models, create and delete instances.

Each endpoint validates, publishes a command and answers 202 with what to watch in /state.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from aiohttp import web

from fleet_bus import Bus, RequestFailed, StateFollower
from fleet_gateway.errors import ApiError, decode_json_body
from fleet_proto import (
    CreateInstance,
    DeleteInstance,
    DeleteModel,
    DownloadModel,
    PlacementsReply,
    PlacementsRequest,
    Shard,
    State,
)
from fleet_proto.subjects import PLACEMENTS_SUBJECT
from fleet_store import DEFAULT_REVISION, MODELS_BUCKET, ObjectStore, StoreError, manifest_key

INSTANCE_ROLES = ("both", "prefill", "decode")


class StageModelBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    source: str


class CreateInstanceBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    engine: str = ""
    shards: tuple[Shard, ...] = ()  # an explicit placement (e.g. one of GET /placements' options)
    role: str = "both"  # "prefill" | "decode" | "both" (disaggregated serving)


def capabilities(state: State) -> dict[str, object]:
    """Which engines the cluster has (seed's /capabilities), with versions and the nodes offering them."""
    engines: dict[str, dict[str, list[str]]] = {}
    for node in state.nodes.values():
        for engine in node.engines:
            entry = engines.setdefault(engine.name, {"versions": [], "nodes": []})
            entry["versions"] = sorted({*entry["versions"], engine.version})
            entry["nodes"] = sorted({*entry["nodes"], node.node_id})
    return {
        "vllm_available": "vllm" in engines,
        "mlx_available": "mlx" in engines,
        "engines": engines,
        "nodes": {n.node_id: {"kind": n.kind, "chip": n.chip} for n in state.nodes.values()},
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def store_unavailable(exc: StoreError, consequence: str) -> ApiError:
    """503 naming object storage (the message of StoreUnavailable says which endpoint, and why)."""
    return ApiError(503, f"object storage is unavailable, so {consequence}: {exc}", code="store_unavailable")


def admin_routes(bus: Bus, follower: StateFollower, store: ObjectStore) -> list[web.RouteDef]:
    async def stage_model(request: web.Request) -> web.Response:
        body = decode_json_body(await request.read(), StageModelBody)
        command = DownloadModel(command_id=_new_id("cmd"), model_id=body.model, source=body.source)
        await bus.publish_command(command)
        return web.json_response({"model": body.model, "command_id": command.command_id}, status=202)

    async def list_downloads(_: web.Request) -> web.Response:
        state = follower.state
        body = {
            model_id: {"status": state.downloads.get(model_id), "card": state.models.get(model_id)}
            for model_id in sorted(state.downloads.keys() | state.models.keys())
        }
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def delete_download(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        state = follower.state
        if model not in state.downloads and model not in state.models:
            raise ApiError(404, f"no model {model!r} is staged", param="model")
        try:  # the downloader deletes from object storage: refuse rather than queue a doomed command
            await asyncio.to_thread(store.check)
        except StoreError as exc:
            raise store_unavailable(exc, f"{model!r} cannot be deleted now") from None
        await bus.publish_command(DeleteModel(command_id=_new_id("cmd"), model_id=model))
        in_use = sorted(i.instance_id for i in state.instances.values() if i.model_id == model)
        return web.json_response({"model": model, "deleted": True, "still_used_by": in_use}, status=202)

    async def create_instance(request: web.Request) -> web.Response:
        body = decode_json_body(await request.read(), CreateInstanceBody)
        try:
            staged = await asyncio.to_thread(
                store.exists, MODELS_BUCKET, manifest_key(body.model, DEFAULT_REVISION)
            )
        except StoreError as exc:  # a worker could not fetch the files either: refuse now, clearly
            raise store_unavailable(exc, f"no instance of {body.model!r} can load its files now") from None
        if not staged:
            raise ApiError(404, f"model {body.model!r} is not staged: POST /models first", param="model")
        if body.role not in INSTANCE_ROLES:
            raise ApiError(
                400, f"role must be one of {', '.join(INSTANCE_ROLES)}, got {body.role!r}", param="role"
            )
        instance_id = _new_id("inst")
        command = CreateInstance(
            command_id=_new_id("cmd"),
            model_id=body.model,
            instance_id=instance_id,
            engine=body.engine,
            shards=body.shards,
            role=body.role,
        )
        await bus.publish_command(command)
        return web.json_response({"instance_id": instance_id, "model": body.model}, status=202)

    async def delete_instance(request: web.Request) -> web.Response:
        instance_id = request.match_info["instance_id"]
        if instance_id not in follower.state.instances:
            raise ApiError(404, f"no instance {instance_id!r}", param="instance_id")
        await bus.publish_command(DeleteInstance(command_id=_new_id("cmd"), instance_id=instance_id))
        return web.json_response({"instance_id": instance_id, "deleted": True}, status=202)

    async def placements(request: web.Request) -> web.Response:
        model = request.query.get("model", "")
        if not model:
            raise ApiError(400, "query parameter 'model' is required", param="model")
        try:
            reply = await bus.request(
                PLACEMENTS_SUBJECT, PlacementsRequest(model_id=model), PlacementsReply, 2.0
            )
        except RequestFailed as exc:
            raise ApiError(503, f"the scheduler did not answer: {exc}") from None
        if reply.error:
            raise ApiError(404, reply.error, param="model")
        return web.Response(
            body=msgspec.json.encode({"model": model, "options": reply.options}),
            content_type="application/json",
        )

    async def get_capabilities(_: web.Request) -> web.Response:
        return web.json_response(capabilities(follower.state))

    async def list_instances(_: web.Request) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(follower.state.instances), content_type="application/json"
        )

    return [
        web.post("/models", stage_model),
        web.post("/downloads", stage_model),
        web.get("/downloads", list_downloads),
        web.delete("/downloads/{model:.+}", delete_download),
        web.post("/instances", create_instance),
        web.get("/instances", list_instances),
        web.get("/placements", placements),
        web.get("/capabilities", get_capabilities),
        web.delete("/instances/{instance_id}", delete_instance),
    ]
