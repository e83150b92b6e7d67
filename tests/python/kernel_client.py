"""Helpers over a real jupyter_client KernelManager/BlockingKernelClient."""

from __future__ import annotations

import queue
import time
from contextlib import contextmanager
from typing import Any, Iterator

from jupyter_client.manager import KernelManager


@contextmanager
def running_kernel(name: str, **kw: Any) -> Iterator[tuple[KernelManager, Any]]:
    km = KernelManager(kernel_name=name)
    km.start_kernel(**kw)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=30)
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def collect(kc: Any, msg_id: str, timeout: float = 15) -> tuple[dict, list[dict]]:
    """Waits for the reply to msg_id and its iopub messages up to idle."""
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    outputs: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply, outputs
        if msg["msg_type"] not in ("status", "execute_input"):
            outputs.append(msg)
    raise TimeoutError(f"no idle for {msg_id}")


def execute(kc: Any, code: str, timeout: float = 15, **kw: Any) -> tuple[dict, list[dict]]:
    return collect(kc, kc.execute(code, **kw), timeout)


def drain_iopub(kc: Any, seconds: float = 0.5) -> list[dict]:
    msgs = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            msgs.append(kc.get_iopub_msg(timeout=0.1))
        except queue.Empty:
            pass
    return msgs


def stream_text(outputs: list[dict], name: str = "stdout") -> str:
    return "".join(
        m["content"]["text"]
        for m in outputs
        if m["msg_type"] == "stream" and m["content"]["name"] == name
    )


class HeartbeatSettled:
    """For jupyter_kernel_test's IopubWelcomeTests, which stop the client right after the
    welcome: jupyter_client's heartbeat thread creates its socket after start_channels
    returns, and one created on the context stop_channels has just destroyed raises in that
    thread ("Too many open files": a terminated context has no socket slots). So the
    teardown waits for that socket first."""

    @classmethod
    def tearDownClass(cls) -> None:
        hb = cls.kc.hb_channel
        deadline = time.monotonic() + 5
        while hb.is_alive() and hb.socket is None and time.monotonic() < deadline:
            time.sleep(0.01)
        super().tearDownClass()
