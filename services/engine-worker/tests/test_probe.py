import importlib.metadata
from pathlib import Path

import pytest

from fleet_proto.subjects import metrics_subject
from fleet_worker.engines.base import ENGINES
from fleet_worker.probe import (
    cpu_flags,
    installed_engines,
    node_id_from,
    node_info,
    node_metrics,
)

pytestmark = pytest.mark.unit


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


def _meminfo_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_this_machine_has_no_gpus_and_that_is_normal(tmp_path: Path):
    from fleet_worker.gpu import NvmlReader

    assert NvmlReader.open() is None  # no NVML library here: None, not an error
    info = node_info("n", tmp_path)
    assert info.gpus == ()
    assert info.kind == "cpu" and not info.unified_memory
    assert abs(info.memory_total_bytes - _meminfo_total_bytes()) <= 0.05 * _meminfo_total_bytes()
    assert "mlx" in {engine.name for engine in info.engines}
    assert info.chip


def test_chip_on_linux_reads_dmi_then_cpuinfo(tmp_path: Path):
    from fleet_proto import GpuInfo
    from fleet_worker.probe import DGX_SPARK_CHIP, chip_name

    dmi, cpuinfo = tmp_path / "dmi", tmp_path / "cpuinfo"
    dmi.mkdir()
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert chip_name((), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == "AMD EPYC 9654 96-Core Processor"

    (dmi / "product_name").write_text("DGX_Spark\n")
    (dmi / "sys_vendor").write_text("NVIDIA\n")
    assert chip_name((), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == DGX_SPARK_CHIP
    (dmi / "product_name").write_text("ASUS Ascent GX10\n")
    assert chip_name((), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == DGX_SPARK_CHIP

    (dmi / "product_name").write_text("DGX_H100\n")
    assert chip_name((), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == "DGX H100"
    h100 = GpuInfo(name="NVIDIA H100 80GB HBM3", vendor="nvidia", memory_bytes=80 * 2**30)
    assert chip_name((h100,), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == "NVIDIA H100 80GB HBM3"
    assert chip_name((h100, h100), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == "2x NVIDIA H100 80GB HBM3"

    # An ARM board without "model name" in /proc/cpuinfo: its DMI name.
    (dmi / "product_name").unlink()
    (dmi / "sys_vendor").write_text("Raspberry\n")
    (dmi / "board_name").write_text("Pi 5\n")
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 108.00\n")
    assert chip_name((), system="Linux", dmi_dir=dmi, cpuinfo=cpuinfo) == "Pi 5"


def test_unified_memory_is_apple_silicon_a_dgx_spark_or_a_gpu_without_memory_of_its_own():
    from fleet_proto import GpuInfo, NodeKind
    from fleet_worker.probe import has_unified_memory

    h100 = GpuInfo(name="NVIDIA H100 80GB HBM3", vendor="nvidia", memory_bytes=80 * 2**30)
    gb10 = GpuInfo(name="NVIDIA GB10", vendor="nvidia", memory_bytes=128 * 2**30)
    shared = GpuInfo(name="NVIDIA GPU", vendor="nvidia", memory_bytes=64 * 2**30, unified_memory=True)
    assert has_unified_memory(NodeKind.APPLE, "")
    assert has_unified_memory(NodeKind.CUDA, "", (gb10,))  # even where NVML reported memory for it
    assert has_unified_memory(NodeKind.CUDA, "DGX_Spark")
    assert has_unified_memory(NodeKind.CUDA, "", (shared,))
    assert not has_unified_memory(NodeKind.CUDA, "DGX_H100", (h100, h100))
    assert not has_unified_memory(NodeKind.CPU, "")


def test_node_metrics_takes_an_optional_gpu_reader(tmp_path: Path):
    from fleet_worker.gpu import GpuSample
    from fleet_worker.probe import gpu_metrics_fields

    class Reader:
        def static(self):
            return ()

        def sample(self):
            return (GpuSample(index=0, utilization_ratio=0.5),)

    metrics = node_metrics("n", tmp_path, reader=Reader())
    assert metrics.memory_used_bytes > 0
    assert gpu_metrics_fields(Reader().sample()) == {"gpus": (GpuSample(index=0, utilization_ratio=0.5),)}


def test_the_ring_host_is_resolved_before_it_is_announced(tmp_path: Path):
    from fleet_worker.probe import Interface, resolved_ring_host

    interfaces = [
        Interface("lo", "127.0.0.1", 0, loopback=True),
        Interface("wlan0", "192.168.1.20", 300),
        Interface("eth0", "192.168.1.10", 10000),
    ]
    assert resolved_ring_host("auto", interfaces) == "192.168.1.10"  # the fastest link
    assert resolved_ring_host("auto", interfaces[:1]) == "127.0.0.1"  # loopback when alone
    assert resolved_ring_host("auto", []) == "127.0.0.1"
    assert resolved_ring_host("10.0.0.7", interfaces) == "10.0.0.7"
    info = node_info("n", tmp_path, ring_host="192.168.1.10", ring_port_base=52400)
    assert (info.ring_host, info.ring_port_base) == ("192.168.1.10", 52400)


def test_cpu_flags_are_the_first_cpus(tmp_path: Path) -> None:
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t: x\n")
    assert cpu_flags(avx2) == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    arm = tmp_path / "arm"
    arm.write_text("Features\t: fp asimd bf16 i8mm\n")
    assert cpu_flags(arm) == frozenset({"fp", "asimd", "bf16", "i8mm"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_an_engine_fleet_now_runs_differently_reports_its_revision_so_it_is_measured_again() -> None:
    versions = {e.name: e.version for e in installed_engines()}
    revision = ENGINES["llamacpp"].revision
    assert versions["llamacpp"] == f"{importlib.metadata.version('llama-cpp-python')}+fleet{revision}"
