#!/usr/bin/env bash
# Type-checks tunnel for macOS from Linux: `cargo clippy --all-targets -D warnings` for each
# TARGET (default: aarch64-apple-darwin x86_64-apple-darwin), adding the rustup target first.
#
# Only a check, never a build: there is no macOS SDK here. Every Rust crate (tunnel's own code,
# its tests, russh, tokio, ...) is compiled to metadata and checked for the target; the one C
# dependency, aws-lc-sys (russh's crypto), is not compiled: its build script is handed a stand-in
# C compiler and archiver that write empty objects, which `cargo check` never links. So the C
# code and linking are not checked; on a Mac, `cargo build -p tunnel` (or packaging/build.sh
# --target aarch64-apple-darwin) is the real build.
#
#   packaging/check-macos.sh [TARGET...]
set -euo pipefail
source "$(dirname "$0")/../scripts/env.sh"
cd "$GPUNB_ROOT"
targets=("$@")
((${#targets[@]})) || targets=(aarch64-apple-darwin x86_64-apple-darwin)

# A fixed place: the build script reruns when CC_<target> changes.
fake="$GPUNB_CACHE/macos-check-tools"
mkdir -p "$fake"
cat >"$fake/cc" <<'SH'
#!/bin/sh
# Stand-in C compiler: writes an empty file wherever -o points, reports success.
out=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift ;; esac
  shift
done
[ -z "$out" ] || : >"$out"
SH
cat >"$fake/ar" <<'SH'
#!/bin/sh
# Stand-in archiver: `ar FLAGS ARCHIVE FILES...` makes an empty archive.
shift; printf '!<arch>\n' >"$1"
SH
chmod +x "$fake/cc" "$fake/ar"

for target in "${targets[@]}"; do
  if ! rustup target list --installed | grep -qx "$target"; then
    step "rustup target add $target"
    rustup target add "$target" >&2
  fi
  t="${target//-/_}"
  step "clippy -p tunnel --target $target (check only: no macOS SDK here)"
  env "CC_$t=$fake/cc" "AR_$t=$fake/ar" \
    cargo clippy --locked -p tunnel --all-targets --target "$target" -q -- -D warnings
done
