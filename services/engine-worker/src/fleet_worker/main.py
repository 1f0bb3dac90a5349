"""Engine worker: announces its node, publishes node metrics about once a second.

Engines and task execution arrive with issue 3 (MLX) and issue 7 (vLLM).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fleet_proto import NodeJoined, NodeLeft, ServiceKind
from fleet_proto.subjects import metrics_subject
from fleet_runtime.service import ServiceContext, run
from fleet_worker.probe import node_id_from, node_info, node_metrics

METRICS_INTERVAL_S = 1.0


async def publish_metrics(ctx: ServiceContext, node_id: str, model_dir: Path) -> None:
    while True:
        await ctx.bus.publish(
            metrics_subject(node_id), await asyncio.to_thread(node_metrics, node_id, model_dir)
        )
        await asyncio.sleep(METRICS_INTERVAL_S)


async def main(ctx: ServiceContext) -> None:
    node_id = ctx.node_id = node_id_from(ctx.settings.resolved_node_id())
    model_dir = Path(ctx.settings.state_dir) / "models"
    info = await asyncio.to_thread(node_info, node_id, model_dir)
    await ctx.bus.publish_event(NodeJoined(node=info, origin=ctx.service_id, at=time.time()))
    ctx.spawn(publish_metrics(ctx, node_id, model_dir), "node-metrics")

    async def leave() -> None:
        await ctx.bus.publish_event(NodeLeft(node_id=node_id, reason="worker stopped", origin=ctx.service_id))

    ctx.on_shutdown(leave)


def cli() -> None:
    run(ServiceKind.WORKER, main)
