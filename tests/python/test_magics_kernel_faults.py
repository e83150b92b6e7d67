"""The gpu-magics kernel under a real jupyter_client: forged and broken messages, interrupts,
shutdown, and the magics' own error messages."""

from __future__ import annotations

import ctypes.util
import signal
import time

import pytest
from jupyter_client.session import Session

from kernel_client import drain_iopub, execute, running_kernel, stream_text

HAS_NVML = ctypes.util.find_library("nvidia-ml") is not None


@pytest.fixture()
def magics_kernel():
    with running_kernel("gpu-magics") as pair:
        yield pair


def test_message_signed_with_wrong_key_is_not_executed(magics_kernel):
    km, kc = magics_kernel
    forged = Session(key=b"not-the-key", username="mallory")
    msg = forged.msg("execute_request", {
        "code": "%echo FORGED", "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True,
    })
    forged.send(kc.shell_channel.socket, msg)
    time.sleep(0.5)
    leaked = [m for m in drain_iopub(kc) if "FORGED" in str(m.get("content"))]
    assert leaked == []
    # The kernel is still serving, and the forged cell did not take an execution count.
    reply, outputs = execute(kc, "%echo genuine")
    assert reply["content"]["status"] == "ok"
    assert reply["content"]["execution_count"] == 1
    assert stream_text(outputs) == "genuine\n"


@pytest.mark.parametrize("frames", [
    [b"<IDS|MSG>", b"sig", b"{"],                                   # truncated
    [b"no delimiter at all"],                                       # no <IDS|MSG>
    [b"<IDS|MSG>", b"", b"not json", b"{}", b"{}", b"{}"],          # unsigned, not JSON
])
def test_broken_frames_do_not_kill_the_kernel(magics_kernel, frames):
    km, kc = magics_kernel
    kc.shell_channel.socket.send_multipart(frames)
    time.sleep(0.3)
    assert km.is_alive()
    reply, outputs = execute(kc, "%echo still here")
    assert reply["content"]["status"] == "ok"
    assert stream_text(outputs) == "still here\n"


def test_validly_signed_but_malformed_json_is_dropped(magics_kernel):
    km, kc = magics_kernel
    session = kc.session  # has the real key
    parts = [b"{not json", b"{}", b"{}", b"{}"]
    signature = session.sign(parts)
    kc.shell_channel.socket.send_multipart([b"<IDS|MSG>", signature, *parts])
    time.sleep(0.3)
    assert km.is_alive()
    assert execute(kc, "%echo ok")[0]["content"]["status"] == "ok"


@pytest.mark.parametrize("how", ["message", "signal"])
def test_interrupt_stops_a_long_magic(magics_kernel, how):
    km, kc = magics_kernel
    msg_id = kc.execute("%gpumem --watch 0.2")
    time.sleep(1.0)
    started = time.monotonic()
    if how == "message":
        km.interrupt_kernel()
    else:
        km.signal_kernel(signal.SIGINT)
    reply = kc.get_shell_msg(timeout=5)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert time.monotonic() - started < 2.0
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    # The kernel takes the next request.
    assert execute(kc, "%echo after")[0]["content"]["status"] == "ok"


def test_watch_gauge_updates_one_display(magics_kernel):
    km, kc = magics_kernel
    reply, outputs = execute(kc, "%gpumem --watch 0.1 --count 3")
    assert reply["content"]["status"] == "ok"
    displays = [m for m in outputs if m["msg_type"] == "display_data"]
    updates = [m for m in outputs if m["msg_type"] == "update_display_data"]
    assert len(displays) == 1 and len(updates) == 2
    display_id = displays[0]["content"]["transient"]["display_id"]
    assert all(u["content"]["transient"]["display_id"] == display_id for u in updates)


def test_shutdown_request_ends_the_process(magics_kernel):
    km, kc = magics_kernel
    process = km.provisioner.process
    kc.shutdown()
    deadline = time.monotonic() + 5
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() == 0, "the kernel exits by itself, with status 0"


def test_execution_count_follows_store_history(magics_kernel):
    km, kc = magics_kernel
    assert execute(kc, "%echo a")[0]["content"]["execution_count"] == 1
    assert execute(kc, "%echo b", store_history=False)[0]["content"]["execution_count"] == 1
    assert execute(kc, "%echo c", silent=True)[0]["content"]["execution_count"] == 1
    assert execute(kc, "%nosuch")[0]["content"]["execution_count"] == 2
    assert execute(kc, "%echo d")[0]["content"]["execution_count"] == 3


def test_errors_name_the_problem_and_the_choices(magics_kernel):
    km, kc = magics_kernel
    reply, outputs = execute(kc, "%gpumen")
    assert reply["content"]["ename"] == "UsageError"
    assert "unknown magic %gpumen" in reply["content"]["evalue"]
    assert "%gpumem" in reply["content"]["evalue"]
    assert [m["msg_type"] for m in outputs] == ["error"]

    reply, _ = execute(kc, "%gpumem --bogus")
    assert "--bogus" in reply["content"]["evalue"]
    assert "Usage: %gpumem" in reply["content"]["evalue"]

    reply, _ = execute(kc, "%gpuhelp nosuch")
    assert "possible values: gpuhelp, gpumem, emptycache, maxbatch, oom, envcheck, echo" in reply["content"]["evalue"]

    reply, _ = execute(kc, "x = 1")
    assert "gpu-python" in reply["content"]["evalue"]

    # A failing line stops the rest of the cell.
    reply, outputs = execute(kc, "%echo first\n%nosuch\n%echo never")
    assert reply["content"]["status"] == "error"
    assert stream_text(outputs) == "first\n"


@pytest.mark.skipif(HAS_NVML, reason="this machine has an NVIDIA driver")
def test_gpumem_without_a_driver_says_so_plainly(magics_kernel):
    km, kc = magics_kernel
    reply, outputs = execute(kc, "%gpumem")
    assert reply["content"]["status"] == "ok"
    text = outputs[0]["content"]["data"]["text/plain"]
    assert text.startswith("No NVIDIA GPU is visible here")
    assert "Traceback" not in text
    reply, outputs = execute(kc, "%gpumem --json")
    assert outputs[0]["content"]["data"]["application/json"]["available"] is False


def test_help_in_the_pager_and_inline(magics_kernel):
    km, kc = magics_kernel
    reply, _ = execute(kc, "%gpumem?")
    page = reply["content"]["payload"][0]
    assert page["source"] == "page" and "--watch" in page["data"]["text/plain"]
    reply, outputs = execute(kc, "%gpumem --help")
    assert "Usage: %gpumem" in stream_text(outputs)


def test_kernel_does_not_load_libtorch_for_nvml_magics(magics_kernel):
    """libtorch (and so any CUDA context) is loaded only when a magic needs it."""
    km, kc = magics_kernel
    assert execute(kc, "%gpumem")[0]["content"]["status"] == "ok"
    maps = open(f"/proc/{km.provisioner.process.pid}/maps").read()
    assert "libtorch" not in maps
    assert "libcuda" not in maps


def test_emptycache_in_the_magics_kernel(magics_kernel):
    km, kc = magics_kernel
    reply, outputs = execute(kc, "%emptycache --json")
    report = outputs[0]["content"]["data"]["application/json"]
    assert [p["who"] for p in report["processes"]] == ["gpukernel"]
    assert "nothing cached" in report["processes"][0]["note"]
