#!/usr/bin/env bash
# Runs gpu_check.py on the CUDA machine. Expects, in the repo: .device/gpukernel and
# .device/libgpuprobe_torch.so (stripped release builds from here) and .whl/ (wheels for
# jupyter_client, ipykernel and gpustat for that machine's Python). See bench/gpu/README.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
nvidia-smi
python3 bench/gpu/gpu_check.py
