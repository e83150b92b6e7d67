"""Every failure gets one clear message and its own documented exit code."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import threading
import time

import pytest

from tunnel_harness import EXIT, run_tunnel
from sshd import Sshd, free_port


@pytest.fixture
def up(sshd, state_dir, tunnel_bin, jupyter_prefix, tmp_path):
    """Run `tunnel up` to completion with a config for `sshd` (optionally altered)."""

    def run(*args, config_options=None, host=None, timeout=90):
        config = tmp_path / "ssh_config"
        config.write_text(sshd.client_config(**(config_options or {})))
        argv = ["up", "-F", str(config), host or sshd.alias, "--no-browser", "--app", "server"]
        if "--env" not in args:
            argv += ["--env", str(jupyter_prefix)]
        r = run_tunnel(tunnel_bin, state_dir, *argv, *args, timeout=timeout)
        assert r.stdout == "", "no URL may be printed on failure"
        # One message, prefixed, at the end of stderr.
        assert r.stderr.count("tunnel: error: ") == 1, r.stderr
        return r

    return run


def runtime_dirs() -> set[str]:
    return set(glob.glob("/tmp/tunnel-jupyter.*"))


def test_unknown_alias(up):
    r = up(host="no-such-alias.invalid")
    assert r.returncode == EXIT["unknown_alias"], r.stderr
    assert 'unknown host "no-such-alias.invalid"' in r.stderr


def test_dns_failure_of_a_configured_alias(up, sshd):
    r = up(config_options={"HostName": "does-not-exist.invalid"})
    assert r.returncode == EXIT["dns"], r.stderr
    assert f"cannot resolve does-not-exist.invalid (HostName of {sshd.alias})" in r.stderr


def test_connection_refused(up):
    port = free_port()
    r = up(config_options={"Port": str(port)})
    assert r.returncode == EXIT["refused"], r.stderr
    assert f"connection to 127.0.0.1 port {port} refused" in r.stderr


def test_timeout_when_the_server_never_answers(up):
    # Accepts TCP connections and says nothing: no SSH banner ever comes.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(5)
    held = []
    stop = threading.Event()

    def accept():
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        r = up(config_options={"Port": str(silent.getsockname()[1]), "ConnectTimeout": "2"})
    finally:
        stop.set()
        thread.join()
        for c in held:
            c.close()
        silent.close()
    assert r.returncode == EXIT["timeout"], r.stderr
    assert "timed out after 2s waiting for the SSH handshake" in r.stderr


def test_authentication_failure_lists_what_was_tried(up, sshd):
    r = up(config_options={"IdentityFile": str(sshd.other_key)})
    assert r.returncode == EXIT["auth"], r.stderr
    assert f"permission denied for {sshd.user}@127.0.0.1" in r.stderr
    assert f"key {sshd.other_key}" in r.stderr
    assert "password (not asked: no terminal)" not in r.stderr  # PasswordAuthentication no
    assert "the server accepts: publickey" in r.stderr


def test_jupyter_missing(up, tmp_path):
    before = runtime_dirs()
    env = tmp_path / "bare-venv"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(env)], check=True)
    r = up("--env", str(env))
    assert r.returncode == EXIT["jupyter_missing"], r.stderr
    assert "jupyter not found on the remote PATH" in r.stderr
    assert f"{env}/bin" in r.stderr
    assert runtime_dirs() == before  # cleaned up on the remote


def test_jupyter_failing_to_start_shows_its_log(up, tmp_path):
    before = runtime_dirs()
    bad = tmp_path / "bad-jupyter-config"
    bad.mkdir()
    (bad / "jupyter_server_config.json").write_text(
        '{"ServerApp": {"root_dir": "/nonexistent-tunnel-test"}}'
    )
    r = up("--init", f"export JUPYTER_CONFIG_DIR={bad}")
    assert r.returncode == EXIT["jupyter_failed"], r.stderr
    assert "jupyter server exited with status 1 before it was ready" in r.stderr
    assert "last lines of the log" in r.stderr
    assert "No such directory" in r.stderr and "/nonexistent-tunnel-test" in r.stderr
    assert runtime_dirs() == before


def test_a_remote_shell_that_never_runs_the_launcher_is_named_when_up_times_out(
        tmp_path, state_dir, tunnel_bin, jupyter_prefix):
    """A login whose shell hangs before running anything (a ~/.bashrc waiting on a stale
    lock, as `pyenv rehash` does for 60s): sshd here runs `sleep` instead of the command."""
    with Sshd(tmp_path / "sshd-hung", extra_sshd_config="ForceCommand exec sleep 600") as server:
        r = run_tunnel(tunnel_bin, state_dir, "up", "-F", str(server.ssh_config), server.alias,
                       "--no-browser", "--app", "server", "--env", str(jupyter_prefix),
                       "--timeout", "3")
    assert r.returncode == EXIT["timeout"], r.stderr
    assert "timed out after 3s waiting for Jupyter on the remote to start" in r.stderr
    assert "the remote shell never ran tunnel's launcher" in r.stderr
    assert "~/.bashrc" in r.stderr and "tunnel doctor" in r.stderr
    assert r.stdout == ""


def processes_with(needle: str) -> int:
    n = 0
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                if needle in f.read().replace(b"\0", b" ").decode(errors="replace"):
                    n += 1
        except OSError:
            pass
    return n


def test_a_hung_init_is_stopped_and_named_by_the_remote(up):
    """--init runs where no stop request reaches it: the remote bounds it by --timeout,
    stops it and what it started, names it, and leaves nothing behind."""
    before = runtime_dirs()
    marker = f"sleep {400000 + os.getpid()}.25"  # this test's processes only
    r = up("--init", f"echo waiting for a licence; {marker} & {marker}", "--timeout", "3")
    assert r.returncode == EXIT["timeout"], r.stderr
    assert ("the --init command was still running when --timeout (3s, counted from the login)"
            " ran out, so the launch was stopped") in r.stderr
    assert "run it by hand in an ssh session" in r.stderr
    assert "waiting for a licence" in r.stderr  # init.log's tail
    time.sleep(0.5)
    assert processes_with(marker) == 0
    assert runtime_dirs() == before


def test_a_hung_env_activation_is_stopped_and_named_by_the_remote(up, tmp_path):
    """--env by name through a conda that never answers (as on a stalled shared file
    system): bounded by --timeout like --init, stopped, named, nothing left."""
    before = runtime_dirs()
    bin_dir = tmp_path / "stalled-conda"
    bin_dir.mkdir()
    marker = f"sleep {400000 + os.getpid()}.5"
    conda = bin_dir / "conda"
    conda.write_text(f"#!/bin/sh\n{marker}\n")
    conda.chmod(0o755)
    r = up("--init", f"PATH={bin_dir}:$PATH; export PATH", "--env", "myenv",
           "--timeout", "3")
    assert r.returncode == EXIT["timeout"], r.stderr
    assert "activating --env myenv was still running when --timeout (3s" in r.stderr
    time.sleep(0.5)
    assert processes_with(marker) == 0
    assert runtime_dirs() == before


def test_a_jupyter_that_hangs_at_start_is_named_by_the_remote(up, tmp_path):
    """Jupyter's own start is bounded on the remote, which names it."""
    slow = tmp_path / "slow-jupyter-config"
    slow.mkdir()
    (slow / "jupyter_server_config.py").write_text("import time\ntime.sleep(30)\n")
    r = up("--init", f"export JUPYTER_CONFIG_DIR={slow}", "--timeout", "5")
    assert r.returncode == EXIT["timeout"], r.stderr
    assert "jupyter server did not write its server info within 5s" in r.stderr


def test_local_port_busy_fails_before_anything_remote(up, sshd):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        r = up("--port", str(port))
    finally:
        busy.close()
    assert r.returncode == EXIT["port_busy"], r.stderr
    assert f"local port {port} is busy" in r.stderr
    assert "Accepted publickey" not in sshd.log.read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env", "/nonexistent/tunnel-env"], "--env /nonexistent/tunnel-env: no such directory"),
        (["--dir", "/nonexistent/tunnel-dir"], "--dir /nonexistent/tunnel-dir: no such directory"),
        (["--init", "exit_with_3() { return 3; }; exit_with_3"],
         "the --init command failed with status 3"),
    ],
)
def test_remote_setup_failures(up, args, message):
    before = runtime_dirs()
    r = up(*args)
    assert r.returncode == EXIT["remote_setup"], r.stderr
    assert message in r.stderr
    assert runtime_dirs() == before


def test_proxy_command_and_a_malformed_jump_are_clear_config_errors(up):
    r = up(config_options={"ProxyCommand": "nc %h %p"})
    assert r.returncode == EXIT["config"], r.stderr
    assert "ProxyCommand nc %h %p" in r.stderr and "not support" in r.stderr
    # (`:ssh` would be fine: ssh, and tunnel, take a service name as a port.)
    r = up(config_options={"ProxyJump": "bastion.example:nosuchservice"})
    assert r.returncode == EXIT["config"], r.stderr
    assert "ProxyJump" in r.stderr and "bastion.example:nosuchservice" in r.stderr


def test_help_documents_every_exit_code(tunnel_bin, state_dir):
    r = run_tunnel(tunnel_bin, state_dir, "up", "--help")
    assert r.returncode == 0
    for code in EXIT.values():
        assert f"\n{code:>5}  " in r.stdout, code


@pytest.mark.parametrize("opt,value,message", [
    ("--timeout", "18446744073709551615", "18446744073709551615 is not in 1..=86400"),
    ("--timeout", "86401", "86401 is not in 1..=86400"),
    ("--timeout", "0", "0 is not in 1..=86400"),
    ("--linger", "18446744073709551615", "18446744073709551615 is not in 0..=604800"),
    ("--linger", "99999999999999999999", "number too large"),
    ("--linger", "-5", "unexpected argument"),
    ("--port", "70000", "70000 is not in 0..=65535"),
])
def test_out_of_range_numbers_are_argument_errors(tunnel_bin, state_dir, opt, value, message):
    """Issue #15: a huge --timeout used to overflow the deadline arithmetic (a panic); it
    is now refused by the argument parser, before anything is read or connected."""
    r = run_tunnel(tunnel_bin, state_dir, "up", "some-host", opt, value, "--no-browser")
    assert r.returncode == 2, r.stderr
    assert f"invalid value '{value}' for '{opt}" in r.stderr or message in r.stderr, r.stderr
    assert message in r.stderr, r.stderr
    assert "panicked" not in r.stderr
    assert not state_dir.exists() or not any(state_dir.iterdir())


def test_the_largest_accepted_values_do_not_panic(up):
    """The bounds themselves are safe: at the top of both ranges tunnel runs normally (and
    fails here only for the bogus --env, after connecting)."""
    r = up("--timeout", "86400", "--linger", "604800", "--env", "/nonexistent/tunnel-env")
    assert r.returncode == EXIT["remote_setup"], r.stderr
    assert "panicked" not in r.stderr
