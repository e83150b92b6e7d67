"""A throwaway one-node SLURM cluster on 127.0.0.1, for tests and demos.

Debian's munged, slurmctld and slurmd, each started with everything in its own
temporary directory: a fresh munge key and socket, a slurm.conf on free ports,
state, spool, pid and log files. The node (default ``gpunode1``) is this
machine, with one fake GPU (``Gres=gpu:1`` backed by /dev/null) so jobs that
ask for ``--gres=gpu:1`` (or any job step on that node) see ``CUDA_VISIBLE_DEVICES`` as on a real cluster.
Nothing touches /etc/slurm or /etc/munge: clients find the cluster through
``SLURM_CONF`` (see :meth:`SlurmCluster.client_env`).

From Python::

    from slurm import SlurmCluster        # with tests/support on sys.path
    with SlurmCluster() as cluster:
        subprocess.run(["sinfo"], env=cluster.client_env())

From a shell (the daemons keep running until `stop`)::

    conf=$(python3 tests/support/slurm.py start --dir /tmp/demo-slurm)
    SLURM_CONF=$conf sinfo
    python3 tests/support/slurm.py stop --dir /tmp/demo-slurm

No cgroups (containers rarely delegate them): proctrack/linuxproc follows a
job's processes by parentage, task/none binds nothing. The daemons and jobs
run as the invoking user (root in CI). Stopping cancels every job, then kills
the daemons, every slurmstepd they left (found by their open files in the
work directory) and everything below them, so a failed test leaves no job
process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sshd import descendants, free_port, kill_tree  # noqa: E402

MUNGED = shutil.which("munged") or "/usr/sbin/munged"
MUNGEKEY = shutil.which("mungekey") or "/usr/sbin/mungekey"
SLURMCTLD = shutil.which("slurmctld") or "/usr/sbin/slurmctld"
SLURMD = shutil.which("slurmd") or "/usr/sbin/slurmd"


def available() -> str | None:
    """None when the SLURM and munge daemons are installed, else what is missing."""
    missing = [p for p in (MUNGED, MUNGEKEY, SLURMCTLD, SLURMD) if not Path(p).exists()]
    for tool in ("sbatch", "srun", "squeue", "scancel", "scontrol"):
        if not shutil.which(tool):
            missing.append(tool)
    if missing:
        return "missing " + ", ".join(missing) + " (apt-get install slurm-wlm munge)"
    return None


class SlurmCluster:
    """munged + slurmctld + one slurmd (node `node`, on this machine) in `workdir`."""

    def __init__(self, workdir: str | os.PathLike | None = None, node: str = "gpunode1",
                 cpus: int = 2, gpus: bool = True, cluster: str = "tunneltest"):
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="tunnel-slurm."))
        self.dir.mkdir(parents=True, exist_ok=True)
        # munged refuses a socket or key in a directory others may write to.
        os.chmod(self.dir, 0o700)
        self.node = node
        self.cpus = cpus
        self.gpus = gpus
        self.cluster = cluster
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.socket"
        self.munge_key = self.dir / "munge.key"
        self.ctld_log = self.dir / "slurmctld.log"
        self.slurmd_log = self.dir / "slurmd.log"
        # munged --foreground logs to stderr (munged.out), not to its log file.
        self.munged_log = self.dir / "munged.out"
        self.jobcomp_log = self.dir / "jobcomp.log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------

    def start(self, detach: bool = False) -> "SlurmCluster":
        for d in ("state", "spool", f"spool/{self.node}"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        if not self.munge_key.exists():
            subprocess.run([MUNGEKEY, "--create", f"--keyfile={self.munge_key}"], check=True)
        os.chmod(self.munge_key, 0o400)
        # --force: munged wants every directory above its socket open to all
        # users (pytest's are 0700); here every client is this same user.
        self._spawn("munged", [
            MUNGED, "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={self.munge_key}", f"--pid-file={self.dir}/munged.pid",
            f"--log-file={self.munged_log}", f"--seed-file={self.dir}/munged.seed",
        ], detach)
        self._wait(lambda: self.munge_socket.exists(), "munged", self.dir / "munged.out")
        for attempt in range(5):
            self.ctld_port, self.slurmd_port = free_port(), free_port()
            if self.ctld_port != self.slurmd_port:
                break
        self._write_conf()
        self._spawn("slurmctld", [SLURMCTLD, "-D", "-f", str(self.conf)], detach)
        self._wait(self._ctld_answers, "slurmctld", self.ctld_log)
        self._spawn("slurmd", [SLURMD, "-D", "-N", self.node, "-f", str(self.conf)], detach)
        self._wait(lambda: self.node_state().startswith("IDLE"), "slurmd", self.slurmd_log,
                   timeout=30)
        self._save_state()
        return self

    def _write_conf(self) -> None:
        d = self.dir
        gres = " Gres=gpu:1" if self.gpus else ""
        self.conf.write_text(f"""# A one-node test cluster written by tests/support/slurm.py.
ClusterName={self.cluster}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser={_user()}
SlurmdUser={_user()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={self.ctld_log}
SlurmdLogFile={self.slurmd_log}
# Chatty logs: tests search them for secrets that must not be there.
SlurmctldDebug=debug
SlurmdDebug=debug
# No cgroups: follow a job's processes by parentage, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp_log}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
# Quick teardown: SIGKILL 2 s after SIGTERM, completed jobs leave squeue at once.
KillWait=2
MinJobAge=2
InactiveLimit=0
# Declared CPUs and memory, whatever this machine has.
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs={self.cpus} RealMemory=1000{gres} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES DefaultTime=01:00:00 MaxTime=04:00:00 State=UP
""")
        # One fake GPU: slurmd hands its index to jobs as CUDA_VISIBLE_DEVICES.
        (d / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File=/dev/null\n" if self.gpus else ""
        )

    def _spawn(self, name: str, argv: list[str], detach: bool) -> None:
        out = open(self.dir / f"{name}.out", "ab")
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env=env, cwd=self.dir, start_new_session=detach)
        out.close()
        self.procs[name] = proc
        self.pids[name] = proc.pid

    def _wait(self, ready, name: str, log: Path, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                break
            if ready():
                return
            time.sleep(0.1)
        text = ""
        for f in (log, self.dir / f"{name}.out"):
            if f.exists():
                text += f"--- {f}\n" + f.read_text()[-3000:]
        self.stop()
        raise RuntimeError(f"{name} did not start:\n{text}")

    def _ctld_answers(self) -> bool:
        r = self.run("scontrol", "ping", check=False)
        return r.returncode == 0 and "UP" in r.stdout

    def stop(self) -> None:
        """Cancel every job, then kill the daemons and whatever they left."""
        if self.pids.get("slurmctld") and self._ctld_answers():
            self.run("scancel", "--partition=debug", check=False)
            self.wait_no_jobs(10)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid:
                kill_tree(pid)
                proc = self.procs.pop(name, None)
                if proc is not None:
                    proc.wait(timeout=10)
        # slurmstepd daemonizes away from slurmd; it keeps slurmd's log open.
        for pid in self.stepd_pids():
            kill_tree(pid)

    def stepd_pids(self) -> list[int]:
        """slurmstepd processes of this cluster (their log file is in our directory)."""
        out = []
        mine = str(self.dir) + "/"
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if not f.read().startswith(b"slurmstepd"):
                        continue
                fds = os.listdir(f"/proc/{entry}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(mine):
                        out.append(int(entry))
                        break
                except OSError:
                    continue
        return out

    def job_pids(self) -> list[int]:
        """Every process that runs as part of a job (below a slurmstepd)."""
        out = []
        for stepd in self.stepd_pids():
            out += descendants(stepd)
        return out

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # -- clients -----------------------------------------------------------

    def client_env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30,
            input: str | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, **self.client_env())
        r = subprocess.run(list(argv), capture_output=True, text=True, env=env,
                           timeout=timeout, input=input,
                           stdin=None if input is not None else subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr}")
        return r

    def log_files(self) -> list[Path]:
        """Every log the daemons wrote (their log files and captured output)."""
        return sorted(p for p in self.dir.iterdir() if p.suffix in (".log", ".out"))

    def node_state(self) -> str:
        r = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False)
        return r.stdout.strip().upper() if r.returncode == 0 else ""

    def jobs(self) -> list[dict[str, str]]:
        """squeue: every job still listed (pending, running, completing)."""
        r = self.run("squeue", "-h", "-o", "%i|%T|%r|%N|%j")
        out = []
        for line in r.stdout.splitlines():
            jid, state, reason, nodes, name = line.split("|", 4)
            out.append({"id": jid, "state": state, "reason": reason, "nodes": nodes,
                        "name": name})
        return out

    def wait_no_jobs(self, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.jobs():
                return True
            time.sleep(0.2)
        return not self.jobs()

    def sbatch(self, *args: str, script: str = "#!/bin/sh\nexec sleep 600\n") -> str:
        """Submit a job (script on stdin); its id."""
        r = self.run("sbatch", "--parsable", "--output=/dev/null", *args, input=script)
        return r.stdout.strip().split(";")[0]

    def _save_state(self) -> None:
        (self.dir / "state.json").write_text(json.dumps({
            "pids": self.pids, "conf": str(self.conf),
        }))


def _user() -> str:
    import pwd
    return pwd.getpwuid(os.getuid()).pw_name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    start = sub.add_parser("start", help="start the cluster; print its slurm.conf path")
    start.add_argument("--dir", required=True, help="directory for keys, configs, state, logs")
    start.add_argument("--node", default="gpunode1", help="the node's name")
    stop = sub.add_parser("stop", help="cancel every job and stop the cluster started in --dir")
    stop.add_argument("--dir", required=True)
    args = ap.parse_args(argv)

    if args.cmd == "start":
        cluster = SlurmCluster(args.dir, node=args.node).start(detach=True)
        print(cluster.conf)
        return 0
    state_file = Path(args.dir) / "state.json"
    if not state_file.exists():
        print(f"no cluster state in {args.dir}", file=sys.stderr)
        return 1
    state = json.loads(state_file.read_text())
    cluster = SlurmCluster(args.dir)
    cluster.pids = {k: int(v) for k, v in state["pids"].items()}
    # Not our children here: stop them by pid, then sweep the steps.
    if cluster._ctld_answers():
        cluster.run("scancel", "--partition=debug", check=False)
        cluster.wait_no_jobs(10)
    for pid in cluster.pids.values():
        kill_tree(pid)
    for pid in cluster.stepd_pids():
        kill_tree(pid)
    state_file.unlink()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
