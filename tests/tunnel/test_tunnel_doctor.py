"""`tunnel doctor`: one line per step against a real sshd, and the failing step
named (with `up`'s exit code) for the usual mistakes."""

from __future__ import annotations

import getpass
import glob
import subprocess

import pytest

from tunnel_harness import EXIT, run_tunnel


def runtime_dirs() -> set[str]:
    return set(glob.glob("/tmp/tunnel-jupyter.*"))


@pytest.fixture
def doctor(sshd, state_dir, tunnel_bin, tmp_path):
    """Run `tunnel doctor` with a config for `sshd` (optionally altered)."""

    def run(*args, config_options=None):
        config = tmp_path / "ssh_config"
        config.write_text(sshd.client_config(**(config_options or {})))
        r = run_tunnel(tunnel_bin, state_dir, "doctor", "-F", str(config), sshd.alias, *args,
                       timeout=120)
        return r

    return run


def steps(stdout: str) -> list[tuple[str, str]]:
    """(status, step) for each report line, in order."""
    out = []
    for line in stdout.splitlines():
        status = line[:6].strip()
        if status in ("ok", "FAIL", "warn"):
            out.append((status, line[6:19].strip()))
    return out


def failed_step(r) -> str:
    fails = [step for status, step in steps(r.stdout) if status == "FAIL"]
    assert len(fails) == 1, r.stdout + r.stderr
    assert "what to do:" in r.stdout
    assert f"the {fails[0]} step failed" in r.stderr
    return fails[0]


def test_all_steps_pass_with_the_jupyter_venv(doctor, jupyter_prefix):
    before = runtime_dirs()
    r = doctor("--env", str(jupyter_prefix), "--init", "true")
    assert r.returncode == EXIT["ok"], r.stdout + r.stderr
    assert steps(r.stdout) == [("ok", s) for s in (
        "config", "connect", "host key", "auth", "remote shell", "init", "env", "jupyter", "gpu")]
    assert f"venv {jupyter_prefix}" in r.stdout
    assert f"{jupyter_prefix}/bin/jupyter jupyter_server 2." in r.stdout
    # Absent or present, the GPU line says which.
    assert "no nvidia-smi" in r.stdout or "GPU" in r.stdout
    assert runtime_dirs() == before  # starts nothing, leaves nothing


def test_wrong_user_fails_at_auth(doctor, sshd):
    user = "nobody" if getpass.getuser() != "nobody" else "root"
    r = doctor(config_options={"User": user})
    assert r.returncode == EXIT["auth"], r.stdout + r.stderr
    assert failed_step(r) == "auth"
    assert f"permission denied for {user}@127.0.0.1" in r.stdout
    assert ("ok", "host key") in steps(r.stdout)


def test_unknown_host_key_fails_at_host_key(doctor, sshd):
    sshd.write_known_hosts(known=False)
    r = doctor()
    assert r.returncode == EXIT["host_key_unknown"], r.stdout + r.stderr
    assert failed_step(r) == "host key"
    assert ("ok", "connect") in steps(r.stdout)
    assert "--accept-new" in r.stdout
    assert sshd.known_hosts.read_text() == ""  # a check records nothing


def test_no_jupyter_on_the_remote(doctor, tmp_path):
    before = runtime_dirs()
    env = tmp_path / "bare-venv"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(env)], check=True)
    r = doctor("--env", str(env))
    assert r.returncode == EXIT["jupyter_missing"], r.stdout + r.stderr
    assert failed_step(r) == "jupyter"
    assert ("ok", "env") in steps(r.stdout)
    assert "jupyter not found on the remote PATH" in r.stdout
    assert runtime_dirs() == before


def test_no_jupyter_on_the_login_path(doctor):
    # No --env, and a PATH without jupyter (set by --init, as a module would).
    r = doctor("--init", "PATH=/usr/bin:/bin; export PATH")
    assert r.returncode == EXIT["jupyter_missing"], r.stdout + r.stderr
    assert failed_step(r) == "jupyter"
    assert ("ok", "init") in steps(r.stdout)


@pytest.mark.parametrize("env", ["no-such-env-name", "/nonexistent/tunnel-env"])
def test_broken_env_name(doctor, env):
    before = runtime_dirs()
    r = doctor("--env", env)
    assert r.returncode == EXIT["remote_setup"], r.stdout + r.stderr
    assert failed_step(r) == "env"
    assert f"--env {env}" in r.stdout
    assert runtime_dirs() == before


def test_failing_init_is_named(doctor, jupyter_prefix):
    r = doctor("--env", str(jupyter_prefix), "--init", "false")
    assert r.returncode == EXIT["remote_setup"], r.stdout + r.stderr
    assert failed_step(r) == "init"


def test_unknown_alias_fails_at_connect(tunnel_bin, state_dir, tmp_path):
    config = tmp_path / "empty_config"
    config.write_text("")
    r = run_tunnel(tunnel_bin, state_dir, "doctor", "-F", str(config), "no-such-host.invalid")
    assert r.returncode == EXIT["unknown_alias"], r.stdout + r.stderr
    assert steps(r.stdout)[0] == ("ok", "config")
    assert failed_step(r) == "connect"


def test_each_jump_host_is_a_step_and_a_changed_middle_key_is_named(
        sshd, state_dir, tunnel_bin, jupyter_prefix, tmp_path):
    from sshd import Sshd

    servers = [Sshd(tmp_path / f"jump{i}", alias=f"jump{i}") for i in (1, 2)]
    try:
        for s in servers:
            s.start()
        j1, j2 = servers
        cfg = tmp_path / "route_config"
        cfg.write_text(j1.client_config() + j2.client_config() + sshd.client_config())
        argv = ["doctor", "-F", str(cfg), "-J", "jump1,jump2", sshd.alias,
                "--env", str(jupyter_prefix)]
        r = run_tunnel(tunnel_bin, state_dir, *argv, timeout=120)
        assert r.returncode == EXIT["ok"], r.stdout + r.stderr
        hops = [l for l in r.stdout.splitlines() if l.startswith("ok    auth")]
        assert [h.split()[2:5] for h in hops] == [
            ["jump", "host", "1"], ["jump", "host", "2"], ["target", sshd.alias, f"({sshd.user}@127.0.0.1"]]

        j2.rotate_host_key()
        r = run_tunnel(tunnel_bin, state_dir, *argv, timeout=120)
        assert r.returncode == EXIT["host_key_changed"], r.stdout + r.stderr
        assert failed_step(r) == "host key"
        fail = next(l for l in r.stdout.splitlines() if l.startswith("FAIL"))
        assert "jump host 2 jump2" in fail and "HOST KEY CHANGED" in fail
        assert "--accept-new" not in r.stdout  # it would not help with a changed key
    finally:
        for s in servers:
            s.cleanup()
