"""Kernel start and execute round trip: gpu-magics (%gpuhelp) vs ipykernel (pass), one run.

Measured with raw pyzmq sockets and jupyter_client's Session (no client threads), so both
kernels see the same client. Start = process spawn to the first kernel_info_reply (the request
is queued before the kernel binds). Round trip = execute_request sent to the idle status.

Usage: python bench/kernel_latency.py [--starts 10] [--runs 300]
"""

from __future__ import annotations

import argparse
import statistics
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import jupyter_client
import zmq
from jupyter_client.connect import write_connection_file
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.session import Session

from common import summary, write_result


class Kernel:
    """A kernel process we spawn ourselves from its kernelspec, so the clock starts at spawn."""

    def __init__(self, name: str) -> None:
        spec = KernelSpecManager().get_kernel_spec(name)
        self.tmp = tempfile.mkdtemp(prefix="bench-kernel-")
        self.conn_file = os.path.join(self.tmp, "kernel.json")
        key = uuid.uuid4().hex
        fname, info = write_connection_file(self.conn_file, key=key.encode())
        self.session = Session(key=key.encode())
        ctx = zmq.Context.instance()
        self.shell = ctx.socket(zmq.DEALER)
        self.shell.linger = 0
        # Retry the connect every 2 ms (default 100 ms) so the start time is the kernel's.
        self.shell.setsockopt(zmq.RECONNECT_IVL, 2)
        self.shell.connect(f"tcp://127.0.0.1:{info['shell_port']}")
        self.iopub = ctx.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(f"tcp://127.0.0.1:{info['iopub_port']}")
        self.control = ctx.socket(zmq.DEALER)
        self.control.linger = 0
        self.control.connect(f"tcp://127.0.0.1:{info['control_port']}")
        argv = [a.replace("{connection_file}", self.conn_file) for a in spec.argv]
        env = {**os.environ, **spec.env}
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        # Queued until the kernel binds: the reply marks the first moment it can serve.
        self.session.send(self.shell, "kernel_info_request", {})
        if not self.shell.poll(30000):
            self.stop()
            raise RuntimeError(f"{name}: no kernel_info_reply within 30 s")
        self.session.recv(self.shell, mode=0)
        self.start_ms = (time.perf_counter() - self.t0) * 1000

    def stop(self) -> None:
        self.session.send(self.control, "shutdown_request", {"restart": False})
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for sock in (self.shell, self.iopub, self.control):
            sock.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def round_trips(kernel: Kernel, code: str, runs: int) -> list[float]:
    """Milliseconds per execute, send to idle, after 20 warm-up runs."""
    times = [round_trip(kernel, code) * 1000 for _ in range(runs + 20)]
    return times[20:]


def print_throughput(kernel: Kernel, lines: int) -> float:
    """Seconds from sending a cell that prints `lines` lines to its idle, all output received."""
    return round_trip(kernel, f"for i in range({lines}): print(i)")


def round_trip(kernel: Kernel, code: str) -> float:
    """Seconds from sending execute_request to the idle status that ends it."""
    session, shell, iopub = kernel.session, kernel.shell, kernel.iopub
    content = {"code": code, "silent": False, "store_history": True,
               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
    t0 = time.perf_counter()
    msg_id = session.send(shell, "execute_request", content)["header"]["msg_id"]
    session.recv(shell, mode=0)
    while True:
        _, reply = session.recv(iopub, mode=0)
        if (reply["header"]["msg_type"] == "status"
                and reply["parent_header"].get("msg_id") == msg_id
                and reply["content"]["execution_state"] == "idle"):
            return time.perf_counter() - t0


def row(label: str, a: float, b: float, fmt: str = ".3f") -> str:
    return f"| {label} | {a:{fmt}} | {b:{fmt}} | {a / b:.3f} |\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--lines", type=int, default=100_000)
    args = parser.parse_args()
    cases = [("gpu-magics", "%gpuhelp"), ("python3", "pass"), ("gpu-python", "pass")]
    starts: dict[str, list[float]] = {name: [] for name, _ in cases}
    trips: dict[str, list[float]] = {}
    printing: dict[str, list[float]] = {"python3": [], "gpu-python": []}
    # Interleave the kernels so drift on the machine hits all alike.
    for i in range(args.starts):
        for name, code in cases:
            kernel = Kernel(name)
            starts[name].append(kernel.start_ms)
            if i == 0:
                time.sleep(0.5)  # let iopub subscriptions settle
                trips[name] = round_trips(kernel, code, args.runs)
                if name in printing:
                    print_throughput(kernel, args.lines)  # warm-up
                    printing[name] = [print_throughput(kernel, args.lines) for _ in range(5)]
            kernel.stop()
    s = {n: summary(v) for n, v in starts.items()}
    r = {n: summary(v) for n, v in trips.items()}
    p = {n: statistics.median(v) for n, v in printing.items()}
    versions = (
        f"jupyter_client {jupyter_client.__version__}, pyzmq {zmq.__version__}, "
        f"Python {sys.version.split()[0]}\n\n"
    )
    magics = (
        "## gpu-magics (magics-only) vs ipykernel\n\n"
        "| measure | gpu-magics | ipykernel | ratio |\n|---|---|---|---|\n"
        + row(f"start to kernel_info_reply, p50 (ms, n={args.starts})", s["gpu-magics"]["p50"], s["python3"]["p50"], ".1f")
        + row("start to kernel_info_reply, p95 (ms)", s["gpu-magics"]["p95"], s["python3"]["p95"], ".1f")
        + row(f"execute round trip p50 (ms, n={args.runs}; `%gpuhelp` vs `pass`)", r["gpu-magics"]["p50"], r["python3"]["p50"])
        + row("execute round trip p95 (ms)", r["gpu-magics"]["p95"], r["python3"]["p95"])
        + "\nTargets (issue 3): start under 300 ms, round trip under 2 ms.\n\n"
    )
    added_p50 = r["gpu-python"]["p50"] - r["python3"]["p50"]
    proxy = (
        "## gpu-python (gpukernel in front of ipykernel) vs ipykernel alone\n\n"
        "| measure | gpu-python | ipykernel | ratio |\n|---|---|---|---|\n"
        + row(f"start to kernel_info_reply, p50 (ms, n={args.starts})", s["gpu-python"]["p50"], s["python3"]["p50"], ".1f")
        + row(f"`pass` round trip p50 (ms, n={args.runs})", r["gpu-python"]["p50"], r["python3"]["p50"])
        + row("`pass` round trip p95 (ms)", r["gpu-python"]["p95"], r["python3"]["p95"])
        + row(f"print {args.lines:,} lines, median of 5 after a warm-up (s)", p["gpu-python"], p["python3"])
        + f"\nAdded at p50: {added_p50:.3f} ms. Throughput ratio (ipykernel time / gpu-python time): "
        f"{p['python3'] / p['gpu-python']:.3f}.\n"
        "Targets (issue 4): at most 0.5 ms added at p50, throughput at least 0.9x, start at most 1.15x.\n"
    )
    body = versions + magics + proxy
    path = write_result("kernel-latency", "python bench/kernel_latency.py " + " ".join(sys.argv[1:]), body)
    print(body)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
