#!/usr/bin/env bash
# GPU check of the specrt GPU path. GPU-ONLY: ran once, on an H100 with the tiny model (docs/gpu.md).
#
# On a machine with an NVIDIA GPU it builds the tiny model's and (when present) the default
# model's graphs in the GPU variants (fp16 gqa for ONNX Runtime CUDA, fp16 standard-op for
# TensorRT), and for each GPU backend that is installed compares them with the fp32 graphs
# on ONNX Runtime CPU (logit delta, greedy agreement, first divergence and its margin);
# where TensorRT is present it also builds the engines with specrt's builder and runs
# `polygraphy run --trt --onnxrt`. See scripts/gpu_check.py for the checks.
#
# Exit status: 0 every check ran and passed; 1 a check failed; 2 no GPU (this script never
# passes on a CPU machine); 3 what could run passed, but some checks could not run yet
# (listed as NOT RUN: e.g. the GPU runtime backends with CUDA-graph replay do not exist yet).
#
# Usage: scripts/gpu_check.sh [--out DIR] [--skip-default]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3

no_gpu() {
    {
        echo "gpu_check: FAILED: no NVIDIA GPU: $1"
        echo "gpu_check: this script checks the GPU path (ONNX Runtime CUDA, TensorRT) and cannot pass without a GPU."
        echo "gpu_check: run it on a GPU machine; on CPU use 'make test'."
    } >&2
    exit 2
}

if [[ "${CUDA_VISIBLE_DEVICES+set}" == set && ( -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == "-1" ) ]]; then
    no_gpu "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' hides every GPU"
fi
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not installed (no NVIDIA driver)"
gpus=$(nvidia-smi -L 2>&1) || no_gpu "nvidia-smi -L failed: ${gpus}"
[[ "$gpus" == *GPU* ]] || no_gpu "nvidia-smi lists no GPU: ${gpus}"
echo "gpu_check: ${gpus}"

exec "$PY" scripts/gpu_check.py "$@"
