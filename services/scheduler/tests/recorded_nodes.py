"""Three machines as their workers announce them (fleet_worker.probe.node_info), and cards of models
sized for them: plain literals, for pure placement and KV budget tests.

- DGX Spark: a GB10 whose 128 GB are the host's; NVML reports no framebuffer, so the probe reports
  the host's memory for the GPU and marks both unified. No MLX: it has no quantized matmul on CUDA.
- H100 box: eight discrete 80 GB H100s (NVML's 81,559 MiB each) beside 2 TB of host memory.
- Mac: an M3 Max with 64 GB shared by its CPU and GPU; no NVML, so no GPUs listed.
"""

from __future__ import annotations

from fleet_proto import EngineInfo, GpuInfo, ModelCard, NodeInfo, NodeKind

DGX_SPARK = NodeInfo(
    node_id="spark-1",
    hostname="spark-1",
    system="Linux",
    machine="aarch64",
    cpu_count=20,
    memory_total_bytes=128_526_278_656,
    memory_available_bytes=121_960_448_000,
    disk_total_bytes=3_936_812_130_304,
    disk_free_bytes=3_512_460_042_240,
    engines=(
        EngineInfo(name="vllm", version="0.32.0"),
        EngineInfo(name="llamacpp", version="0.3.36+fleet2"),
        EngineInfo(name="torch", version="2.13.0"),
    ),
    kind=NodeKind.CUDA,
    chip="NVIDIA DGX Spark (GB10)",
    gpus=(GpuInfo(name="NVIDIA GB10", vendor="nvidia", memory_bytes=128_526_278_656, unified_memory=True),),
    ring_host="192.168.1.21",
    ring_port_base=52400,
    unified_memory=True,
)

H100_GPU = GpuInfo(name="NVIDIA H100 80GB HBM3", vendor="nvidia", memory_bytes=85_520_809_984)
H100_BOX = NodeInfo(
    node_id="dgx-h100-1",
    hostname="dgx-h100-1",
    system="Linux",
    machine="x86_64",
    cpu_count=224,
    memory_total_bytes=2_164_203_307_008,
    memory_available_bytes=2_089_614_766_080,
    disk_total_bytes=30_721_226_547_200,
    disk_free_bytes=27_418_066_313_216,
    engines=(
        EngineInfo(name="mlx", version="0.32.4"),
        EngineInfo(name="vllm", version="0.32.0"),
        EngineInfo(name="llamacpp", version="0.3.36+fleet2"),
        EngineInfo(name="mlx-lm", version="0.32.2"),
        EngineInfo(name="torch", version="2.13.0"),
    ),
    kind=NodeKind.CUDA,
    chip="8x NVIDIA H100 80GB HBM3",
    gpus=(H100_GPU,) * 8,
    ring_host="10.0.0.11",
    ring_port_base=52400,
)

MAC_M3_MAX = NodeInfo(
    node_id="mac-m3-max",
    hostname="mac-m3-max.local",
    system="Darwin",
    machine="arm64",
    cpu_count=16,
    memory_total_bytes=68_719_476_736,
    memory_available_bytes=49_392_123_904,
    disk_total_bytes=994_662_584_320,
    disk_free_bytes=412_316_860_416,
    engines=(
        EngineInfo(name="mlx", version="0.32.4"),
        EngineInfo(name="llamacpp", version="0.3.36+fleet2"),
        EngineInfo(name="mlx-lm", version="0.32.2"),
    ),
    kind=NodeKind.APPLE,
    chip="Apple M3 Max",
    ring_host="192.168.1.30",
    ring_port_base=52400,
    unified_memory=True,
)

# Llama 3.1 8B Instruct in bfloat16: 16 GB of weights, 128 KiB of KV per token.
LLAMA_8B = ModelCard(
    model_id="meta-llama/Llama-3.1-8B-Instruct",
    architecture="llama",
    num_layers=32,
    hidden_size=4096,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    storage_bytes=16_060_522_496,
    publisher="meta-llama",
    supported_engines=("vllm", "mlx", "llamacpp"),
)
# Llama 3.3 70B Instruct in bfloat16: 141 GB, more than one H100 holds, far less than the box's RAM.
LLAMA_70B = ModelCard(
    model_id="meta-llama/Llama-3.3-70B-Instruct",
    architecture="llama",
    num_layers=80,
    hidden_size=8192,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    storage_bytes=141_107_412_992,
    publisher="meta-llama",
    supported_engines=("vllm", "llamacpp"),
)
# Qwen2.5 32B Instruct in bfloat16 (65.5 GB), and a 4-bit GGUF of Qwen2.5 72B (47.4 GB).
QWEN_32B = ModelCard(
    model_id="Qwen/Qwen2.5-32B-Instruct",
    architecture="qwen2",
    num_layers=64,
    hidden_size=5120,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    storage_bytes=65_527_752_704,
    publisher="Qwen",
    supported_engines=("vllm", "llamacpp"),
)
QWEN_72B_GGUF = ModelCard(
    model_id="bartowski/Qwen2.5-72B-Instruct-GGUF",
    architecture="qwen2",
    num_layers=80,
    hidden_size=8192,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    storage_bytes=47_415_715_968,
    quantization="gguf-q4_k_m",
    publisher="bartowski",
    supported_engines=("llamacpp",),
)
# mlx-community's 4-bit Qwen2.5 32B (18.4 GB), and SmolLM2 135M (Fleet's test model, 270 MB).
QWEN_32B_MLX = ModelCard(
    model_id="mlx-community/Qwen2.5-32B-Instruct-4bit",
    architecture="qwen2",
    num_layers=64,
    hidden_size=5120,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    storage_bytes=18_447_000_000,
    quantization="mlx-4bit",
    publisher="mlx-community",
    supported_engines=("mlx",),
)
SMOLLM2_135M = ModelCard(
    model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    architecture="llama",
    num_layers=30,
    hidden_size=576,
    num_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
    storage_bytes=269_060_552,
    publisher="HuggingFaceTB",
    supported_engines=("vllm", "mlx", "llamacpp"),
)
