from fleet_metrics.prometheus import render
from fleet_proto import NodeMetrics


def test_render_is_prometheus_text_with_one_series_per_node():
    samples = [
        NodeMetrics(
            node_id=n, at=0, memory_used_bytes=1, memory_available_bytes=2, cpu_percent=3.5, disk_free_bytes=4
        )
        for n in ("b", 'we"ird')
    ]
    text = render(samples)
    assert "# TYPE fleet_node_cpu_percent gauge" in text
    assert 'fleet_node_cpu_percent{node="b"} 3.5' in text
    assert 'fleet_node_memory_used_bytes{node="we\\"ird"} 1' in text
    assert text.endswith("\n")
