# Sourced by the scripts: where the cached Python env and cargo target live, and the
# variables that build tch against the venv's torch. Override GPUNB_CACHE to move them.
GPUNB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUNB_CACHE="${GPUNB_CACHE:-$HOME/.cache/gpunb}"
# One long-lived venv, brought in line with requirements.lock whenever the lock changes
# (setup compares a hash stamp), so CI's cache stays warm across lock edits.
GPUNB_LOCK_HASH="$(sha256sum "$GPUNB_ROOT/requirements.lock" | cut -c1-16)"
GPUNB_VENV="${GPUNB_VENV:-$GPUNB_CACHE/venv-py311}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$GPUNB_CACHE/target}"
# torch-sys only checks that LIBTORCH_USE_PYTORCH is set, but reruns its build script when the
# value changes: the venv path as the value makes a moved venv rebuild against the right torch.
export LIBTORCH_USE_PYTORCH="$GPUNB_VENV"
export PATH="$GPUNB_VENV/bin:$HOME/.cargo/bin:$PATH"
export VIRTUAL_ENV="$GPUNB_VENV"
export GPUKERNEL_BIN="$CARGO_TARGET_DIR/release/gpukernel"
export TUNNEL_BIN="$CARGO_TARGET_DIR/release/tunnel"
export GPUKERNEL_TORCH_PLUGIN="$CARGO_TARGET_DIR/release/libgpuprobe_torch.so"
export PYTHONUNBUFFERED=1
step() { printf '\n==> %s\n' "$*" >&2; }
