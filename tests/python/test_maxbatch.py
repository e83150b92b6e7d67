"""%maxbatch's libtorch engine on a machine without a GPU: argument errors, and model validation
by one real CPU training step (built-in, TorchScript file, and a module exported from the
notebook with --engine libtorch, which must come out untouched). The python engine has its own
file, test_maxbatch_python_engine.py. The GPU search itself is checked by bench/gpu/maxbatch_check.py on a
CUDA machine."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

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
    assert "one training step of batch 2 ran on the CPU with input [3, 32, 32]" in text


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
    ("%maxbatch model", "notebook variables work in the gpu-python kernel"),
    ("%maxbatch resnet50 --amp fp8", "possible values: fp16, bf16"),
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


EXPORT_MODULE = Path(__file__).resolve().parents[2] / "crates/gpukernel/src/magics/maxbatch/export_module.py"

# A model mid-training: BatchNorm statistics moved, gradients and Adam state present. `Traced`
# cannot be scripted (a Python lambda in forward), so %maxbatch must trace it, which runs
# forward: BatchNorm and dropout would change state if the export did not put it back.
NOTEBOOK = """
import copy, torch
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(8, 4)
    def forward(self, x):
        x = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(x.mean(dim=(2, 3)))

class Traced(Net):
    def __init__(self):
        super().__init__()
        self.scale = lambda t: t * 2
    def forward(self, x):
        return self.scale(super().forward(x))

def train(model):
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3, 16, 16)).sum().backward()
    opt.step()
    return opt

def snapshot(model, opt):
    return (copy.deepcopy(model.state_dict()), [p.grad.clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()), [m.training for m in model.modules()],
            torch.random.get_rng_state())

def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

net, traced = Net(), Traced()
net_opt, traced_opt = train(net), train(traced)
traced.eval()  # a mode that must survive the trace, which runs in training mode
before = {"net": snapshot(net, net_opt), "traced": snapshot(traced, traced_opt)}
"""


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel-tmp")
    with running_kernel("gpu-python", env={**os.environ, "TMPDIR": str(tmp)}) as (km, kc):
        reply, _ = execute(kc, NOTEBOOK, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        yield kc, tmp


@pytest.mark.parametrize("variable, method", [("net", "script"), ("traced", "trace")])
def test_a_notebook_module_is_exported_validated_and_left_untouched(notebook, variable, method):
    kc, tmp = notebook
    reply, outputs = execute(kc, f"%maxbatch {variable} --input 3x16x16 --engine libtorch",
                             timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = stream_text(outputs)
    assert f"saved as TorchScript by torch.jit.{method}" in text, text
    assert "one training step of batch 2 ran on the CPU with input [3, 16, 16]" in text, text
    opt = f"{variable}_opt"
    reply, outputs = execute(
        kc, f"print(same(before[{variable!r}], snapshot({variable}, {opt})))", timeout=60)
    assert stream_text(outputs).strip() == "True", outputs
    assert list(tmp.glob("gpukernel-maxbatch-*")) == [], "the private TorchScript file was left"


def test_an_unscriptable_module_needs_an_input_shape(notebook):
    kc, tmp = notebook
    reply, _ = execute(kc, "%maxbatch traced --engine libtorch", timeout=60)
    assert reply["content"]["status"] == "error"
    assert "pass --input SHAPE so it can be traced" in reply["content"]["evalue"]
    assert list(tmp.glob("gpukernel-maxbatch-*")) == []


@pytest.mark.parametrize("cell, expected", [
    ("%maxbatch nosuch --engine libtorch", "'nosuch' is not defined in this notebook"),
    ("%maxbatch before --engine libtorch", "before is a dict, not a torch.nn.Module"),
    ("%maxbatch net.nosuch --engine libtorch", "has no attribute 'nosuch'"),
    ("%maxbatch nosuch --input 8", "'nosuch' is not defined in this notebook"),
    ("%maxbatch before --input 8", "before is a dict, not a torch.nn.Module"),
    ("%maxbatch net.nosuch --input 8", "has no attribute 'nosuch'"),
    ("%maxbatch net()", "nor a notebook variable"),
])
def test_notebook_variable_errors_name_the_problem(notebook, cell, expected):
    kc, _ = notebook
    reply, _ = execute(kc, cell, timeout=60)
    assert reply["content"]["status"] == "error"
    assert expected in reply["content"]["evalue"], reply["content"]["evalue"]


def test_the_export_file_is_private(tmp_path, monkeypatch):
    """export_module.py on its own: the file it hands over is 0600 and loads with torch."""
    import torch

    spec = importlib.util.spec_from_file_location("export_module", EXPORT_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    result = module.export({"m": torch.nn.Linear(4, 2)}, "m", None, None)
    path = Path(result["path"])
    assert path.parent == tmp_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert result["method"] == "script" and result["parameters"] == 10
    assert torch.jit.load(str(path))(torch.ones(1, 4)).shape == (1, 2)


def test_the_export_names_what_the_libtorch_engine_feeds_differently(tmp_path, monkeypatch):
    """The engine calls a module with one batch-first tensor: the export names the layers
    that take (seq, batch, ...) and a forward's targets argument, for the report's notes."""
    import torch

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.attn = torch.nn.MultiheadAttention(8, 2)  # batch_first=False
            self.head = torch.nn.Linear(8, 20)
        def forward(self, idx, targets=None):
            x = self.emb(idx)
            return self.head(self.attn(x, x, x, need_weights=False)[0])

    spec = importlib.util.spec_from_file_location("export_module", EXPORT_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    result = module.export({"lm": LM()}, "lm", [5], None)
    # torch 2.11 scripts it but cannot save the script ("strides() called on an undefined
    # Tensor" in MultiheadAttention): it is traced instead.
    assert result["method"] == "trace"
    assert result["seq_first"] == ["lm.attn"]
    assert result["targets_parameter"] == "targets"
    result = module.export({"m": torch.nn.Linear(4, 2)}, "m", None, None)
    assert result["seq_first"] == [] and result["targets_parameter"] is None


def test_the_export_names_the_allocator_budget_of_its_kernel():
    """What the libtorch engine sizes a notebook module against: the kernel allocator's
    free + reserved bytes, within its memory fraction (a stand-in for torch.cuda here: this
    machine has no GPU; the H200 run is maxbatch-truth-2026-12-04-libtorch-budget)."""
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("export_module", EXPORT_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gib = 1 << 30

    def card(fraction):
        cuda = SimpleNamespace(mem_get_info=lambda d: (100 * gib, 140 * gib),
                               memory_reserved=lambda d: 2 * gib,
                               get_per_process_memory_fraction=lambda d: fraction)
        return SimpleNamespace(cuda=cuda)

    assert module._allocator_limit(card(1.0), 0) == 102 * gib
    assert module._allocator_limit(card(0.25), 0) == 35 * gib  # a notebook capped to a share


def test_the_export_says_whether_its_kernels_cache_strands_blocks():
    """The libtorch engine leaves room for a stranded block only where the notebook's own
    allocator can strand one: not under expandable segments, whether the segments it holds
    say so or, before it holds any, the settings it reads at start (a stand-in for
    torch.cuda, as above)."""
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("export_module", EXPORT_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    device = SimpleNamespace(index=0)

    def holding(*segments):
        return SimpleNamespace(cuda=SimpleNamespace(memory_snapshot=lambda: list(segments)))

    mapped = {"device": 0, "is_expandable": True}
    carved = {"device": 0, "is_expandable": False}
    other_card = {"device": 1, "is_expandable": True}
    assert module._expandable_segments(holding(mapped), device, {}) is True
    assert module._expandable_segments(holding(carved, other_card), device, {}) is False
    # The segments outrank the settings (set at run time through torch.cuda.memory).
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert module._expandable_segments(holding(carved), device, conf) is False
    # Nothing held on the card yet: the settings decide.
    empty = holding(other_card)
    assert module._expandable_segments(empty, device, conf) is True
    assert module._expandable_segments(
        empty, device, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"})
    assert module._expandable_segments(
        empty, device, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is False
    assert module._expandable_segments(empty, device, {}) is False


def test_amp_and_dtype_do_not_combine(magics):
    km, kc = magics
    reply, _ = execute(kc, "%maxbatch resnet18 --amp bf16 --dtype fp16")
    assert reply["content"]["status"] == "error"
    assert "cannot be used with" in reply["content"]["evalue"], reply["content"]["evalue"]


def test_amp_validates_on_cpu(magics):
    km, kc = magics
    reply, outputs = execute(kc, "%maxbatch resnet18 --input 3x32x32 --amp bf16", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "one training step of batch 2 ran on the CPU" in stream_text(outputs)


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
