"""tunnel.exe (x86_64-pc-windows-gnu, cross-built with mingw-w64) under Wine against the tests'
real sshd: key file auth with known_hosts checked, all given as Windows paths (`Z:\\...`, which
Wine maps to this machine's /), the URL, /api/status through the forward, then Ctrl-C or
`tunnel.exe down` stops Jupyter and removes its runtime dir.

What Wine cannot show, and where it is covered instead (each test says so when it skips):
- Owner-only ACLs: Wine 8 keeps no DACL on files (it maps DACLs onto Unix modes, and an
  owner-only one would become 0777), so tunnel leaves Wine's modes alone there. The DACL tunnel
  sets is unit-tested (platform/sddl.rs), and on real Windows read back by
  platform::windows::tests::a_private_dir_gets_the_owner_only_dacl.
- Closing the console window (CTRL_CLOSE_EVENT): a headless Wine has no window to close;
  Interrupts maps it like Ctrl-C (platform/windows.rs), Ctrl-C itself is tested here.
- The OpenSSH for Windows agent and Pageant do not exist under Wine: the named-pipe agent
  transport is unit-tested against a minimal agent on a pipe
  (platform::windows::tests::the_agent_is_reached_through_a_named_pipe).

Needs `wine`, the prefix from scripts/setup ($GPUNB_CACHE/wine, with its bcryptprimitives.dll
stand-in) and a built tunnel.exe ($TUNNEL_EXE, else $CARGO_TARGET_DIR/x86_64-pc-windows-gnu/
{debug,release}/tunnel.exe; scripts/test builds it). Skipped, saying which, when one is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest
import requests

from tunnel_harness import (
    EXIT,
    REPO,
    Tunnel,
    alive,
    port_of,
    processes_of_runtime_dir,
    token_of,
    wait_until,
)

CACHE = Path(os.environ.get("GPUNB_CACHE", Path.home() / ".cache" / "gpunb"))
PREFIX = Path(os.environ.get("WINEPREFIX", CACHE / "wine"))
TRIPLE = "x86_64-pc-windows-gnu"


def find_exe() -> Path | None:
    explicit = os.environ.get("TUNNEL_EXE")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    root = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parents[2] / "target"))
    for profile in ("debug", "release"):
        p = root / TRIPLE / profile / "tunnel.exe"
        if p.is_file():
            return p
    return None


def winpath(p) -> str:
    """This machine's absolute path as a Windows program under Wine names it (drive Z: is /)."""
    return "Z:" + str(p).replace("/", "\\")


def wine_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(WINEPREFIX=str(PREFIX), WINEDEBUG="-all", WINEDLLOVERRIDES="mscoree,mshtml=")
    env.pop("SSH_AUTH_SOCK", None)
    env.update(extra or {})
    return env


def require_wine() -> None:
    if shutil.which("wine") is None:
        pytest.skip("wine is not installed (scripts/setup installs it)")
    if not (PREFIX / "drive_c/windows/system32/bcryptprimitives.dll").is_file():
        pytest.skip(f"no prepared Wine prefix at {PREFIX} (scripts/setup makes it)")


@pytest.fixture(scope="module")
def exe(tmp_path_factory) -> Path:
    """A `tunnel`-like launcher (`exec wine tunnel.exe "$@"`), so the harness drives tunnel.exe
    as it drives the Linux binary; exec keeps the pid, so a signal reaches the Wine process."""
    if shutil.which("wine") is None:
        pytest.skip("wine is not installed (scripts/setup installs it)")
    if not (PREFIX / "drive_c/windows/system32/bcryptprimitives.dll").is_file():
        pytest.skip(f"no prepared Wine prefix at {PREFIX} (scripts/setup makes it)")
    built = find_exe()
    if built is None:
        pytest.skip(f"tunnel.exe is not built (cargo build -p tunnel --target {TRIPLE}, or "
                    "set TUNNEL_EXE)")
    d = tmp_path_factory.mktemp("wine-launcher")
    launcher = d / "tunnel"  # the harness's ownership checks look for "tunnel" in the name
    launcher.write_text(f'#!/bin/sh\nexec wine "{built}" "$@"\n')
    launcher.chmod(0o755)
    return launcher


def run_exe(exe: Path, state_dir: Path, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout,
                          env=wine_env({"TUNNEL_STATE_DIR": winpath(state_dir)}))


def windows_config(sshd, tmp_path: Path, known_hosts: Path) -> Path:
    """The sshd's client config with every path as Windows spells it (backslashes)."""
    config = tmp_path / "ssh_config_windows"
    config.write_text(sshd.client_config(
        IdentityFile=winpath(sshd.client_key),
        UserKnownHostsFile=winpath(known_hosts),
        GlobalKnownHostsFile="none",
    ))
    return config


def start(exe, sshd, state_dir, jupyter_prefix, config) -> Tunnel:
    return Tunnel(exe, sshd, state_dir, jupyter_prefix, ["--app", "server"],
                  env=wine_env({"TUNNEL_STATE_DIR": winpath(state_dir)}), config=winpath(config))


def reach_status(url: str) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[0-9a-f]{64}", url), url
    r = requests.get(f"http://127.0.0.1:{port_of(url)}/api/status",
                     headers={"Authorization": f"token {token_of(url)}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "started" in r.json(), r.json()


def remote_of(exe, state_dir, alias) -> tuple[str, int, dict]:
    st = run_exe(exe, state_dir, "status", "--json", alias)
    assert st.returncode == 0, st.stderr
    assert "stop_key" not in st.stdout, "status shows the stop key"
    data = json.loads(st.stdout)
    return data["remote_runtime_dir"], data["remote_pid"], data


def assert_remote_gone(rt: str, jupyter_pid: int) -> None:
    assert wait_until(lambda: not alive(jupyter_pid), 20), f"jupyter {jupyter_pid} still runs"
    assert processes_of_runtime_dir(rt) == [] and not Path(rt).exists()


def test_tunnel_exe_up_then_down_under_wine(exe, sshd, state_dir, jupyter_prefix, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd.known_hosts_line() + "\n")
    config = windows_config(sshd, tmp_path, known_hosts)
    t = start(exe, sshd, state_dir, jupyter_prefix, config)
    try:
        reach_status(t.wait_url(90))
        rt, jupyter_pid, data = remote_of(exe, state_dir, sshd.alias)
        assert data["alive"] and data["phase"] == "ready" and alive(jupyter_pid)
        # The state file is where TUNNEL_STATE_DIR (a Windows path) says; it holds the stop key
        # `down` needs, and no token.
        state_file = state_dir / f"{sshd.alias}.json"
        saved = json.loads(state_file.read_text())
        assert re.fullmatch(r"[0-9a-f]{32}", saved["stop_key"]), saved
        assert token_of(t.stdout_lines[0]) not in state_file.read_text()
        # `down` from another tunnel.exe: through the stop pipe, the `up` stops Jupyter and exits 0.
        r = run_exe(exe, state_dir, "down", sshd.alias)
        assert r.returncode == EXIT["ok"], r.stderr
        assert t.wait(60) == EXIT["ok"], t.stderr
        assert "tunnel down: stopping jupyter" in t.stderr, t.stderr
        assert_remote_gone(rt, jupyter_pid)
        assert not state_file.exists()
        r = run_exe(exe, state_dir, "status", sshd.alias)
        assert r.returncode == EXIT["no_tunnel"], r.stderr
    finally:
        t.kill()


def test_ctrl_c_stops_tunnel_exe_under_wine(exe, sshd, state_dir, jupyter_prefix, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd.known_hosts_line() + "\n")
    config = windows_config(sshd, tmp_path, known_hosts)
    t = start(exe, sshd, state_dir, jupyter_prefix, config)
    try:
        reach_status(t.wait_url(90))
        rt, jupyter_pid, _ = remote_of(exe, state_dir, sshd.alias)
        # Wine turns SIGINT into the console's CTRL_C_EVENT, which tokio's ctrl_c() receives.
        t.signal(signal.SIGINT)
        assert t.wait(60) == EXIT["ok"], t.stderr
        assert "Ctrl-C: stopping jupyter" in t.stderr, t.stderr
        assert_remote_gone(rt, jupyter_pid)
    finally:
        t.kill()


def test_tunnel_exe_checks_known_hosts_under_wine(exe, sshd, state_dir, jupyter_prefix,
                                                  tmp_path):
    # Unknown host key, StrictHostKeyChecking yes: refused before any login.
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    t = start(exe, sshd, state_dir, jupyter_prefix, windows_config(sshd, tmp_path, empty))
    assert t.wait(90) == EXIT["host_key_unknown"], t.stderr
    # A different key recorded for it: refused as changed.
    other = tmp_path / "known_hosts_other"
    other.write_text(f"[{sshd.listen_host}]:{sshd.port} "
                     "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJL5PxvuM170rxZR1jnhSBGBAi3YVV3xNczSHJOHAJdP\n")
    t = start(exe, sshd, state_dir, jupyter_prefix, windows_config(sshd, tmp_path, other))
    assert t.wait(90) == EXIT["host_key_changed"], t.stderr


def test_config_paths_resolve_as_openssh_for_windows(exe, state_dir, tmp_path):
    """`~/` and `%d` are the profile directory (as OpenSSH for Windows' pw_dir), backslashes
    stay separators, and the default known_hosts is under the profile."""
    profile = subprocess.run(["wine", "cmd", "/c", "echo %USERPROFILE%"], capture_output=True,
                             text=True, timeout=60, env=wine_env()).stdout.strip()
    assert re.match(r"^[A-Za-z]:\\", profile), profile
    config = tmp_path / "cfg"
    config.write_text("Host w\n  HostName 127.0.0.1\n  IdentityFile ~/.ssh/id_w\n"
                      "  IdentityFile %d\\keys\\id_x\n  IdentityFile Z:\\keys\\id_y\n")
    r = run_exe(exe, state_dir, "config", "-F", winpath(config), "w", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["identityfile"] == [f"{profile}/.ssh/id_w", f"{profile}\\keys\\id_x",
                                   "Z:\\keys\\id_y"], got
    assert got["userknownhostsfile"][0] == f"{profile}/.ssh/known_hosts", got
    assert got["globalknownhostsfile"][0].lower().endswith("\\ssh/ssh_known_hosts"), got


def test_console_close_is_not_testable_under_wine():
    pytest.skip("closing the console window (CTRL_CLOSE_EVENT) needs a console window, which "
                "headless Wine does not have; platform/windows.rs maps it to a clean stop like "
                "Ctrl-C (tested above through Wine's SIGINT -> CTRL_C_EVENT)")


def test_owner_only_acl_is_not_testable_under_wine():
    pytest.skip("Wine 8 keeps no DACLs on files (it maps them onto Unix modes; an owner-only "
                "DACL would become 0777), so tunnel leaves Wine's modes alone; the DACL itself "
                "is unit-tested in platform/sddl.rs and read back on real Windows by "
                "platform::windows::tests::a_private_dir_gets_the_owner_only_dacl")


@pytest.mark.timeout(1500)  # a cold release build for Windows takes minutes on 2 cores
def test_windows_wheel_carries_tunnel_exe_and_it_runs_under_wine():
    """packaging/build.sh --target x86_64-pc-windows-gnu: a win_amd64 wheel holding only
    tunnel.exe, the same bytes as the bare download, which runs (under Wine here).
    TUNNEL_WIN_WHEEL and TUNNEL_WIN_EXE name prebuilt files instead."""
    require_wine()
    wheel, binary = os.environ.get("TUNNEL_WIN_WHEEL"), os.environ.get("TUNNEL_WIN_EXE")
    if not (wheel and binary):
        r = subprocess.run([str(REPO / "packaging" / "build.sh"), "--target", TRIPLE],
                           capture_output=True, text=True, timeout=1400)
        assert r.returncode == 0, f"packaging/build.sh failed:\n{r.stderr[-6000:]}"
        wheel, binary = r.stdout.split()[-2:]
    wheel, binary = Path(wheel), Path(binary)
    version = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    assert wheel.name == f"gpunb_tunnel-{version}-py3-none-win_amd64.whl", wheel.name
    with zipfile.ZipFile(wheel) as z:
        payload = [n for n in z.namelist() if ".dist-info/" not in n]
        assert payload == [f"gpunb_tunnel-{version}.data/scripts/tunnel.exe"], payload
        assert z.read(payload[0]) == binary.read_bytes()
    r = subprocess.run(["wine", str(binary), "--version"], capture_output=True, text=True,
                       timeout=120, env=wine_env())
    assert r.returncode == 0 and r.stdout.strip() == f"tunnel {version}", r
    # The Windows notes are in --help, as the README promises.
    r = subprocess.run(["wine", str(binary), "--help"], capture_output=True, text=True,
                       timeout=120, env=wine_env())
    assert r.returncode == 0 and "On Windows:" in r.stdout and "openssh-ssh-agent" in r.stdout
