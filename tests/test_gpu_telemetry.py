"""Fake NVML in the worker's probe -> NodeMetrics -> the metrics-collector's Prometheus text (unit).

The fake is the tests' stand-in for the pynvml module (services/engine-worker/tests/test_gpu.py);
everything after it is the real code path of both services, without a bus in between.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet_metrics.registry import FleetMetrics
from fleet_proto import NodeMetrics
from fleet_worker.gpu import NvmlReader
from fleet_worker.probe import node_metrics
from tests.support import REPO, load_module

pytestmark = pytest.mark.unit

gpu_tests = load_module(REPO / "services/engine-worker/tests/test_gpu.py")


def test_fake_nvml_readings_become_the_right_prometheus_values(tmp_path: Path):
    reader = NvmlReader(gpu_tests.FakeNvml(gpu_tests.TWO_H100))
    sample = node_metrics("gpu-node", tmp_path, reader=reader)
    sample = msgspec.json.decode(msgspec.json.encode(sample), type=NodeMetrics)  # as it travels on NATS
    metrics = FleetMetrics(live_nodes=lambda: [sample])
    values = {
        (s.name, s.labels.get("gpu")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("fleet_gpu_")
    }
    assert values[("fleet_gpu_utilization_ratio", "0")] == 0.37
    assert values[("fleet_gpu_temperature_celsius", "0")] == 61
    assert values[("fleet_gpu_power_watts", "0")] == 312.5
    assert values[("fleet_gpu_memory_used_bytes", "0")] == 10 * 2**30
    assert values[("fleet_gpu_power_watts", "1")] == 70.0
