"""Plain data shared by commands, events, tasks and State."""

from __future__ import annotations

from enum import StrEnum
from typing import dataclass_transform

import msgspec


# msgspec passes `frozen` on to subclasses; this tells type checkers so (without it mypy reads every
# subclass as a non-frozen dataclass inheriting from a frozen one), and checks their fields read-only.
@dataclass_transform(frozen_default=True, field_specifiers=(msgspec.field,))
class Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base of every value type: immutable, keyword-only, tolerant of fields added by newer peers."""


class EngineInfo(Frozen):
    name: str
    version: str


class EngineQuality(Frozen):
    """How close an engine's answers come to a float32 reference of the same weights
    (fleet_worker.quality): teacher-forced over a fixed text, and greedy on fixed chat prompts."""

    top1_agreement: float  # share of positions whose most likely next token is the reference's
    mean_kl: float  # mean KL(reference || engine) per position, in nats
    perplexity: float  # of the evaluation text
    reference_perplexity: float  # the reference's, by the same rule
    greedy_agreement: float  # share of chat prompts answered greedily token for token as the reference
    positions: int = 0
    prompts: int = 0


class QualityBudget(Frozen):
    """How close to the float32 reference an engine and weight format must come for Fleet to pick
    it by itself (fleet_proto.quality; FLEET_QUALITY_BUDGET on each worker)."""

    min_top1_agreement: float = 0.98
    max_mean_kl: float = 0.02


class EngineCalibration(Frozen):
    """How fast one engine ran one model on this node, in one weight format, and how close its
    answers came to the float32 reference: a fixed greedy request timed, and the quality measured,
    when the engine first loaded the model there (fleet_worker.calibration). Placement and routing
    compare engines by it (fleet_proto.speed, fleet_proto.quality)."""

    engine: str
    engine_version: str
    model_id: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prompt_tokens: int  # of the timed request
    completion_tokens: int
    at: float  # unix time of the measurement
    # The weight format served ("" the engine's own choice; llama.cpp: "as-is", "Q8_0", "F16", ...).
    weight_format: str = ""
    quality: EngineQuality | None = None  # None: not measured (no reference on that node)
    peak_memory_bytes: int = 0  # the engine process's peak resident memory while measured (0: unknown)


class GpuInfo(Frozen):
    name: str
    vendor: str  # "nvidia" | "apple" | ...
    memory_bytes: int
    # It has no memory of its own (NVML reports none, as on a DGX Spark's GB10): memory_bytes is the host's.
    unified_memory: bool = False


class GpuSample(Frozen):
    """One GPU's dynamic state; -1 in a field the device does not report."""

    index: int
    utilization_ratio: float = -1.0  # 0..1
    temperature_c: float = -1.0
    power_w: float = -1.0
    memory_used_bytes: int = -1
    memory_total_bytes: int = -1


class NodeKind(StrEnum):
    """What a node's fastest compute is, for placement preferences (seed rules)."""

    APPLE = "apple"  # Apple Silicon: MLX on Metal
    CUDA = "cuda"  # NVIDIA GPU(s)
    CPU = "cpu"


class NodeInfo(Frozen):
    """Static facts of one engine-worker's machine, sent when it joins."""

    node_id: str
    hostname: str
    system: str
    machine: str
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    disk_total_bytes: int
    disk_free_bytes: int
    engines: tuple[EngineInfo, ...] = ()
    kind: NodeKind = NodeKind.CPU
    chip: str = ""  # e.g. "Apple M3 Max", "NVIDIA GB10 (DGX Spark)", the CPU model name
    gpus: tuple[GpuInfo, ...] = ()
    cached_models: tuple[str, ...] = ()  # models whose files are already on this node
    # Pipeline rings (issue 15): the address this node's engine processes listen on, as other nodes
    # reach it, and the first port of its ring port range (0: the node takes no part in pipelines).
    ring_host: str = ""
    ring_port_base: int = 0
    calibrations: tuple[EngineCalibration, ...] = ()  # measured engine speeds (issue 16)
    quality_budget: QualityBudget = QualityBudget()  # what this node's measurements are held to
    # Its GPU shares host memory (Apple silicon, a DGX Spark's GB10): one pool, memory_available_bytes,
    # for every engine. False: an engine that allocates on its GPU takes that GPU's own memory
    # (fleet_proto.memory).
    unified_memory: bool = False


class ServiceKind(StrEnum):
    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    DOWNLOADER = "downloader"
    METRICS = "metrics-collector"
    WORKER = "engine-worker"


class ServiceInfo(Frozen):
    service_id: str
    kind: ServiceKind
    hostname: str
    pid: int
    version: str
    started_at: float
    node_id: str = ""


class InstanceStatus(StrEnum):
    PLACED = "placed"
    DOWNLOADING = "downloading"
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Shard(Frozen):
    """Layers [start_layer, end_layer) of a model on one node; its rank is its position in Instance.shards."""

    node_id: str
    start_layer: int
    end_layer: int
    ring_address: str = ""  # "host:port" where this rank's engine listens for the ring; "" on one node


class Instance(Frozen):
    instance_id: str
    model_id: str
    node_id: str
    engine: str
    status: InstanceStatus = InstanceStatus.PLACED
    progress: float = 0.0
    reason: str = ""
    # Pipeline placements list every rank; a single-node instance has one shard (or none, = all layers).
    shards: tuple[Shard, ...] = ()
    role: str = "both"  # "prefill" | "decode" | "both" (disaggregation, issue 9)
    # How many times the scheduler placed this instance id again; workers restart a rank when it changes.
    generation: int = 0
    # The user asked for this engine: the scheduler never moves it to an engine measured faster.
    engine_pinned: bool = False
    # What placement granted a single-node instance in its node's pool (fleet_proto.memory.grant;
    # 0: its weights times its engine's headroom); an engine that reserves its KV cache at start
    # (vLLM on a GPU) sizes the cache by it.
    granted_bytes: int = 0

    @property
    def is_pipeline(self) -> bool:
        """Split by layers across nodes: one engine process per shard, connected in a ring."""
        return len(self.shards) > 1

    def runs_on(self, node_id: str) -> bool:
        """Whether any of its ranks is on the node (a pipeline has one per shard)."""
        return self.node_id == node_id or any(s.node_id == node_id for s in self.shards)


class DownloadPhase(StrEnum):
    DOWNLOADING = "downloading"
    CONVERTING = "converting"
    UPLOADING = "uploading"
    DONE = "done"
    FAILED = "failed"


class DownloadStatus(Frozen):
    model_id: str
    phase: DownloadPhase
    done_bytes: int = 0
    total_bytes: int = 0
    reason: str = ""
    bytes_per_s: float = 0.0
    eta_s: float = -1.0


class EmbeddingFacts(Frozen):
    """An embedding model's own pooling, from its sentence-transformers files (fleet_store.cards):
    every engine that embeds it pools and normalises as this says."""

    dimensions: int  # the length of its vectors
    pooling: str = "mean"  # how token states become one vector: "mean", "cls" or "last"
    normalize: bool = False  # vectors of unit length (a sentence-transformers Normalize module)
    max_tokens: int = 512  # the longest input it embeds, special tokens included (max_seq_length)


class ModelCard(Frozen):
    """What placement needs to know about a model, derived from its config.json and files."""

    model_id: str
    architecture: str  # config.json model_type, e.g. "llama"
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float16", "float32"
    storage_bytes: int
    quantization: str = ""  # "", "mlx-4bit", "mlx-8bit", "gguf-q4_1", "fp8", ...
    publisher: str = ""  # the org part of the model id, e.g. "mlx-community"
    base_model: str = ""  # the model it derives from (same weights family), for routing
    has_tokenizer: bool = True
    has_chat_template: bool = True
    supported_engines: tuple[str, ...] = ("mlx",)
    # Facts computed where the card is built (fleet_store.cards), so placement never reads the name:
    # packed quantized weights that only engines listing the format load ("mlx": MLX's), "" for none
    quantization_format: str = ""
    preferred_node_kinds: tuple[NodeKind, ...] = ()  # where it runs best, best first ((): anywhere)
    # an embedding model: its instances serve embeddings only, on engines whose facts say `embeds`
    embedding: EmbeddingFacts | None = None

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value
