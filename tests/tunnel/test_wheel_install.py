"""`tunnel` installed without Rust (issue 16): the wheel that packaging/build.sh makes, pip
installed into a fresh venv whose PATH has no cargo or rustc, runs `tunnel up` against a real
sshd and `tunnel down` cleans up; the static binary beside it needs no libc at all.

The wheel is built (or, when nothing changed, reused by cargo in seconds) by packaging/build.sh;
TUNNEL_WHEEL and TUNNEL_STATIC_BIN name prebuilt files instead."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import requests

from tunnel_harness import (
    EXIT, REPO, Tunnel, alive, port_of, processes_of_runtime_dir, run_tunnel, token_of,
)

VERSION = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["version"]
# A PATH a laptop without Rust would have: the system's directories, no ~/.cargo/bin, no
# project venv.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# A cold build of the musl target takes minutes on a 2-core machine; later ones, seconds.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="session")
def dist() -> dict[str, Path]:
    wheel, binary = os.environ.get("TUNNEL_WHEEL"), os.environ.get("TUNNEL_STATIC_BIN")
    if not (wheel and binary):
        r = subprocess.run([str(REPO / "packaging" / "build.sh")], capture_output=True, text=True,
                           timeout=1400)
        assert r.returncode == 0, f"packaging/build.sh failed:\n{r.stderr[-6000:]}"
        wheel, binary = r.stdout.split()[-2:]
    return {"wheel": Path(wheel), "binary": Path(binary)}


def no_rust_env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CARGO", "RUST", "VIRTUAL_ENV", "PYTHON", "LIBTORCH"))}
    env["PATH"] = f"{bin_dir}:{SYSTEM_PATH}"
    for tool in ("cargo", "rustc", "rustup", "maturin"):
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is on the clean PATH"
    return env


def test_wheel_is_tagged_for_glibc_and_musl_and_carries_only_the_binary(dist):
    wheel = dist["wheel"]
    name = wheel.name
    assert name.startswith(f"gpunb_tunnel-{VERSION}-py3-none-"), name
    assert "manylinux_2_17_x86_64" in name and "musllinux_1_2_x86_64" in name, name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        scripts = [n for n in names if ".data/scripts/" in n]
        assert scripts == [f"gpunb_tunnel-{VERSION}.data/scripts/tunnel"], names
        assert not [n for n in names if n.endswith(".py")], names  # no Python shim
        # The wheel's binary is the static one in dist/, byte for byte.
        assert z.read(scripts[0]) == dist["binary"].read_bytes()


def test_static_binary_needs_no_libc(dist):
    binary = dist["binary"]
    described = subprocess.run(["file", "-b", str(binary)], capture_output=True, text=True,
                               check=True).stdout
    assert "ELF 64-bit" in described and "x86-64" in described, described
    assert re.search(r"static(-pie)? linked|statically linked", described), described
    assert "interpreter" not in described, described  # no dynamic loader named
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
    assert "not a dynamic executable" in ldd.stdout + ldd.stderr or \
        "statically linked" in ldd.stdout + ldd.stderr, ldd
    # It runs with an empty environment.
    r = subprocess.run([str(binary), "--version"], env={}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == f"tunnel {VERSION}", r


def build_venv() -> Path:
    """Where packaging/build.sh keeps maturin and pipx (scripts/env.sh's cache)."""
    cache = Path(os.environ.get("GPUNB_CACHE", Path.home() / ".cache" / "gpunb"))
    return Path(os.environ.get("GPUNB_BUILD_VENV", cache / "venv-build"))


def test_pipx_installs_the_wheel_offline_and_tunnel_runs(dist, state_dir, tmp_path):
    # As the README's first line says, with pipx's home and bin dir in tmp_path; no index
    # (pipx's shared venv takes pip from the wheel build.sh keeps beside pipx).
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "pipx-bin"
    env = no_rust_env(bin_dir)
    env.update(HOME=str(home), PIPX_HOME=str(tmp_path / "pipx"), PIPX_BIN_DIR=str(bin_dir),
               PIP_NO_INDEX="1", PIP_FIND_LINKS=str(build_venv() / "wheels"))
    r = subprocess.run([str(build_venv() / "bin" / "pipx"), "install", str(dist["wheel"])],
                       env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert shutil.which("tunnel", path=env["PATH"]) == str(bin_dir / "tunnel")
    r = subprocess.run(["tunnel", "--version"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == f"tunnel {VERSION}", r
    r = run_tunnel(bin_dir / "tunnel", state_dir, "ls", env=env)
    assert r.returncode == 0 and r.stdout.strip() == "no tunnels", r


def test_pip_installed_wheel_runs_tunnel_up_and_down_without_rust(
    dist, sshd, state_dir, jupyter_prefix, tmp_path
):
    # A fresh venv from the base interpreter, as a user's would be; pip installs the wheel file
    # offline (--no-index: nothing can be fetched or built from source).
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=120)
    env = no_rust_env(venv / "bin")
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-index", "--no-deps",
                        str(dist["wheel"])], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    installed = venv / "bin" / "tunnel"
    assert installed.is_file() and not installed.is_symlink() and os.access(installed, os.X_OK)
    assert shutil.which("tunnel", path=env["PATH"]) == str(installed)

    r = subprocess.run(["tunnel", "--version"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == f"tunnel {VERSION}", r

    # `tunnel up` from that venv, with the clean PATH (the harness keeps the rest of the
    # environment), against the test sshd: key file auth, known_hosts checked, and the host
    # named `localhost`, so the static binary's own resolver (musl's: /etc/hosts, then DNS; no
    # NSS) finds it.
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[localhost]:{sshd.port} {sshd.host_public_key()}\n")
    config = tmp_path / "ssh_config"
    config.write_text(sshd.client_config(HostName="localhost", UserKnownHostsFile=str(known_hosts)))
    t = Tunnel(installed, sshd, state_dir, jupyter_prefix, ["--app", "server"], env=env,
               config=config)
    try:
        url = t.wait_url()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[0-9a-f]{64}", url), url
        base, token = f"http://127.0.0.1:{port_of(url)}", token_of(url)
        r = requests.get(f"{base}/api/status", headers={"Authorization": f"token {token}"},
                         timeout=30)
        assert r.status_code == 200, r.text
        assert "started" in r.json(), r.json()

        st = run_tunnel(installed, state_dir, "status", "--json", sshd.alias, env=env)
        assert st.returncode == 0, st.stderr
        st = json.loads(st.stdout)
        rt, jupyter_pid = st["remote_runtime_dir"], st["remote_pid"]
        assert st["pid"] == t.pid and alive(jupyter_pid)
        assert "localhost" in t.stderr, t.stderr  # "connecting to root@localhost port N"

        r = run_tunnel(installed, state_dir, "down", sshd.alias, env=env)
        assert r.returncode == EXIT["ok"], r.stderr
        assert t.wait(30) == EXIT["ok"], t.stderr
        assert not alive(jupyter_pid)
        assert processes_of_runtime_dir(rt) == [] and not Path(rt).exists()
        r = run_tunnel(installed, state_dir, "status", sshd.alias, env=env)
        assert r.returncode == EXIT["no_tunnel"], r.stderr
    finally:
        t.kill()
