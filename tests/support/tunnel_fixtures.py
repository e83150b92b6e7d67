"""pytest fixtures for tests that drive the real `tunnel` binary against a real OpenSSH sshd
on 127.0.0.1 (sshd.py), which starts a real Jupyter server ("the remote" is this machine).

Shared by tests/tunnel and tests/browser: their conftest.py imports the fixtures by name::

    from tunnel_fixtures import jupyter_prefix, sshd, state_dir, tunnel, tunnel_bin  # noqa: F401
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
for _dir in (REPO / "tests" / "support", REPO / "tests" / "tunnel"):  # sshd.py, tunnel_harness.py
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

from sshd import Sshd  # noqa: E402
from tunnel_harness import Tunnel, find_tunnel_binary, jupyter_env  # noqa: E402


@pytest.fixture(scope="session")
def tunnel_bin() -> Path:
    return find_tunnel_binary()


@pytest.fixture(scope="session")
def jupyter_prefix() -> Path:
    """The Python environment that has Jupyter (passed as --env)."""
    return jupyter_env()


@pytest.fixture
def sshd(tmp_path):
    """A fresh sshd; on teardown it and everything started through it is killed."""
    with Sshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture
def state_dir(tmp_path) -> Path:
    d = tmp_path / "state"
    return d


@pytest.fixture
def tunnel(tunnel_bin, sshd, state_dir, jupyter_prefix):
    """Factory for `tunnel` processes against `sshd`; all are killed on teardown."""
    started: list[Tunnel] = []

    def make(*args: str, env: dict | None = None, config: Path | None = None,
             host: str | None = None) -> Tunnel:
        t = Tunnel(tunnel_bin, sshd, state_dir, jupyter_prefix, args, env=env, config=config,
                   host=host)
        started.append(t)
        return t

    yield make
    for t in started:
        t.kill()
