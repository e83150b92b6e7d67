"""gpu-python under a real jupyter_client: stdin, interrupts, the child dying, restart,
shutdown, comms, forged messages, mixed cells and the side channel."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.session import Session

from kernel_client import collect, drain_iopub, execute, running_kernel, stream_text


@pytest.fixture()
def proxy():
    with running_kernel("gpu-python") as pair:
        yield pair


def child_of(km) -> psutil.Process:
    children = psutil.Process(km.provisioner.process.pid).children()
    assert len(children) == 1, children
    return children[0]


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_input_round_trip(proxy):
    km, kc = proxy
    msg_id = kc.execute("name = input('who? ')\nprint('hello', name)", allow_stdin=True)
    request = kc.get_stdin_msg(timeout=10)
    assert request["msg_type"] == "input_request"
    assert request["content"]["prompt"] == "who? "
    kc.input("gpu")
    reply, outputs = collect(kc, msg_id)
    assert reply["content"]["status"] == "ok"
    assert "hello gpu" in stream_text(outputs)


def test_getpass_round_trip(proxy):
    km, kc = proxy
    msg_id = kc.execute("import getpass\nsecret = getpass.getpass('pw: ')\nprint(len(secret))",
                        allow_stdin=True)
    request = kc.get_stdin_msg(timeout=10)
    assert request["content"]["password"] is True
    kc.input("hunter2")
    reply, outputs = collect(kc, msg_id)
    assert stream_text(outputs) == "7\n"


@pytest.mark.parametrize("how", ["signal", "message"])
def test_interrupting_sleep_returns_within_two_seconds(proxy, how):
    km, kc = proxy
    msg_id = kc.execute("import time; time.sleep(60)")
    time.sleep(1.0)
    started = time.monotonic()
    if how == "signal":
        km.interrupt_kernel()  # the kernelspec says interrupt_mode "signal"
    else:
        kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    reply, outputs = collect(kc, msg_id, timeout=5)
    assert time.monotonic() - started < 2.0
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert execute(kc, "print('alive')")[0]["content"]["status"] == "ok"


def test_child_exit_ends_the_pair_and_restart_works():
    with running_kernel("gpu-python") as (km, kc):
        assert execute(kc, "x = 1")[0]["content"]["execution_count"] == 1
        child = child_of(km)
        kc.execute("import os; os._exit(1)")
        assert wait_gone(child.pid, 5)
        proxy_process = km.provisioner.process
        deadline = time.monotonic() + 5
        while proxy_process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy_process.poll() == 1, "gpukernel exits when its Python kernel dies"
        messages = drain_iopub(kc, 0.5)
        assert any("exited unexpectedly" in str(m["content"]) for m in messages)
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=30)
        reply, outputs = execute(kc, "print('x' in dir())")
        assert reply["content"]["execution_count"] == 1, "a fresh count after restart"
        assert stream_text(outputs) == "False\n"


def test_shutdown_leaves_no_child():
    with running_kernel("gpu-python") as (km, kc):
        child = child_of(km)
        km.shutdown_kernel(now=False)
        assert wait_gone(child.pid, 5)
        assert km.provisioner is None or not km.is_alive()


def test_killing_gpukernel_takes_the_child_too():
    with running_kernel("gpu-python") as (km, kc):
        child = child_of(km)
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        # ipykernel polls its parent once a second (JPY_PARENT_PID).
        assert wait_gone(child.pid, 5)


def test_mixed_cell_outputs_in_order_with_one_count(proxy):
    km, kc = proxy
    assert execute(kc, "a = 1")[0]["content"]["execution_count"] == 1
    reply, outputs = execute(kc, "%gpuhelp\nprint('first')\n%gpumem\nprint('second')")
    kinds = [(m["msg_type"], m["content"].get("text")) for m in outputs]
    assert kinds == [("display_data", None), ("stream", "first\n"),
                     ("display_data", None), ("stream", "second\n")], kinds
    assert reply["content"]["execution_count"] == 2
    assert execute(kc, "b = 2")[0]["content"]["execution_count"] == 3
    # IPython's own history has the magic lines, under the cell's count.
    _, outputs = execute(kc, "print(repr(In[2]))")
    assert "%gpuhelp" in stream_text(outputs) and "%gpumem" in stream_text(outputs)
    _, outputs = execute(kc, "%history -n 2")
    assert "%gpuhelp" in stream_text(outputs)


def test_mixed_cell_stops_at_the_first_failure(proxy):
    km, kc = proxy
    reply, outputs = execute(kc, "print('a')\n1/0\n%gpuhelp")
    assert reply["content"]["ename"] == "ZeroDivisionError"
    assert [m["msg_type"] for m in outputs] == ["stream", "error"]
    reply, outputs = execute(kc, "%gpumem --bogus\nprint('never')")
    assert reply["content"]["ename"] == "UsageError"
    assert stream_text(outputs) == ""
    # IPython's own magics still reach IPython.
    reply, outputs = execute(kc, "%time x = 1\n%gpuhelp")
    assert reply["content"]["status"] == "ok"
    assert "Wall time" in stream_text(outputs)


def test_comm_from_the_child_reaches_the_client_and_back(proxy):
    km, kc = proxy
    _, outputs = execute(kc, "from comm import create_comm\n"
                             "received = []\n"
                             "c = create_comm(target_name='gpu-test', data={'hello': 1})\n"
                             "c.on_msg(lambda m: received.append(m['content']['data']))")
    opened = [m for m in outputs if m["msg_type"] == "comm_open"]
    assert opened and opened[0]["content"]["target_name"] == "gpu-test"
    assert opened[0]["content"]["data"] == {"hello": 1}
    comm_id = opened[0]["content"]["comm_id"]
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"back": 42}}))
    time.sleep(0.5)
    _, outputs = execute(kc, "print(received)")
    assert stream_text(outputs) == "[{'back': 42}]\n"


def test_forged_message_is_not_executed(proxy):
    km, kc = proxy
    forged = Session(key=b"wrong-key")
    msg = forged.msg("execute_request", {"code": "open('/tmp/gpukernel-forged', 'w')", "silent": False,
                                         "store_history": True, "user_expressions": {},
                                         "allow_stdin": False, "stop_on_error": True})
    if os.path.exists("/tmp/gpukernel-forged"):
        os.remove("/tmp/gpukernel-forged")
    forged.send(kc.shell_channel.socket, msg)
    time.sleep(0.5)
    assert not os.path.exists("/tmp/gpukernel-forged")
    assert execute(kc, "1")[0]["content"]["execution_count"] == 1


def test_side_channel_sees_torch_without_importing_it(proxy):
    km, kc = proxy
    _, outputs = execute(kc, "%gpumem --json")
    state = outputs[0]["content"]["data"]["application/json"]["python_kernel"]
    assert state["pid"] == child_of(km).pid
    assert state["torch"]["imported"] is False
    _, outputs = execute(kc, "import sys; print('torch' in sys.modules)")
    assert stream_text(outputs) == "False\n", "the side channel must never import torch"
    # The side channel neither shows output nor takes an execution count.
    assert execute(kc, "1")[0]["content"]["execution_count"] == 3

    execute(kc, "import torch", timeout=60)
    _, outputs = execute(kc, "%gpumem --json")
    torch_state = outputs[0]["content"]["data"]["application/json"]["python_kernel"]["torch"]
    assert torch_state["imported"] is True
    assert torch_state["version"].startswith("2.11")
    assert torch_state["cuda_initialized"] is False
    _, outputs = execute(kc, "%gpumem")
    assert "torch 2.11" in outputs[0]["content"]["data"]["text/plain"]


def test_emptycache_without_torch_says_so(proxy):
    km, kc = proxy
    reply, outputs = execute(kc, "%emptycache --json")
    assert reply["content"]["status"] == "ok"
    report = outputs[0]["content"]["data"]["application/json"]
    python_row = next(p for p in report["processes"] if p["who"] == "Python kernel")
    assert "torch is not imported" in python_row["note"]
    _, outputs = execute(kc, "import sys; print('torch' in sys.modules)")
    assert stream_text(outputs) == "False\n"
    execute(kc, "import torch", timeout=60)
    _, outputs = execute(kc, "%emptycache")
    assert "torch has not initialised CUDA" in outputs[0]["content"]["data"]["text/plain"]


def test_watch_gauge_updates_while_python_runs(proxy):
    km, kc = proxy
    started = time.monotonic()
    reply, outputs = execute(kc, "%gpumem --watch 0.2")
    assert time.monotonic() - started < 2, "the gauge does not hold the cell"
    display_id = outputs[0]["content"]["transient"]["display_id"]
    msg_id = kc.execute("import time; time.sleep(1.5); print('trained')")
    updates_during = []
    deadline = time.monotonic() + 10
    finished = False
    while not finished and time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=5)
        if msg["msg_type"] == "update_display_data":
            assert msg["content"]["transient"]["display_id"] == display_id
            updates_during.append(msg)
        finished = (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle")
    assert finished
    assert len(updates_during) >= 4, "the gauge kept updating while the cell ran"
    _, outputs = execute(kc, "%gpumem --stop")
    assert stream_text(outputs) == "Stopped the GPU gauge.\n"
    time.sleep(0.3)
    drain_iopub(kc, 0.2)
    assert [m for m in drain_iopub(kc, 1.0) if m["msg_type"] == "update_display_data"] == []
    _, outputs = execute(kc, "%gpumem --stop")
    assert stream_text(outputs) == "No GPU gauge is running.\n"


def _child_spec(gpukernel: Path, name: str, child_argv: list[str]) -> None:
    """A kernelspec in the tests' JUPYTER_PATH whose Python kernel is `child_argv`."""
    spec_dir = Path(os.environ["JUPYTER_PATH"]) / "kernels" / name
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(gpukernel), "run", "-f", "{connection_file}", "--", *child_argv],
        "display_name": name, "language": "python", "interrupt_mode": "message"}))


def test_the_child_is_reachable_only_through_a_private_directory(tmp_path, gpukernel):
    """The child kernel listens on ipc sockets in a 0700 directory (its connection file is
    0600 there): no other user of the machine can reach it, and it listens on no TCP port."""
    record = tmp_path / "child.json"
    wrapper = tmp_path / "child.py"
    wrapper.write_text(
        "import json, os, stat, sys\n"
        "d = os.path.dirname(sys.argv[1])\n"
        f"json.dump({{'info': json.load(open(sys.argv[1])), 'pid': os.getpid(),\n"
        "           'dir': d, 'dir_mode': stat.S_IMODE(os.stat(d).st_mode),\n"
        "           'file_mode': stat.S_IMODE(os.stat(sys.argv[1]).st_mode)},\n"
        f"          open({str(record)!r}, 'w'))\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'ipykernel_launcher', '-f', sys.argv[1]])\n")
    name = f"private-{os.getpid()}"
    _child_spec(gpukernel, name, [sys.executable, str(wrapper), "{child_connection_file}"])
    try:
        with running_kernel(name) as (km, kc):
            reply, outputs = execute(kc, "print(6 * 7)")
            assert stream_text(outputs) == "42\n"
            seen = json.loads(record.read_text())
            assert seen["info"]["transport"] == "ipc"
            assert seen["dir_mode"] == 0o700 and seen["file_mode"] == 0o600
            sockets = sorted(p.name for p in Path(seen["dir"]).iterdir() if p.is_socket())
            assert sockets == ["k-1", "k-2", "k-3", "k-4", "k-5"]
            # No channel of the child is on TCP. The one loopback port ipykernel itself opens
            # is its pipe for output from forked subprocesses (iostream.py), the same in a
            # plain ipykernel, and it carries no requests.
            _, outputs = execute(kc, "import sys; print(getattr(sys.stdout.pub_thread, "
                                     "'_pipe_port', None))")
            pipe_port = stream_text(outputs).strip()
            listening = {c.laddr.port for c in psutil.Process(seen["pid"]).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN}
            assert {str(p) for p in listening} <= {pipe_port}, listening
            km.shutdown_kernel()  # as Jupyter does: a shutdown_request first
        # The directory goes with the kernel.
        deadline = time.monotonic() + 5
        while Path(seen["dir"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(seen["dir"]).exists()
    finally:
        shutil.rmtree(Path(os.environ["JUPYTER_PATH"]) / "kernels" / name)


def test_a_child_that_never_starts_is_reported(tmp_path, gpukernel):
    counter = tmp_path / "starts"
    wrapper = tmp_path / "child.sh"
    wrapper.write_text(f"#!/bin/sh\necho start >> {counter}\necho 'no python here' >&2\nexit 3\n")
    wrapper.chmod(0o755)

    conn = tmp_path / "kernel.json"
    conn.write_text(json.dumps({"ip": "127.0.0.1", "transport": "tcp", "shell_port": 0,
                                "iopub_port": 0, "stdin_port": 0, "control_port": 0,
                                "hb_port": 0, "key": "k", "signature_scheme": "hmac-sha256"}))
    out = subprocess.run([str(gpukernel), "run", "-f", str(conn), "--", str(wrapper)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "exited during start-up (exit status: 3)" in out.stderr, out.stderr
    assert counter.read_text().count("start") == 1
