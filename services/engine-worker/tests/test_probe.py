from pathlib import Path

from fleet_proto.subjects import metrics_subject
from fleet_worker.probe import node_id_from, node_info, node_metrics


def test_hostnames_become_subject_tokens():
    assert node_id_from("gpu-01.lab.example") == "gpu-01-lab-example"
    assert metrics_subject(node_id_from("a.b c")) == "fleet.metrics.a-b-c"


def test_node_info_reads_this_machine(tmp_path: Path):
    info = node_info("n", tmp_path / "not-yet-created")
    assert info.cpu_count >= 1
    assert 0 < info.memory_available_bytes <= info.memory_total_bytes
    assert info.disk_free_bytes > 0
    assert node_metrics("n", tmp_path).memory_used_bytes > 0
