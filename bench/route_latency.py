"""Routing decision latency: 1,000 `fleet.route` requests in a row against a real scheduler.

    .venv/bin/python bench/route_latency.py [--requests 1000] [--nodes 16] [--instances 64]

Starts nats-server, valkey and one scheduler process, publishes a cluster of N nodes with M ready
instances as events (no engines needed: routing reads only State and load), then measures in one
run: the round trip a gateway sees (request -> reply over NATS) and the pure `route()` call alone.
Prints p50/p99 and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cluster_events(nodes: int, instances: int) -> list:
    from fleet_proto import EngineInfo, Instance, InstancePlaced, InstanceReady, NodeInfo, NodeJoined

    events: list = []
    for n in range(nodes):
        info = NodeInfo(
            node_id=f"node-{n}", hostname=f"node-{n}", system="Linux", machine="x86_64", cpu_count=8,
            memory_total_bytes=64 << 30, memory_available_bytes=64 << 30, disk_total_bytes=1 << 40,
            disk_free_bytes=1 << 40, engines=(EngineInfo(name="mlx", version="0.32.4"),),
        )  # fmt: skip
        events.append(NodeJoined(node=info))
    for i in range(instances):
        instance = Instance(
            instance_id=f"inst-{i:03d}", model_id=f"model-{i % 4}", node_id=f"node-{i % nodes}", engine="mlx"
        )
        events += [InstancePlaced(instance=instance), InstanceReady(instance_id=instance.instance_id)]
    return events


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(nats_url: str, requests: int, nodes: int, instances: int) -> dict:
    from fleet_bus import Bus, StateFollower, ensure_streams
    from fleet_proto import RouteReply, RouteRequest, replay
    from fleet_proto.routing import route
    from fleet_proto.subjects import ROUTE_SUBJECT

    bus = await Bus.connect(nats_url, "bench-route")
    await ensure_streams(bus.js)
    events = cluster_events(nodes, instances)
    for event in events:
        await bus.publish_event(event)
    follower = StateFollower(bus)
    await follower.start()
    state = replay(enumerate(events, start=1))

    request = RouteRequest(request_id="bench", model_id="model-1", prompt_tokens=512)
    for _ in range(50):  # warm up; also waits until the scheduler has folded the events
        reply = await bus.request(ROUTE_SUBJECT, request, RouteReply, 5.0)
    assert reply.instance_id, reply.error

    round_trip, pure = [], []
    for i in range(requests):
        request = RouteRequest(request_id=f"r{i}", model_id=f"model-{i % 4}", prompt_tokens=512)
        started = time.perf_counter()
        reply = await bus.request(ROUTE_SUBJECT, request, RouteReply, 5.0)
        round_trip.append(time.perf_counter() - started)
        assert reply.instance_id
        started = time.perf_counter()
        route(state, request, {})
        pure.append(time.perf_counter() - started)
    await follower.stop()
    await bus.close()
    ms = lambda values, q: 1000 * percentile(values, q)  # noqa: E731
    return {
        "requests": requests,
        "nodes": nodes,
        "ready_instances": instances,
        "round_trip_ms_p50": ms(round_trip, 0.5),
        "round_trip_ms_p99": ms(round_trip, 0.99),
        "round_trip_ms_max": 1000 * max(round_trip),
        "pure_route_ms_p50": ms(pure, 0.5),
        "pure_route_ms_p99": ms(pure, 0.99),
        "round_trip_ms_mean": 1000 * statistics.mean(round_trip),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

    from fleet_local.processes import spawn, stop_pid, wait_http
    from fleet_local.servers import start_nats, start_redis

    root = Path(tempfile.mkdtemp(prefix="fleet-route-bench-"))
    nats, redis = start_nats(root), start_redis(root)
    env = {
        **os.environ,
        "FLEET_NATS_URL": nats.url,
        "FLEET_REDIS_URL": redis.url,
        "FLEET_HEALTH_PORT": "18999",
        "FLEET_STATE_DIR": str(root),
        "FLEET_LOG_LEVEL": "WARNING",
    }
    scheduler = spawn([sys.executable, "-m", "fleet_scheduler"], root / "scheduler.log", env=env)
    try:
        wait_http(scheduler, "scheduler", root / "scheduler.log", "http://127.0.0.1:18999/health", 60)
        result = asyncio.run(measure(nats.url, args.requests, args.nodes, args.instances))
    finally:
        stop_pid(scheduler.pid)
        redis.stop()
        nats.stop()
    r = result
    print(f"{r['requests']} route requests, {r['nodes']} nodes, {r['ready_instances']} ready instances:")
    p50, p99 = r["round_trip_ms_p50"], r["round_trip_ms_p99"]
    print(f"  round trip over NATS  p50 {p50:.3f} ms  p99 {p99:.3f} ms (target < 5)")
    print(f"  route() alone         p50 {r['pure_route_ms_p50']:.3f} ms  p99 {r['pure_route_ms_p99']:.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"route_latency-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
