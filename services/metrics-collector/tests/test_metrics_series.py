import uuid

import pytest
import redis.asyncio as aioredis

from fleet_metrics.api import nodes_view
from fleet_proto import NodeMetrics
from fleet_proto.common import GpuSample
from fleet_proto.messages import RequestStats
from fleet_store import series
from fleet_store.series import DEFAULT_WINDOW_S, BadQuery, parse_series_query


def sample(at: float, used: int = 1, **kw) -> NodeMetrics:
    return NodeMetrics(
        node_id="n",
        at=at,
        memory_used_bytes=used,
        memory_available_bytes=2,
        cpu_percent=12.5,
        disk_free_bytes=3,
        **kw,
    )


@pytest.fixture
async def redis_client(redis_server):
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


def test_point_encoding_roundtrip():
    assert series.decode_point(series.encode_point(1700000000.1234, 12.5).encode()) == (1700000000.123, 12.5)
    assert series.decode_point(b"garbage") is None
    assert series.series_key("n1", "cpu_percent") == "fleet:series:n1:cpu_percent"


def test_sample_points_sums_instances():
    points = series.sample_points(sample(1.0, active_requests={"a": 2, "b": 3}, queued_tokens={"a": 7}))
    assert points["active_requests"] == 5
    assert points["queued_tokens"] == 7
    assert points["running_tokens"] == 0
    assert points["cpu_percent"] == 12.5
    assert set(points) == set(series.METRICS) - {"gpu_utilization"}  # a CPU node reports no GPU


async def test_record_read_trim_and_window(redis_client):
    node = f"node-{uuid.uuid4().hex[:8]}"
    for i in range(10):
        await series.record(redis_client, node, sample(1000.0 + i, used=i), max_points=5, ttl_s=60)
    key = series.series_key(node, "memory_used_bytes")
    assert await redis_client.llen(key) == 5
    assert 0 < await redis_client.ttl(key) <= 60
    points = await series.read(redis_client, node, "memory_used_bytes", 3600, now=1010.0)
    assert points == [(1000.0 + i, float(i)) for i in range(5, 10)]  # oldest trimmed, in order
    recent = await series.read(redis_client, node, "memory_used_bytes", 2.5, now=1010.0)
    assert recent == [(1008.0, 8.0), (1009.0, 9.0)]
    assert await series.read(redis_client, node, "cpu_percent", 1.5, now=1010.0) == [(1009.0, 12.5)]
    assert await series.read(redis_client, "no-such-node", "cpu_percent", 60) == []


def test_parse_series_query():
    assert parse_series_query({"metric": "cpu_percent", "window": "60"}) == ("cpu_percent", 60.0)
    assert parse_series_query({"metric": "cpu_percent"}) == ("cpu_percent", DEFAULT_WINDOW_S)
    for bad in (
        {"metric": "nope"},
        {},
        {"metric": "cpu_percent", "window": "abc"},
        {"metric": "cpu_percent", "window": "0"},
        {"metric": "cpu_percent", "window": "-5"},
        {"metric": "cpu_percent", "window": "nan"},
        {"metric": "cpu_percent", "window": "1e9"},
    ):
        with pytest.raises(BadQuery):
            parse_series_query(bad)


def test_nodes_view_lists_live_nodes_with_latest_sample():
    latest = {"n": sample(5.0), "gone": sample(5.0)}
    view = nodes_view({"n": {"hostname": "h"}, "m": {"hostname": "h2"}}, latest)
    assert [v["node_id"] for v in view] == ["m", "n"]
    assert view[0]["metrics"] is None
    assert view[1]["metrics"]["memory_used_bytes"] == 1
    assert view[1]["info"] == {"hostname": "h"}


def stats(**kw) -> RequestStats:
    fields = dict(request_id="r", model_id="m", instance_id="i", node_id="n", prompt_tokens=100)
    fields |= dict(completion_tokens=11, ttft_s=0.5, tpot_s=0.02, total_s=0.7, finish_reason="stop")
    return RequestStats(**(fields | kw))


def test_request_points_are_ttft_decode_rate_and_kv_hits():
    points = series.request_points(stats(prefix_cached_tokens=64))
    assert points == {"ttft_s": 0.5, "decode_tokens_per_s": 50.0, "kv_hit_ratio": 0.64}
    assert series.request_points(stats(completion_tokens=0, prompt_tokens=0)) == {}  # nothing to say
    assert set(series.request_points(stats(completion_tokens=1))) == {"ttft_s", "kv_hit_ratio"}


def test_an_embedding_request_gives_its_latency_and_input_rate_only():
    embedded = stats(task="embed", inputs=8, completion_tokens=0, prompt_tokens=90, total_s=0.25)
    assert series.request_points(embedded) == {"embedding_latency_s": 0.25, "embedding_inputs_per_s": 32.0}
    assert {"embedding_latency_s", "embedding_inputs_per_s"} <= set(series.SERIES)  # the dashboard's list


def test_gpu_utilization_is_the_mean_of_the_gpus_that_report_it():
    gpus = (
        GpuSample(index=0, utilization_ratio=0.5),
        GpuSample(index=1, utilization_ratio=1.0),
        GpuSample(index=2),
    )
    assert series.sample_points(sample(1.0, gpus=gpus))["gpu_utilization"] == 0.75
    assert "gpu_utilization" not in series.sample_points(sample(1.0))


async def test_request_series_land_on_the_node(redis_client):
    node = f"node-{uuid.uuid4().hex[:8]}"
    await series.record_request(redis_client, stats(node_id=node), at=1000.0)
    assert await series.read(redis_client, node, "ttft_s", 60, now=1001.0) == [(1000.0, 0.5)]
    assert parse_series_query({"metric": "kv_hit_ratio"})[0] == "kv_hit_ratio"
