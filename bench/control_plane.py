"""What Fleet itself costs, with no model in the way: routing decisions/s of the scheduler, NATS
publish/consume rates on this machine, and the gateway's requests/s and added latency when the
engine is replaced by the echo engine (fleet_worker.engines.echo_engine: no model, one token per step).

    .venv/bin/fleet bench control-plane               # ~1 minute
    .venv/bin/fleet bench control-plane --quick       # smaller counts (what the tests run)
    .venv/bin/fleet bench control-plane --scale       # 1,000 simulated workers, 10M KV blocks in Redis
    .venv/bin/fleet bench control-plane --overhead    # the gateway's cost per request, 1 and 2 replicas

1. Routing: `route()` called directly, and `fleet.route` requests answered by a real scheduler over
   NATS (one at a time, and 16 in flight) on a synthetic cluster of 16 nodes / 64 ready instances
   (events only, no engines), next to a bare NATS request/reply echo on the same server.
2. NATS: core publish -> one subscriber (256-byte messages), JetStream acked publish, and a pull
   consumer draining it.
3. Gateway: an embedded stack whose worker offers only the echo engine, serving a tiny model:
   1-token chat completions one at a time (latency; GET /health alongside as the HTTP floor) and 16
   at a time (requests/s), and one / eight long streams (tokens/s the stack can carry per stream).
Every loop is bounded by its count. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, discard, scratch_dir, write_result
from loadgen import percentile


def ms(values: list[float], q: float) -> float:
    return 1000 * percentile(values, q)


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


async def routing_and_nats(nats_url: str, requests: int, messages: int, js_messages: int) -> dict:
    from fleet_bus import Bus, ensure_streams
    from fleet_proto import RouteReply, RouteRequest, replay
    from fleet_proto.routing import route
    from fleet_proto.subjects import ROUTE_SUBJECT

    bus = await Bus.connect(nats_url, "bench-control-plane")
    await ensure_streams(bus.js)
    events = cluster_events(16, 64)
    for event in events:
        await bus.publish_event(event)
    state = replay(enumerate(events, start=1))
    asks = [
        RouteRequest(request_id=f"r{i}", model_id=f"model-{i % 4}", prompt_tokens=512)
        for i in range(requests)
    ]
    for _ in range(50):  # warm up; also waits until the scheduler has folded the events
        reply = await bus.request(ROUTE_SUBJECT, asks[0], RouteReply, 5.0)
    assert reply.instance_id, reply.error

    started = time.perf_counter()
    for ask in asks:
        route(state, ask, {})
    pure_per_s = len(asks) / (time.perf_counter() - started)

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    await bus.nc.subscribe("bench.echo", cb=echo)
    bare, routed = [], []
    for ask in asks:  # interleaved, so noise hits both alike
        started = time.perf_counter()
        await bus.nc.request("bench.echo", b"x" * 64, timeout=5)
        bare.append(time.perf_counter() - started)
        started = time.perf_counter()
        reply = await bus.request(ROUTE_SUBJECT, ask, RouteReply, 5.0)
        routed.append(time.perf_counter() - started)
        assert reply.instance_id, reply.error

    in_flight = asyncio.Semaphore(16)

    async def one(ask: RouteRequest) -> None:
        async with in_flight:
            await bus.request(ROUTE_SUBJECT, ask, RouteReply, 5.0)

    started = time.perf_counter()
    await asyncio.gather(*(one(a) for a in asks))
    concurrent_per_s = len(asks) / (time.perf_counter() - started)

    received = 0
    done = asyncio.Event()

    async def count(_msg) -> None:
        nonlocal received
        received += 1
        if received == messages:
            done.set()

    await bus.nc.subscribe("bench.rate", cb=count)
    payload = b"x" * 256
    started = time.perf_counter()
    for _ in range(messages):
        await bus.nc.publish("bench.rate", payload)
    await bus.nc.flush()
    published_s = time.perf_counter() - started
    await asyncio.wait_for(done.wait(), 60)
    consumed_s = time.perf_counter() - started

    await bus.js.add_stream(name="BENCH", subjects=["bench.js"], storage="memory")
    started = time.perf_counter()
    for _ in range(js_messages):
        await bus.js.publish("bench.js", payload)
    js_publish_s = time.perf_counter() - started
    consumer = await bus.js.pull_subscribe("bench.js", durable="bench")
    started = time.perf_counter()
    drained = 0
    while drained < js_messages:
        batch = await consumer.fetch(min(256, js_messages - drained), timeout=10)
        for msg in batch:
            await msg.ack()
        drained += len(batch)
    js_consume_s = time.perf_counter() - started
    await bus.js.delete_stream("BENCH")
    await bus.close()
    return {
        "routing": {
            "cluster": "16 nodes, 64 ready instances, 4 models",
            "requests": len(asks),
            "pure_route_decisions_per_s": pure_per_s,
            "nats_round_trip_ms_p50": ms(routed, 50),
            "nats_round_trip_ms_p99": ms(routed, 99),
            "bare_nats_echo_ms_p50": ms(bare, 50),
            "ratio_route_over_bare_echo_p50": percentile(routed, 50) / percentile(bare, 50),
            "sequential_decisions_per_s": len(asks) / sum(routed),
            "decisions_per_s_16_in_flight": concurrent_per_s,
        },
        "nats": {
            "core_messages": messages,
            "core_publish_msgs_per_s": messages / published_s,
            "core_consume_msgs_per_s": messages / consumed_s,
            "jetstream_messages": js_messages,
            "jetstream_acked_publish_msgs_per_s": js_messages / js_publish_s,
            "jetstream_pull_consume_msgs_per_s": js_messages / js_consume_s,
        },
    }


async def chat(
    session: aiohttp.ClientSession, gateway: str, model: str, max_tokens: int, stream: bool
) -> tuple:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
            "stream": stream}  # fmt: skip
    started = time.perf_counter()
    tokens = 0
    async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"chat: HTTP {response.status}: {await response.text()}")
        if not stream:
            tokens = (await response.json())["usage"]["completion_tokens"]
        else:
            async for line in response.content:
                if line.startswith(b"data: {") and b'"content"' in line:
                    tokens += 1
    return time.perf_counter() - started, tokens


async def gateway_figures(
    gateway: str, model: str, sequential: int, concurrent: int, stream_tokens: int
) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(5):
            await chat(session, gateway, model, 1, False)
        health, one_token = [], []
        for _ in range(sequential):  # interleaved with the HTTP floor
            started = time.perf_counter()
            async with session.get(f"{gateway}/health") as response:
                await response.read()
            health.append(time.perf_counter() - started)
            one_token.append((await chat(session, gateway, model, 1, False))[0])

        in_flight = asyncio.Semaphore(16)

        async def bounded() -> None:
            async with in_flight:
                await chat(session, gateway, model, 1, False)

        started = time.perf_counter()
        await asyncio.gather(*(bounded() for _ in range(concurrent)))
        requests_per_s = concurrent / (time.perf_counter() - started)

        wall, tokens = await chat(session, gateway, model, stream_tokens, True)
        started = time.perf_counter()
        eight = await asyncio.gather(*(chat(session, gateway, model, stream_tokens, True) for _ in range(8)))
        eight_wall = time.perf_counter() - started
    return {
        "engine": "echo (no model: one token per engine step)",
        "health_ms_p50": ms(health, 50),
        "chat_1_token_ms_p50": ms(one_token, 50),
        "chat_1_token_ms_p99": ms(one_token, 99),
        "added_over_http_floor_ms_p50": ms(one_token, 50) - ms(health, 50),
        "requests_per_s_16_in_flight": requests_per_s,
        "requests_in_flight_run": concurrent,
        "stream_tokens_per_s_1_stream": tokens / wall,
        "stream_tokens_per_s_8_streams": sum(t for _, t in eight) / eight_wall,
        "stream_tokens": stream_tokens,
    }


def run_routing(root: Path, requests: int, messages: int, js_messages: int) -> dict:
    from fleet_local.processes import free_port, spawn, stop_pid, wait_http
    from fleet_local.servers import start_nats, start_redis

    nats, redis = start_nats(root), start_redis(root)
    port = free_port()
    env = {
        **os.environ,
        "FLEET_NATS_URL": nats.url,
        "FLEET_REDIS_URL": redis.url,
        "FLEET_HEALTH_PORT": str(port),
        "FLEET_STATE_DIR": str(root),
        "FLEET_LOG_LEVEL": "WARNING",
    }
    scheduler = spawn([sys.executable, "-m", "fleet_scheduler"], root / "scheduler.log", env=env)
    try:
        wait_http(scheduler, "scheduler", root / "scheduler.log", f"http://127.0.0.1:{port}/health", 60)
        return asyncio.run(routing_and_nats(nats.url, requests, messages, js_messages))
    finally:
        stop_pid(scheduler.pid)
        redis.stop()
        nats.stop()


def run_gateway(root: Path, sequential: int, concurrent: int, stream_tokens: int) -> dict:
    from fleet_local import stack
    from fleet_local.bootstrap import stage_and_serve
    from fleet_local.processes import free_port

    sys.path.insert(0, str(REPO))
    from tests.support import make_chat_model

    # the worker offers only the echo engine, and computes no calibration or quality reference (it
    # would take a core for seconds after the instance is ready, under the figures)
    os.environ |= {"FLEET_NODE_ENGINES": "echo", "FLEET_CALIBRATION": "off"}
    source = f"file://{make_chat_model(root / 'tiny-src', max_positions=4096)}"  # room for long streams
    manifest = stack.up(root / "stack", gateway_port=free_port(), auth=False)
    try:
        stage_and_serve(manifest.gateway_url, "tiny/echo", source, 300, print, engine="echo")
        return asyncio.run(
            gateway_figures(manifest.gateway_url, "tiny/echo", sequential, concurrent, stream_tokens)
        )
    finally:
        stack.down(root / "stack")


def report(result: dict) -> None:
    r, n, g = result["routing"], result["nats"], result["gateway"]
    print(f"\nrouting ({r['cluster']}, {r['requests']} requests)")
    print(f"  route() alone                 {r['pure_route_decisions_per_s']:10.0f} decisions/s")
    print(f"  scheduler over NATS, 1 at once {r['sequential_decisions_per_s']:9.0f} decisions/s, p50 "
          f"{r['nats_round_trip_ms_p50']:.3f} ms, p99 {r['nats_round_trip_ms_p99']:.3f} ms")  # fmt: skip
    print(f"  ... 16 in flight              {r['decisions_per_s_16_in_flight']:10.0f} decisions/s")
    print(f"  bare NATS echo p50            {r['bare_nats_echo_ms_p50']:10.3f} ms "
          f"(route / echo {r['ratio_route_over_bare_echo_p50']:.2f})")  # fmt: skip
    print("NATS on this machine")
    print(
        f"  core publish {n['core_publish_msgs_per_s']:10.0f} msg/s, "
        f"consume {n['core_consume_msgs_per_s']:.0f} msg/s"
    )
    print(f"  JetStream acked publish {n['jetstream_acked_publish_msgs_per_s']:.0f} msg/s, "
          f"pull consume {n['jetstream_pull_consume_msgs_per_s']:.0f} msg/s")  # fmt: skip
    print(f"gateway with the {g['engine']}")
    print(f"  1-token chat p50 {g['chat_1_token_ms_p50']:.1f} ms, p99 {g['chat_1_token_ms_p99']:.1f} ms "
          f"(GET /health {g['health_ms_p50']:.2f} ms)")  # fmt: skip
    print(f"  {g['requests_per_s_16_in_flight']:.0f} requests/s at 16 in flight")
    print(f"  streaming {g['stream_tokens_per_s_1_stream']:.0f} tok/s on 1 stream, "
          f"{g['stream_tokens_per_s_8_streams']:.0f} tok/s on 8")  # fmt: skip


def overhead(args: argparse.Namespace) -> int:
    import control_plane_overhead as cpo

    default = cpo.QUICK_RATES if args.quick else cpo.RATES
    rates = [float(r) for r in args.rates.split(",")] if args.rates else list(default)
    step_s = args.step_seconds or (1.0 if args.quick else 5.0)
    root = scratch_dir("fleet-bench-overhead-")
    result = cpo.run_overhead(root, rates, step_s, args.quick)
    discard(root)
    cpo.report(result)
    write_result(args.out, "control_plane_overhead", {"overhead": result})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small counts (seconds)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--scale", action="store_true", help="the control plane at scale, simulated "
                        "(bench/control_plane_scale.py)")  # fmt: skip
    parser.add_argument("--workers", type=int, help="--scale: workers (default 1,000; --quick 100)")
    parser.add_argument("--blocks", type=int, help="--scale: KV blocks indexed (default 10M; --quick 100k)")
    parser.add_argument("--overhead", action="store_true", help="the gateway's cost per request under "
                        "open-loop load, one and two gateways (bench/control_plane_overhead.py)")  # fmt: skip
    parser.add_argument("--rates", help="--overhead: offered req/s, comma separated (default "
                        "25,50,100,150,200,300; --quick 20,40)")  # fmt: skip
    parser.add_argument("--step-seconds", type=float, help="--overhead: seconds of arrivals per rate "
                        "(default 5; --quick 1)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.overhead:
        return overhead(args)
    if args.scale:
        from control_plane_scale import run_scale

        write_result(
            args.out, "control_plane_scale", {"scale": run_scale(args.workers, args.blocks, args.quick)}
        )
        return 0
    scale = 10 if args.quick else 1
    root = scratch_dir("fleet-bench-control-")
    result = run_routing(root / "routing", 1000 // scale, 50_000 // scale, 5000 // scale)
    result["gateway"] = run_gateway(root / "gateway", 200 // scale, 480 // scale, 512 // scale)
    discard(root)
    report(result)
    write_result(args.out, "control_plane", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
