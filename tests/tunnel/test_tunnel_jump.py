"""ProxyJump: two real jump sshds in front of a third, each hop checked on its own."""

from __future__ import annotations

import pytest
import requests

from sshd import Sshd
from tunnel_harness import (
    EXIT, established_to, port_of, run_tunnel, token_of,
)


@pytest.fixture
def jumps(tmp_path):
    servers = [Sshd(tmp_path / f"jump{i}", alias=f"jump{i}") for i in (1, 2)]
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.cleanup()


def route_config(tmp_path, sshd, j1, j2, proxy_jump: str | None):
    """jump1 is known only under a HostKeyAlias, so that alias must be honoured."""
    j1.known_hosts.write_text(f"bastion-one {j1.host_public_key()}\n")
    text = (j1.client_config(HostKeyAlias="bastion-one") + j2.client_config()
            + sshd.client_config(ProxyJump=proxy_jump))
    cfg = tmp_path / "route_config"
    cfg.write_text(text)
    return cfg


def test_proxy_jump_through_two_hosts(tunnel, sshd, jumps, tmp_path):
    j1, j2 = jumps
    cfg = route_config(tmp_path, sshd, j1, j2, proxy_jump="jump1,jump2")
    t = tunnel("--app", "server", config=cfg)
    url = t.wait_url()
    r = requests.get(f"http://127.0.0.1:{port_of(url)}/api/status",
                     headers={"Authorization": f"token {token_of(url)}"}, timeout=30)
    assert r.status_code == 200, r.text
    # The path really is client -> jump1 -> jump2 -> target: jump1's session
    # holds the connection to jump2, and jump2's the one to the target.
    assert established_to(j2.port, j1.session_pids())
    assert established_to(sshd.port, j2.session_pids())
    for s in (j1, j2, sshd):
        assert "Accepted publickey" in s.log.read_text(), s.alias
    assert "via jump host" in t.stderr
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr


def test_changed_key_on_the_middle_hop_is_refused(tunnel_bin, sshd, jumps, tmp_path, state_dir,
                                                   jupyter_prefix):
    j1, j2 = jumps
    cfg = route_config(tmp_path, sshd, j1, j2, proxy_jump=None)
    j2.rotate_host_key()
    # Same route given with -J this time.
    r = run_tunnel(tunnel_bin, state_dir, "up", "-F", str(cfg), "-J", "jump1,jump2",
                   sshd.alias, "--no-browser", "--env", str(jupyter_prefix))
    assert r.returncode == EXIT["host_key_changed"], r.stderr
    assert "jump host jump2" in r.stderr and "HOST KEY CHANGED" in r.stderr, r.stderr
    assert f"[127.0.0.1]:{j2.port}" in r.stderr
    # jump1 was passed (it was checked and accepted on its own), the target never reached.
    assert "Accepted publickey" in j1.log.read_text()
    assert "Accepted" not in sshd.log.read_text()
    assert "Accepted" not in j2.log.read_text()
