"""`tunnel up` end to end: real sshd, real Jupyter, real kernel, through the forward."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import uuid
from datetime import datetime, timezone
from pathlib import Path

import requests
import websocket

from tunnel_harness import (
    EXIT, alive, cmdline, cmdlines_containing, files_containing, is_loopback, kernel_pids,
    listening_sockets, port_of, processes_of_runtime_dir, run_tunnel, token_of, wait_until,
)


def status_json(tunnel_bin, state_dir, host):
    r = run_tunnel(tunnel_bin, state_dir, "status", "--json", host)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def execute(ws, code: str, timeout: float = 60) -> tuple[str, dict]:
    """Run code over the kernel websocket (Jupyter's JSON protocol); (stdout, reply)."""
    msg_id = uuid.uuid4().hex
    ws.settimeout(timeout)
    ws.send(json.dumps({
        "header": {
            "msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex,
            "msg_type": "execute_request", "version": "5.3",
            "date": datetime.now(timezone.utc).isoformat(),
        },
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {
            "code": code, "silent": False, "store_history": True,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": True,
        },
    }))
    out, reply, idle = [], None, False
    while reply is None or not idle:
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            out.append(msg["content"]["text"])
        elif kind == "execute_reply":
            reply = msg["content"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    return "".join(out), reply


def start_kernel(base: str, token: str) -> str:
    r = requests.post(f"{base}/api/kernels", headers={"Authorization": f"token {token}"},
                      json={"name": "python3"}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_up_serves_jupyter_through_the_forward_and_ctrl_c_cleans_up(
    tunnel, sshd, state_dir, tunnel_bin, tmp_path
):
    # A stand-in for the desktop's opener records how tunnel asked for a browser.
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    record = tmp_path / "browser"
    opener = fakebin / "xdg-open"
    opener.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$BROWSER_RECORD/argv"\n'
                      'stat -c %a "$1" > "$BROWSER_RECORD/mode"\n')
    opener.chmod(0o755)
    record.mkdir()

    t = tunnel("--browser", env={"PATH": f"{fakebin}:{os.environ['PATH']}",
                                 "BROWSER_RECORD": str(record)})
    url = t.wait_url()

    # stdout carries exactly one line: the URL with a >= 128-bit token.
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/lab\?token=[0-9a-f]{64}", url), url
    token, port = token_of(url), port_of(url)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"token {token}"}

    r = requests.get(f"{base}/api/status", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert requests.get(f"{base}/api/status", timeout=30).status_code == 403  # the token is the lock

    # A kernel started over REST runs code over the websocket, all through the forward.
    kid = start_kernel(base, token)
    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels",
                                     header=[f"Authorization: token {token}"], timeout=60)
    try:
        out, reply = execute(ws, "import os; print(6 * 7, os.getpid())")
    finally:
        ws.close()
    assert reply["status"] == "ok", reply
    answer, kernel_pid = out.split()
    assert answer == "42"

    st = status_json(tunnel_bin, state_dir, sshd.alias)
    rt, jupyter_pid = st["remote_runtime_dir"], st["remote_pid"]
    assert st["phase"] == "ready" and st["alive"] and st["local_port"] == port
    assert int(kernel_pid) in kernel_pids(rt)
    # Jupyter adds the sticky bit (so tmp cleaners leave it alone); nobody else may enter.
    assert stat.S_IMODE(os.stat(rt).st_mode) & 0o777 == 0o700

    # Loopback only, on both sides.
    local = listening_sockets(t.pid)
    assert local == [("127.0.0.1", port)], local
    remote = listening_sockets(jupyter_pid)
    assert any(p == st["remote_port"] for _, p in remote), remote
    assert all(is_loopback(a) for a, _ in remote), remote

    # The token is on no command line, in no log, and only in private files.
    assert cmdlines_containing(token) == []
    assert token not in t.stderr
    assert token not in sshd.log.read_text()
    jupyter_log = (Path(rt) / "jupyter.log").read_text()
    assert "ServerApp" in jupyter_log and token not in jupyter_log
    hits = files_containing(token, ["/tmp", state_dir, Path.home() / ".local/share/jupyter",
                                    Path.home() / ".jupyter"])
    assert any(p.name.startswith("jpserver-") for p, _ in hits), hits  # the scan sees files
    assert all(mode & 0o077 == 0 for _, mode in hits), hits

    # The browser got a 0600 redirect file, never the token in its argv.
    assert wait_until(lambda: (record / "mode").exists(), 10)
    argv = (record / "argv").read_text()
    assert token not in argv
    page = Path(argv.strip())
    assert (record / "mode").read_text().strip() == "600"
    assert f"url={url}" in page.read_text()

    # Ctrl-C: exit 0, Jupyter and the kernel gone, runtime dir removed.
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert processes_of_runtime_dir(rt) == []
    assert not alive(jupyter_pid) and not alive(int(kernel_pid))
    assert not Path(rt).exists()
    assert not page.exists()
    assert run_tunnel(tunnel_bin, state_dir, "ls").stdout.strip() == "no tunnels"


def test_down_status_and_ls_from_another_terminal(tunnel, sshd, state_dir, tunnel_bin, jupyter_prefix):
    t = tunnel("--app", "server")
    url = t.wait_url()
    token, port = token_of(url), port_of(url)

    # A second `up` to the same host is refused while the first runs.
    r = run_tunnel(tunnel_bin, state_dir, "up", "-F", str(sshd.ssh_config), sshd.alias,
                   "--no-browser", "--env", str(jupyter_prefix))
    assert r.returncode == EXIT["already_running"], r.stderr
    assert "already running" in r.stderr and f"pid {t.pid}" in r.stderr

    for args in (["status"], ["status", sshd.alias], ["status", "--json"],
                 ["status", "--json", sshd.alias], ["ls"], ["ls", "--json"]):
        r = run_tunnel(tunnel_bin, state_dir, *args)
        assert r.returncode == 0, (args, r.stderr)
        assert sshd.alias in r.stdout, args
        assert token not in r.stdout + r.stderr, args
    st = status_json(tunnel_bin, state_dir, sshd.alias)
    assert st["url"] == url.split("?")[0] and st["pid"] == t.pid and st["alive"]
    listing = json.loads(run_tunnel(tunnel_bin, state_dir, "ls", "--json").stdout)
    assert [x["host"] for x in listing] == [sshd.alias]
    state_files = list(Path(state_dir).iterdir())
    assert state_files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in state_files)
    assert stat.S_IMODE(Path(state_dir).stat().st_mode) == 0o700

    rt = st["remote_runtime_dir"]
    start_kernel(f"http://127.0.0.1:{port}", token)
    assert wait_until(lambda: kernel_pids(rt), 30)

    r = run_tunnel(tunnel_bin, state_dir, "down", sshd.alias)
    assert r.returncode == EXIT["ok"], r.stderr
    # `down` returns once the tunnel has stopped everything and exited.
    assert t.proc.poll() == EXIT["ok"], t.stderr
    assert processes_of_runtime_dir(rt) == []
    assert not Path(rt).exists()

    r = run_tunnel(tunnel_bin, state_dir, "status", sshd.alias)
    assert r.returncode == EXIT["no_tunnel"] and "no tunnel" in r.stderr
    r = run_tunnel(tunnel_bin, state_dir, "down", sshd.alias)
    assert r.returncode == EXIT["no_tunnel"] and "no tunnel" in r.stderr


def test_sigkill_of_the_client_leaves_the_server_to_stop_after_the_linger(
    tunnel, sshd, state_dir, tunnel_bin
):
    linger = 4
    t = tunnel("--app", "server", "--linger", str(linger))
    url = t.wait_url()
    st = status_json(tunnel_bin, state_dir, sshd.alias)
    rt, jupyter_pid = st["remote_runtime_dir"], st["remote_pid"]
    start_kernel(f"http://127.0.0.1:{port_of(url)}", token_of(url))
    assert wait_until(lambda: kernel_pids(rt), 30)

    t.signal(signal.SIGKILL)
    t.wait()
    # No goodbye: the server lingers (a reconnect could pick it up) ...
    assert not wait_until(lambda: not alive(jupyter_pid), 1.5)
    assert Path(rt).exists()
    # ... then stops itself, kernels included, and removes its runtime dir.
    assert wait_until(lambda: not processes_of_runtime_dir(rt) and not Path(rt).exists(),
                      linger + 15), processes_of_runtime_dir(rt)

    # The dead client's state is shown as such, and `down` clears it.
    assert status_json(tunnel_bin, state_dir, sshd.alias)["alive"] is False
    assert " dead " in run_tunnel(tunnel_bin, state_dir, "ls").stdout
    r = run_tunnel(tunnel_bin, state_dir, "down", sshd.alias)
    assert r.returncode == EXIT["no_tunnel"] and "died" in r.stderr
    assert run_tunnel(tunnel_bin, state_dir, "ls").stdout.strip() == "no tunnels"


def test_shutting_jupyter_down_from_its_ui_closes_the_tunnel_cleanly(
    tunnel, sshd, state_dir, tunnel_bin
):
    t = tunnel("--app", "server")
    url = t.wait_url()
    rt = status_json(tunnel_bin, state_dir, sshd.alias)["remote_runtime_dir"]
    # What File > Shut Down does in JupyterLab.
    r = requests.post(f"http://127.0.0.1:{port_of(url)}/api/shutdown",
                      headers={"Authorization": f"token {token_of(url)}"}, timeout=30)
    assert r.status_code == 200
    assert t.wait(40) == EXIT["ok"], t.stderr
    assert "was shut down" in t.stderr
    assert processes_of_runtime_dir(rt) == [] and not Path(rt).exists()
