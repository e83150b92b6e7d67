"""Fixtures for the tunnel end-to-end tests: the real `tunnel` binary, a real
OpenSSH sshd on 127.0.0.1 (tests/support/sshd.py), and a real Jupyter server
that tunnel starts through it ("the remote" is this same machine). The fixtures
live in tests/support/tunnel_fixtures.py, shared with tests/browser."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(HERE))

from tunnel_fixtures import jupyter_prefix, sshd, state_dir, tunnel, tunnel_bin  # noqa: E402,F401
