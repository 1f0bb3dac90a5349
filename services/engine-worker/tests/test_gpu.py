from pathlib import Path
from types import SimpleNamespace

import pytest

from fleet_worker.gpu import GpuSample, NvmlReader, parse_visible_devices, visible_indices
from fleet_worker.probe import DGX_SPARK_CHIP, node_info

pytestmark = pytest.mark.unit

NOT_SUPPORTED = 3


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class FakeNvml:
    """The pynvml functions NvmlReader calls, over a list of device dicts."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices: list[dict], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.initialised = False
        self.uuid_reads = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict:
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: dict) -> str:
        return handle["name"]

    def nvmlDeviceGetUUID(self, handle: dict) -> str:
        self.uuid_reads += 1
        return handle.get("uuid", "")

    def nvmlDeviceGetMemoryInfo(self, handle: dict) -> SimpleNamespace:
        if handle.get("memory") is None:
            raise FakeNvmlError(NOT_SUPPORTED)
        used, total = handle["memory"]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: dict) -> SimpleNamespace:
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetTemperature(self, handle: dict, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return handle["temp"]

    def nvmlDeviceGetPowerUsage(self, handle: dict) -> int:
        if handle.get("power_mw") is None:
            raise FakeNvmlError(NOT_SUPPORTED)
        return handle["power_mw"]


GIB = 2**30
TWO_H100 = [
    {
        "name": "NVIDIA H100 80GB HBM3",
        "memory": (10 * GIB, 80 * GIB),
        "util": 37,
        "temp": 61,
        "power_mw": 312_500,
    },
    {"name": b"NVIDIA H100 80GB HBM3", "memory": (0, 80 * GIB), "util": 0, "temp": 34, "power_mw": 70_000},
]
GB10 = [{"name": "NVIDIA GB10", "memory": None, "util": 5, "temp": 45, "power_mw": None}]


def test_two_gpus_give_static_facts_and_samples():
    fake = FakeNvml(TWO_H100)
    reader = NvmlReader.open(fake, environ={})  # CUDA_VISIBLE_DEVICES unset: every GPU
    assert reader is not None and fake.initialised
    gpus = reader.static()
    assert [(g.name, g.vendor, g.memory_bytes) for g in gpus] == [
        ("NVIDIA H100 80GB HBM3", "nvidia", 80 * GIB)
    ] * 2
    first, second = reader.sample()
    assert first == GpuSample(
        index=0,
        utilization_ratio=pytest.approx(0.37),
        temperature_c=61,
        power_w=pytest.approx(312.5),
        memory_used_bytes=10 * GIB,
        memory_total_bytes=80 * GIB,
    )
    assert (second.index, second.utilization_ratio, second.temperature_c, second.power_w) == (
        1,
        0.0,
        34,
        70.0,
    )
    assert (second.memory_used_bytes, second.memory_total_bytes) == (0, 80 * GIB)
    reader.close()
    assert not fake.initialised


def test_unsupported_fields_are_minus_one_and_unified_memory_is_the_systems():
    reader = NvmlReader(FakeNvml(GB10), system_memory_bytes=lambda: 128 * GIB)
    (gpu,) = reader.static()
    assert (gpu.name, gpu.memory_bytes, gpu.unified_memory) == ("NVIDIA GB10", 128 * GIB, True)
    (sample,) = reader.sample()
    assert (sample.memory_used_bytes, sample.memory_total_bytes, sample.power_w) == (-1, -1, -1)
    assert (sample.utilization_ratio, sample.temperature_c) == (pytest.approx(0.05), 45)


def test_a_gb10_makes_a_cuda_dgx_spark_node(tmp_path: Path):
    info = node_info("spark", tmp_path, reader=NvmlReader(FakeNvml(GB10)))
    assert info.kind == "cuda"
    assert info.chip == DGX_SPARK_CHIP
    assert [g.name for g in info.gpus] == ["NVIDIA GB10"]
    assert info.unified_memory  # placement counts one pool for all its engines


def test_two_h100_make_a_cuda_node(tmp_path: Path):
    info = node_info("h", tmp_path, reader=NvmlReader(FakeNvml(TWO_H100)))
    assert (info.kind, info.chip, len(info.gpus)) == ("cuda", "2x NVIDIA H100 80GB HBM3", 2)
    assert not info.unified_memory and not any(g.unified_memory for g in info.gpus)  # VRAM: its own pool


def test_failing_init_or_missing_library_gives_none():
    assert (
        NvmlReader.open(FakeNvml(TWO_H100, init_error=FakeNvmlError(9))) is None
    )  # NVML_ERROR_DRIVER_NOT_LOADED
    assert NvmlReader.open() is None  # this machine: nvidia-ml-py installed, no libnvidia-ml.so


def test_samples_round_trip_through_msgpack():
    import msgspec

    sample = GpuSample(index=1, utilization_ratio=0.5, temperature_c=40.0, power_w=100.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sample), type=GpuSample) == sample


UUIDS = ["GPU-8f6c0a8e-1111-2222-3333-444444444444", "GPU-0b2d9c1f-5555-6666-7777-888888888888", ""]


@pytest.mark.parametrize(
    ("value", "entries"),
    [
        (None, None),
        ("", ()),
        (" ", ()),
        ("0", ("0",)),
        ("1, 0", ("1", "0")),
        ("GPU-8f6c,2", ("GPU-8f6c", "2")),
    ],
)
def test_cuda_visible_devices_parses_as_cuda_reads_it(value, entries):
    assert parse_visible_devices(value) == entries


@pytest.mark.parametrize(
    ("entries", "indices"),
    [
        (None, (0, 1, 2)),  # unset: every GPU
        ((), ()),  # set but empty: none
        (("1",), (1,)),
        (("2", "0"), (2, 0)),  # CUDA's order
        (("GPU-0b2d9c1f-5555-6666-7777-888888888888",), (1,)),
        (("gpu-8F6C",), (0,)),  # a unique prefix, in any case
        (("GPU-",), ()),  # a prefix of two: names none, ends the list
        (("0", "-1", "1"), (0,)),  # -1 ends the list, as in CUDA
        (("1", "7", "0"), (1,)),  # so does an index out of range
        (("1", "1", "0"), (1, 0)),  # a repeat is skipped
        (("MIG-1234",), ()),  # MIG instances are not whole GPUs
    ],
)
def test_visible_indices_picks_the_named_gpus_in_order(entries, indices):
    assert visible_indices(entries, UUIDS) == indices


def test_the_reader_reports_only_the_visible_gpus_with_their_nvml_index():
    devices = [
        {**TWO_H100[0], "uuid": UUIDS[0]},
        {**TWO_H100[1], "uuid": UUIDS[1], "util": 55},
    ]
    fake = FakeNvml(devices)
    reader = NvmlReader.open(fake, environ={"CUDA_VISIBLE_DEVICES": "GPU-0b2d"})
    assert reader is not None
    (gpu,) = reader.static()
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    (sample,) = reader.sample()
    assert (sample.index, sample.utilization_ratio) == (1, pytest.approx(0.55))  # nvidia-smi's index
    reader.sample()
    assert fake.uuid_reads == 2  # the selection is worked out once

    by_index = NvmlReader(FakeNvml(devices), visible_devices="0")
    assert [s.index for s in by_index.sample()] == [0]
    assert NvmlReader(fake, visible_devices="").static() == ()  # empty: no GPU at all


def test_indices_alone_read_no_uuids():
    fake = FakeNvml(TWO_H100)
    assert len(NvmlReader(fake, visible_devices="1,0").sample()) == 2
    assert fake.uuid_reads == 0
