"""Surviving a real network outage: the link to the remote goes down for 20 s.

The "remote" is a network namespace joined to this one by a veth pair, with
its own sshd (tests/support/sshd.py) on the namespace's side of the link; the
Jupyter server tunnel starts through it runs in the namespace, on the
namespace's own 127.0.0.1. Taking the host end of the veth down cuts the link
for real: no process is killed and neither end is told; every packet in
between is lost until the link is back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest
import requests

from sshd import Sshd
from test_tunnel_reconnect import lines_with, run_code
from test_tunnel_up import start_kernel, status_json
from tunnel_harness import EXIT, alive, port_of, processes_of_runtime_dir, token_of, wait_until

CUT_SECONDS = 20
# After the link is back, tunnel must be back within this (as after a killed session).
RECOVERY_SECONDS = 10


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


@dataclass
class Netns:
    name: str
    host_if: str
    host_addr: str
    ns_addr: str

    def cut(self) -> None:
        ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        ip("link", "set", self.host_if, "up")


def _free_slot() -> int:
    """A namespace name and /30 subnet nobody else on this machine uses (other
    test runs may be making their own at the same time): `ip netns add` fails
    on a taken name, so the first one it accepts is ours."""
    taken = ip("route", "show", "table", "all").stdout + ip("link", "show").stdout
    for i in range(256):
        slot = (os.getpid() + i) % 16384
        name = f"tncut{slot}"
        subnet = f"10.213.{slot // 64}.{slot % 64 * 4}/30"
        if name in taken or subnet in taken:
            continue
        if ip("netns", "add", name, check=False).returncode == 0:
            return slot
    pytest.fail("no free network namespace name / subnet for the test")


@pytest.fixture
def netns():
    """A namespace behind a veth pair; always removed with everything in it."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to create a network namespace")
    probe = ip("netns", "add", f"tncut-probe{os.getpid()}", check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace (no CAP_NET_ADMIN?): "
                    f"{probe.stderr.strip()}")
    ip("netns", "del", f"tncut-probe{os.getpid()}")

    slot = _free_slot()
    name = f"tncut{slot}"
    net = f"10.213.{slot // 64}.{slot % 64 * 4}"
    prefix = net.rsplit(".", 1)[0]
    last = int(net.rsplit(".", 1)[1])
    ns = Netns(name=name, host_if=f"{name}h", host_addr=f"{prefix}.{last + 1}",
               ns_addr=f"{prefix}.{last + 2}")
    # The host end, and a second veth whose peer stays down: the fallback
    # route through it, used only while the real link is down, makes packets
    # for the namespace vanish (as on a dead uplink) instead of leaving by
    # this machine's default route, where a gateway might even answer them.
    blackhole_if = f"{name}b"
    try:
        ip("link", "add", ns.host_if, "type", "veth", "peer", "name", f"{name}n")
        ip("link", "set", f"{name}n", "netns", name)
        ip("addr", "add", f"{ns.host_addr}/30", "dev", ns.host_if)
        ip("link", "set", ns.host_if, "up")
        ip("-n", name, "addr", "add", f"{ns.ns_addr}/30", "dev", f"{name}n")
        ip("-n", name, "link", "set", f"{name}n", "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("link", "add", blackhole_if, "type", "veth", "peer", "name", f"{name}p")
        ip("link", "set", blackhole_if, "up")
        ip("route", "add", f"{net}/30", "dev", blackhole_if, "metric", "1000")
        # The namespace has no default route: a dial made during the cut
        # leaves with this machine's other address and is never answered,
        # even after the link is back; only a fresh dial gets through.
        ip("neigh", "replace", ns.ns_addr, "lladdr", "02:00:00:00:00:01", "dev", blackhole_if,
           "nud", "permanent")
        yield ns
    finally:
        # Whatever still runs in there (sshd, its sessions, Jupyter and its
        # kernels, however they daemonized) is ours.
        pids = ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        # Deleting one end of a veth deletes its peer (and the routes through it).
        ip("link", "del", ns.host_if, check=False)
        ip("link", "del", blackhole_if, check=False)
        ip("netns", "del", name, check=False)


@pytest.fixture
def sshd(tmp_path, netns):
    """The sshd of this module runs in the namespace (overrides conftest's)."""
    with Sshd(tmp_path / "sshd", listen_host=netns.ns_addr,
              command_prefix=["ip", "netns", "exec", netns.name]) as server:
        # No ConnectTimeout (nor ServerAlive*): tunnel's own defaults must cope,
        # as they do for a user whose ssh config says nothing about them.
        server.ssh_config.write_text(server.client_config(ConnectTimeout=None))
        yield server


def user_lines(t, since: int) -> list[str]:
    """What tunnel told the user (not its -v debug lines) after stderr line `since`."""
    return [l for l in t.stderr_lines[since:] if not l.startswith("tunnel: [")]


def test_network_cut_reconnects_to_the_same_url_and_kernel(tunnel, sshd, netns, state_dir,
                                                           tunnel_bin):
    t = tunnel("--app", "server", "--linger", "90")
    url = t.wait_url()
    port, token = port_of(url), token_of(url)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"token {token}"}
    st = status_json(tunnel_bin, state_dir, sshd.alias)
    jupyter_pid, rt = st["remote_pid"], st["remote_runtime_dir"]
    # Jupyter really is on the far side of the link.
    assert os.readlink(f"/proc/{jupyter_pid}/ns/net") != os.readlink("/proc/self/ns/net")
    kid = start_kernel(base, token)
    run_code(port, token, kid, "x = 41")
    before = len(t.stderr_lines)

    netns.cut()
    cut_at = time.monotonic()
    lost_after = None
    waiting: dict = {}

    def ask_status():
        try:
            waiting["status"] = requests.get(f"{base}/api/status", headers=auth, timeout=60)
        except requests.RequestException as e:
            waiting["status"] = e

    while time.monotonic() - cut_at < CUT_SECONDS:
        if lost_after is None and lines_with(t, "lost; reconnecting"):
            lost_after = time.monotonic() - cut_at
            # A browser that asks while the link is down gets its answer once
            # the tunnel is back, on the same URL.
            waiting["thread"] = threading.Thread(target=ask_status, daemon=True)
            waiting["thread"].start()
        assert t.proc.poll() is None, f"tunnel exited during the cut:\n{t.stderr}"
        time.sleep(0.1)
    netns.restore()
    up_at = time.monotonic()
    back = wait_until(lambda: lines_with(t, "reconnected to"), RECOVERY_SECONDS + 5)
    back_after = time.monotonic() - up_at
    print(f"network cut {CUT_SECONDS}s: drop noticed after {lost_after}s, "
          f"reconnected {back_after:.1f}s after the link came back")
    assert lost_after is not None, f"the drop went unnoticed during the cut:\n{t.stderr}"
    assert back and back_after < RECOVERY_SECONDS, (
        f"reconnected {back_after:.1f}s after the link came back:\n{t.stderr}")
    # One line for the drop and one for the recovery: no line per retry.
    told = user_lines(t, before)
    assert len(told) == 2, "\n".join(told)
    assert "lost; reconnecting" in told[0] and "reconnected to" in told[1], "\n".join(told)

    waiting["thread"].join(30)
    asked = waiting.get("status")
    assert isinstance(asked, requests.Response) and asked.status_code == 200, asked
    # The same URL works, on the same server, and the kernel kept its state.
    r = requests.get(f"{base}/api/status", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert alive(jupyter_pid)
    assert status_json(tunnel_bin, state_dir, sshd.alias)["remote_pid"] == jupyter_pid
    assert run_code(port, token, kid, "print(x + 1)").strip() == "42"

    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert processes_of_runtime_dir(rt) == [] and not os.path.exists(rt)
