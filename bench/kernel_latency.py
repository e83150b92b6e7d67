"""Kernel start and execute round trip: gpu-magics (%gpuhelp) vs ipykernel (pass), one run.

Measured with raw pyzmq sockets and jupyter_client's Session (no client threads), so both
kernels see the same client. Start = process spawn to the first kernel_info_reply (the request
is queued before the kernel binds). Round trip = execute_request sent to the idle status.

Usage: python bench/kernel_latency.py [--starts 10] [--runs 300]
"""

from __future__ import annotations

import argparse
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
    session, shell, iopub = kernel.session, kernel.shell, kernel.iopub
    content = {"code": code, "silent": False, "store_history": True,
               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
    times = []
    for _ in range(runs + 20):
        t0 = time.perf_counter()
        msg = session.send(shell, "execute_request", content)
        msg_id = msg["header"]["msg_id"]
        session.recv(shell, mode=0)
        while True:
            _, reply = session.recv(iopub, mode=0)
            if (reply["header"]["msg_type"] == "status"
                    and reply["parent_header"].get("msg_id") == msg_id
                    and reply["content"]["execution_state"] == "idle"):
                break
        times.append((time.perf_counter() - t0) * 1000)
    return times[20:]  # warm-up dropped


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    cases = [("gpu-magics", "%gpuhelp"), ("python3", "pass")]
    starts: dict[str, list[float]] = {name: [] for name, _ in cases}
    trips: dict[str, list[float]] = {}
    # Interleave the kernels so drift on the machine hits both alike.
    for i in range(args.starts):
        for name, code in cases:
            kernel = Kernel(name)
            starts[name].append(kernel.start_ms)
            if i == 0:
                time.sleep(0.5)  # let iopub subscriptions settle
                trips[name] = round_trips(kernel, code, args.runs)
            kernel.stop()
    s = {n: summary(v) for n, v in starts.items()}
    r = {n: summary(v) for n, v in trips.items()}
    body = (
        f"jupyter_client {jupyter_client.__version__}, pyzmq {zmq.__version__}, "
        f"Python {sys.version.split()[0]}\n\n"
        "| measure | gpu-magics | ipykernel | ratio (gpu-magics / ipykernel) |\n|---|---|---|---|\n"
        f"| start to kernel_info_reply, p50 (ms, n={args.starts}) | {s['gpu-magics']['p50']:.1f} | "
        f"{s['python3']['p50']:.1f} | {s['gpu-magics']['p50'] / s['python3']['p50']:.3f} |\n"
        f"| start to kernel_info_reply, p95 (ms) | {s['gpu-magics']['p95']:.1f} | "
        f"{s['python3']['p95']:.1f} | {s['gpu-magics']['p95'] / s['python3']['p95']:.3f} |\n"
        f"| execute round trip p50 (ms, n={args.runs}; `%gpuhelp` vs `pass`) | "
        f"{r['gpu-magics']['p50']:.3f} | {r['python3']['p50']:.3f} | "
        f"{r['gpu-magics']['p50'] / r['python3']['p50']:.3f} |\n"
        f"| execute round trip p95 (ms) | {r['gpu-magics']['p95']:.3f} | "
        f"{r['python3']['p95']:.3f} | {r['gpu-magics']['p95'] / r['python3']['p95']:.3f} |\n\n"
        "Targets (issue 3): start under 300 ms, round trip under 2 ms.\n"
    )
    path = write_result("kernel-latency", "python bench/kernel_latency.py " + " ".join(sys.argv[1:]), body)
    print(body)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
