"""Surviving drops: reconnect with the same URL and kernels, and --detach/reattach/down."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import requests
import websocket

from test_tunnel_up import execute, start_kernel, status_json
from tunnel_harness import (
    EXIT, alive, cmdline, kernel_pids, port_of, processes_of_runtime_dir, run_tunnel, token_of,
    wait_until,
)


def kill_ssh_sessions(sshd) -> None:
    """SIGKILL sshd's per-connection processes: the TCP connection dies under tunnel,
    while what the session started (the launcher, Jupyter) lives on."""
    sessions = [p for p in sshd.session_pids() if cmdline(p).startswith(b"sshd:")]
    assert sessions, "no ssh session to kill"
    for p in sessions:
        os.kill(p, signal.SIGKILL)


def run_code(port: int, token: str, kid: str, code: str) -> str:
    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels",
                                     header=[f"Authorization: token {token}"], timeout=30)
    try:
        out, reply = execute(ws, code)
    finally:
        ws.close()
    assert reply["status"] == "ok", reply
    return out


def lines_with(t, needle: str) -> list[str]:
    return [l for l in t.stderr_lines if needle in l]


def test_killed_ssh_session_reconnects_to_the_same_url_and_kernel(tunnel, sshd, state_dir,
                                                                  tunnel_bin):
    t = tunnel("--app", "server", "--linger", "30")
    url = t.wait_url()
    port, token = port_of(url), token_of(url)
    base = f"http://127.0.0.1:{port}"
    jupyter_pid = status_json(tunnel_bin, state_dir, sshd.alias)["remote_pid"]
    kid = start_kernel(base, token)
    run_code(port, token, kid, "x = 41")

    kill_ssh_sessions(sshd)
    lost_at = time.monotonic()
    assert wait_until(lambda: lines_with(t, "reconnected to"), 10), t.stderr
    assert time.monotonic() - lost_at < 10
    # One line for the drop, one for the recovery (plus nothing else at info level).
    assert len(lines_with(t, "lost; reconnecting")) == 1, t.stderr
    assert len(lines_with(t, "reconnected to")) == 1, t.stderr

    # The same URL works, on the same server, and the kernel kept its state.
    r = requests.get(f"{base}/api/status", headers={"Authorization": f"token {token}"},
                     timeout=30)
    assert r.status_code == 200, r.text
    assert alive(jupyter_pid)
    assert status_json(tunnel_bin, state_dir, sshd.alias)["remote_pid"] == jupyter_pid
    assert run_code(port, token, kid, "print(x + 1)").strip() == "42"

    # A second drop is survived the same way.
    kill_ssh_sessions(sshd)
    assert wait_until(lambda: len(lines_with(t, "reconnected to")) == 2, 10), t.stderr
    assert run_code(port, token, kid, "print(x + 2)").strip() == "43"

    rt = status_json(tunnel_bin, state_dir, sshd.alias)["remote_runtime_dir"]
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert processes_of_runtime_dir(rt) == [] and not Path(rt).exists()


def test_unrecoverable_loss_gives_up_after_the_linger(tunnel, sshd, state_dir, tunnel_bin):
    t = tunnel("--app", "server", "--linger", "3")
    t.wait_url()
    rt = status_json(tunnel_bin, state_dir, sshd.alias)["remote_runtime_dir"]
    # The listening sshd goes first, so nothing can answer a reconnect.
    sessions = [p for p in sshd.session_pids() if cmdline(p).startswith(b"sshd:")]
    assert sessions
    os.kill(sshd.pid, signal.SIGKILL)
    for p in sessions:
        os.kill(p, signal.SIGKILL)
    assert t.wait(30) == EXIT["connection_lost"], t.stderr
    assert len(lines_with(t, "lost; reconnecting")) == 1, t.stderr
    assert "could not be restored" in t.stderr and "refused" in t.stderr
    # The server, with no client back within the linger, stopped itself.
    assert wait_until(lambda: not processes_of_runtime_dir(rt) and not Path(rt).exists(), 20)


def test_detach_then_up_reattaches_to_the_same_server_and_down_stops_it(
    tunnel, sshd, state_dir, tunnel_bin, jupyter_prefix
):
    t = tunnel("--app", "server", "--detach", "--linger", "2")
    url = t.wait_url()
    port, token = port_of(url), token_of(url)
    st = status_json(tunnel_bin, state_dir, sshd.alias)
    rt, jupyter_pid = st["remote_runtime_dir"], st["remote_pid"]
    kid = start_kernel(f"http://127.0.0.1:{port}", token)
    run_code(port, token, kid, "x = 41")
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert "left jupyter running" in t.stderr

    # Well past the linger, the server is still there, waiting for us.
    time.sleep(3.5)
    assert alive(jupyter_pid) and Path(rt).is_dir()
    assert stat.S_IMODE(os.stat(rt).st_mode) & 0o777 == 0o700
    # The token is kept by the client only, in a 0600 file; nothing of ours on
    # the remote holds it (Jupyter's own info file aside, 0600 in the 0700 dir).
    record = Path(state_dir) / f"{sshd.alias}.server"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert json.loads(record.read_text())["token"] == token
    ours = [p for p in Path(rt).iterdir() if not p.name.startswith(("jpserver-", "kernel-"))]
    assert all(token.encode() not in p.read_bytes() for p in ours if p.is_file()), ours

    # `up` again: same server, same token, same kernel with its state.
    t2 = tunnel("--app", "server")
    url2 = t2.wait_url()
    assert token_of(url2) == token
    assert "reattached" in t2.stderr
    assert status_json(tunnel_bin, state_dir, sshd.alias)["remote_pid"] == jupyter_pid
    assert run_code(port_of(url2), token, kid, "print(x + 1)").strip() == "42"
    # Reattached without --detach, it is an ordinary tunnel: `down` stops all.
    r = run_tunnel(tunnel_bin, state_dir, "down", sshd.alias)
    assert r.returncode == EXIT["ok"], r.stderr
    assert t2.proc.poll() == EXIT["ok"], t2.stderr
    assert processes_of_runtime_dir(rt) == [] and not Path(rt).exists()
    assert not record.exists()


def test_down_stops_a_detached_server_with_no_client(tunnel, sshd, state_dir, tunnel_bin):
    t = tunnel("--app", "server", "--detach")
    url = t.wait_url()
    rt = status_json(tunnel_bin, state_dir, sshd.alias)["remote_runtime_dir"]
    start_kernel(f"http://127.0.0.1:{port_of(url)}", token_of(url))
    assert wait_until(lambda: kernel_pids(rt), 30)
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert processes_of_runtime_dir(rt)

    r = run_tunnel(tunnel_bin, state_dir, "down", sshd.alias)
    assert r.returncode == EXIT["ok"], r.stderr
    assert "stopped jupyter" in r.stderr
    assert wait_until(lambda: not processes_of_runtime_dir(rt), 10)
    assert not Path(rt).exists()
    assert not (Path(state_dir) / f"{sshd.alias}.server").exists()
    r = run_tunnel(tunnel_bin, state_dir, "down", sshd.alias)
    assert r.returncode == EXIT["no_tunnel"], r.stderr
