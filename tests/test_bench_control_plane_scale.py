"""`fleet bench control-plane --scale`'s pure parts: the synthetic cluster, load and cached prefixes, the
KV index's synthetic prompts and the commands that fill Redis with KVIndex's layout, the statistics,
the verdict, and the flag's wiring (no Redis here: the run itself is `--scale --quick`)."""

from __future__ import annotations

import math
import sys

import msgspec
import pytest

from fleet_proto import InstanceStatus, NodeMetrics, encode
from fleet_store.kv import DEFAULT_BLOCK_SIZE, block_hashes
from fleet_store.kv_index import DEFAULT_TTL_S, TIER2, KVIndex, block_key
from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import control_plane
import control_plane_scale as scale

pytestmark = pytest.mark.unit


def test_summaries_are_in_microseconds_and_growth_is_an_exponent() -> None:
    summary = scale.summary_us([1000 * v for v in range(1, 101)])
    assert summary["n"] == 100 and summary["max_us"] == 100
    assert summary["p50_us"] == pytest.approx(50.5) and summary["p99_us"] == pytest.approx(99.01)
    assert summary["mean_us"] == pytest.approx(50.5)
    assert math.isnan(scale.summary_us([])["p50_us"]) and math.isnan(scale.summary_us([])["mean_us"])
    assert scale.growth_exponent(1.0, 10.0, 100, 1000) == pytest.approx(1.0)
    assert scale.growth_exponent(1.0, 100.0, 100, 1000) == pytest.approx(2.0)
    assert math.isnan(scale.growth_exponent(0.0, 1.0, 100, 1000))
    assert math.isnan(scale.growth_exponent(1.0, 2.0, 100, 100))


def test_the_synthetic_cluster_has_one_ready_instance_per_node_and_a_load_on_each() -> None:
    state = scale.synthetic_state(16)
    assert len(state.nodes) == len(state.instances) == 16
    assert all(i.status == InstanceStatus.READY for i in state.instances.values())
    assert {i.model_id for i in state.instances.values()} == {f"model-{m}" for m in range(4)}
    load = scale.synthetic_load(state)
    assert load.keys() == state.instances.keys() and all(0 <= t < 32_768 for t in load.values())
    assert load == scale.synthetic_load(state) != scale.synthetic_load(state, seed=1)


def test_cached_prefixes_sit_on_a_few_nodes_serving_the_model_in_whole_blocks() -> None:
    state = scale.synthetic_state(100)
    serving = {i.node_id for i in state.instances.values() if i.model_id == "model-2"}
    cached = scale.synthetic_cached(state, "model-2", 16 * DEFAULT_BLOCK_SIZE + 100)
    assert len(cached) == 4 and cached.keys() <= serving
    assert all(t % DEFAULT_BLOCK_SIZE == 0 and 0 < t <= 16 * DEFAULT_BLOCK_SIZE for t in cached.values())
    assert len(scale.synthetic_cached(scale.synthetic_state(4), "model-0", 1024)) == 1  # one node serves it


def test_route_requests_cycle_through_the_models_and_prompt_sizes() -> None:
    asks = scale.route_requests(12)
    assert {a.model_id for a in asks} == {f"model-{m}" for m in range(4)}
    assert [a.prompt_tokens for a in asks[:3]] == [b * DEFAULT_BLOCK_SIZE + 100 for b in (4, 16, 64)]
    assert len({(a.model_id, a.prompt_tokens) for a in asks}) == 12


def test_prompts_have_8_to_64_blocks_and_the_plan_writes_exactly_the_blocks_asked() -> None:
    assert {scale.prompt_blocks(p) for p in range(5000)} == set(range(8, 65))
    plan = list(scale.fill_plan(1000))
    assert sum(b for _, b in plan) == 1000 and [p for p, _ in plan] == list(range(len(plan)))
    assert all(b == scale.prompt_blocks(p) for p, b in plan[:-1])
    assert plan[-1][1] <= scale.prompt_blocks(plan[-1][0])  # the last one cut short
    assert list(scale.fill_plan(10, first_prompt=7)) == [(7, 10)]
    assert list(scale.fill_plan(0)) == []


def test_prompt_hashes_are_fleets_chain_so_a_longer_prompt_extends_a_shorter_one() -> None:
    fingerprint = scale.model_fingerprints()[1]
    short, long = scale.prompt_hashes(fingerprint, 42, 4), scale.prompt_hashes(fingerprint, 42, 16)
    assert long[:4] == short and len(long) == 16 and all(len(h) == 32 for h in long)
    assert short == block_hashes(fingerprint, [42, 1, 2, 3], 1)
    assert not set(long) & set(scale.prompt_hashes(fingerprint, 43, 16))  # prompts share no block
    assert scale.prompt_hashes(scale.model_fingerprints()[2], 42, 4) != short
    assert len(set(scale.model_fingerprints())) == 4


def test_a_prompt_lives_on_a_node_that_serves_its_model_and_every_other_one_in_object_storage() -> None:
    state = scale.synthetic_state(100)
    served = {i.node_id: i.model_id for i in state.instances.values()}
    for prompt in range(0, 1000, 37):
        members = scale.prompt_members(prompt, 100)
        assert served[members[0]] == f"model-{scale.prompt_model(prompt, 100)}"
        assert (TIER2 in members) == (prompt % 2 == 0)


def test_the_fill_speaks_resp() -> None:
    fingerprint = scale.model_fingerprints()[1]
    key = block_key(fingerprint, scale.prompt_hashes(fingerprint, 1, 1)[0])
    payload, commands, blocks = scale.fill_commands([(1, 1)], 4, scale.model_fingerprints(), ttl_s=60)
    sadd = f"*3\r\n$4\r\nSADD\r\n${len(key)}\r\n{key}\r\n$6\r\nnode-1\r\n"
    assert payload.decode() == sadd + f"*3\r\n$6\r\nEXPIRE\r\n${len(key)}\r\n{key}\r\n$2\r\n60\r\n"
    assert (commands, blocks) == (2, 1)


def parse_resp(payload: bytes) -> list[list[str]]:
    commands, lines = [], iter(payload.decode().split("\r\n"))
    for head in lines:
        if not head:
            continue
        assert head.startswith("*")
        parts = []
        for _ in range(int(head[1:])):
            assert next(lines).startswith("$")
            parts.append(next(lines))
        commands.append(parts)
    return commands


class RecordingPipe:
    """Stands in for redis-py's pipeline: records what KVIndex.add sends."""

    def __init__(self, sent: list[list[str]]) -> None:
        self.sent = sent

    async def __aenter__(self) -> RecordingPipe:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    def sadd(self, key: str, *members: str) -> None:
        self.sent.append(["SADD", key, *members])

    def expire(self, key: str, ttl: int) -> None:
        self.sent.append(["EXPIRE", key, str(ttl)])

    async def execute(self) -> list:
        return []


class RecordingRedis:
    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    def pipeline(self, transaction: bool = True) -> RecordingPipe:
        return RecordingPipe(self.sent)


def folded(commands: list[list[str]]) -> dict[str, tuple[frozenset[str], int]]:
    """What Redis holds after the commands: key -> (members, ttl)."""
    members: dict[str, set[str]] = {}
    ttl: dict[str, int] = {}
    for name, key, *rest in commands:
        if name == "SADD":
            members.setdefault(key, set()).update(rest)
        else:
            assert name == "EXPIRE"
            ttl[key] = int(rest[0])
    return {key: (frozenset(held), ttl[key]) for key, held in members.items()}


async def test_the_fill_writes_what_kv_index_add_writes() -> None:
    workers, fingerprints, prompts = 8, scale.model_fingerprints(), [(3, 5), (4, 2)]
    payload, commands, blocks = scale.fill_commands(prompts, workers, fingerprints)
    assert (commands, blocks) == (14, 7)
    sent = parse_resp(payload)
    assert (
        len(sent) == commands
        and sent[0][0] == "SADD"
        and sent[1] == ["EXPIRE", sent[0][1], str(DEFAULT_TTL_S)]
    )
    fake = RecordingRedis()
    index = KVIndex(fake)  # type: ignore[arg-type]
    for prompt, count in prompts:  # a worker adds its node's blocks, and later the uploaded ones
        fingerprint = fingerprints[scale.prompt_model(prompt, workers)]
        for member in scale.prompt_members(prompt, workers):
            await index.add(fingerprint, scale.prompt_hashes(fingerprint, prompt, count), member)
    assert folded(sent) == folded(fake.sent)
    fingerprint = fingerprints[scale.prompt_model(4, workers)]
    key = block_key(fingerprint, scale.prompt_hashes(fingerprint, 4, 1)[0])
    assert folded(sent)[key] == (frozenset({"node-4", TIER2}), DEFAULT_TTL_S)


def test_a_lookup_request_starts_with_a_filled_prompts_blocks() -> None:
    fingerprints = scale.model_fingerprints()
    ask = scale.lookup_request(6, 64, 100, fingerprints)
    assert ask.model_id == "model-2" and ask.kv_fingerprint == fingerprints[2]
    assert ask.prompt_tokens == 64 * DEFAULT_BLOCK_SIZE + 100 and len(ask.block_hashes) == 64
    filled = scale.prompt_hashes(fingerprints[2], 6, scale.prompt_blocks(6))
    assert list(ask.block_hashes[: len(filled)]) == filled


def test_worker_metrics_report_every_instance_and_feed_the_schedulers_load() -> None:
    from fleet_scheduler.main import LoadTracker

    state = scale.synthetic_state(16)
    metrics = scale.worker_metrics(state)
    assert [m.node_id for m in metrics] == sorted(state.nodes)
    tracker = LoadTracker()
    for m in metrics:
        tracker.on_metrics(msgspec.json.decode(encode(m), type=NodeMetrics))
    load = tracker.load()
    assert load.keys() == state.instances.keys()
    by_instance = {i: m.queued_tokens[i] + m.active_requests[i] for m in metrics for i in m.running_tokens}
    assert load == by_instance


def figures(decision_ms: float, route_ms: float, workers: int = 1000, blocks: int = 10_000_000) -> dict:
    def us(ms: float) -> dict:
        return {"p50_us": 1000 * ms, "p99_us": 1000 * ms}

    def decision(total_ms: float, route_ms: float) -> dict:
        rest = total_ms - route_ms
        return us(total_ms) | {
            "route": us(route_ms),
            "lookup": us(rest),
            "rest_p50_us": 1000 * rest,
            "rest_p99_us": 1000 * rest,
        }

    def state(n: int) -> dict:
        return {"state_json_bytes": 700 * n, "get_state_bytes": 20 * n * n, "get_state_ms": n * n / 1600,
                "apply_one_event_us": 1.0 + n / 100}  # fmt: skip

    return {
        "workers": workers,
        "blocks": blocks,
        "routing": {"100": us(route_ms / 10), str(workers): us(route_ms)},
        "state": {"100": state(100), str(workers): state(workers)},
        "decision": {"4": decision(decision_ms / 2, route_ms), "64": decision(decision_ms, route_ms)},
        "index": {
            "holders": {"4": us(0.2), "16": us(0.5), "64": us(1.2)},
            "prefix_blocks": {"4": us(0.1), "16": us(0.15), "64": us(0.3)},
            "holders_16_small_index": us(0.5),
            "small_index_blocks": 20_000,
            "used_memory_bytes_per_block": 150.0,
        },
        "metrics": {"messages_per_s": 1000.0, "scheduler_core_share": 0.002},
    }


def test_a_decisions_parts_are_summed_per_call() -> None:
    summary = scale.decision_summary([(1000, 100, 3000), (2000, 100, 5000)])
    assert summary["n"] == 2 and summary["max_us"] == 7.1 and summary["p50_us"] == pytest.approx(5.6)
    assert summary["route"]["p50_us"] == 4.0 and summary["lookup"]["max_us"] == 2.0
    assert summary["rest_p99_us"] == pytest.approx(2.09) and summary["rest_p50_us"] == pytest.approx(1.6)
    assert math.isnan(scale.decision_summary([])["route"]["p50_us"])


def test_the_verdict_judges_the_goal_and_names_what_grows_first() -> None:
    lines = scale.verdict(figures(decision_ms=5.5, route_ms=4.0))
    assert lines[0].startswith("decision p99 5.50 ms at 1,000 workers and 10,000,000 blocks (64-block")
    assert "MISSES the 5 ms goal" in lines[0] and "set at" not in lines[0]
    assert "the larger part is route()" in lines[1]
    growth = next(line for line in lines if line.startswith("growth from 100"))
    assert growth.index("GET /state body (partner table) ~N^2.0") < growth.index(
        "route() per decision ~N^1.0"
    )
    assert any("reaches 5 ms at ~875 workers at p99" in line for line in lines)  # (5 - 1.5) / 4 of 1,000
    assert any(line.startswith("Redis: 150 bytes/block: 1.40 GiB") for line in lines)
    quick = scale.verdict(figures(decision_ms=1.0, route_ms=0.3, workers=100, blocks=100_000))
    assert "meets the 5 ms goal (set at 1,000 workers" in quick[0]
    lookup_bound = scale.verdict(figures(decision_ms=9.0, route_ms=1.0))
    assert any(
        "reaches 5 ms at any size (the KV lookup and load() alone) at p99" in line for line in lookup_bound
    )
    assert (
        scale.workers_at_goal(1000, 1.0, 4.0, 1.0) == 1000
        and scale.workers_at_goal(1000, 2.0, 1.0, 1.0) == 2000
    )
    assert scale.workers_at_goal(1000, 1.0, 1.0, 5.0) == 0


def test_scale_is_a_mode_of_the_control_plane_bench(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    calls, written = [], []
    monkeypatch.setattr(scale, "run_scale", lambda *args: calls.append(args) or {"workers": args[0]})
    monkeypatch.setattr(
        control_plane, "write_result", lambda out, name, result: written.append((name, result))
    )
    argv = ["--scale", "--workers", "200", "--blocks", "5000", "--quick", "--out", str(tmp_path)]
    assert control_plane.main(argv) == 0
    assert calls == [(200, 5000, True)]
    assert written == [("control_plane_scale", {"scale": {"workers": 200}})]
