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


def test_overrides_replace_what_is_probed(tmp_path: Path):
    from fleet_worker.probe import Overrides, parse_engines

    info = node_info("n", tmp_path, Overrides(memory_bytes=8 * 2**30, engines="vllm=0.32.0,mlx", kind="cuda"))
    assert (info.memory_total_bytes, info.memory_available_bytes) == (8 * 2**30, 8 * 2**30)
    assert [(e.name, e.version) for e in info.engines] == [("vllm", "0.32.0"), ("mlx", "unknown")]
    assert info.kind == "cuda"
    assert parse_engines("none") == ()
