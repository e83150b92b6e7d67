"""Authentication through a real ssh-agent, and an explicit local --port."""

from __future__ import annotations

import pytest
import requests

from sshd import free_port
from tunnel_harness import EXIT, port_of, ssh_agent, token_of


@pytest.fixture
def agent(tmp_path, sshd):
    """An ssh-agent holding the authorized client key (and nothing on disk is configured)."""
    with ssh_agent(tmp_path / "agent.sock", [sshd.client_key]) as sock:
        yield sock


def test_agent_key_and_explicit_port(tunnel, sshd, agent, tmp_path):
    config = tmp_path / "ssh_config"
    # The only key file configured is not authorized: success must come from the agent.
    config.write_text(sshd.client_config(IdentityAgent=str(agent), IdentityFile=str(sshd.other_key),
                                         IdentitiesOnly=None))
    port = free_port()
    t = tunnel("--app", "server", "--port", str(port), config=config)
    url = t.wait_url()
    assert port_of(url) == port
    r = requests.get(f"http://127.0.0.1:{port}/api/status",
                     headers={"Authorization": f"token {token_of(url)}"}, timeout=30)
    assert r.status_code == 200
    assert "authenticated with agent key" in t.stderr
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
