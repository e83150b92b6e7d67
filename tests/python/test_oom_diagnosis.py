"""The OOM diagnosis in the gpu-python kernel, on a machine without a GPU: a real gpukernel in
front of a real ipykernel with real torch, driven by jupyter_client.

A cell raises a real ``torch.cuda.OutOfMemoryError`` (constructed on the CPU, from inside a
model's forward, as the allocator's would surface) and gets the diagnosis display right after
its traceback, before the cell's idle, with the request parsed from the message and the batch
advice made from the model's input. Cells that catch their own OOM, raise another error, or
raise an error whose text merely looks like an OOM get none. ``%oom`` repeats the last one;
``%oom --json`` returns it. The notebook's namespace and ``sys.modules`` are what they were.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from kernel_client import execute, running_kernel

GIB = 1 << 30

SETUP = r"""
import torch

OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
            "78.08 GiB memory in use. Of the allocated memory 76.50 GiB is allocated by PyTorch, "
            "and 512.00 MiB is reserved by PyTorch but unallocated.")

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
    def forward(self, x):
        h = self.lin(x)
        raise torch.cuda.OutOfMemoryError(OOM_TEXT)

model = Net()
features = torch.zeros(1024, 1024)      # 4 MiB, the biggest live tensor
batches = [torch.ones(16, 64) for _ in range(3)]
batch_size = 64
"""

OOM_CELL = "model(torch.randn(batch_size, 64))"


def snapshot(kc) -> tuple[list[str], list[str]]:
    """The notebook's global names and sys.modules, read by a silent request (adds nothing)."""
    msg_id = kc.execute(
        "",
        silent=True,
        store_history=False,
        user_expressions={
            "g": "sorted(globals())",
            "m": "sorted(__import__('sys').modules)",
        },
    )
    reply = kc.get_shell_msg(timeout=15)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=15)
    values = reply["content"]["user_expressions"]
    return (
        eval(values["g"]["data"]["text/plain"]),  # noqa: S307 - a list literal from the kernel
        eval(values["m"]["data"]["text/plain"]),  # noqa: S307
    )


def when(msg: dict) -> datetime:
    date = msg["header"]["date"]
    return date if isinstance(date, datetime) else datetime.fromisoformat(date)


def displays(outputs: list[dict]) -> list[dict]:
    return [m for m in outputs if m["msg_type"] == "display_data"]


def diagnosis_of(outputs: list[dict]) -> dict:
    found = [
        m["content"]["data"]
        for m in displays(outputs)
        if "gpukernel-oom" in m["content"]["data"].get("text/html", "")
    ]
    assert len(found) == 1, [m["msg_type"] for m in outputs]
    return found[0]


@pytest.fixture(scope="module")
def kernel():
    with running_kernel("gpu-python") as (km, kc):
        reply, _ = execute(kc, SETUP, timeout=90)
        assert reply["content"]["status"] == "ok", reply["content"]
        # IPython imports its traceback formatting (stack_data, asttokens...) at the first
        # error it shows: let that happen before anything compares sys.modules.
        # The same frames as the OOM cell's, so the same imports.
        reply, _ = execute(kc, "model.forward = lambda x: model.lin(x)[None]['warm-up']\n"
                               "try:\n    model(torch.randn(batch_size, 64))\n"
                               "finally:\n    del model.forward", timeout=30)
        assert reply["content"]["status"] == "error"
        yield kc


def test_an_oom_gets_the_diagnosis_under_its_traceback(kernel):
    kc = kernel
    names_before, modules_before = snapshot(kc)
    reply, outputs = execute(kc, OOM_CELL, timeout=30)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "OutOfMemoryError"
    kinds = [m["msg_type"] for m in outputs]
    assert "error" in kinds and "display_data" in kinds, kinds
    # Right after the traceback, before the cell's idle (collect stops there).
    assert kinds.index("display_data") == kinds.index("error") + 1, kinds
    error_at = when(outputs[kinds.index("error")])
    shown_at = when(displays(outputs)[0])
    assert (shown_at - error_at).total_seconds() < 1.0

    data = diagnosis_of(outputs)
    assert {"text/plain", "text/html", "application/json"} <= set(data)
    d = data["application/json"]
    assert d["exception_type"] == "torch.OutOfMemoryError"
    assert d["requested_bytes"] == 2 * GIB
    assert d["device"]["cuda_index"] == 0
    assert d["at_oom"]["reserved_unallocated_at_oom"] == 512 << 20
    # Raised by code, not the allocator: CUDA was never initialised here.
    assert d["allocator_confirms"] is None
    assert d["model"] == "model"
    assert d["batch"] == {"size": 64, "source": "the first dimension of model's input"}
    names = [t["name"] for t in d["tensors"]]
    assert names[0] == "features" and d["tensors"][0]["bytes"] == 4 << 20
    assert d["tensors"][0]["shape"] == [1024, 1024]
    assert "model" in names and "batches[0]" in names
    first = d["suggestions"][0]
    assert first == {**first, "kind": "gradient_accumulation", "from": 64, "batch": 32, "steps": 2}
    assert "64 -> 32 x 2" in first["text"]
    assert any(s == {**s, "kind": "run_maxbatch", "command": "%maxbatch model"}
               for s in d["suggestions"])
    text = data["text/plain"]
    assert "asked for 2.00 GiB on cuda:0" in text and "features" in text

    names_after, modules_after = snapshot(kc)
    assert set(modules_after) ^ set(modules_before) == set()
    added = set(names_after) - set(names_before)
    # IPython's own record of the cell's input; nothing else.
    assert all(n.startswith("_i") for n in added), added
    # IPython deletes __warningregistry__ before every cell (pre_execute).
    assert set(names_before) - set(names_after) - {"__warningregistry__"} == set()

    # %oom shows it again; --json returns it as the cell's value.
    reply, outputs = execute(kc, "%oom", timeout=30)
    assert reply["content"]["status"] == "ok"
    assert diagnosis_of(outputs)["application/json"] == d
    reply, outputs = execute(kc, "%oom --json", timeout=30)
    results = [m for m in outputs if m["msg_type"] == "execute_result"]
    assert results and results[0]["content"]["data"]["application/json"] == d


def test_a_caught_oom_another_error_and_a_lookalike_get_none(kernel):
    kc = kernel
    cells = {
        "caught": "try:\n    model(torch.randn(8, 64))\nexcept torch.cuda.OutOfMemoryError:\n"
        "    print('caught')",
        "other": "raise ValueError('not memory')",
        "lookalike": "raise RuntimeError(OOM_TEXT)",
    }
    for name, code in cells.items():
        reply, outputs = execute(kc, code, timeout=30)
        assert not displays(outputs), (name, outputs)
        assert reply["content"]["status"] == ("ok" if name == "caught" else "error"), name
    # %oom still has the last real one (from the test above, or none if run alone).
    reply, outputs = execute(kc, "%oom --json", timeout=30)
    value = [m for m in outputs if m["msg_type"] == "execute_result"][0]["content"]["data"]
    assert value["application/json"].get("exception_type", "torch.OutOfMemoryError") == (
        "torch.OutOfMemoryError"
    )


def test_a_wrapped_oom_and_one_in_a_mixed_cell_are_diagnosed(kernel):
    kc = kernel
    wrapped = (
        "try:\n    model(torch.randn(batch_size, 64))\n"
        "except torch.OutOfMemoryError as e:\n    raise RuntimeError('step failed') from e"
    )
    reply, outputs = execute(kc, wrapped, timeout=30)
    assert reply["content"]["ename"] == "RuntimeError"
    assert diagnosis_of(outputs)["application/json"]["requested_bytes"] == 2 * GIB

    reply, outputs = execute(kc, "%gpumem\n" + OOM_CELL, timeout=30)
    assert reply["content"]["status"] == "error"
    kinds = [m["msg_type"] for m in outputs]
    assert kinds[-2:] == ["error", "display_data"], kinds
    assert diagnosis_of(outputs)["application/json"]["batch"]["size"] == 64


def test_release_lets_go_of_the_failed_cells_traceback(kernel):
    kc = kernel
    reply, _ = execute(kc, OOM_CELL, timeout=30)
    assert reply["content"]["status"] == "error"
    reply, outputs = execute(kc, "%oom --release --json", timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    value = [m for m in outputs if m["msg_type"] == "execute_result"][0]["content"]["data"]
    assert value["application/json"]["had_traceback"] is True
    reply, outputs = execute(kc, "import sys\nprint(hasattr(sys, 'last_traceback'), "
                                 "get_ipython().InteractiveTB.tb)", timeout=30)
    assert "".join(m["content"].get("text", "") for m in outputs).strip() == "False None"


def test_magics_only_kernel_has_oom_with_nothing_to_show():
    with running_kernel("gpu-magics") as (km, kc):
        reply, outputs = execute(kc, "%oom --json", timeout=30)
        assert reply["content"]["status"] == "ok"
        value = [m for m in outputs if m["msg_type"] == "execute_result"][0]["content"]["data"]
        assert value["application/json"] == {"diagnosis": None}
        assert "magics-only" in value["text/plain"]
        reply, outputs = execute(kc, "%gpuhelp", timeout=30)
        assert "%oom" in json.dumps([m["content"] for m in outputs])
