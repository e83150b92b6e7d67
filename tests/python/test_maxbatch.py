"""%maxbatch on a machine without a GPU: argument errors, and model validation by one real CPU
training step (built-in and TorchScript). The GPU search itself is checked by
bench/gpu/maxbatch_check.py on a CUDA machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernel_client import execute, running_kernel, stream_text


@pytest.fixture(scope="module")
def magics():
    with running_kernel("gpu-magics") as pair:
        yield pair


def test_builtin_model_is_validated_on_cpu(magics):
    km, kc = magics
    reply, outputs = execute(kc, "%maxbatch resnet18 --input 3x32x32", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = stream_text(outputs)
    assert "No CUDA GPU is visible to libtorch" in text
    assert "one training step of batch 1 ran on the CPU with input [3, 32, 32]" in text


def test_torchscript_file_is_validated_on_cpu(magics, tmp_path):
    path = tmp_path / "mlp.pt"
    subprocess.run([sys.executable, "-c", (
        "import torch, sys\n"
        "m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n"
        f"torch.jit.script(m).save({str(path)!r})\n")], check=True)
    km, kc = magics
    reply, outputs = execute(kc, f"%maxbatch {path} --input 16 --optimizer sgd", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "input [16]" in stream_text(outputs)
    reply, _ = execute(kc, f"%maxbatch {path}")
    assert "needs --input SHAPE" in reply["content"]["evalue"]


@pytest.mark.parametrize("cell, expected", [
    ("%maxbatch resnet51", "neither a built-in model nor a TorchScript file"),
    ("%maxbatch resnet50 --limit 24furlongs", "unknown unit"),
    ("%maxbatch resnet50 --input 3x-1", "not a shape"),
    ("%maxbatch resnet50 --optimizer lbfgs", "possible values: none, sgd, adam, adamw"),
    ("%maxbatch", "required"),
])
def test_argument_errors_name_the_problem(magics, cell, expected):
    km, kc = magics
    reply, outputs = execute(kc, cell)
    assert reply["content"]["status"] == "error"
    assert expected in reply["content"]["evalue"], reply["content"]["evalue"]


def test_python_variable_hint_in_the_python_kernel():
    with running_kernel("gpu-python") as (km, kc):
        execute(kc, "model = object()")
        reply, _ = execute(kc, "%maxbatch model")
        assert "torch.jit.script(model).save" in reply["content"]["evalue"]


def test_gpumem_shows_gpukernel_allocator_once_libtorch_is_loaded():
    with running_kernel("gpu-magics") as (km, kc):
        _, outputs = execute(kc, "%gpumem")
        assert "gpukernel" not in outputs[0]["content"]["data"]["text/plain"]
        execute(kc, "%maxbatch resnet18 --input 3x32x32", timeout=120)  # loads libtorch
        _, outputs = execute(kc, "%gpumem")
        text = outputs[0]["content"]["data"]["text/plain"]
        assert "gpukernel: libtorch loaded, no CUDA context" in text, text
        _, outputs = execute(kc, "%gpumem --json")
        assert "no CUDA context" in outputs[0]["content"]["data"]["application/json"]["gpukernel_allocator"]
