#!/usr/bin/env bash
# Builds `tunnel` for people without Rust, into dist/:
#   - a wheel that carries only the binary (maturin, `bindings = "bin"`, packaging/tunnel-wheel/):
#     `pip install` / `pipx install` it and `tunnel` is on PATH;
#   - the bare binary, statically linked where the target allows (musl).
#
#   packaging/build.sh [--target TRIPLE] [--out DIR] [--compatibility TAG...]
#   packaging/build.sh --prepare [--target TRIPLE]   # only install what the build needs
#
# Targets:
#   x86_64-unknown-linux-musl (default)  static binary (no libc needed at run time); the wheel is
#       tagged manylinux_2_17 and musllinux_1_2, so one file installs on glibc and musl distros.
#   x86_64-unknown-linux-gnu             dynamically linked against this machine's glibc, tagged
#       with the lowest manylinux that maturin's audit allows. Built on Debian 12 the binary
#       needs GLIBC_2.34 (objdump -T), so manylinux2014 is out of reach: musl's wheel has it.
#   x86_64-pc-windows-gnu                cross-built with Debian's mingw-w64 (and nasm, for
#       aws-lc-sys): a win_amd64 wheel and tunnel.exe. Every dependency builds; tunnel's own code
#       does not compile for Windows yet (issue 16's port is under way).
#   *-apple-darwin                       needs macOS's SDK, so not from here; on a Mac,
#       `maturin build --release` in packaging/tunnel-wheel should make it (not tried yet).
#
# Prints the paths it wrote on stdout, one per line (wheel first); progress goes to stderr.
# Cargo artifacts go to $GPUNB_CACHE/target-dist (not the shared target dir, so a build here
# never waits on another cargo's lock). Re-running is incremental: seconds when nothing changed.
set -euo pipefail
source "$(dirname "$0")/../scripts/env.sh"
cd "$GPUNB_ROOT"

target=x86_64-unknown-linux-musl
out="$GPUNB_ROOT/dist"
prepare_only=0
compat=()
while (($#)); do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --target=*) target="${1#*=}"; shift ;;
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#*=}"; shift ;;
    --compatibility) shift; while (($#)) && [[ "$1" != --* ]]; do compat+=("$1"); shift; done ;;
    --prepare) prepare_only=1; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

BUILD_VENV="${GPUNB_BUILD_VENV:-$GPUNB_CACHE/venv-build}"
BUILD_REQS="$GPUNB_ROOT/packaging/requirements-build.txt"
export CARGO_TARGET_DIR="${GPUNB_DIST_TARGET_DIR:-$GPUNB_CACHE/target-dist}"

apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  step "installing Debian packages: ${missing[*]}"
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# What the build needs, each checked first so a prepared machine returns at once.
prepare() {
  case "$target" in
    *-linux-musl) apt_install musl-tools ;;          # musl-gcc, for aws-lc-sys's C code
    x86_64-pc-windows-gnu) apt_install gcc-mingw-w64-x86-64 nasm ;;  # nasm: aws-lc-sys's asm
  esac
  if ! rustup target list --installed | grep -qx "$target"; then
    step "rustup target add $target"
    rustup target add "$target" >&2
  fi
  local want; want="$(sha256sum "$BUILD_REQS" | cut -c1-16)"
  if [ "$(cat "$BUILD_VENV/.req-hash" 2>/dev/null)" != "$want" ]; then
    step "build venv $BUILD_VENV from packaging/requirements-build.txt"
    [ -x "$BUILD_VENV/bin/python" ] || python3 -m venv "$BUILD_VENV"
    "$BUILD_VENV/bin/pip" install -q -r "$BUILD_REQS"
    "$BUILD_VENV/bin/pip" download -q --no-deps -d "$BUILD_VENV/wheels" "$(grep -E '^pip==' "$BUILD_REQS")"
    echo "$want" >"$BUILD_VENV/.req-hash"
  fi
}

prepare
((prepare_only)) && exit 0

exe=""
case "$target" in
  *-linux-musl)
    ((${#compat[@]})) || compat=(manylinux2014 musllinux_1_2)
    # Static by default on musl; said explicitly so a changed default cannot go unnoticed.
    export RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static"
    cc_var="CC_${target//-/_}"
    export "$cc_var"="${!cc_var:-musl-gcc}"
    ;;
  *-windows-*) exe=".exe" ;;
esac
compat_args=()
((${#compat[@]})) && compat_args=(--compatibility "${compat[@]}")

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
mkdir -p "$out"
step "maturin: wheel for $target (cargo target dir: $CARGO_TARGET_DIR)"
start=$SECONDS
log="$(mktemp)"
if ! (cd packaging/tunnel-wheel &&
      "$BUILD_VENV/bin/maturin" build --release --target "$target" "${compat_args[@]}" \
        --out "$out" >"$log" 2>&1); then
  cat "$log" >&2; rm -f "$log"
  exit 1
fi
grep -E '^(📦|🔗|⚠️|💻|🐍|📖)|Built wheel|warning' "$log" >&2 || true
wheel="$(sed -n 's/.*Built wheel to \(.*\.whl\).*/\1/p' "$log" | tail -1)"
rm -f "$log"
[ -f "$wheel" ] || { echo "build.sh: maturin reported no wheel" >&2; exit 1; }
# One wheel per platform tag in $out: drop an older version's.
for old in "$out"/gpunb_tunnel-*-"${wheel##*/gpunb_tunnel-*-py3-none-}"; do
  [ "$old" = "$wheel" ] || rm -f "$old"
done

# The bare binary: the same artifact the wheel carries (maturin strips it: `strip = true`).
bin_src="$CARGO_TARGET_DIR/$target/release/tunnel$exe"
bin_dst="$out/tunnel-$version-$target$exe"
install -m755 "$bin_src" "$bin_dst"
(cd "$out" && sha256sum "$(basename "$wheel")" "$(basename "$bin_dst")" >"SHA256SUMS-$target")
step "built in $((SECONDS - start))s: $(du -h "$wheel" | cut -f1) wheel, $(du -h "$bin_dst" | cut -f1) binary"
printf '%s\n' "$wheel" "$bin_dst"
