"""Issue #15's smaller hardening items, end to end against a real sshd: server text with
terminal controls, and IdentitiesOnly with only OpenSSH's default identity files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

from sshd import Sshd
from tunnel_harness import EXIT, run_tunnel


def test_a_banner_cannot_send_terminal_controls(tmp_path, state_dir, tunnel_bin, jupyter_prefix):
    # Clears the screen, sets the window title, and rings the bell, around plain text.
    banner = tmp_path / "banner"
    banner.write_bytes(b"Welcome\x1b[2J\x1b[H to gpu01\r\n\x1b]0;pwned\x07Authorized use only\r\n")
    with Sshd(tmp_path / "sshd", extra_sshd_config=f"Banner {banner}") as server:
        r = run_tunnel(tunnel_bin, state_dir, "doctor", "-F", str(server.ssh_config),
                       server.alias, "--env", str(jupyter_prefix), timeout=120)
    assert r.returncode == EXIT["ok"], r.stdout + r.stderr
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr and "\r" not in r.stderr
    # Shown, escaped, as ssh shows it; the line ends kept.
    assert "Welcome\\033[2J\\033[H to gpu01\n\\033]0;pwned\\007Authorized use only\n" in r.stderr
