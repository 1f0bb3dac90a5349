#!/usr/bin/env bash
# The vLLM engine and KV connector checks of tests/, on an NVIDIA GPU (about 5 minutes on one GPU).
#
# Run it from a clone of this repository on a CUDA machine where vLLM is installed, e.g. inside the
# upstream image the vllm-cuda worker is built on:
#   docker run --rm --gpus all -v "$PWD:/fleet" -w /fleet --entrypoint bash \
#       vllm/vllm-openai:v0.32.0 deploy/gpu/check_vllm_cuda.sh
# It installs Fleet's own packages beside the image's vLLM (never replacing its torch), refuses to
# run without a CUDA device (so a CPU fallback never passes for a GPU check), then runs:
#   - VllmEngine vs LLM.generate (greedy, 4 concurrent, single stream, stop token, seeds, cancel, bad
#     requests) on a tiny random llama, with the CUDA attention backend's paged layout;
#   - Fleet's KV connector: export of every prompt block, vLLM KV -> MLX cache decodes as MLX's own
#     prefill, MLX prefix KV -> vLLM skips those tokens, a corrupt block is recomputed
#     (the MLX side runs MLX's CPU build, which this script installs);
#   - disaggregation: a vLLM prefill-only request hands its KV over layer by layer from CUDA pages
#     (and a suffix from start_pos, narrowed to bf16) and an MLX engine decodes it as colocated;
#   - sliding-window and hybrid models: a llama with a sliding layer loads with the connector (one
#     KV cache group) and hands its window over from CUDA pages as the ring buffer MLX decodes on
#     from; a Qwen3-Next (gated-delta-net layers) loads without the connector, which vLLM cannot
#     run with it, and refuses handoffs saying why;
#   - the pure layout, sampling and layer-state tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

"$PY" - <<'PYCHECK'
import sys
import torch
import vllm
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this check needs a GPU")
print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PYCHECK

"$PY" -m pip install -q --no-deps -e libs/proto -e libs/bus -e libs/store -e libs/runtime \
    -e services/engine-worker -e services/gateway -e services/downloader -e deploy/local
"$PY" -m pip install -q "msgspec==0.22.0" "nats-py" "minio==7.2.20" "psutil" "nvidia-ml-py" \
    "pytest==9.2.0" "pytest-asyncio==1.5.0" "pytest-timeout==2.4.0" "hypothesis" 2>/dev/null || true
"$PY" -m pip install -q "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"

export VLLM_ENABLE_V1_MULTIPROCESSING=0
exec timeout 600 "$PY" -m pytest -q -p no:cacheprovider --timeout 300 \
    services/engine-worker/tests/test_vllm_pure.py services/engine-worker/tests/test_vllm_states.py \
    services/engine-worker/tests/test_vllm_engine.py services/engine-worker/tests/test_vllm_sliding.py "$@"
