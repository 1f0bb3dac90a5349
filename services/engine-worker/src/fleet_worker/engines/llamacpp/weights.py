"""Which weight encoding the llama.cpp engine serves a GGUF in.

llama.cpp multiplies some weight types far slower than others on an x86 CPU: Q4_0, Q8_0 and F16
have tiled GEMM kernels (llamafile's sgemm, the repacked layouts), Q4_1 and Q5_1 fall back to one dot
product per output. Measured on SmolLM2-135M's Q4_1 GGUF, 2 cores, llama-cpp-python directly: a
512-token prompt takes 1.95-2.03 s as Q4_1, 1.24 s re-encoded to Q8_0 (decode 90-99 vs 106-109
tokens/s; F16: 1.0 s but decode 64-69). Speed is not all: llama.cpp multiplies quantized weights with
activations quantized to 8 bits, and on that 135M model the Q4_1 and Q8_0 paths change the greedy
answer ("L'Etoile" for the capital of France) where F16, the file's own values, answers as the
float32 reference does. So on a CPU-only build "auto" re-encodes a Q4_1/Q5_1 file once to F16 (the
copy is cached beside the original), until the worker has measured every format's speed and quality
and names the fastest within the quality budget (fleet_proto.quality) as `weight_type`. GPU builds,
other types and weight_type="as-is" serve the file as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp

log = logging.getLogger("fleet_worker.llamacpp")

SLOW_ON_CPU = frozenset({llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1})
WEIGHT_TYPES = {
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
}
CPU_TARGET = "F16"
PREFILL_TARGET = "F16"
UNQUANTIZED = frozenset(
    {llama_cpp.LLAMA_FTYPE_ALL_F32, llama_cpp.LLAMA_FTYPE_MOSTLY_F16, llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}
)
PREFILL_COPY_MEMORY_SHARE = 4  # an F16 prefill copy may take at most 1/4 of the machine's memory
REENCODED_DIR = ".llamacpp"  # hidden: the model folder still holds one *.gguf


# CPU flags under which llama.cpp puts quantized weights in AMX tile buffers (an "extra" buffer type).
AMX_FLAGS = frozenset({"amx_int8", "amx_tile"})
EXTRA_BUFFERS = ("auto", "on", "off")


class WeightTypeError(ValueError):
    pass


def use_extra_buffers(asked: str, cpu_flags: frozenset[str]) -> bool:
    """Whether llama.cpp may put weights in its extra buffer types (repacked layouts, AMX tiles).

    "auto": not where the CPU reports AMX. On this project's VMs (a Xeon that reports amx_int8 and
    amx_tile, the kernel granting tile data) llama.cpp's AMX buffers kill the process with SIGILL on
    the first batched matmul of Q4_1 or Q8_0 weights (2026-12-06: any prompt of 8+ tokens, or 2+
    streams at once); without extra buffers the same weights run on its AVX-512 kernels. An AMX CPU
    whose tiles work can have them back with "on"."""
    if asked not in EXTRA_BUFFERS:
        raise WeightTypeError(f"extra_buffers {asked!r}: expected one of {', '.join(EXTRA_BUFFERS)}")
    return asked == "on" or (asked == "auto" and not cpu_flags & AMX_FLAGS)


def target_weight_type(asked: str, file_type: int, gpu_offload: bool) -> str | None:
    """The type to re-encode to, or None to serve the file as it is."""
    if asked == "as-is":
        return None
    if asked == "auto":
        return CPU_TARGET if not gpu_offload and file_type in SLOW_ON_CPU else None
    if asked not in WEIGHT_TYPES:
        raise WeightTypeError(
            f"weight_type {asked!r}: expected auto, as-is or one of {', '.join(WEIGHT_TYPES)}"
        )
    return None if WEIGHT_TYPES[asked] == file_type else asked


def prefill_weight_type(
    asked: str, served_type: int, gpu_offload: bool, f16_bytes: int, memory_bytes: int
) -> str | None:
    """The type a second, prefill-only copy of the weights is encoded in, or None for no copy.

    "auto": F16 on a CPU-only build when the served weights are quantized and the copy is small
    beside the machine's memory. Measured on SmolLM2-135M, 2 cores, a 256-token prefill: Q4_1 1.36 s,
    Q8_0 0.78 s, F16 0.57 s (llamafile's F16 GEMM); a batch of 8 decode rows is cheapest on Q8_0
    (32 ms, F16 41, Q4_1 58), so decode keeps the quantized weights."""
    if asked == "none":
        return None
    if asked == "auto":
        small = f16_bytes * PREFILL_COPY_MEMORY_SHARE <= memory_bytes
        return PREFILL_TARGET if not gpu_offload and served_type not in UNQUANTIZED and small else None
    if asked not in WEIGHT_TYPES:
        raise WeightTypeError(
            f"prefill_weight_type {asked!r}: expected auto, none or one of {', '.join(WEIGHT_TYPES)}"
        )
    return None if WEIGHT_TYPES[asked] == served_type else asked


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def file_type(path: Path) -> int:
    """general.file_type of a GGUF (a LLAMA_FTYPE_* value), read without loading its tensors."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise WeightTypeError(f"llama.cpp could not read {path}")
    try:
        return loaded_file_type(model)
    finally:
        llama_cpp.llama_model_free(model)


def loaded_file_type(model: ctypes.c_void_p) -> int:
    """general.file_type of a loaded llama_model (-1 when the file does not say)."""
    value = ctypes.create_string_buffer(32)
    found = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", value, len(value))
    return int(value.value) if found > 0 else -1


def served_gguf(path: Path, asked: str = "auto", threads: int = 0) -> Path:
    """The GGUF to load for `path`: the file itself or its cached re-encoding."""
    target = target_weight_type(asked, file_type(path), bool(llama_cpp.llama_supports_gpu_offload()))
    if target is None:
        return path
    copy = path.parent / REENCODED_DIR / f"{path.stem}.{target}.gguf"
    if copy.exists():
        return copy
    copy.parent.mkdir(exist_ok=True)
    partial = copy.with_suffix(f".partial-{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = WEIGHT_TYPES[target]
    params.allow_requantize = True
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(path).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        partial.unlink(missing_ok=True)
        raise WeightTypeError(f"llama.cpp could not re-encode {path.name} to {target}")
    partial.rename(copy)  # atomic: a worker that loads it meanwhile sees the whole file or none
    log.info("llama.cpp: %s re-encoded to %s (%d MiB)", path.name, target, copy.stat().st_size >> 20)
    return copy
