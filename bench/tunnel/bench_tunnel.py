#!/usr/bin/env python3
"""Benchmark `tunnel` side by side, in one run, against the same throwaway sshd:

1. startup: time from `tunnel up` to the URL, next to the remote Jupyter server's
   own start time (same app, same env, run directly) and to `jupyter-forward`
   (PyPI) reaching its URL;
2. bulk throughput: a large file downloaded from Jupyter's /files/ endpoint
   through tunnel's forward vs through OpenSSH `ssh -L` (and directly, as the
   ceiling);
3. small-request latency: GET /api/status on a kept-alive connection, and on a
   new connection each time (a new SSH channel each), tunnel vs `ssh -L`.

Results are ratios computed in this run, written to bench/results/tunnel-<date>.{json,md}.

Usage (from the repo root, with the project venv active):
    python bench/tunnel/bench_tunnel.py [--rounds 3] [--file-mb 256] [--requests 300]

jupyter-forward is installed into a throwaway venv (default /tmp/tunnel-bench-jf)
unless --jupyter-forward-venv points at one that has it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(REPO / "tests" / "tunnel"))
from sshd import Sshd, free_port, kill_tree  # noqa: E402
from tunnel_harness import all_pids, environ, find_tunnel_binary, jupyter_env  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def wait_http_ok(url: str, headers: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def read_line_with_deadline(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    """First stdout line containing needle (stdout must be line-buffered text)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = ""
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.05):
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
        if not chunk:
            break
        buf += chunk
        for line in buf.splitlines():
            if needle in line:
                return line
    raise RuntimeError(f"no line with {needle!r} within {timeout}s; got:\n{buf[-3000:]}")


# -- 1. startup ------------------------------------------------------------------


def server_own_start(prefix: Path, workdir: Path) -> float:
    """Spawn to /api/status 200 for `jupyter lab` run directly, as tunnel runs it."""
    rt = Path(tempfile.mkdtemp(prefix="bench-rt.", dir=workdir))
    token = os.urandom(16).hex()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(rt), JUPYTER_TOKEN=token,
               PATH=f"{prefix}/bin:{os.environ['PATH']}")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["jupyter", "lab", "--no-browser", "--ip=127.0.0.1", "--port=0", "--allow-root"],
        cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        port = None
        while port is None:
            if proc.poll() is not None:
                raise RuntimeError("jupyter lab exited")
            for f in rt.glob("jpserver-*.json"):
                try:
                    port = json.loads(f.read_text())["port"]
                except (ValueError, KeyError):
                    pass
            time.sleep(0.005)
        wait_http_ok(f"http://127.0.0.1:{port}/api/status",
                     {"Authorization": f"token {token}"}, 60)
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        shutil.rmtree(rt, ignore_errors=True)


def tunnel_start(binary: Path, server: Sshd, prefix: Path, state: Path, workdir: Path) -> float:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(binary), "up", "-F", str(server.ssh_config), server.alias, "--env", str(prefix),
         "--dir", str(workdir), "--no-browser"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TUNNEL_STATE_DIR=str(state)),
    )
    try:
        read_line_with_deadline(proc, "token=", 120)
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def ssh_true(server: Sshd) -> float:
    """OpenSSH running `true` on the host: connection + session + the user's shell start."""
    t0 = time.monotonic()
    subprocess.run(["ssh", "-F", str(server.ssh_config), server.alias, "true"],
                   stdin=subprocess.DEVNULL, check=True)
    return time.monotonic() - t0


def login_shell() -> float:
    """The remote user's login shell sourcing its profile (tunnel runs one, on purpose)."""
    shell = os.environ.get("SHELL", "/bin/sh")
    t0 = time.monotonic()
    subprocess.run([shell, "-l", "-c", "true"], stdin=subprocess.DEVNULL, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0


def ensure_jupyter_forward(venv: Path) -> Path:
    exe = venv / "bin" / "jupyter-forward"
    if not exe.exists():
        log(f"installing jupyter-forward into {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "jupyter-forward"], check=True)
    return exe


def jupyter_forward_setup(server: Sshd, prefix: Path, workdir: Path) -> tuple[dict, Path, Path]:
    """A HOME whose ~/.ssh/config reaches the sshd (fabric reads only that), and a
    remote-shell shim: jupyter-forward runs `$SHELL -lc CMD`, a login shell resets
    PATH to the system one, and Jupyter refuses root without allow_root."""
    home = workdir / "jf-home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "config").write_text(server.client_config(IdentityAgent=None,
                                                               GlobalKnownHostsFile=None))
    shutil.copy(server.known_hosts, home / ".ssh" / "known_hosts")
    cfg = workdir / "jf-jupyter-config"
    cfg.mkdir(exist_ok=True)
    (cfg / "jupyter_server_config.json").write_text('{"ServerApp": {"allow_root": true}}')
    # `source activate NAME` (jupyter-forward's env activation) finds this first on PATH.
    jf_bin = workdir / "jf-bin"
    jf_bin.mkdir(exist_ok=True)
    (jf_bin / "activate").write_text(f'. "{prefix}/bin/activate"\n')
    (jf_bin / "activate").chmod(0o755)
    shim = workdir / "jf-shell"
    shim.write_text(
        "#!/bin/sh\n"
        f'export PATH="{jf_bin}:{prefix}/bin:$PATH" JUPYTER_CONFIG_DIR="{cfg}"\n'
        '[ "$1" = -lc ] && shift\n'
        'exec /bin/bash --norc --noprofile -c "$1"\n'
    )
    shim.chmod(0o755)
    env = dict(os.environ, HOME=str(home), BROWSER="true", COLUMNS="400", TERM="dumb",
               NO_COLOR="1")
    env.pop("SSH_AUTH_SOCK", None)
    return env, shim, cfg


def kill_by_env(var: str, value: str) -> None:
    needle = f"{var}={value}".encode()
    for pid in all_pids():
        if pid != os.getpid() and needle in environ(pid).split(b"\0"):
            kill_tree(pid)


def jupyter_forward_start(exe: Path, server: Sshd, env: dict, shim: Path, cfg: Path,
                          workdir: Path) -> float:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        # jupyter-forward 2025.1.16 exits unless --conda-env is given; with it, it runs
        # `source activate NAME`, which finds the venv's activation first on PATH.
        [str(exe), server.alias, "--port", str(free_port()), "--shell", str(shim),
         "--notebook-dir", str(workdir), "--conda-env", "bench-venv"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,
    )
    try:
        read_line_with_deadline(proc, "Jupyter Lab URL:", 180)
        return time.monotonic() - t0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        kill_by_env("JUPYTER_CONFIG_DIR", str(cfg))


# -- 2./3. data path -------------------------------------------------------------


def download_mbps(port: int, token: str, name: str, size: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.monotonic()
    conn.request("GET", f"/files/{name}", headers={"Authorization": f"token {token}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    got = 0
    while True:
        chunk = resp.read(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    dt = time.monotonic() - t0
    conn.close()
    assert got == size, (got, size)
    return size / dt / 1e6


def latency_keepalive(port: int, token: str, n: int) -> list[float]:
    s = requests.Session()
    h = {"Authorization": f"token {token}"}
    url = f"http://127.0.0.1:{port}/api/status"
    s.get(url, headers=h, timeout=30)  # warm the connection
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = s.get(url, headers=h, timeout=30)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200
    s.close()
    return out


def latency_new_connection(port: int, token: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/api/status", headers={"Authorization": f"token {token}"})
        r = conn.getresponse()
        r.read()
        conn.close()
        out.append(time.perf_counter() - t0)
        assert r.status == 200
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- report ----------------------------------------------------------------------


def versions(binary: Path, jf: Path | None) -> dict:
    def out(cmd):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            return (r.stdout or r.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "unknown"

    import jupyter_server
    import jupyterlab
    v = {
        "tunnel": out([str(binary), "--version"]),
        "tunnel_git": out(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "openssh": out(["ssh", "-V"]),
        "python": platform.python_version(),
        "jupyter_server": jupyter_server.__version__,
        "jupyterlab": jupyterlab.__version__,
    }
    if jf is not None:
        v["jupyter_forward"] = out([str(jf.parent / "python"), "-c",
                                    "import importlib.metadata as m; print(m.version('jupyter-forward'))"])
    return v


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "kernel": platform.release(),
            "os": platform.platform(), "loadavg_at_start": os.getloadavg()[0]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--file-mb", type=int, default=256)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--jupyter-forward-venv", type=Path, default=Path("/tmp/tunnel-bench-jf"))
    ap.add_argument("--skip-jupyter-forward", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return ap.parse_args()


def startup_rounds(rounds: int, binary: Path, server: Sshd, prefix: Path, state: Path,
                   work: Path, jf: Path | None) -> dict:
    """1. startup, interleaved so drift hits all three alike; with the login's own cost."""
    res: dict = {"startup_s": {"server_own": [], "tunnel": [], "jupyter_forward": []},
                 "context_s": {"ssh_true": [], "login_shell": []}}
    jf_env = jf_shim = jf_cfg = None
    if jf is not None:
        jf_env, jf_shim, jf_cfg = jupyter_forward_setup(server, prefix, work)
    # One untimed round of each warms the page cache.
    server_own_start(prefix, work)
    tunnel_start(binary, server, prefix, state, work)
    for i in range(rounds):
        res["startup_s"]["server_own"].append(server_own_start(prefix, work))
        res["startup_s"]["tunnel"].append(tunnel_start(binary, server, prefix, state, work))
        if jf is not None:
            res["startup_s"]["jupyter_forward"].append(
                jupyter_forward_start(jf, server, jf_env, jf_shim, jf_cfg, work))
        res["context_s"]["ssh_true"].append(ssh_true(server))
        res["context_s"]["login_shell"].append(login_shell())
        log(f"startup round {i + 1}: " + ", ".join(
            f"{k} {v[-1]:.2f}s" for k, v in res["startup_s"].items() if v))
    return res


@contextlib.contextmanager
def forwarded(binary: Path, server: Sshd, prefix: Path, state: Path, work: Path):
    """One tunnel and one `ssh -L` to the same Jupyter; yields the token and the ports of the
    three paths to it (direct on the remote, tunnel, OpenSSH)."""
    proc = subprocess.Popen(
        [str(binary), "up", "-F", str(server.ssh_config), server.alias, "--env", str(prefix),
         "--dir", str(work), "--no-browser"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TUNNEL_STATE_DIR=str(state)),
    )
    ssh = None
    try:
        url = read_line_with_deadline(proc, "token=", 120).strip()
        token = url.split("token=")[1]
        tunnel_port = int(url.split(":")[2].split("/")[0])
        st = json.loads(subprocess.run(
            [str(binary), "status", "--json", "bench"], capture_output=True, text=True,
            env=dict(os.environ, TUNNEL_STATE_DIR=str(state)), check=True).stdout)
        remote_port = st["remote_port"]
        ssh_port = free_port()
        ssh = subprocess.Popen(
            ["ssh", "-F", str(server.ssh_config), "-N", "-o", "ExitOnForwardFailure=yes",
             "-L", f"127.0.0.1:{ssh_port}:127.0.0.1:{remote_port}", server.alias],
            stdin=subprocess.DEVNULL,
        )
        wait_http_ok(f"http://127.0.0.1:{ssh_port}/api/status",
                     {"Authorization": f"token {token}"}, 30)
        yield token, {"direct": remote_port, "tunnel": tunnel_port, "openssh": ssh_port}
    finally:
        if ssh is not None:
            ssh.terminate()
            ssh.wait(timeout=10)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def throughput(paths: dict, token: str, name: str, size: int, rounds: int) -> dict:
    """2. MB/s of downloading the file through each path, after one warm-up each."""
    found: dict = {k: [] for k in paths}
    for k, p in paths.items():  # warm-up
        download_mbps(p, token, name, size)
    for _ in range(rounds):
        for k, p in paths.items():
            found[k].append(download_mbps(p, token, name, size))
    log("throughput MB/s: " + ", ".join(f"{k} {max(v):.0f}" for k, v in found.items()))
    return found


def latency(paths: dict, token: str, rounds: int, requests: int) -> tuple[dict, dict]:
    """3. Small-request latency, kept-alive and on new connections: interleaved rounds,
    samples pooled per path, so load drift on a shared machine hits every path alike."""
    ka_all: dict = {k: [] for k in paths}
    nc_all: dict = {k: [] for k in paths}
    per_round = max(1, requests // rounds)
    for _ in range(rounds):
        for k, p in paths.items():
            ka_all[k] += latency_keepalive(p, token, per_round)
            nc_all[k] += latency_new_connection(p, token, max(1, per_round // 3))

    def summary(samples: dict) -> dict:
        return {k: {"median": statistics.median(v) * 1e3, "p95": pct(v, 0.95) * 1e3,
                    "n": len(v)} for k, v in samples.items()}

    return summary(ka_all), summary(nc_all)


def verdict(res: dict) -> tuple[dict, dict, dict, dict]:
    """Medians, the ratios tunnel vs the others, and the targets they meet."""
    med = {k: statistics.median(v) for k, v in res["startup_s"].items() if v}
    ctx = {k: statistics.median(v) for k, v in res["context_s"].items()}
    ratios = {
        "tunnel_minus_server_own_s": med["tunnel"] - med["server_own"],
        "tunnel_over_jupyter_forward": (med["tunnel"] / med["jupyter_forward"]
                                        if "jupyter_forward" in med else None),
        "throughput_tunnel_over_openssh": (max(res["throughput_MBps"]["tunnel"])
                                           / max(res["throughput_MBps"]["openssh"])),
        "latency_keepalive_tunnel_over_openssh": (res["latency_keepalive_ms"]["tunnel"]["median"]
                                                  / res["latency_keepalive_ms"]["openssh"]["median"]),
        "latency_new_connection_tunnel_over_openssh": (
            res["latency_new_connection_ms"]["tunnel"]["median"]
            / res["latency_new_connection_ms"]["openssh"]["median"]),
    }
    targets = {
        "ready within 0.5 s of the server's own start": ratios["tunnel_minus_server_own_s"] <= 0.5,
        "faster than jupyter-forward": (ratios["tunnel_over_jupyter_forward"] is not None
                                        and ratios["tunnel_over_jupyter_forward"] < 1),
        "throughput >= 0.7x OpenSSH": ratios["throughput_tunnel_over_openssh"] >= 0.7,
        "latency <= 1.2x OpenSSH (keep-alive)": ratios["latency_keepalive_tunnel_over_openssh"] <= 1.2,
    }
    return med, ctx, ratios, targets


def main() -> int:
    args = parse_args()
    mach = machine()  # before we add load ourselves
    binary = find_tunnel_binary()
    prefix = jupyter_env()
    jf = None if args.skip_jupyter_forward else ensure_jupyter_forward(args.jupyter_forward_venv)
    log(f"tunnel {binary}, env {prefix}")

    work = Path(tempfile.mkdtemp(prefix="tunnel-bench."))
    server = Sshd(work / "sshd", alias="bench")
    server.start()
    state = work / "state"
    try:
        res = startup_rounds(args.rounds, binary, server, prefix, state, work, jf)
        name, size = "bench.bin", args.file_mb * 1_000_000
        with open(work / name, "wb") as f:
            for _ in range(args.file_mb):
                f.write(os.urandom(1_000_000))
        with forwarded(binary, server, prefix, state, work) as (token, paths):
            res["throughput_MBps"] = throughput(paths, token, name, size, args.rounds)
            res["latency_keepalive_ms"], res["latency_new_connection_ms"] = latency(
                paths, token, args.rounds, args.requests)
            log(f"latency keep-alive: {res['latency_keepalive_ms']}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    med, ctx, ratios, targets = verdict(res)
    today = datetime.date.today().isoformat()
    report = {
        "date": today,
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(REPO))]
                                        + sys.argv[1:]),
        "machine": mach,
        "versions": versions(binary, jf),
        "binary": str(binary),
        "settings": {"rounds": args.rounds, "file_mb": args.file_mb, "requests": args.requests},
        "loadavg_at_end": os.getloadavg()[0],
        "results": res,
        "medians_startup_s": med,
        "medians_context_s": ctx,
        "ratios": ratios,
        "targets_met": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"tunnel-{today}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"tunnel-{today}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(r: dict) -> str:
    res, ra = r["results"], r["ratios"]
    m = r["medians_startup_s"]
    lines = [
        f"# tunnel benchmark, {r['date']}",
        "",
        f"Command: `{r['command']}` (binary: `{r['binary']}`)",
        "",
        f"Machine: {r['machine']['nproc']} CPUs, {r['machine']['cpu']}, Linux {r['machine']['kernel']}.",
        "The \"remote\" is the same machine: an OpenSSH sshd on 127.0.0.1 started by the bench. "
        f"1-minute load average {r['machine']['loadavg_at_start']:.2f} at the start and "
        f"{r['loadavg_at_end']:.2f} at the end (the machine is shared; rounds are interleaved so "
        "that load hits every contender alike).",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        "",
        "## Startup (seconds, median of rounds; every round listed)",
        "",
        "| what | median | rounds |",
        "| --- | ---: | --- |",
    ]
    names = {"server_own": "`jupyter lab` run directly: spawn to /api/status 200",
             "tunnel": "`tunnel up`: spawn to URL on stdout (ready checked through the forward)",
             "jupyter_forward": "`jupyter-forward`: spawn to its \"Jupyter Lab URL\" line"}
    for k, v in res["startup_s"].items():
        if v:
            lines.append(f"| {names[k]} | {m[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    c = r["medians_context_s"]
    lines += [
        "",
        "Context (medians): OpenSSH `ssh HOST true` (connect, session, the user's shell start) "
        f"{c['ssh_true']:.2f} s; the user's login shell `$SHELL -l -c true` {c['login_shell']:.2f} s. "
        "tunnel pays both before Jupyter starts: it runs a command over SSH and, on purpose, a "
        "login shell (PATH, modules, conda) around Jupyter.",
        "",
        f"tunnel overhead over the server's own start: **{ra['tunnel_minus_server_own_s']:+.2f} s**"
        + (f"; tunnel / jupyter-forward: **{ra['tunnel_over_jupyter_forward']:.2f}x**"
           if ra["tunnel_over_jupyter_forward"] is not None else ""),
        "",
        f"## Bulk throughput: {r['settings']['file_mb']} MB file from Jupyter's /files/ (MB/s, best of rounds)",
        "",
        "| path | best | rounds |",
        "| --- | ---: | --- |",
    ]
    for k, v in res["throughput_MBps"].items():
        lines.append(f"| {k} | {max(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    lines += [
        "",
        f"tunnel / OpenSSH `ssh -L`: **{ra['throughput_tunnel_over_openssh']:.2f}x**",
        "",
        f"## Small-request latency: GET /api/status (ms; {r['settings']['requests']} kept-alive and "
        f"{r['settings']['requests'] // 3} new-connection requests per path, in interleaved rounds)",
        "",
        "| path | keep-alive median | keep-alive p95 | new connection median | new connection p95 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in res["latency_keepalive_ms"]:
        ka, nc = res["latency_keepalive_ms"][k], res["latency_new_connection_ms"][k]
        lines.append(f"| {k} | {ka['median']:.2f} | {ka['p95']:.2f} | {nc['median']:.2f} | {nc['p95']:.2f} |")
    lines += [
        "",
        f"tunnel / OpenSSH, keep-alive median: **{ra['latency_keepalive_tunnel_over_openssh']:.2f}x**; "
        f"new connection (a new SSH channel each) median: **{ra['latency_new_connection_tunnel_over_openssh']:.2f}x**",
        "",
        "## Targets (issue 7)",
        "",
    ]
    for k, ok in r["targets_met"].items():
        lines.append(f"- {'met' if ok else 'NOT met'}: {k}")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
