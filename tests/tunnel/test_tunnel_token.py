"""Token hygiene (issue #15): during a real session, with a kernel and a terminal running,
the token is in no process's environment and on no process's command line, anywhere on
the machine (here the laptop and the remote are the same machine, so both sides count)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import requests

from tunnel_harness import (
    EXIT, all_pids, alive, cmdline, environ, kernel_pids, port_of, processes_of_runtime_dir,
    run_tunnel, token_of, wait_until,
)


def status_json(tunnel_bin, state_dir, host):
    r = run_tunnel(tunnel_bin, state_dir, "status", "--json", host)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def has_tty(pid: int) -> bool:
    """Whether the process has a controlling terminal (tty_nr in /proc/PID/stat): a
    terminal's shell, which terminado starts on a pty, has one; a short-lived helper that
    Jupyter runs beside it has none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[4]) != 0
    except (OSError, ValueError, IndexError):
        return False


def token_hits(token: str) -> list[tuple[int, str, bytes]]:
    """(pid, where, command line) of every process holding the token in its
    environment or argv."""
    needle = token.encode()
    hits = []
    for pid in all_pids():
        argv = cmdline(pid)
        for where, data in (("environ", environ(pid)), ("cmdline", argv)):
            if needle in data:
                hits.append((pid, where, argv.replace(b"\0", b" ")[:200]))
    return hits


def test_the_token_is_in_no_environment_and_no_command_line(
    tunnel, sshd, state_dir, tunnel_bin
):
    t = tunnel("--app", "server")
    url = t.wait_url()
    token, port = token_of(url), port_of(url)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"token {token}"}
    assert requests.get(f"{base}/api/status", headers=auth, timeout=30).status_code == 200

    st = status_json(tunnel_bin, state_dir, sshd.alias)
    rt, jupyter_pid = st["remote_runtime_dir"], st["remote_pid"]
    before = set(processes_of_runtime_dir(rt))

    # A kernel and a terminal, started through the forward as a browser would.
    r = requests.post(f"{base}/api/kernels", headers=auth, json={"name": "python3"}, timeout=60)
    assert r.status_code == 201, r.text
    assert wait_until(lambda: kernel_pids(rt), 30), "no kernel process"
    r = requests.post(f"{base}/api/terminals", headers=auth, timeout=60)
    assert r.status_code == 200, f"terminals (terminado) unavailable: {r.status_code} {r.text}"
    term = r.json()["name"]

    def terminal_pids():
        # The terminal's shell is Jupyter's child on a pty (terminado forks it); its own
        # short-lived children (a bashrc's commands) and helpers Jupyter runs without a pty
        # come and go, so they are not what is checked below.
        return [p for p in set(processes_of_runtime_dir(rt)) - before
                if parent(p) == jupyter_pid and p not in kernel_pids(rt) and has_tty(p)]
    assert wait_until(terminal_pids, 30), "no terminal process"
    kernels, terminals = kernel_pids(rt), terminal_pids()

    # The scan: every process on the machine, environment and argv.
    assert token_hits(token) == []

    # It can fail: the processes that would carry the token are there and readable, and
    # Jupyter got the token's file path instead of the token (the file itself is gone
    # once Jupyter has read it: the only copy left is Jupyter's own 0600 info file).
    for pid in [jupyter_pid, *kernels, *terminals]:
        assert alive(pid), pid
        env = environ(pid).split(b"\0")
        assert env != [b""], f"cannot read the environment of {pid}"
        assert f"JUPYTER_RUNTIME_DIR={rt}".encode() in env, pid
        assert not any(v.startswith(b"JUPYTER_TOKEN=") for v in env), (pid, env)
    jenv = environ(jupyter_pid).split(b"\0")
    assert f"JUPYTER_TOKEN_FILE={rt}/token".encode() in jenv
    assert not Path(rt, "token").exists()
    assert token in Path(rt, f"jpserver-{jupyter_pid}.json").read_text()

    r = requests.delete(f"{base}/api/terminals/{term}", headers=auth, timeout=30)
    assert r.status_code == 204, r.text
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert not os.path.exists(rt)
    assert token_hits(token) == []


def test_a_jupyter_token_exported_by_a_login_profile_is_not_used(tunnel):
    """JUPYTER_TOKEN would win over JUPYTER_TOKEN_FILE in Jupyter: the launcher unsets it."""
    t = tunnel("--app", "server", "--init", "export JUPYTER_TOKEN=from-the-profile")
    url = t.wait_url()
    base = f"http://127.0.0.1:{port_of(url)}"
    ok = {"Authorization": f"token {token_of(url)}"}
    bogus = {"Authorization": "token from-the-profile"}
    assert requests.get(f"{base}/api/status", headers=ok, timeout=30).status_code == 200
    assert requests.get(f"{base}/api/status", headers=bogus, timeout=30).status_code == 403
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
