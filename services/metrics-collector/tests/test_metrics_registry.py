import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet_metrics.registry import FleetMetrics, cpu_ratio, node_families, prefix_hit_ratio
from fleet_proto import (
    GpuSample,
    Instance,
    InstancePlaced,
    InstanceStatus,
    NodeMetrics,
    ScalingPolicy,
    ScalingPolicySet,
)
from fleet_proto.messages import AdmissionSample
from fleet_proto.testing import state_of

from .metrics_stats_helper import stats

pytestmark = pytest.mark.unit


def parse(metrics: FleetMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def node(node_id: str, **kw) -> NodeMetrics:
    fields = dict(
        node_id=node_id,
        at=1.0,
        memory_used_bytes=100,
        memory_available_bytes=200,
        cpu_percent=50.0,
        disk_free_bytes=300,
    )
    fields.update(kw)
    return NodeMetrics(**fields)


def test_request_histograms_and_counters():
    m = FleetMetrics()
    m.observe_request(
        stats("a", ttft_s=0.2, tpot_s=0.02, total_s=0.5, prompt_tokens=100, completion_tokens=10)
    )
    m.observe_request(stats("a", ttft_s=0.3, tpot_s=0.04, total_s=1.5, prompt_tokens=50, completion_tokens=5))
    m.observe_request(stats("b", finish_reason="length", ttft_s=1.0, total_s=2.0, completion_tokens=1))
    v = parse(m)
    assert v[("fleet_request_ttft_seconds_count", (("model", "a"),))] == 2
    assert v[("fleet_request_ttft_seconds_sum", (("model", "a"),))] == pytest.approx(0.5)
    assert v[("fleet_request_ttft_seconds_bucket", (("le", "0.25"), ("model", "a")))] == 1
    assert v[("fleet_request_ttft_seconds_bucket", (("le", "+Inf"), ("model", "a")))] == 2
    assert v[("fleet_request_tpot_seconds_count", (("model", "a"),))] == 2
    assert v[("fleet_request_tpot_seconds_sum", (("model", "a"),))] == pytest.approx(0.06)
    # one completion token: a TTFT but no TPOT
    assert v[("fleet_request_ttft_seconds_count", (("model", "b"),))] == 1
    assert ("fleet_request_tpot_seconds_count", (("model", "b"),)) not in v
    assert v[("fleet_request_duration_seconds_count", ())] == 3
    assert v[("fleet_request_duration_seconds_sum", ())] == pytest.approx(4.0)
    assert v[("fleet_tokens_generated_total", (("model", "a"),))] == 15
    assert v[("fleet_prompt_tokens_total", (("model", "a"),))] == 150
    assert v[("fleet_requests_total", (("finish_reason", "stop"), ("model", "a")))] == 2
    assert v[("fleet_requests_total", (("finish_reason", "length"), ("model", "b")))] == 1


def test_embedding_requests_have_their_own_series():
    m = FleetMetrics()
    m.observe_request(stats("e", task="embed", inputs=3, prompt_tokens=40, completion_tokens=0, total_s=0.05))
    m.observe_request(stats("e", task="embed", inputs=1, prompt_tokens=9, completion_tokens=0, total_s=0.02))
    v = parse(m)
    assert v[("fleet_embedding_requests_total", (("finish_reason", "stop"), ("model", "e")))] == 2
    assert v[("fleet_embedding_inputs_total", (("model", "e"),))] == 4
    assert v[("fleet_embedding_tokens_total", (("model", "e"),))] == 49
    assert v[("fleet_embedding_duration_seconds_count", (("model", "e"),))] == 2
    # none of generation's
    assert ("fleet_requests_total", (("finish_reason", "stop"), ("model", "e"))) not in v
    assert ("fleet_prompt_tokens_total", (("model", "e"),)) not in v


def test_request_without_tokens_observes_no_ttft():
    m = FleetMetrics()
    m.observe_request(stats("a", finish_reason="error", completion_tokens=0, ttft_s=-1, tpot_s=-1))
    v = parse(m)
    assert ("fleet_request_ttft_seconds_count", (("model", "a"),)) not in v
    assert v[("fleet_requests_total", (("finish_reason", "error"), ("model", "a")))] == 1


def test_prefix_cache_hit_ratio_over_all_requests():
    m = FleetMetrics()
    assert parse(m)[("fleet_prefix_cache_hit_ratio", ())] == 0
    m.observe_request(stats(prompt_tokens=100, prefix_cached_tokens=80))
    m.observe_request(stats(prompt_tokens=300, prefix_cached_tokens=20))
    assert parse(m)[("fleet_prefix_cache_hit_ratio", ())] == pytest.approx(0.25)
    assert prefix_hit_ratio(0, 0) == 0.0


def test_node_gauges_only_for_live_nodes_at_scrape_time():
    latest = {
        "n1": node("n1", cpu_percent=25.0, active_requests={"i1": 3}, queued_tokens={"i1": 40}),
        "n2": node("n2"),
    }
    live = {"n1", "n2"}
    m = FleetMetrics(lambda: [s for k, s in latest.items() if k in live])
    v = parse(m)
    assert v[("fleet_node_memory_used_bytes", (("node", "n1"),))] == 100
    assert v[("fleet_node_memory_available_bytes", (("node", "n1"),))] == 200
    assert v[("fleet_node_disk_free_bytes", (("node", "n1"),))] == 300
    assert v[("fleet_node_cpu_utilization_ratio", (("node", "n1"),))] == 0.25
    assert v[("fleet_instance_active_requests", (("instance", "i1"), ("node", "n1")))] == 3
    assert v[("fleet_instance_queued_tokens", (("instance", "i1"), ("node", "n1")))] == 40
    assert ("fleet_node_memory_used_bytes", (("node", "n2"),)) in v
    live.discard("n2")  # n2 left State: gone from the next scrape
    v = parse(m)
    assert ("fleet_node_memory_used_bytes", (("node", "n2"),)) not in v
    assert ("fleet_node_memory_used_bytes", (("node", "n1"),)) in v


def test_gpu_gauges_skip_unknown_values():
    sample = msgspec.structs.replace(
        node("g"),
        gpus=(
            GpuSample(index=0, utilization_ratio=0.5, temperature_c=61.0, power_w=250.0, memory_used_bytes=9),
            GpuSample(index=1, power_w=300.0),  # the rest unknown (-1)
        ),
    )
    m = FleetMetrics(lambda: [sample])
    v = parse(m)
    assert v[("fleet_gpu_utilization_ratio", (("gpu", "0"), ("node", "g")))] == 0.5
    assert v[("fleet_gpu_temperature_celsius", (("gpu", "0"), ("node", "g")))] == 61
    assert v[("fleet_gpu_power_watts", (("gpu", "0"), ("node", "g")))] == 250
    assert v[("fleet_gpu_memory_used_bytes", (("gpu", "0"), ("node", "g")))] == 9
    assert v[("fleet_gpu_power_watts", (("gpu", "1"), ("node", "g")))] == 300
    for name in (
        "fleet_gpu_utilization_ratio",
        "fleet_gpu_temperature_celsius",
        "fleet_gpu_memory_used_bytes",
    ):
        assert (name, (("gpu", "1"), ("node", "g"))) not in v


def test_samples_without_gpus_field_render_no_gpu_series():
    families = {f.name: f for f in node_families([node("x")])}
    assert families["fleet_gpu_utilization_ratio"].samples == []


def test_registries_are_per_instance():
    a, b = FleetMetrics(), FleetMetrics()
    a.observe_request(stats("a"))
    assert ("fleet_requests_total", (("finish_reason", "stop"), ("model", "a"))) not in parse(b)


def test_cpu_ratio_is_clamped():
    assert cpu_ratio(150.0) == 1.0
    assert cpu_ratio(-1.0) == 0.0
    assert cpu_ratio(40.0) == 0.4


def test_migrations_and_admission_waits_are_counted():
    metrics = FleetMetrics()
    metrics.observe_request(stats(migrations=2, queued_s=0.3))
    metrics.observe_request(stats())
    values = parse(metrics)
    assert values[("fleet_request_migrations_total", (("model", "m"),))] == 2
    assert values[("fleet_admission_wait_seconds_count", (("model", "m"),))] == 2
    assert values[("fleet_admission_wait_seconds_sum", (("model", "m"),))] == pytest.approx(0.3)


def test_the_gateways_admission_queues_are_summed_at_scrape_time():
    samples = [
        AdmissionSample(gateway_id="g1", at=0.0, waiting={"m": 3}, refused={"timeout": 1}),
        AdmissionSample(gateway_id="g2", at=0.0, waiting={"m": 2, "n": 1}, refused={"timeout": 2}),
    ]
    values = parse(FleetMetrics(live_gateways=lambda: samples))
    assert values[("fleet_admission_waiting_requests", (("model", "m"),))] == 5
    assert values[("fleet_admission_waiting_requests", (("model", "n"),))] == 1
    assert values[("fleet_admission_refused_total", (("reason", "timeout"),))] == 3


def test_each_models_instances_by_status_and_its_scaling_bounds_come_from_the_state():
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=3)
    instances = [
        Instance(instance_id="a", model_id="m", node_id="n", engine="mlx", status=InstanceStatus.READY),
        Instance(instance_id="b", model_id="m", node_id="n", engine="mlx", status=InstanceStatus.LOADING),
        Instance(instance_id="c", model_id="m", node_id="n", engine="mlx", status=InstanceStatus.READY),
    ]
    state = state_of(
        *(InstancePlaced(instance=i) for i in instances),
        ScalingPolicySet(model_id="m", policy=policy),
        ScalingPolicySet(model_id="off", policy=ScalingPolicy()),
    )
    values = parse(FleetMetrics(state=lambda: state))
    assert values[("fleet_model_instances", (("model", "m"), ("status", "ready")))] == 2
    assert values[("fleet_model_instances", (("model", "m"), ("status", "loading")))] == 1
    assert values[("fleet_model_scaling_instances", (("bound", "max"), ("model", "m")))] == 3
    assert values[("fleet_model_scaling_instances", (("bound", "min"), ("model", "m")))] == 0
    assert not any(labels == (("bound", "max"), ("model", "off")) for _, labels in values)
