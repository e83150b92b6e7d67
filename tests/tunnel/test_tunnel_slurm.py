"""`tunnel up LOGIN --slurm ...`: a real one-node SLURM cluster (Debian's munged,
slurmctld and slurmd, tests/support/slurm.py) behind a test sshd playing the
login node, and a second sshd playing the compute node's ssh (the node is this
machine). Jupyter runs as a step of the job; the forward goes through the
login node to the node."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import requests
import websocket

from slurm import SlurmCluster, available
from sshd import Sshd
from test_tunnel_up import execute, start_kernel
from tunnel_harness import (
    EXIT, Tunnel, alive, established_to, cmdlines_containing, files_containing, is_loopback,
    listening_sockets, port_of, processes_of_runtime_dir, run_tunnel, token_of, wait_until,
)

missing = available()
pytestmark = pytest.mark.skipif(missing is not None, reason=f"SLURM test cluster: {missing}")

EXIT_SLURM = 18
EXIT_INTERRUPTED = 130


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the module (starting it takes a few seconds); every test
    leaves its queue empty, and a failed one has its jobs cancelled."""
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture
def login(tmp_path, cluster):
    """The login node: its sessions find the cluster through SLURM_CONF, as a
    real login node's find /etc/slurm/slurm.conf."""
    with Sshd(tmp_path / "login", alias="login",
              extra_sshd_config=f"SetEnv SLURM_CONF={cluster.conf}") as s:
        yield s


@pytest.fixture
def node_sshd(tmp_path, cluster):
    """The compute node's sshd, reached by name (gpunode1) through the login node."""
    with Sshd(tmp_path / "node", alias=cluster.node) as s:
        yield s


@pytest.fixture
def ssh_config(tmp_path, login, node_sshd) -> Path:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(login.client_config() + node_sshd.client_config())
    return cfg


@pytest.fixture
def up(tunnel_bin, login, ssh_config, state_dir, jupyter_prefix, cluster):
    """Factory for `tunnel up login --slurm ARGS ...`; killed on teardown, and
    whatever jobs are left are cancelled (and fail the test)."""
    started: list[Tunnel] = []

    def make(sbatch: str, *args: str) -> Tunnel:
        t = Tunnel(tunnel_bin, login, state_dir, jupyter_prefix, ["--slurm", sbatch, *args],
                   config=ssh_config, host="login")
        started.append(t)
        return t

    yield make
    for t in started:
        t.kill()
    left = cluster.jobs()
    if left:
        cluster.run("scancel", "--partition=debug", check=False)
        cluster.wait_no_jobs(20)
        pytest.fail(f"jobs left in squeue: {left}")


def status_json(tunnel_bin, state_dir, host="login"):
    r = run_tunnel(tunnel_bin, state_dir, "status", "--json", host)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def job_of(t: Tunnel) -> str:
    for line in t.stderr_lines:
        if "submitted" in line and "job " in line:
            return line.split("job ", 1)[1].split()[0]
    raise AssertionError(f"no job id in:\n{t.stderr}")


def test_jupyter_runs_in_the_job_through_the_login_node_and_ctrl_c_cancels_it(
    up, cluster, login, node_sshd, tunnel_bin, state_dir
):
    started = time.monotonic()
    t = up("--gres=gpu:1 --time=10", "--app", "server")
    url = t.wait_url(120)
    token, port = token_of(url), port_of(url)
    job = job_of(t)
    auth = {"Authorization": f"token {token}"}

    # Through the forward: /api/status answers, and a kernel runs code in the
    # job's allocation (its GPU as CUDA_VISIBLE_DEVICES, with nothing configured).
    r = requests.get(f"http://127.0.0.1:{port}/api/status", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    kid = start_kernel(f"http://127.0.0.1:{port}", token)
    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels",
                                     header=[f"Authorization: token {token}"], timeout=60)
    try:
        out, reply = execute(ws, "import os; print(6 * 7, os.environ.get('SLURM_JOB_ID'), "
                                 "os.environ.get('CUDA_VISIBLE_DEVICES'), os.getpid())")
    finally:
        ws.close()
    assert reply["status"] == "ok", reply
    answer, job_env, cuda, kernel_pid = out.split()
    assert (answer, job_env, cuda) == ("42", job, "0")

    # squeue: the job runs on the node while the tunnel is up.
    jobs = cluster.jobs()
    assert [(j["id"], j["state"], j["nodes"]) for j in jobs] == [(job, "RUNNING", cluster.node)]
    assert f"job {job} RUNNING on {cluster.node}" in t.stderr

    # status: job id, node, state and time left.
    st = status_json(tunnel_bin, state_dir)
    assert st["slurm"]["job_id"] == job and st["slurm"]["state"] == "RUNNING"
    assert st["slurm"]["node"] == cluster.node
    assert 0 < st["slurm_time_left_secs"] <= 600
    text = run_tunnel(tunnel_bin, state_dir, "status", "login").stdout
    assert f"slurm:   job {job} RUNNING on {cluster.node}, time left " in text, text

    # Jupyter and its kernel are processes of the job (below its slurmstepd),
    # not of an ssh session, and they listen on loopback only.
    rt, jupyter_pid = st["remote_runtime_dir"], st["remote_pid"]
    job_pids = cluster.job_pids()
    assert jupyter_pid in job_pids and int(kernel_pid) in job_pids
    assert not set(job_pids) & set(login.session_pids() + node_sshd.session_pids())
    for pid in job_pids:
        assert all(is_loopback(a) for a, _ in listening_sockets(pid)), (pid, listening_sockets(pid))
    assert any(p == st["remote_port"] for _, p in listening_sockets(jupyter_pid))
    # The forward's way in: the node's sshd (reached through the login node's)
    # holds the connection to Jupyter's port.
    assert established_to(st["remote_port"], node_sshd.session_pids())
    assert "Accepted publickey" in node_sshd.log.read_text()

    # The token: in no job record, job script, command line or log; only in
    # private files (Jupyter's own 0600 info file on the node).
    job_record = cluster.run("scontrol", "show", "job", "-dd", job).stdout
    assert f"JobId={job}" in job_record and token not in job_record
    script = cluster.run("scontrol", "write", "batch_script", job, "-").stdout
    assert script.startswith("#!/bin/sh") and token not in script
    steps = cluster.run("scontrol", "show", "step", "-dd", job).stdout
    assert f"StepId={job}.0" in steps and token not in steps
    assert cmdlines_containing(token) == []
    logs = [login.log, node_sshd.log, Path(rt) / "jupyter.log", *cluster.log_files()]
    assert cluster.ctld_log in logs and cluster.slurmd_log in logs
    for log in logs:
        assert token not in log.read_text(errors="replace"), log
    assert token not in t.stderr
    hits = files_containing(token, ["/tmp", state_dir, cluster.dir])
    assert any(p.name.startswith("jpserver-") for p, _ in hits), hits
    assert all(mode & 0o077 == 0 for _, mode in hits), hits
    # Nothing SLURM keeps (saved job state with its environment, slurmd's
    # spool, logs) has it.
    assert not [p for p, _ in hits if cluster.dir in p.parents], hits

    # Ctrl-C: Jupyter stopped, the job cancelled and gone from squeue, nothing
    # of it left on the node.
    assert t.interrupt_and_wait(60) == EXIT["ok"], t.stderr
    assert f"cancelled job {job}" in t.stderr
    assert cluster.jobs() == []
    assert cluster.job_pids() == []
    assert not alive(jupyter_pid) and not alive(int(kernel_pid))
    assert processes_of_runtime_dir(rt) == [] and not Path(rt).exists()
    # The job's completion record holds no token either.
    assert wait_until(lambda: job in cluster.jobcomp_log.read_text(), 10)
    assert token not in cluster.jobcomp_log.read_text()
    print(f"up, kernel, checks and Ctrl-C took {time.monotonic() - started:.1f}s")


def test_tunnel_down_cancels_the_job(up, cluster, tunnel_bin, state_dir):
    t = up("--time=5", "--app", "server")
    t.wait_url(120)
    job = job_of(t)
    assert [j["id"] for j in cluster.jobs()] == [job]
    jupyter_pid = status_json(tunnel_bin, state_dir)["remote_pid"]
    # `down` signals the tunnel (SIGTERM), which stops Jupyter and cancels the job.
    r = run_tunnel(tunnel_bin, state_dir, "down", "login")
    assert r.returncode == EXIT["ok"], r.stderr
    # `down` returns once the process has exited (its exit status may take a
    # moment longer to be collectable).
    assert t.wait(10) == EXIT["ok"], t.stderr
    assert "SIGTERM" in t.stderr and f"cancelled job {job}" in t.stderr
    assert cluster.jobs() == [] and cluster.job_pids() == []
    assert not alive(jupyter_pid)


def test_a_pending_job_shows_its_reason_and_ctrl_c_cancels_it(up, cluster, tunnel_bin, state_dir):
    # Another job takes the whole node, so ours must wait for resources.
    blocker = cluster.sbatch("--exclusive", "--job-name=blocker")
    assert wait_until(lambda: any(j["id"] == blocker and j["state"] == "RUNNING"
                                  for j in cluster.jobs()), 30)
    try:
        t = up("--time=5")
        assert wait_until(lambda: "PENDING (Resources)" in t.stderr, 60), t.stderr
        job = job_of(t)
        assert {j["id"]: (j["state"], j["reason"]) for j in cluster.jobs()}[job] == \
            ("PENDING", "Resources")
        assert f"job {job} PENDING (Resources)" in run_tunnel(
            tunnel_bin, state_dir, "status", "login").stdout
        assert t.stdout_lines == []  # no URL: nothing runs yet

        t.signal(signal.SIGINT)
        assert t.wait(60) == EXIT_INTERRUPTED, t.stderr
        assert f"cancelled job {job}" in t.stderr
        # Our job is gone; the other one was not touched.
        assert [j["id"] for j in cluster.jobs()] == [blocker]
    finally:
        cluster.run("scancel", blocker, check=False)
        assert cluster.wait_no_jobs(30)


def test_bad_slurm_arguments_give_sbatchs_own_message(
    tunnel_bin, ssh_config, state_dir, jupyter_prefix, cluster
):
    def up_with(sbatch: str):
        return run_tunnel(tunnel_bin, state_dir, "up", "-F", str(ssh_config), "login",
                          "--no-browser", "--env", str(jupyter_prefix), "--slurm", sbatch)

    r = up_with("--no-such-option")
    assert r.returncode == EXIT_SLURM, r.stderr
    assert "sbatch: unrecognized option '--no-such-option'" in r.stderr, r.stderr
    r = up_with("-p nosuchpartition --time=5")
    assert r.returncode == EXIT_SLURM, r.stderr
    assert "invalid partition specified: nosuchpartition" in r.stderr, r.stderr
    assert "correct them" in r.stderr
    # Unbalanced quotes are caught before anything is sent.
    r = up_with("-J 'unfinished")
    assert r.returncode == 2 and "unbalanced quotes" in r.stderr, r.stderr
    assert cluster.jobs() == []


def test_where_ssh_to_the_node_is_closed_connections_go_through_relay_steps(
    up, cluster, node_sshd, tunnel_bin, state_dir
):
    node_sshd.stop()  # this cluster refuses ssh to its nodes
    t = up("--time=5", "--app", "server")
    url = t.wait_url(120)
    token, port = token_of(url), port_of(url)
    job = job_of(t)
    assert f"cannot ssh to {cluster.node} through login" in t.stderr, t.stderr
    assert "relaying through a job step" in t.stderr
    # HTTP and a kernel's websocket, through the job's relay step.
    r = requests.get(f"http://127.0.0.1:{port}/api/status",
                     headers={"Authorization": f"token {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    kid = start_kernel(f"http://127.0.0.1:{port}", token)
    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels",
                                     header=[f"Authorization: token {token}"], timeout=60)
    try:
        out, reply = execute(ws, "print('x' * 100000, 6 * 7)")
        steps = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%j").stdout.split()
    finally:
        ws.close()
    assert reply["status"] == "ok" and out.split() == ["x" * 100000, "42"], reply
    assert "jupyter-relay" in steps, steps
    st = status_json(tunnel_bin, state_dir)
    assert st["remote_pid"] in cluster.job_pids()
    assert cmdlines_containing(token) == []

    assert t.interrupt_and_wait(60) == EXIT["ok"], t.stderr
    assert f"cancelled job {job}" in t.stderr
    assert cluster.jobs() == [] and cluster.job_pids() == []
    assert not alive(st["remote_pid"])


def test_a_killed_client_leaves_no_job_behind(up, cluster, tunnel_bin, state_dir):
    t = up("--time=5", "--app", "server")
    t.wait_url(120)
    job = job_of(t)
    st = status_json(tunnel_bin, state_dir)
    jupyter_pid, rt = st["remote_pid"], st["remote_runtime_dir"]
    # No goodbye, no scancel: the login connection just closes. srun's stdin
    # ends, the launcher stops Jupyter, and the batch script ends the job.
    t.signal(signal.SIGKILL)
    t.wait()
    assert cluster.wait_no_jobs(30), cluster.jobs()
    assert cluster.job_pids() == [] and not alive(jupyter_pid)
    assert wait_until(lambda: not Path(rt).exists(), 10), os.listdir(rt)
    assert f"JobId={job} " in cluster.jobcomp_log.read_text()


def test_a_job_ended_from_outside_ends_the_tunnel_with_its_state(up, cluster, tunnel_bin,
                                                                  state_dir):
    t = up("--time=5", "--app", "server")
    t.wait_url(120)
    job = job_of(t)
    st = status_json(tunnel_bin, state_dir)
    jupyter_pid, rt = st["remote_pid"], st["remote_runtime_dir"]
    # What a time limit or an admin's scancel does to the job under the tunnel.
    cluster.run("scancel", job)
    assert t.wait(60) == EXIT_SLURM, t.stderr
    assert f"job {job} ended while Jupyter ran in it" in t.stderr, t.stderr
    assert cluster.wait_no_jobs(20) and cluster.job_pids() == []
    # SIGTERM from slurm; the job may leave squeue while Jupyter is exiting.
    assert wait_until(lambda: not alive(jupyter_pid), 10)
    # Killed before it could clean up, the launcher left its runtime
    # directory to the batch script, which removed it.
    assert wait_until(lambda: not Path(rt).exists(), 10), os.listdir(rt)


def test_one_relay_step_carries_every_connection(
    up, cluster, node_sshd, tunnel_bin, state_dir
):
    """Where ssh to the node is closed, all connections share one relay job step (one
    exec channel), multiplexed: many at once, idle ones held open, each answered."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    node_sshd.stop()  # relays only
    t = up("--time=5", "--app", "server")
    url = t.wait_url(120)
    token, port = token_of(url), port_of(url)
    job = job_of(t)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"token {token}"}

    def relay_steps():
        out = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%j").stdout.split()
        return out.count("jupyter-relay")

    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
    try:
        def get(i):
            # A fresh connection each (no keep-alive), half-closed by the server's answer.
            r = requests.get(f"{base}/api/status", headers={**auth, "Connection": "close"},
                             timeout=60)
            return r.status_code
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(get, range(24)))
        assert codes == [200] * 24, codes
        kid = start_kernel(base, token)
        ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels",
                                         header=[f"Authorization: token {token}"], timeout=60)
        try:
            out, reply = execute(ws, "print('y' * 300000)")
        finally:
            ws.close()
        assert reply["status"] == "ok" and out.strip() == "y" * 300000
        assert relay_steps() == 1
    finally:
        for h in held:
            h.close()
    assert "relay step ended" not in t.stderr, t.stderr
    assert t.interrupt_and_wait(60) == EXIT["ok"], t.stderr
    assert cluster.jobs() == []
