#!/usr/bin/env bash
# One device call: our search and Lightning's own BatchSizeFinder on the issue's eight required
# models, both warmed by one untimed step at batch 2, so neither time holds first-step setup
# (the runs of -06q and -06t warmed ours only). Ours runs with SURVEY=1 TIMING=1 (no truth, no
# baseline: about 3 minutes), Lightning's in a process of its own (about 2). Results:
# $OUT/ours/maxbatch_truth.json and $OUT/lf/lightning_finder.json; then, here,
#   python3 bench/gpu/truth_report.py ours.json --lightning lf.json > bench/results/X.md
# Needs, in the repo: .device/gpukernel and .device/libgpuprobe_torch.so (stripped release
# builds of this tree), .whl/*.whl, .whl/lightning/*.whl and .whl/numpy/*.whl (bench/gpu/README.md).
# Run as
#   run(command="bash bench/gpu/lightning_side_by_side.sh", carry=[".device", ".whl"])
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for the results (the device tool sets it)}"
ROWS="resnet18_fp32 vit_b16_fp32 vit_b16_bf16 gpt_fp32 gpt_fp16_scaler lstm_fp32 unet_fp32 gpt_checkpointed"
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pip_target /tmp/site .whl/*.whl || exit 1
pip_target /tmp/lt .whl/lightning/*.whl || exit 1
# torchmetrics needs numpy; the device's Python may lack it (.whl/numpy/, only then).
python3 -c 'import numpy' 2>/dev/null || pip_target /tmp/lt .whl/numpy/*.whl || exit 1
export PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
mkdir -p "$OUT/ours" "$OUT/lf"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== ours (SURVEY=1 TIMING=1) $(date -u +%T)"
OUT=$OUT/ours SURVEY=1 TIMING=1 PYTHONPATH=/tmp/site python3 bench/gpu/maxbatch_truth.py $ROWS
echo "== Lightning's BatchSizeFinder $(date -u +%T)"
OUT=$OUT/lf PYTHONPATH=/tmp/lt:/tmp/site python3 bench/gpu/lightning_finder.py $ROWS
echo "== done $(date -u +%T)"
