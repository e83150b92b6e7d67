"""Host keys: a changed key is refused, always; an unknown one needs --accept-new."""

from __future__ import annotations

import glob
import subprocess
import time

import pytest
import requests

from tunnel_harness import EXIT, port_of, run_tunnel, token_of


def fingerprint(pub_path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub_path)], capture_output=True, text=True,
                         check=True).stdout
    return out.split()[1]


def runtime_dirs() -> set[str]:
    return set(glob.glob("/tmp/tunnel-jupyter.*"))


def test_changed_host_key_is_refused_and_nothing_starts(sshd, state_dir, tunnel_bin, jupyter_prefix):
    old_fp = fingerprint(f"{sshd.host_key}.pub")
    known_line = sshd.known_hosts_line()
    sshd.rotate_host_key()
    new_fp = fingerprint(f"{sshd.host_key}.pub")
    assert old_fp != new_fp
    before = runtime_dirs()

    # Refused with and without --accept-new: only unknown keys may be accepted.
    for extra in ([], ["--accept-new"]):
        r = run_tunnel(tunnel_bin, state_dir, "up", "-F", str(sshd.ssh_config), sshd.alias,
                       "--no-browser", "--env", str(jupyter_prefix), *extra)
        assert r.returncode == EXIT["host_key_changed"], r.stderr
        assert "HOST KEY CHANGED" in r.stderr
        assert new_fp in r.stderr and old_fp in r.stderr
        assert known_line in r.stderr  # the offending known_hosts line, shown
        assert f"{sshd.known_hosts}:1" in r.stderr
        assert r.stdout == ""

    # Nothing authenticated, nothing launched, known_hosts untouched.
    time.sleep(0.3)
    assert "Accepted publickey" not in sshd.log.read_text()
    assert sshd.session_pids() == []
    assert runtime_dirs() == before
    assert sshd.known_hosts.read_text().strip() == known_line


def test_unknown_host_is_refused_without_accept_new_and_recorded_with_it(
    tunnel, sshd, state_dir, tunnel_bin, jupyter_prefix, tmp_path
):
    sshd.write_known_hosts(known=False)
    # No StrictHostKeyChecking: ssh's default "ask"; with no terminal that is a refusal.
    config = tmp_path / "ssh_config"
    config.write_text(sshd.client_config(StrictHostKeyChecking=None))
    fp = fingerprint(f"{sshd.host_key}.pub")

    r = run_tunnel(tunnel_bin, state_dir, "up", "-F", str(config), sshd.alias, "--no-browser",
                   "--env", str(jupyter_prefix))
    assert r.returncode == EXIT["host_key_unknown"], r.stderr
    assert fp in r.stderr and "--accept-new" in r.stderr and "no terminal" in r.stderr
    assert sshd.known_hosts.read_text() == ""
    assert "Accepted publickey" not in sshd.log.read_text()

    t = tunnel("--app", "server", "--accept-new", config=config)
    url = t.wait_url()
    r = requests.get(f"http://127.0.0.1:{port_of(url)}/api/status",
                     headers={"Authorization": f"token {token_of(url)}"}, timeout=30)
    assert r.status_code == 200
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert "permanently added" in t.stderr
    assert sshd.known_hosts.read_text().split() == sshd.known_hosts_line().split()

    # The recorded key is honoured without --accept-new, also once hashed by ssh-keygen -H.
    subprocess.run(["ssh-keygen", "-H", "-f", str(sshd.known_hosts)], check=True,
                   capture_output=True)
    assert sshd.known_hosts.read_text().startswith("|1|")
    t = tunnel("--app", "server", config=config)
    t.wait_url()
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert "permanently added" not in t.stderr


def test_unknown_host_confirmed_at_the_terminal_prompt(sshd, state_dir, tunnel_bin, jupyter_prefix,
                                                       tmp_path):
    """With a terminal, an unknown key is shown with its fingerprint and accepted on "yes"."""
    import os
    import pty
    import select
    import signal

    from tunnel_harness import tunnel_env

    sshd.write_known_hosts(known=False)
    config = tmp_path / "ssh_config"
    config.write_text(sshd.client_config(StrictHostKeyChecking=None))
    fp = fingerprint(f"{sshd.host_key}.pub")

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(tunnel_bin), "up", "-F", str(config), sshd.alias, "--no-browser", "--app", "server",
         "--env", str(jupyter_prefix)],
        stdin=slave, stderr=slave, stdout=subprocess.PIPE, env=tunnel_env(state_dir),
        start_new_session=True,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"continue connecting" not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 4096)
        assert fp.encode() in seen
        os.write(master, b"yes\n")
        url = proc.stdout.readline().decode().strip()
        assert "token=" in url, seen.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        # Keep draining the terminal so tunnel never blocks writing to it.
        deadline = time.monotonic() + 40
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    os.read(master, 4096)
                except OSError:
                    break
        assert proc.wait(timeout=5) == EXIT["ok"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert sshd.known_hosts.read_text().split() == sshd.known_hosts_line().split()


def lab_config(sshd, match: str) -> str:
    """Issue #15's config: `Host lab-*`, then a Match that turns host-key checking off for
    lab-1 only; everything else (the real address, keys, known_hosts) in `Host *` below, so
    that the Match sees the name typed and its options are the first obtained for lab-1."""
    return (
        f"Host lab-*\n"
        f"    Port {sshd.port}\n"
        f"    User {sshd.user}\n"
        f"Match {match}\n"
        f"    StrictHostKeyChecking no\n"
        f"    UserKnownHostsFile /dev/null\n"
        f"Host *\n"
        f"    HostName {sshd.listen_host}\n"
        f"    IdentityFile {sshd.client_key}\n"
        f"    IdentitiesOnly yes\n"
        f"    IdentityAgent none\n"
        f"    UserKnownHostsFile {sshd.known_hosts}\n"
        f"    GlobalKnownHostsFile /dev/null\n"
        f"    StrictHostKeyChecking yes\n"
        f"    PasswordAuthentication no\n"
        f"    ConnectTimeout 10\n"
    )


def ssh_true(config, host):
    return subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", host, "true"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("match", ["host lab-1", "originalhost lab-1,!lab-2"])
def test_a_match_for_one_host_does_not_weaken_its_siblings(
    match, sshd, state_dir, tunnel_bin, jupyter_prefix, tunnel, tmp_path
):
    """With a changed host key, lab-2 is refused, by ssh and by tunnel alike: the Match that
    disables checking applies to lab-1 only (it used to be merged into `Host lab-*`)."""
    config = tmp_path / "ssh_config"
    config.write_text(lab_config(sshd, match))
    known_line = sshd.known_hosts_line()
    sshd.rotate_host_key()
    before = runtime_dirs()

    r = run_tunnel(tunnel_bin, state_dir, "config", "-F", str(config), "lab-2")
    assert r.returncode == 0, r.stderr
    assert "stricthostkeychecking true\n" in r.stdout
    assert f"userknownhostsfile {sshd.known_hosts}\n" in r.stdout

    r = run_tunnel(tunnel_bin, state_dir, "up", "-F", str(config), "lab-2", "--no-browser",
                   "--env", str(jupyter_prefix))
    assert r.returncode == EXIT["host_key_changed"], r.stderr
    assert "HOST KEY CHANGED" in r.stderr and known_line in r.stderr
    assert r.stdout == ""
    time.sleep(0.3)
    assert "Accepted publickey" not in sshd.log.read_text()
    assert runtime_dirs() == before
    assert sshd.known_hosts.read_text().strip() == known_line

    # OpenSSH itself: refuses lab-2 the same way, and lets lab-1 in.
    s = ssh_true(config, "lab-2")
    assert s.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in s.stderr, s.stderr
    s = ssh_true(config, "lab-1")
    assert s.returncode == 0, s.stderr

    # And so does tunnel: lab-1 (no checking, /dev/null as known_hosts) comes up.
    t = tunnel("--app", "server", config=config, host="lab-1")
    url = t.wait_url()
    r = requests.get(f"http://127.0.0.1:{port_of(url)}/api/status",
                     headers={"Authorization": f"token {token_of(url)}"}, timeout=30)
    assert r.status_code == 200
    assert t.interrupt_and_wait() == EXIT["ok"], t.stderr
    assert sshd.known_hosts.read_text().strip() == known_line
