"""Instances following demand, on one machine (issue 45):

    fleet bench autoscale                      # SmolLM2 on llama.cpp, 8 clients, a worker joins at 10 s
    fleet bench autoscale --clients 8 --join-at 5 --load-s 60

A fresh embedded stack whose own worker serves nothing, and worker w1 with one instance of the
default model; autoscaling on (min 1, max 2, short windows). `--clients` closed loops of streamed
chat requests run for `--load-s` seconds; at `--join-at` a second worker, w2, starts (as `fleet
worker` would on another machine). Then the load stops, the policy drains one instance, and with
min_instances 0 the last; one more request is then sent and waits for an instance placed for it.

Reported (and written as JSON): TTFT p50/p90 while one instance serves and once two do (and their
ratio, measured in the same run), the time from w2's start to its instance's first placement and
readiness, from the end of the load to the scale-down, the cold start's time to first token, the
instance count over time, and every scaling decision the scheduler recorded, with its reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, call, discard, scratch_dir, serve_on, stage, until, workers_stack, write_result
from loadgen import percentile

ENGINE = "llamacpp"
ENGINE_OPTIONS = {"n_threads": 1}  # one core per worker: the two workers share this machine
LIVE = ("placed", "downloading", "loading", "warming", "ready")
PROMPT = [{"role": "user", "content": "Name three rivers of Europe and say one thing about each."}]
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Timeline:
    """What the bench saw, on its own monotonic clock (s since the load started)."""

    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT s)
    instances: list[tuple[float, int, int]] = field(default_factory=list)  # (at, live, ready)
    errors: list[str] = field(default_factory=list)


def serving(state: dict, model: str) -> list[dict]:
    return [i for i in state["instances"].values() if i["model_id"] == model and i["status"] in LIVE]


def first_at(
    instances: Sequence[tuple[float, int, int]], after: float, live: int = -1, ready: int = -1
) -> float:
    """When the count first reached `live` (or `ready`) at or after `after` (nan: never)."""
    for at, n_live, n_ready in instances:
        if at >= after and ((live >= 0 and n_live == live) or (ready >= 0 and n_ready == ready)):
            return at
    return float("nan")


def phase_ttfts(timeline: Timeline, one_until: float, two_from: float, two_until: float) -> dict:
    """TTFT p50/p90 of the requests sent while one instance served (before `one_until`) and while two
    did ([two_from, two_until)), and after/before."""
    one = [t for at, t in timeline.ttfts if at < one_until]
    two = [t for at, t in timeline.ttfts if two_from <= at < two_until]

    def summary(values: list[float]) -> dict:
        return {"requests": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90)}

    before, after = summary(one), summary(two)
    ratio = after["p50"] / before["p50"] if one and two and before["p50"] else float("nan")
    return {"one_instance": before, "two_instances": after, "p50_two_over_one": ratio}


async def streamed(
    session: aiohttp.ClientSession, gateway: str, model: str, max_tokens: int
) -> tuple[float, int]:
    """One streamed chat request: its TTFT and how many cold-start progress comments it saw."""
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, ttft, waits = time.monotonic(), float("nan"), 0
    async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status} {await response.text()}")
        async for line in response.content:
            waits += line.startswith(b": waiting_for_instance")
            has_text = b'"content":"' in line and b'"content":""' not in line
            if ttft != ttft and line.startswith(b"data: {") and has_text:
                ttft = time.monotonic() - started
    return ttft, waits


async def run(args: argparse.Namespace, gateway: str, model: str, start_w2) -> dict:
    timeline, began = Timeline(), time.monotonic()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        policy = {
            "min_instances": 1,
            "max_instances": 2,
            "scale_up_window_s": args.window_s,
            "scale_up_cooldown_s": args.window_s * 2,
            "scale_down_delay_s": args.down_delay_s,
            "target_utilization": args.target_utilization,
        }
        await call(session, "PUT", f"{gateway}/scaling/{model}", policy)
        stop = asyncio.Event()

        async def watch() -> None:
            while True:
                state = await call(session, "GET", f"{gateway}/state")
                live = serving(state, model)
                at = time.monotonic() - began
                timeline.instances.append((at, len(live), sum(i["status"] == "ready" for i in live)))
                await asyncio.sleep(0.5)

        async def client() -> None:
            while not stop.is_set():
                sent = time.monotonic() - began
                try:
                    ttft, _ = await streamed(session, gateway, model, args.max_tokens)
                    timeline.ttfts.append((sent, ttft))
                except Exception as exc:
                    timeline.errors.append(str(exc)[:300])

        watcher = asyncio.create_task(watch())
        clients = [asyncio.create_task(client()) for _ in range(args.clients)]
        await asyncio.sleep(args.join_at)
        joined_at = time.monotonic() - began
        start_w2()
        await asyncio.sleep(max(args.load_s - args.join_at, 0))
        stop.set()
        await asyncio.gather(*clients)
        load_end = time.monotonic() - began
        await until(session, gateway, lambda s: len(serving(s, model)) == 1, args.down_delay_s * 4 + 120)
        await asyncio.sleep(1)
        # scale to zero, then one request waits for the instance placed for it
        await call(session, "PUT", f"{gateway}/scaling/{model}", {"min_instances": 0, "idle_s": 3})
        await until(session, gateway, lambda s: not serving(s, model), args.down_delay_s * 4 + 120)
        cold_ttft, waits = await streamed(session, gateway, model, 8)
        watcher.cancel()
        state = await call(session, "GET", f"{gateway}/state")
    placed = first_at(timeline.instances, joined_at, live=2)
    ready = first_at(timeline.instances, joined_at, ready=2)
    down = first_at(timeline.instances, load_end, live=1)
    return {
        "ttft": phase_ttfts(timeline, one_until=joined_at, two_from=ready + 1, two_until=load_end),
        "w2_started_at_s": joined_at,
        "second_instance_placed_after_join_s": placed - joined_at,
        "second_instance_ready_after_join_s": ready - joined_at,
        "scaled_down_after_load_s": down - load_end,
        "cold_start": {"ttft_s": cold_ttft, "progress_comments": waits},
        "errors": timeline.errors[:10],
        "error_count": len(timeline.errors),
        "instances_over_time": timeline.instances,
        "decisions": state.get("scaling", {}).get(model, {}).get("decisions", []),
    }


def report_lines(result: dict) -> list[str]:
    ttft = result["ttft"]
    one, two = ttft["one_instance"], ttft["two_instances"]
    return [
        f"TTFT p50 one instance {one['p50']:.3f} s (p90 {one['p90']:.3f}, {one['requests']} requests); "
        f"two {two['p50']:.3f} s (p90 {two['p90']:.3f}, {two['requests']}): {ttft['p50_two_over_one']:.2f}x",
        f"w2 started -> its instance placed {result['second_instance_placed_after_join_s']:.1f} s, "
        f"ready {result['second_instance_ready_after_join_s']:.1f} s; load stopped -> one instance "
        f"{result['scaled_down_after_load_s']:.1f} s",
        f"cold start from zero: first token after {result['cold_start']['ttft_s']:.1f} s "
        f"({result['cold_start']['progress_comments']} progress comments); errors {result['error_count']}",
        *(f"  {d['kind']:<10} {d['instance_id'] or '-':<22} {d['reason']}" for d in result["decisions"]),
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet bench autoscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="closed-loop streams (default 8)")
    parser.add_argument(
        "--target-utilization", type=float, default=0.5,
        help="of an instance's request slots (llama.cpp's: 8); 8 clients ask for 2 instances at 0.5",
    )  # fmt: skip
    parser.add_argument("--load-s", type=float, default=45.0, help="how long the load runs")
    parser.add_argument("--join-at", type=float, default=10.0, help="when w2 starts, s into the load")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=3.0, help="scale_up_window_s (cooldown: 2x)")
    parser.add_argument("--down-delay-s", type=float, default=5.0, help="scale_down_delay_s")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from fleet_local.bootstrap import DEFAULT_MODEL, DEFAULT_SOURCE

    args = parse_args(argv)
    root = scratch_dir("fleet-bench-autoscale-")
    worker_env = {
        "FLEET_NODE_ENGINES": ENGINE,
        "FLEET_CALIBRATION": "off",
        "FLEET_ENGINE_OPTIONS": json.dumps({ENGINE: ENGINE_OPTIONS}),
    }
    with workers_stack(root, ["w1"], worker_env, {}) as cluster:
        asyncio.run(stage(cluster.gateway, DEFAULT_MODEL, DEFAULT_SOURCE, nodes=2))
        asyncio.run(serve_on(cluster.gateway, DEFAULT_MODEL, "w1", 30, engine=ENGINE))
        result = asyncio.run(run(args, cluster.gateway, DEFAULT_MODEL, lambda: cluster.start("w2")))
    result |= {"model": DEFAULT_MODEL, "engine": ENGINE, "engine_options": ENGINE_OPTIONS, "args": {
        k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    print("\n".join(report_lines(result)))
    write_result(args.out, "autoscale", result)
    discard(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
