"""Cells that mix our magics with Python, under a real jupyter_client and a real ipykernel
child: every cell completes, whatever its parts, and the rule holds: one execute_reply, one
busy/idle pair and one execution count per cell, outputs in the order of the parts."""

from __future__ import annotations

import queue
import random
import time

import pytest

from kernel_client import running_kernel, stream_text


@pytest.fixture(scope="module")
def proxy():
    with running_kernel("gpu-python") as pair:
        yield pair


def run_cell(kc, code, inputs=(), timeout=30, interrupt_after=None, km=None):
    """Executes `code`, answers its input_requests with `inputs` in order, and returns
    (reply, outputs, statuses, prompts): every iopub message of the cell up to its idle,
    then a short drain to be sure nothing of it comes later."""
    msg_id = kc.execute(code, allow_stdin=True)
    answers = list(inputs)
    prompts = []
    reply = None
    outputs, statuses = [], []
    deadline = time.monotonic() + timeout
    idle = False
    started = time.monotonic()
    interrupted = False
    while time.monotonic() < deadline and not (reply is not None and idle):
        if interrupt_after is not None and not interrupted and \
                time.monotonic() - started > interrupt_after:
            km.interrupt_kernel()
            interrupted = True
        try:
            request = kc.get_stdin_msg(timeout=0.01)
            if request["parent_header"].get("msg_id") == msg_id:
                prompts.append(request["content"]["prompt"])
                if answers:
                    kc.input(answers.pop(0))
        except queue.Empty:
            pass
        try:
            msg = kc.get_shell_msg(timeout=0.01)
            if msg["parent_header"].get("msg_id") == msg_id:
                assert reply is None, "a second execute_reply"
                reply = msg
        except queue.Empty:
            pass
        try:
            msg = kc.get_iopub_msg(timeout=0.01)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status":
            statuses.append(msg["content"]["execution_state"])
            idle = statuses[-1] == "idle"
        elif msg["msg_type"] != "execute_input":
            outputs.append(msg)
    assert reply is not None and idle, f"cell never completed: {statuses} {outputs}"
    drain_until = time.monotonic() + 0.5
    while time.monotonic() < drain_until:
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            if msg["msg_type"] == "status":
                statuses.append(msg["content"]["execution_state"])
            else:
                outputs.append(msg)
    return reply, outputs, statuses, prompts


def merged(outputs):
    """Adjacent stream texts joined: Python may send consecutive prints in one message."""
    out = []
    for kind, text in outputs:
        if kind == "stream" and out and out[-1][0] == "stream":
            out[-1] = ("stream", out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def count_of(kc):
    reply, _, statuses, _ = run_cell(kc, "pass")
    assert statuses == ["busy", "idle"]
    return reply["content"]["execution_count"]


def test_identical_python_parts_around_a_magic_all_run(proxy):
    _, kc = proxy
    run_cell(kc, "steps = 0")
    before = count_of(kc)
    reply, outputs, statuses, _ = run_cell(kc, "steps += 1\n%gpuhelp\nsteps += 1")
    assert reply["content"]["status"] == "ok", reply["content"]
    assert statuses == ["busy", "idle"]
    assert reply["content"]["execution_count"] == before + 1
    _, outputs, _, _ = run_cell(kc, "print(steps)")
    assert stream_text(outputs) == "2\n"
    assert count_of(kc) == before + 3


def test_near_identical_parts_and_up_to_ten_of_them(proxy):
    _, kc = proxy
    for parts in range(1, 11):
        lines = []
        for i in range(parts):
            lines.append("print('part')" if i % 2 else "print('part' )")
            lines.append("%gpuhelp")
        reply, outputs, statuses, _ = run_cell(kc, "\n".join(lines))
        assert reply["content"]["status"] == "ok", reply["content"]
        assert statuses == ["busy", "idle"]
        kinds = [m["msg_type"] for m in outputs]
        assert kinds == ["stream", "display_data"] * parts, kinds
        assert stream_text(outputs) == "part\n" * parts


@pytest.mark.parametrize("code, inputs, expected", [
    ("a = input('first? ')\n%gpuhelp\nprint('got', a)", ["x"], "got x\n"),
    ("%gpuhelp\nb = input('between? ')\n%gpuhelp\nprint('got', b)", ["y"], "got y\n"),
    ("%gpuhelp\nc = input('after? ')\nprint('got', c)", ["z"], "got z\n"),
    ("d = input('one? ')\n%gpuhelp\ne = input('two? ')\nprint('got', d, e)", ["1", "2"],
     "got 1 2\n"),
])
def test_input_before_between_and_after_magics(proxy, code, inputs, expected):
    _, kc = proxy
    before = count_of(kc)
    reply, outputs, statuses, prompts = run_cell(kc, code, inputs)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert len(prompts) == len(inputs), prompts
    assert stream_text(outputs) == expected
    assert statuses == ["busy", "idle"]
    assert reply["content"]["execution_count"] == before + 1
    assert count_of(kc) == before + 2


def test_interrupt_while_a_part_waits_for_input(proxy):
    km, kc = proxy
    before = count_of(kc)
    reply, outputs, statuses, prompts = run_cell(
        kc, "%gpuhelp\nname = input('wait? ')\nprint('never')", interrupt_after=2, km=km)
    assert prompts == ["wait? "]
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    assert "never" not in stream_text(outputs)
    assert statuses == ["busy", "idle"]
    assert count_of(kc) == before + 2


def test_interrupt_while_a_part_runs(proxy):
    km, kc = proxy
    before = count_of(kc)
    t0 = time.monotonic()
    reply, outputs, statuses, _ = run_cell(
        kc, "%gpuhelp\nimport time\ntime.sleep(60)\n%gpuhelp", interrupt_after=2, km=km)
    assert time.monotonic() - t0 < 10
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    assert [m["msg_type"] for m in outputs] == ["display_data", "error"], outputs
    assert statuses == ["busy", "idle"]
    assert count_of(kc) == before + 2


def test_random_mixed_cells_keep_the_rules(proxy):
    """Property-style: random cells of Python prints, magics and input() calls; outputs come
    in the order of the parts, one reply, one busy/idle pair, counts one apart."""
    _, kc = proxy
    rng = random.Random(20261203)
    for case in range(25):
        lines, expected, inputs = [], [], []
        for j in range(rng.randint(1, 7)):
            kind = rng.choice(["print", "print", "magic", "input"])
            if kind == "print":
                lines.append(f"print('p{case}_{j}')")
                expected.append(("stream", f"p{case}_{j}\n"))
            elif kind == "magic":
                lines.append("%gpuhelp")
                expected.append(("display_data", None))
            else:
                answer = f"a{case}_{j}"
                lines.append(f"print(input('q{j}? '))")
                inputs.append(answer)
                expected.append(("stream", answer + "\n"))
        before = count_of(kc)
        code = "\n".join(lines)
        reply, outputs, statuses, prompts = run_cell(kc, code, inputs)
        assert reply["content"]["status"] == "ok", (code, reply["content"])
        got = merged([(m["msg_type"], m["content"].get("text")) for m in outputs])
        assert got == merged(expected), code
        assert statuses == ["busy", "idle"], code
        assert len(prompts) == len(inputs), code
        assert reply["content"]["execution_count"] == before + 1, code


def test_a_child_that_dies_mid_cell_ends_the_cell_and_a_restart_serves():
    with running_kernel("gpu-python") as (km, kc):
        msg_id = kc.execute("%gpuhelp\nimport os\nos._exit(3)\n%gpuhelp")
        deadline = time.monotonic() + 20
        while km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not km.is_alive(), "gpukernel stops with its Python kernel"
        assert msg_id
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=30)
        reply, outputs, statuses, _ = run_cell(kc, "print('back')\n%gpuhelp")
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["execution_count"] == 1
        assert stream_text(outputs) == "back\n"
