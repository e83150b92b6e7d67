"""Issue #15's smaller hardening items, end to end against a real sshd: server text with
terminal controls, and IdentitiesOnly with only OpenSSH's default identity files."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from sshd import Sshd
from tunnel_harness import EXIT, run_tunnel, ssh_agent


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


@pytest.fixture
def agent_with_both_keys(tmp_path, sshd):
    """An ssh-agent holding the authorized key and the stranger key."""
    with ssh_agent(tmp_path / "agent.sock", [sshd.client_key, sshd.other_key]) as sock:
        yield sock


def in_home(home, argv, env, timeout=90) -> subprocess.CompletedProcess:
    """Run argv with `home` mounted over the passwd home (a private mount namespace):
    OpenSSH and tunnel both find the default identity files there, not in $HOME."""
    real = os.path.expanduser("~" + os.environ.get("USER", "root"))
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(home), real, *argv],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root for a private mount namespace")
@pytest.mark.parametrize("default_key", ["authorized", "stranger"])
def test_identities_only_without_identity_file_uses_the_default_files_agent_keys(
    default_key, sshd, agent_with_both_keys, tmp_path, tunnel_bin, state_dir
):
    """IdentitiesOnly yes and no IdentityFile: of the agent's keys only those whose public
    key is a default identity file (~/.ssh/id_ed25519.pub, ...) are offered, as ssh does."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = sshd.client_key if default_key == "authorized" else sshd.other_key
    # Only the public half: what the agent holds must be picked by it.
    shutil.copy(f"{key}.pub", home / ".ssh" / "id_ed25519.pub")
    config = tmp_path / "ssh_config"
    config.write_text(sshd.client_config(IdentityFile=None, IdentitiesOnly="yes",
                                         IdentityAgent=str(agent_with_both_keys)))
    binary = tmp_path / "tunnel"  # the build may live under the home mounted over
    shutil.copy(tunnel_bin, binary)
    env = {**os.environ, "TUNNEL_STATE_DIR": str(state_dir)}
    env.pop("SSH_AUTH_SOCK", None)

    ssh = in_home(home, ["ssh", "-F", str(config), "-o", "BatchMode=yes", sshd.alias, "true"],
                  env)
    r = in_home(home, [str(binary), "-v", "up", "-F", str(config), sshd.alias, "--no-browser",
                       "--env", "/nonexistent-env"], env)
    if default_key == "authorized":
        assert ssh.returncode == 0, ssh.stderr
        # Authenticated: it fails later, at the remote setup, for the bogus --env.
        assert r.returncode == EXIT["remote_setup"], r.stderr
        assert "authenticated with agent key" in r.stderr
    else:
        assert ssh.returncode == 255 and "Permission denied" in ssh.stderr, ssh.stderr
        # The authorized key is in the agent, but it is no default identity file.
        assert r.returncode == EXIT["auth"], r.stderr
        assert "ssh-agent (1 key(s))" in r.stderr, r.stderr
