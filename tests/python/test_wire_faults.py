"""A local peer without the key, on every socket of both kernel modes: raw ZMTP over TCP with
a huge announced frame, a truncated frame, garbage bytes; and a captured signed message sent
again. The kernel drops the peer (or the message) and answers the next request."""

from __future__ import annotations

import os
import queue
import socket
import struct
import time

import pytest

from kernel_client import collect, execute, running_kernel, stream_text

CHANNELS = ["shell", "iopub", "stdin", "control", "hb"]
SOCKET_TYPE = {"shell": b"DEALER", "iopub": b"SUB", "stdin": b"DEALER",
               "control": b"DEALER", "hb": b"REQ"}


@pytest.fixture(scope="module", params=["gpu-magics", "gpu-python"])
def kernel(request):
    with running_kernel(request.param) as (km, kc):
        yield request.param, km, kc


def greeting() -> bytes:
    """A ZMTP 3.0 greeting with the NULL mechanism (what any zmq client sends first)."""
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def ready(socket_type: bytes) -> bytes:
    """The READY command that completes the NULL handshake."""
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def long_frame_header(length: int, command: bool = False) -> bytes:
    return bytes([0x02 | (0x04 if command else 0)]) + struct.pack(">Q", length)


def connect(km, channel: str) -> socket.socket:
    port = getattr(km, f"{channel}_port")
    sock = socket.create_connection((km.ip, port), timeout=5)
    sock.settimeout(5)
    return sock


def dropped(sock: socket.socket) -> bool:
    """True once the kernel has closed this connection (EOF or reset)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
    return False


def still_serving(mode: str, km, kc) -> None:
    """Every channel answers: shell and iopub (a cell), control, heartbeat, stdin."""
    assert km.is_alive()
    if mode == "gpu-python":
        msg_id = kc.execute("print('answer:', input('q? '))", allow_stdin=True)
        request = kc.get_stdin_msg(timeout=15)
        assert request["parent_header"]["msg_id"] == msg_id
        kc.input("42")
        reply, outputs = collect(kc, msg_id)
        assert stream_text(outputs) == "answer: 42\n"
    else:
        reply, outputs = execute(kc, "%echo still here")
        assert stream_text(outputs) == "still here\n"
    assert reply["content"]["status"] == "ok"
    msg = kc.session.msg("kernel_info_request", {})
    kc.control_channel.send(msg)
    control_reply = kc.get_control_msg(timeout=10)
    assert control_reply["parent_header"]["msg_id"] == msg["header"]["msg_id"]
    assert kc.hb_channel.is_beating()


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_huge_announced_frame_drops_the_peer(kernel, channel):
    """The crash of the issue: greeting, then a frame announcing 2^62 bytes (before any
    handshake, and after a complete one, as a message and as a command)."""
    mode, km, kc = kernel
    for after_handshake, command in [(False, False), (True, False), (True, True)]:
        sock = connect(km, channel)
        sock.sendall(greeting())
        if after_handshake:
            sock.sendall(ready(SOCKET_TYPE[channel]))
        sock.sendall(long_frame_header(1 << 62, command) + b"x" * 64)
        assert dropped(sock), f"{channel}: the peer was not disconnected"
        sock.close()
    still_serving(mode, km, kc)


@pytest.mark.parametrize("channel", CHANNELS)
def test_truncated_frames_and_garbage_leave_the_kernel_serving(kernel, channel):
    mode, km, kc = kernel
    # A frame announcing 1000 bytes, 10 sent, then the peer goes.
    sock = connect(km, channel)
    sock.sendall(greeting() + ready(SOCKET_TYPE[channel]) + b"\x00" + bytes([200]) + b"x" * 10)
    sock.close()
    # Bytes that are no ZMTP at all.
    sock = connect(km, channel)
    sock.sendall(bytes(range(256)) * 64)
    assert dropped(sock), f"{channel}: a peer sending garbage was not disconnected"
    sock.close()
    # A greeting cut short.
    sock = connect(km, channel)
    sock.sendall(greeting()[:30])
    sock.close()
    still_serving(mode, km, kc)


def count(mode: str, kc) -> int:
    """The kernel's execution count, read with a silent-free cell of its own."""
    reply, _ = execute(kc, "%echo count" if mode == "gpu-magics" else "pass")
    return reply["content"]["execution_count"]


def test_a_replayed_execute_request_runs_once(kernel):
    """A signed request captured on the wire and sent again is dropped, as jupyter_client's
    digest history does: the cell runs once and takes one execution count."""
    mode, km, kc = kernel
    before = count(mode, kc)
    code = "%echo replayed" if mode == "gpu-magics" else "print('replayed')"
    msg = kc.session.msg("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True})
    frames = kc.session.serialize(msg)
    socket_ = kc.shell_channel.socket
    socket_.send_multipart(frames)
    reply, outputs = collect(kc, msg["header"]["msg_id"])
    assert stream_text(outputs) == "replayed\n"
    socket_.send_multipart(frames)
    time.sleep(1.0)
    after = count(mode, kc)
    assert after == before + 2, "the replay ran"  # the cell itself and this count's cell


def test_a_replayed_control_request_is_answered_once(kernel):
    mode, km, kc = kernel
    msg = kc.session.msg("kernel_info_request", {})
    frames = kc.session.serialize(msg)
    kc.control_channel.socket.send_multipart(frames)
    kc.control_channel.socket.send_multipart(frames)
    replies = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            replies.append(kc.get_control_msg(timeout=0.5))
        except queue.Empty:
            pass
    ours = [r for r in replies if r["parent_header"].get("msg_id") == msg["header"]["msg_id"]]
    assert len(ours) == 1
    still_serving(mode, km, kc)


def test_a_replayed_input_reply_does_not_answer_the_next_prompt(kernel):
    """The first answer, captured and sent again while the cell asks a second question, must
    not be taken as the second answer."""
    mode, km, kc = kernel
    if mode != "gpu-python":
        pytest.skip("the magics-only kernel asks for no input")
    msg_id = kc.execute("a = input('first? '); b = input('second? '); print(a, b)",
                        allow_stdin=True)
    assert kc.get_stdin_msg(timeout=15)["content"]["prompt"] == "first? "
    answer = kc.session.msg("input_reply", {"value": "one"})
    frames = kc.session.serialize(answer)
    kc.stdin_channel.socket.send_multipart(frames)
    assert kc.get_stdin_msg(timeout=15)["content"]["prompt"] == "second? "
    kc.stdin_channel.socket.send_multipart(frames)  # the replay
    time.sleep(0.5)
    kc.input("two")
    reply, outputs = collect(kc, msg_id)
    assert stream_text(outputs) == "one two\n"


def test_a_message_over_the_configured_limit_drops_only_that_peer(tmp_path, gpukernel):
    """GPUKERNEL_MAX_MESSAGE_BYTES: a real client's message over it is refused (the peer
    disconnected, its request never runs); one under it is served, and the kernel goes on."""
    env = dict(os.environ, GPUKERNEL_MAX_MESSAGE_BYTES=str(1 << 20))
    with running_kernel("gpu-magics", env=env) as (km, kc):
        big = "x" * (2 << 20)
        kc.execute(f"%echo {big}")
        time.sleep(1.0)
        # The client's zmq reconnects by itself; the next request is served.
        reply, outputs = execute(kc, "%echo " + "y" * (512 << 10), timeout=30)
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["execution_count"] == 1, "the oversized request ran"
        assert stream_text(outputs) == "y" * (512 << 10) + "\n"
