"""MLX's CPU matmuls on the system's OpenBLAS (cpu_blas), and the compute dtype that goes with it."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx

from fleet_worker.engines.cpu_blas import openblas_path
from fleet_worker.engines.mlx.engine import chosen_compute_dtype

# In a fresh interpreter, as an engine process starts: OpenBLAS first, then mlx, whose cblas_sgemm
# must then be OpenBLAS's (the dynamic linker's global scope), and auto picks float32.
ENGINE_PROCESS_START = """
import ctypes
from fleet_worker.engines.base import engine_spec
engine_spec("mlx").before_import()
import mlx.core as mx
from fleet_worker.engines.mlx.engine import chosen_compute_dtype
def address(library):
    return ctypes.cast(library.cblas_sgemm, ctypes.c_void_p).value
same = address(ctypes.CDLL(None)) == address(ctypes.CDLL(sys.argv[1]))
print(same, chosen_compute_dtype("auto", {}, pipeline=False))
"""


def test_the_makefile_installs_openblas_and_mlx_engines_bind_to_it() -> None:
    path = openblas_path()
    assert path, "no OpenBLAS: make install's apt step installs libopenblas0-pthread"
    code = "import sys\n" + ENGINE_PROCESS_START
    result = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "mlx.core.float32"]


def test_auto_keeps_stored_weights_where_float32_would_not_be_faster_or_could_not_match() -> None:
    assert chosen_compute_dtype("auto", {"quantization": {"bits": 4}}, pipeline=False) is None
    assert chosen_compute_dtype("auto", {}, pipeline=True) is None  # every rank in one dtype
    assert chosen_compute_dtype("model", {}, pipeline=False) is None
    assert chosen_compute_dtype("bfloat16", {}, pipeline=True) == mx.bfloat16
