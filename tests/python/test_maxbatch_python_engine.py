"""%maxbatch's python engine on a machine without a GPU, through a real gpu-python kernel (real
ipykernel child, real jupyter_client): the engine protocol, the loss it infers, and the user's
state surviving a trial exactly (tensor by tensor) after success, an out-of-memory error in the
middle of a step, an error in the user's step, an interrupt and a timeout. Without CUDA the
engine runs one trial of batch 2 (it has no GPU memory to search); the search itself runs on
the GPU machine (bench/gpu/maxbatch_truth.py).

The second half drives trials.py in-process with real torch on the CPU: snapshot and restore
of optimizer state, GradScaler and LR scheduler, what a step function can reach, and the
standard step's losses."""

from __future__ import annotations

import collections
import importlib.util
import json
import time
import warnings
from pathlib import Path

import pytest

from kernel_client import collect, execute, running_kernel, stream_text

REPO = Path(__file__).resolve().parents[2]

# A model mid-training, with every kind of state a trial could disturb: BatchNorm statistics,
# gradients, AdamW state, an LR scheduler, a GradScaler, training flags (eval on one
# submodule), and the torch, random and NumPy generators.
NOTEBOOK = r"""
import copy, random, time
import numpy as np
import torch
import torch.nn.functional as F
torch.manual_seed(0); random.seed(0); np.random.seed(0)

class TinyLM(torch.nn.Module):
    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.BatchNorm1d(dim)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(dim, vocab)
    def forward(self, x):
        h = self.emb(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.drop(h))

class Seg(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    def forward(self, x):
        return self.conv(x)

class SegAux(Seg):  # {'out', 'aux'}, as torchvision's segmentation models with aux_loss
    def __init__(self):
        super().__init__()
        self.aux = torch.nn.Conv2d(3, 5, 1)
    def forward(self, x):
        return {"out": self.conv(x), "aux": self.aux(x)}

class TracedAux(SegAux):  # torch.jit.script rejects the lambda: the export traces it instead
    def __init__(self):
        super().__init__()
        self.act = lambda t: t.relu()
    def forward(self, x):
        return {"out": self.act(self.conv(x)), "aux": self.aux(x)}

class Regress(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
    def forward(self, x):
        return self.lin(x)

class MaskedAE(torch.nn.Module):  # MAE's forward(imgs) -> (loss, pred, mask), no targets
    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(12, 8), torch.nn.Linear(8, 12)
    def forward(self, imgs, mask_ratio=0.75):
        patches = imgs.flatten(2).transpose(1, 2)
        pred = self.dec(self.enc(patches).relu())
        mask = (torch.rand(patches.shape[:2]) < mask_ratio).float()
        loss = (((pred - patches) ** 2).mean(-1) * mask).sum() / mask.sum().clamp(min=1)
        return loss, pred, mask

class ModelOutput(dict):  # as Hugging Face's: its entries by key and as attributes
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

class MaskedAEOutput(MaskedAE):  # ViTMAEForPreTraining's output: .loss, .logits, .mask
    def forward(self, imgs, mask_ratio=0.75):
        loss, pred, mask = super().forward(imgs, mask_ratio)
        return ModelOutput(loss=loss, logits=pred, mask=mask)

class WithAuxLoss(torch.nn.Module):  # a mixture of experts' (logits, aux_loss)
    def __init__(self):
        super().__init__()
        self.gate, self.head = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)
    def forward(self, x):
        return self.head(x), self.gate(x).softmax(-1).square().mean()

class WithZLoss(torch.nn.Module):  # logits and a z-loss computed from them (PaLM's)
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 6)
    def forward(self, x):
        logits = self.head(x)
        return logits, 1e-4 * logits.logsumexp(-1).square().mean()

class DetachedScores(WithZLoss):  # the loss, and the logits detached for logging
    def forward(self, x):
        logits = self.head(x)
        return logits.logsumexp(-1).mean(), logits.detach()

class LossItself(torch.nn.Module):  # a diffusion wrapper's forward(x): the loss
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 8)
    def forward(self, x):
        return (self.net(x + torch.randn_like(x)) - x).square().mean()

lm = TinyLM()
opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for _ in range(2):
    x = torch.randint(0, 50, (4, 8))
    out = lm(x)
    F.cross_entropy(out.reshape(-1, 50), torch.randint(0, 50, (32,))).backward()
    opt.step(); sched.step()
lm.drop.eval()
seg, seg_aux, traced_aux, regress = Seg(), SegAux(), TracedAux(), Regress()
mae, with_aux, with_zloss, loss_itself = MaskedAE(), WithAuxLoss(), WithZLoss(), LossItself()
detached_scores, mae_output = DetachedScores(), MaskedAEOutput()
# BatchNorm after global pooling, as DeepLabV3's pooled branch: one sample per batch fails it
pooled_bn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 5))

def snapshot():
    return (copy.deepcopy(lm.state_dict()), [None if p.grad is None else p.grad.clone()
                                            for p in lm.parameters()],
            copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()),
            scaler.state_dict(), [m.training for m in lm.modules()],
            torch.random.get_rng_state(), random.getstate(), np.random.get_state())

def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

def lm_step(batch):
    opt.zero_grad()
    out = lm(torch.randint(0, 50, (batch, 8)))
    F.cross_entropy(out.reshape(-1, 50), torch.randint(0, 50, (batch * 8,))).backward()
    opt.step(); sched.step()

def oom_mid_step(batch):
    lm_step(batch)      # the weights, AdamW state and scheduler have moved...
    torch.randn(3)      # ...and the generator...
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.2 GiB total capacity)")

def broken_step(batch):
    lm_step(batch)
    raise ValueError(f"shapes do not match at batch {batch}")

def slow_step(batch):
    lm_step(batch)
    time.sleep(60)

def two_argument_step(model, batch):  # written for a loop that passes the model
    lm_step(batch)

def drawing_step(batch):  # draws from an epoch's iterator the notebook's loop used up
    next(drawn_epoch)
    lm_step(batch)
drawn_epoch = iter(())

def catches_its_own_oom(batch):
    lm_step(batch)
    try:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    except torch.cuda.OutOfMemoryError:
        pass

class TwoInputs(torch.nn.Module):  # a forward that needs a mask as well
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
    def forward(self, x, mask):
        return self.lin(x * mask)

tagger = torch.nn.Conv1d(3, 5, 1)  # [batch, 5 classes, length]
class Detector(torch.nn.Module):  # as torchvision's detection models: targets to train
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
    def forward(self, images, targets=None):
        if self.training and targets is None:
            raise AssertionError("targets should not be none when in training mode")
        return {"loss_box": self.conv(images).mean()}
detector = Detector()
class DeepSup(torch.nn.Module):  # deep supervision, as nnU-Net: the map, then at half size
    def __init__(self):
        super().__init__()
        self.enc, self.full, self.coarse = (torch.nn.Conv2d(3, 4, 3, padding=1),
                                          torch.nn.Conv2d(4, 5, 1), torch.nn.Conv2d(4, 5, 1))
    def forward(self, x):
        h = self.enc(x).relu()
        return [self.full(h), self.coarse(F.avg_pool2d(h, 2))]
deep_sup = DeepSup()
class Vae(torch.nn.Module):  # as PyTorch's examples/vae: the image back flattened, mu, logvar
    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(192, 8), torch.nn.Linear(4, 192)
    def forward(self, x):
        mu, logvar = self.enc(x.flatten(1)).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return torch.sigmoid(self.dec(z)), mu, logvar
vae = Vae()
# A denoiser: an RGB image in, one out; its 3 channels are not 3 classes.
denoiser = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 3, 3, padding=1))
lazy = torch.nn.LazyLinear(2)
scripted = torch.jit.script(torch.nn.Linear(8, 2))  # TorchScript keeps its state in C++
frozen = torch.nn.Linear(8, 2).requires_grad_(False)
with torch.device("meta"):
    on_meta = torch.nn.Linear(8, 2)
two_inputs = TwoInputs()
n_layers = 12

# PyTorch's nn.Transformer tutorial, shrunk: fed (seq, batch) token ids, its encoder
# seq-first (batch_first=False, the default), its Embedding registered after the encoder.
class SeqLM(torch.nn.Module):
    def __init__(self, vocab=40, dim=16):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.1)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.register_buffer("pe", torch.randn(64, 1, dim))
        self.head = torch.nn.Linear(dim, vocab)
    def forward(self, src):
        return self.head(self.encoder(self.emb(src) + self.pe[:src.size(0)]))

class SeqRNN(torch.nn.Module):  # a seq-first LSTM classifier over (seq, batch, features)
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(6, 10)
        self.head = torch.nn.Linear(10, 3)
    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[-1])

seq_lm, seq_rnn = SeqLM(), SeqRNN()

# nanoGPT's contract: forward(idx, targets=None) -> (logits, loss), and without targets the
# logits of the last position only (its "inference-time mini-optimization").
class NanoGPT(torch.nn.Module):
    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
    def forward(self, idx, targets=None):
        x = self.block(self.wte(idx)).relu()
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

# A Hugging Face-style classifier: `labels=` adds the loss, the logits are the same.
class LabelledClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
    def forward(self, x, labels=None):
        logits = self.lin(x)
        return {"logits": logits,
                "loss": None if labels is None else F.cross_entropy(logits, labels)}

# An encoder-decoder as T5: the decoder's input is made from the labels, and without them
# (nor decoder ids) the forward fails after its encoder; given them it returns (loss, logits).
class Seq2Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30)
    def forward(self, input_ids, labels=None):
        encoded = self.emb(input_ids)
        if labels is None:
            raise ValueError("You have to specify either decoder_input_ids or "
                             "decoder_inputs_embeds")
        logits = self.head(encoded + self.emb(F.pad(labels, (1, 0))[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, 30), labels.reshape(-1)), logits

# Its logits, or given labels the loss alone: traceable either way, for the libtorch engine.
class Scored(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
    def forward(self, x, labels=None):
        logits = self.lin(x)
        return logits if labels is None else F.cross_entropy(logits, labels)

# Token ids in (1000 of them), 5 tags out, and no forward at all without its labels: the
# probe's labels cannot come from the vocabulary, or they would be out of the tags' range.
class NeedsLabels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 5)
    def forward(self, input_ids, labels=None):
        if labels is None:
            raise ValueError("labels are required")
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1)), logits

nano, labelled, seq2seq, scored = NanoGPT(), LabelledClassifier(), Seq2Seq(), Scored()
needs_labels = NeedsLabels()

# A ViT whose encoder layers keep PyTorch's default batch_first=False, fed (batch, patches,
# dim): it trains, attending across the samples of each batch.
class MixingViT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 16, 4, 4)
        self.encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32),
                                                   1, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 10)
    def forward(self, x):
        return self.head(self.encoder(self.patch(x).flatten(2).transpose(1, 2)).mean(1))

mixing_vit = MixingViT()

def overstepped_schedule(batch):  # the user's line that makes torch raise
    one = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), max_lr=0.1, total_steps=1)
    for _ in range(2):
        one.step()

opt2 = torch.optim.SGD(lm.parameters(), lr=0.1)
split_lm = TinyLM()  # its matrices under one optimizer, the rest under another (Muon and AdamW)
split_matrices = torch.optim.SGD([p for p in split_lm.parameters() if p.dim() == 2], lr=0.1,
                                 momentum=0.9)
split_rest = torch.optim.AdamW([p for p in split_lm.parameters() if p.dim() != 2])
not_a_module = {"a": 1}

# A physics-informed-style net trained with LBFGS: its history lives in lists of tensors.
pinn = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
pinn_opt = torch.optim.LBFGS(pinn.parameters(), history_size=20, max_iter=4)
def pinn_step(batch):
    x = torch.randn(batch, 2)
    def closure():
        pinn_opt.zero_grad()
        loss = (pinn(x) - x.prod(1, keepdim=True)).square().mean()
        loss.backward()
        return loss
    return pinn_opt.step(closure)
for _ in range(3):
    pinn_step(16)

# LoRA-style adapters over a frozen base, whose step also drifts the base through `.data`.
lora = torch.nn.ModuleDict({"base": torch.nn.Linear(64, 64).requires_grad_(False),
                            "down": torch.nn.Linear(64, 4, bias=False),
                            "up": torch.nn.Linear(4, 64, bias=False)})
lora_opt = torch.optim.AdamW([*lora["down"].parameters(), *lora["up"].parameters()])
def lora_step(batch):
    x = torch.randn(batch, 64)
    lora_opt.zero_grad()
    (lora["base"](x) + lora["up"](lora["down"](x))).square().mean().backward()
    lora_opt.step()
    lora["base"].weight.data.mul_(0.5)
lora_base = [t.clone() for t in lora["base"].parameters()]
names_before = sorted(k for k in get_ipython().user_ns if not k.startswith("_"))
before = snapshot()
"""

# The state as it was, no new names in the notebook (beyond the two the setup cell made after
# listing them), and no module of gpukernel's left in sys.modules.
UNCHANGED = ("print(same(before, snapshot()),"
             " sorted(k for k in get_ipython().user_ns if not k.startswith('_'))"
             " == sorted(names_before + ['before', 'names_before']),"
             " [k for k in __import__('sys').modules if k.startswith('_gpukernel')])")


@pytest.fixture(scope="module")
def notebook():
    with running_kernel("gpu-python") as (km, kc):
        reply, _ = execute(kc, NOTEBOOK, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        yield km, kc


def report_of(kc, cell):
    """The report of a %maxbatch cell that succeeded, its lines joined by single spaces."""
    reply, outputs = execute(kc, cell, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    return " ".join(stream_text(outputs).split())


def json_value_of(kc, cell):
    """The value of a `%maxbatch ... --json` cell that succeeded: its one execute_result."""
    reply, outputs = execute(kc, cell, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    values = [o["content"]["data"]["application/json"] for o in outputs
              if o["msg_type"] == "execute_result"]
    assert len(values) == 1, outputs
    return values[0]


def assert_untouched(kc):
    _, outputs = execute(kc, UNCHANGED, timeout=60)
    assert stream_text(outputs).strip() == "True True []", outputs


def test_a_module_step_is_checked_and_the_state_survives_it(notebook):
    _, kc = notebook
    reply, outputs = execute(kc, "%maxbatch lm --input 8 --optimizer-from opt", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = stream_text(outputs)
    assert "No CUDA GPU is visible to torch in your Python kernel" in text, text
    assert "one step of batch 2 ran on the cpu" in text, text
    # The vocabulary came from the model's Embedding, the loss from the output's shape.
    assert "loss cross-entropy over the last dimension (50 classes)" in text, text
    assert ("your model (weights, buffers, gradients, attributes), its optimizer and the random "
            "generators are as they were") in text, text
    # What the trial assumed, as the report on a GPU says it.
    assert "optimizer the notebook's opt (AdamW)" in text, text
    assert "precision float32;" in text, text  # the weights', not the token ids' int64
    assert "input 8 per sample, token ids < 50 (from the model's Embedding)" in text, text
    assert_untouched(kc)


def test_a_models_hooks_that_keep_what_they_saw_are_put_back_in_a_real_kernel(notebook):
    """A forward hook that appends each output to a notebook list (feature extraction): the
    check's step ran it, and the list is as it was, as the report says."""
    _, kc = notebook
    # (Private names and a forked generator: the module's other tests compare the notebook's
    # variables and random state with how NOTEBOOK left them.)
    reply, _ = execute(kc, "_feats = []\n"
                           "with torch.random.fork_rng():\n"
                           "    _hooked = torch.nn.Sequential(torch.nn.Linear(8, 16),"
                           " torch.nn.ReLU(), torch.nn.Linear(16, 3))\n"
                           "_ = _hooked[1].register_forward_hook(lambda m, i, o: _feats.append(o))",
                       timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = report_of(kc, "%maxbatch _hooked --input 8")
    assert ("your model (weights, buffers, gradients, attributes), its optimizer, what its "
            "hooks and forwards keep and the random generators are as they were") in text, text
    _, outputs = execute(kc, "print(len(_feats))", timeout=60)
    assert stream_text(outputs).strip() == "0", outputs
    assert_untouched(kc)


def test_json_without_a_gpu_is_the_cells_value_with_no_batch_size(notebook):
    _, kc = notebook
    v = json_value_of(kc, "%maxbatch lm --input 8 --optimizer-from opt --amp bf16 --json")
    assert v["max_batch"] is None and v["recommended"] is None and v["gpu"] is False, v
    assert v["checked"] == "one step of batch 2 ran on the cpu", v
    assert v["assumptions"]["precision"].startswith("bf16 autocast"), v
    assert v["assumptions"]["optimizer"] == "the notebook's opt (AdamW)", v
    # The standard step is not the user's loop: at the limit theirs can differ by a sample.
    assert "--step FN sizes your own step exactly" in v["assumptions"]["step"], v
    assert "the last output alive into the next step" in v["assumptions"]["step"], v
    assert_untouched(kc)


def test_drops_output_is_taken_through_the_kernel_and_stated(notebook):
    _, kc = notebook
    v = json_value_of(kc, "%maxbatch lm --input 8 --optimizer-from opt --drops-output --json")
    assert "only the loss kept, the output let go before backward (--drops-output)" in \
        v["assumptions"]["step"], v
    assert_untouched(kc)
    # A step function's loop is its own: the option is refused, and nothing runs.
    reply, outputs = execute(kc, "%maxbatch --step lm_step --drops-output", timeout=60)
    assert reply["content"]["status"] == "error", reply["content"]
    assert "--drops-output" in reply["content"]["evalue"], reply["content"]
    assert_untouched(kc)


def test_a_step_functions_report_says_what_is_not_put_back(notebook):
    _, kc = notebook
    reply, outputs = execute(kc, "%maxbatch --step lm_step", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert ("the attributes and tensors of the objects it reaches and the variables it assigns "
            "are as they were (an iterator it draws from is not put back)") in \
        stream_text(outputs), stream_text(outputs)
    assert_untouched(kc)


def test_a_frozen_base_a_step_function_writes_comes_back_through_the_kernel(notebook):
    """A `--step` over LoRA-style adapters that also drifts the frozen base through `.data`
    (no version counter sees it) comes back bit for bit through the kernel. On the CPU the
    watched base has no fingerprint and is put back every time: this checks the wiring;
    the fingerprints' own path is checked by the trials-level tests, and the report's note
    (shown on a GPU only) by `python_engine.rs`'s."""
    _, kc = notebook
    text = report_of(kc, "%maxbatch --step lora_step")
    assert "one step of batch 2 ran on the cpu" in text, text
    _, outputs = execute(kc, "print(all(torch.equal(a, b) for a, b in "
                         "zip(lora_base, lora['base'].parameters())))", timeout=60)
    assert stream_text(outputs).strip() == "True", outputs
    assert_untouched(kc)


# Every value of LBFGS's state, its history's lists by their tensors' sums, to the last bit.
LBFGS_STATE = ("print([(k, [t if t is None else float(t.double().sum()) for t in v] "
               "if isinstance(v, list) else "
               "float(v.double().sum()) if torch.is_tensor(v) else v) "
               "for k, v in pinn_opt.state[next(pinn.parameters())].items()])")


@pytest.mark.parametrize("cell", ["%maxbatch pinn --input 2", "%maxbatch --step pinn_step"])
def test_an_lbfgs_model_is_stepped_with_a_closure_and_its_history_put_back(notebook, cell):
    _, kc = notebook
    _, outputs = execute(kc, LBFGS_STATE, timeout=60)
    history = stream_text(outputs)
    assert "'old_dirs', [" in history, history
    _, outputs = execute(kc, "print(len(pinn_opt.state[next(pinn.parameters())]['old_dirs']))",
                         timeout=60)
    pairs = int(stream_text(outputs))
    assert 0 < pairs < 20, pairs  # not full: the report says it fills over the next steps
    reply, outputs = execute(kc, cell, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = stream_text(outputs)
    assert "one step of batch 2 ran on the cpu" in text, text
    if "--step" not in cell:
        # 3 steps of 4 iterations made some of its 20 pairs of vectors as large as its 129
        # float32 parameters (20640 bytes when full).
        assert ("optimizer the notebook's pinn_opt (LBFGS), stepped with a closure; its "
                f"history, {pairs} of up to 20 pairs of gradient-sized vectors (20.2 KiB), "
                "fills over your next steps") in text, text
    _, outputs = execute(kc, LBFGS_STATE, timeout=60)
    assert stream_text(outputs) == history
    assert_untouched(kc)


@pytest.mark.parametrize("cell, loss", [
    # nanoGPT without targets computes the logits of one position: a step on those would size
    # a far smaller step than its training loop's, which passes targets.
    ("%maxbatch nano --input 16", "loss the model's own: nano(x, targets=...) returns it at "
     "output[1], targets ids < 40 shaped like the input (without targets its forward returns "
     "output[0] [2, 1, 40], not the [2, 16, 40] it trains on with them: --loss ce computes "
     "cross-entropy on that instead)"),
    ("%maxbatch nano --input 16 --loss own", "loss the model's own: nano(x, targets=...) "
     "returns it at output[1], targets ids < 40 shaped like the input; "),
    ("%maxbatch nano --input 16 --loss ce", "loss cross-entropy over the last dimension (40 "
     "classes); optimizer"),
    # The same logits with labels as without, but a forward written to take them is given
    # them: the loss it returns (a Hugging Face model's upcasts bf16 logits to float32).
    ("%maxbatch labelled --input 8", "loss the model's own: labelled(x, labels=...) returns it "
     "at output['loss'], labels ids < 3 shaped [2] at batch 2 (a loop that passes labels "
     "trains on the loss its forward returns; --loss ce sizes cross-entropy on "
     "output['logits'] instead, if yours computes its own)"),
    ("%maxbatch labelled --input 8 --loss ce", "loss cross-entropy over the last dimension (3 "
     "classes); optimizer"),
    # --target-classes asks for cross-entropy over them, not the model's own loss.
    ("%maxbatch labelled --input 8 --target-classes 3", "loss cross-entropy over the last "
     "dimension (3 classes); optimizer"),
    # Labels below the head's 5 tags, not the vocabulary's 1000 (an index error on the CPU, a
    # device-side assert on a GPU).
    ("%maxbatch needs_labels --input 6 --vocab 1000", "labels ids < 5 shaped like the input "
     "(without labels its forward fails (ValueError: labels are required)"),
    # An encoder-decoder makes its decoder's input from its labels: it runs only with them.
    ("%maxbatch seq2seq --input 6", "loss the model's own: seq2seq(x, labels=...) returns it at "
     "output[0], labels ids < 30 shaped like the input (without labels its forward fails "
     "(ValueError: You have to specify either decoder_input_ids or decoder_inputs_embeds); "
     "given them it returns the loss, which a loop that passes them trains on)"),
    ("%maxbatch labelled --input 8 --loss own", "loss the model's own: labelled(x, labels=...) "
     "returns it at output['loss'], labels ids < 3 shaped [2] at batch 2; "),
    # Without targets: a loss the forward computes from its own output.
    # MAE returns the loss it computed from its prediction: a loop trains on that.
    ("%maxbatch mae --input 12x2x2", "loss the model's own: mae(x) returns it at output[0] (its "
     "forward returns a loss computed from output[1], which a loop over it trains on; --loss "
     "ce, mse or mean sizes that loss on output[1] instead)"),
    ("%maxbatch mae --input 12x2x2 --loss own", "loss the model's own: mae(x) returns it at "
     "output[0]"),
    ("%maxbatch mae --input 12x2x2 --loss mse", "loss mean squared error against a random target"),
    # An auxiliary loss the logits do not flow into is beside the loss on them, not it.
    ("%maxbatch with_aux --input 8", "loss cross-entropy over the last dimension (6 classes) "
     "(the scalar also returned at output[1] is not in it: an auxiliary loss, say, which --step "
     "FN sizes in a loop that adds it); "),
    # A scalar computed from class scores is a term beside the cross-entropy on them.
    ("%maxbatch with_zloss --input 8", "loss cross-entropy over the last dimension (6 classes), "
     "plus the scalar with_zloss(x) returns at output[1], which is computed from output[0] (a "
     "term of its loss, as a z-loss is; --loss ce leaves it out)"),
    ("%maxbatch with_zloss --input 8 --loss ce", "loss cross-entropy over the last dimension "
     "(6 classes) (the scalar also returned at output[1] is not in it"),
    # Scores without a gradient: the loss beside them is all a loop can train on.
    ("%maxbatch detached_scores --input 8", "loss the model's own: detached_scores(x) returns it "
     "at output[0] (its forward returns a loss, and output[1] carries no gradient: that loss is "
     "what a loop over it trains on)"),
    ("%maxbatch loss_itself --input 8", "loss the model's own: loss_itself(x) returns it at "
     "output (its forward returns the loss itself, which a loop over it trains on)"),
    # A Hugging Face output names its loss twice (.loss, ['loss']): the one trained on.
    ("%maxbatch mae_output --input 12x2x2", "loss the model's own: mae_output(x) returns it at "
     "output.loss (its forward returns a loss computed from output.logits, which a loop over it "
     "trains on; --loss ce, mse or mean sizes that loss on output.logits instead); "),
])
def test_a_model_that_computes_its_own_loss_is_trained_on_it(notebook, cell, loss):
    _, kc = notebook
    text = report_of(kc, cell)
    assert loss in text, text
    assert "one step of batch 2 ran on the cpu" in text, text
    assert_untouched(kc)


def test_the_libtorch_engine_names_a_returned_scalar_it_leaves_out(notebook):
    """TorchScript cannot tell whether the output flows into a scalar it returns: the report
    says what it left out, and where the python engine trains on it."""
    _, kc = notebook
    text = report_of(kc, "%maxbatch mae --input 12x2x2 --engine libtorch")
    assert ("loss mean squared error against a random target (the scalar also returned at "
            "output[0] is left out: where one is computed from output[1] (a masked "
            "autoencoder's loss, a z-loss), the python engine trains on it, for a notebook "
            "variable)") in text, text
    assert_untouched(kc)


def test_a_seq_first_model_is_fed_seq_first_and_the_report_says_so(notebook):
    """PyTorch's Transformer tutorial as a new user writes it: %maxbatch finds its token ids
    though its Embedding is registered last, and puts the batch on dim 1, where its seq-first
    encoder takes it (fed batch-first, the encoder would attend across the batch and the
    search would size another model)."""
    _, kc = notebook
    text = report_of(kc, "%maxbatch seq_lm --input 12")
    assert ("input 12 per sample, the batch on dim 1 of the input, as "
            "seq_lm.encoder.layers.0.self_attn (MultiheadAttention, batch_first=False) takes it "
            "(--batch-dim 0 if your loop feeds the batch first), token ids < 40 (from the "
            "model's emb, an Embedding and the first layer the input reaches), output "
            "[12, 2, 40]") in text, text
    assert "one step of batch 2 ran on the cpu" in text, text
    # A model that cannot take the batch on dim 1 is sized as its loop must feed it, batch
    # first, and the user learns that the layer mixes the samples of a batch.
    text = report_of(kc, "%maxbatch mixing_vit --input 3x8x8")
    assert ("Note: mixing_vit.encoder.layers.0.self_attn (MultiheadAttention, batch_first=False) "
            "takes (seq, batch, ...) and gets your batch as its sequence (with the batch on dim "
            "1 of the input, mixing_vit fails), so it mixes the samples of a batch; sized "
            "batch-first") in text, text
    assert "input 3x8x8 per sample, output [2, 10]" in text, text
    # Said the other way, it is sized as said, batch first.
    text = report_of(kc, "%maxbatch seq_lm --input 12 --batch-dim 0")
    assert "input 12 per sample, token ids < 40" in text and "output [2, 12, 40]" in text, text
    assert_untouched(kc)


@pytest.mark.parametrize("cell, loss", [
    ("%maxbatch seg --input 3x8x8 --optimizer sgd", "cross-entropy over dimension 1 (5 classes"),
    ("%maxbatch seg_aux --input 3x8x8", "cross-entropy over dimension 1 (5 classes, per "
     "position), on output['out'] and the heads trained with it (output['aux']), summed"),
    # The libtorch engine selects and sums alike on the notebook module's TorchScript copy.
    ("%maxbatch seg_aux --input 3x8x8 --engine libtorch", "cross-entropy over dimension 1 (5 "
     "classes, per position), on output['out'] and the heads trained with it (output['aux']), "
     "summed"),
    # A dict output reaches the libtorch engine through a trace too (strict=False).
    ("%maxbatch traced_aux --input 3x8x8 --engine libtorch", "saved as TorchScript by "
     "torch.jit.trace"),
    ("%maxbatch traced_aux --input 3x8x8 --engine libtorch", "on output['out'] and the heads "
     "trained with it (output['aux']), summed"),
    # The libtorch engine's CPU check steps two samples, which BatchNorm needs in training.
    ("%maxbatch pooled_bn --input 3x8x8 --engine libtorch", "one training step of batch 2 ran "
     "on the CPU with input [3, 8, 8], loss cross-entropy over the last dimension (5 classes)"),
    ("%maxbatch regress --input 8", "mean squared error"),
    ("%maxbatch regress --input 8 --loss mean", "the output's mean"),
    # --target-classes picks the dimension: of [2, 5, 8, 8], the last one holds 8.
    ("%maxbatch seg --input 3x8x8 --target-classes 8", "the last dimension (8 classes)"),
    # [2, 5, 100] read as 5 positions of 100 classes; the other reading is one flag away.
    ("%maxbatch tagger --input 3x100", "the last dimension (100 classes) (if dimension 1 holds "
                                       "the classes ([batch, classes, length], as a 1-d "
                                       "convolution gives), say --target-classes 5)"),
    ("%maxbatch tagger --input 3x100 --target-classes 5", "cross-entropy over dimension 1 (5"),
    # The libtorch engine cannot pass targets, and says what the python engine does instead.
    ("%maxbatch scored --input 8 --engine libtorch", "scored.forward takes labels, and this "
     "engine calls it without and trains on its output's loss as planned here; the python "
     "engine (the default for a notebook variable) passes them"),
    # An output shaped like its float input is a reconstruction, on either engine.
    ("%maxbatch denoiser --input 3x8x8", "mean squared error against a random target (the "
     "output holds as many values as the input, as an autoencoder's or a denoiser's does; if "
     "they are class scores, say --loss ce)"),
    # A VAE's reconstruction comes flattened: [2, 192] of [2, 3, 8, 8], not 192 classes.
    ("%maxbatch vae --input 3x8x8", "mean squared error against a random target (the output"),
    ("%maxbatch vae --input 3x8x8 --engine libtorch", "loss mean squared error"),
    ("%maxbatch denoiser --input 3x8x8 --engine libtorch", "loss mean squared error"),
    ("%maxbatch denoiser --input 3x8x8 --loss ce", "cross-entropy over dimension 1 (3 classes"),
    # Deep supervision: the coarser map is trained too, on either engine.
    ("%maxbatch deep_sup --input 3x8x8", "cross-entropy over dimension 1 (5 classes, per "
     "position), on output[0] and the heads trained with it (output[1] at 4x4), summed"),
    ("%maxbatch deep_sup --input 3x8x8 --engine libtorch", "cross-entropy over dimension 1 (5 "
     "classes, per position), on output[0] and the heads trained with it (output[1] at 4x4), "
     "summed"),
])
def test_the_loss_is_inferred_from_the_output_and_stated(notebook, cell, loss):
    _, kc = notebook
    reply, outputs = execute(kc, cell, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert loss in stream_text(outputs), stream_text(outputs)
    assert_untouched(kc)


def test_an_out_of_memory_error_mid_step_is_reported_and_the_state_put_back(notebook):
    _, kc = notebook
    reply, outputs = execute(kc, "%maxbatch --step oom_mid_step", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "the step ran out of memory at batch 2" in stream_text(outputs), outputs
    assert_untouched(kc)


def test_an_out_of_memory_error_the_step_catches_leaves_a_step_that_ran(notebook):
    """A step that returns trained its batch: what it caught on the way (as cuDNN catches a
    refused workspace) is its own business."""
    _, kc = notebook
    reply, outputs = execute(kc, "%maxbatch --step catches_its_own_oom", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "one step of batch 2 ran" in stream_text(outputs)
    assert_untouched(kc)


def test_a_step_that_raises_is_explained_and_the_state_put_back(notebook):
    _, kc = notebook
    reply, _ = execute(kc, "%maxbatch --step broken_step", timeout=120)
    content = reply["content"]
    assert content["status"] == "error"
    assert "ValueError: shapes do not match at batch 2" in content["evalue"], content
    assert "in broken_step" in content["evalue"], content  # where in the user's code
    assert_untouched(kc)


def test_an_interrupt_mid_step_ends_the_cell_and_puts_the_state_back(notebook):
    km, kc = notebook
    msg_id = kc.execute("%maxbatch --step slow_step")
    time.sleep(3)
    started = time.monotonic()
    km.interrupt_kernel()
    reply, _ = collect(kc, msg_id, timeout=30)
    assert time.monotonic() - started < 5
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    assert_untouched(kc)
    reply, outputs = execute(kc, "print(1 + 1)")
    assert stream_text(outputs) == "2\n"


def test_a_trial_past_its_time_limit_is_interrupted_and_reported(notebook):
    _, kc = notebook
    started = time.monotonic()
    reply, _ = execute(kc, "%maxbatch --step slow_step --trial-timeout 2", timeout=60)
    assert time.monotonic() - started < 20
    assert reply["content"]["status"] == "error"
    assert "ran past 2 s (--trial-timeout)" in reply["content"]["evalue"], reply["content"]
    assert_untouched(kc)


@pytest.mark.parametrize("cell, expected", [
    ("%maxbatch lm", "needs --input SHAPE"),
    ("%maxbatch not_a_module --input 8", "not_a_module is a dict, not a torch.nn.Module"),
    ("%maxbatch opt --input 8", "(for a function that runs your own step, use --step)"),
    # Overlapping optimizers (one made again in a later cell): which one is the user's to say.
    ("%maxbatch lm --input 8", "several optimizers hold lm's parameters (opt, opt2): name yours "
                               "with --optimizer-from VAR, or pick a new one with --optimizer"),
    ("%maxbatch lm --input 8 --optimizer-from not_a_module", "not a torch.optim.Optimizer"),
    # A model split between two optimizers: the step that trains it is the user's own.
    ("%maxbatch split_lm --input 8", "split_lm's trainable parameters are split between "
                                     "optimizers (split_matrices, split_rest): a step of one "
                                     "alone would leave the others' state out. If your loop "
                                     "steps more than one, write a function FN(batch_size) that "
                                     "runs your whole step and use --step FN"),
    ("%maxbatch split_lm --input 8 --optimizer-from split_matrices",
     "split_matrices holds 2 of split_lm's 5 trainable parameter tensors, and split_rest holds "
     "others: a step of split_matrices alone would leave their optimizer state out. If your "
     "loop steps more than one"),
    ("%maxbatch --step lm", "not a function"),
    ("%maxbatch --step nosuch", "'nosuch' is not defined in this notebook"),
    ("%maxbatch --step lm_step --input 8", "cannot be used with"),
    ("%maxbatch --step lm_step --engine libtorch", "drop --engine libtorch"),
    ("%maxbatch lm --input 8 --dtype bf16", "--dtype is for the libtorch engine"),
    ("%maxbatch regress --input 8 --loss ce", "cross-entropy needs class scores"),
    ("%maxbatch seg --input 3x8x8 --target-classes 7", "matches no dimension of the output"),
    ("%maxbatch lm --input 3x8 --optimizer-from opt", "check --input"),
    # An image's shape as PIL and NumPy hold it: the shape PyTorch's convolution takes.
    ("%maxbatch seg --input 8x8x3", "check --input (the shape of one sample): its first "
                                    "convolution (conv) takes 3 channels first, so --input "
                                    "3x8x8 for this sample, or if"),
    ("%maxbatch --step 'f()'", "is not a name"),
    ("%maxbatch --step n_layers", "n_layers is an int, not a function"),
    # Said before any trial runs, with the way to call it.
    ("%maxbatch --step two_argument_step", "two_argument_step(model, batch) cannot be called as "
                                           "two_argument_step(batch_size), which is how every "
                                           "trial calls it"),
    # What ran dry and where, not Python's "generator raised StopIteration".
    ("%maxbatch --step drawing_step", "the step raised DataRanOut: next() raised StopIteration "
                                      "in your step at its first call: the iterator it draws "
                                      "from ran dry"),
    ("%maxbatch --step drawing_step", "in drawing_step)"),
    ("%maxbatch torch --input 8", "torch is a Python module, not a torch.nn.Module"),
    # Models the standard step cannot drive: said before any trial, with what to do.
    ("%maxbatch two_inputs --input 8", "two_inputs.forward needs 2 arguments (x, mask), while "
                                       "%maxbatch MODULE calls it with one tensor of --input: "
                                       "write a function FN(batch_size)"),
    ("%maxbatch frozen --input 8", "frozen has no trainable parameters"),
    ("%maxbatch on_meta --input 8", "2 of on_meta's 2 weights and buffers are on the meta "
                                    "device"),
    ("%maxbatch lazy --input 8", "lazy has lazy modules not initialized yet"),
    ("%maxbatch regress --input 8 --loss own", "regress.forward takes no targets (no optional "
                                               "targets or labels or target) and returns no "
                                               "such loss"),
    ("%maxbatch nano --input 16 --loss own --engine libtorch", "--loss own runs your model's "
                                                               "forward with targets"),
    # nanoGPT returns (logits, None) without targets: no TorchScript copy, and what to do.
    ("%maxbatch nano --input 16 --engine libtorch", "nor torch.jit.trace trace it (RuntimeError: "
                                                    "Only tensors, lists, tuples of tensors, or "
                                                    "dictionary of tensors can be output from "
                                                    "traced functions): drop --engine libtorch"),
    ("%maxbatch seq_rnn --input 5x6 --batch-dim 3", "--batch-dim 3 is not a dimension of a "
                                                    "batch of --input 5x6: it goes from 0 to 2"),
    ("%maxbatch seq_rnn --input 5x6 --engine libtorch --batch-dim 1", "the libtorch engine puts "
                                                                       "the batch first"),
    ("%maxbatch regress --input 5", "check --input (the shape of one sample; --vocab N for "
                                      "token ids), or if it takes more than one input"),
    # A forward that needs its labels, told not to take the model's own loss: what to drop.
    ("%maxbatch seq2seq --input 6 --loss ce", "decoder_inputs_embeds; seq2seq.forward also "
                                              "takes labels, which --loss ce does not pass: "
                                              "drop --loss to train on the loss it returns"),
    ("%maxbatch detector --input 3x8x8 --loss own", "--loss own: detector(x, targets=...) gave "
                                                    "no loss (no targets to try for this "
                                                    "output), and without targets it fails "
                                                    "(AssertionError: targets should not be "
                                                    "none when in training mode)"),
    ("%maxbatch detector --input 3x8x8", "targets should not be none when in training mode; "
                                         "and with targets too (none could be shaped: without "
                                         "them its forward gives no output to shape them by, "
                                         "and the input is not token ids); check --input (the "
                                         "shape of one sample), or if it needs its targets "
                                         "in another form (a detection model's boxes and "
                                         "labels per image) or more than one input: write a "
                                         "function"),
    # Where the user's line is, not torch's frame that raised.
    ("%maxbatch --step overstepped_schedule", "in overstepped_schedule"),
])
def test_bad_requests_name_the_problem_and_change_nothing(notebook, cell, expected):
    _, kc = notebook
    reply, _ = execute(kc, cell, timeout=60)
    assert reply["content"]["status"] == "error", reply["content"]
    assert expected in reply["content"]["evalue"], reply["content"]["evalue"]
    assert_untouched(kc)


# --- trials.py in-process ---------------------------------------------------------------

def call(trials, ns, name, **args):
    return json.loads(trials.call(ns, name, json.dumps(args)))


def test_state_the_trial_created_is_dropped_and_state_it_changed_restored(trials):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 3))
    fresh = torch.optim.Adam(model.parameters())  # no state yet: a trial creates it
    ns = {"model": model, "fresh": fresh}
    weights = [p.detach().clone() for p in model.parameters()]
    stats = model[1].running_mean.clone()
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [4]})
    assert reply["describe"]["optimizer"] == "the notebook's fresh (Adam)"
    assert reply["describe"]["gpus"] == []  # on the CPU: no GPU to name, none split over
    assert reply["output"]["shape"] == [2, 3]
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    assert reply["describe"]["optimizers_without_state"] == ["the notebook's fresh (Adam)"]
    for batch in (4, 6):
        result = call(trials, ns, "trial", batch=batch, steps=2)
        assert result["result"] == "ran", result
        # Each trial starts as the user's loop will, with no Adam state: what the trial made
        # is gone, and everything the user had is back.
        assert len(fresh.state) == 0
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        assert torch.equal(stats, model[1].running_mean)
    assert call(trials, ns, "close")["closed"] is True
    assert len(fresh.state) == 0, "the trials' Adam state is gone"
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


class FakeAllocator:
    """Allocated bytes and their peak since the last reset, as torch's caching allocator
    counts them (its counters need a GPU)."""

    def __init__(self, base):
        self.current = self.high = base

    def alloc(self, n):
        self.current += n
        self.high = max(self.high, self.current)

    def free(self, n):
        self.current -= n

    def stats(self):
        return (lambda: (self.high, self.high + 7), self.reset)

    def reset(self):
        self.high = self.current


def test_phase_peaks_part_the_optimizers_update_from_the_rest_of_the_step(trials):
    import torch

    fake = FakeAllocator(1000)

    class Update(torch.optim.AdamW):  # a user's own optimizer class: torch wraps its step too
        def step(self, closure=None):
            fake.alloc(300)  # the update's temporaries
            fake.free(300)
            return super().step(closure)

    model = torch.nn.Linear(4, 2)
    opt = Update(model.parameters())
    optim = importlib.import_module("torch.optim.optimizer")
    hooks = dict(optim._global_optimizer_pre_hooks)
    peaks = trials.PhasePeaks(torch, fake.stats())
    peaks.start()
    try:
        for activations in (100, 120):  # two steps, the second's forward larger
            fake.alloc(activations)
            model(torch.randn(3, 4)).sum().backward()
            fake.free(activations)
            opt.step()
            opt.zero_grad()
    finally:
        peaks.stop()
    assert peaks.phases() == {"outside": 1120, "optimizer": 1300}
    assert peaks.allocated() == 1300
    assert peaks.reserved() == 1307
    # The hooks are gone: the user's own steps afterwards are not watched.
    assert dict(optim._global_optimizer_pre_hooks) == hooks
    assert dict(optim._global_optimizer_post_hooks) == {}
    opt.step()
    assert peaks.phases() == {"outside": 1120, "optimizer": 1300}

    # A GradScaler that skips the update (an overflow): no optimizer phase, the whole peak.
    fake = FakeAllocator(1000)
    scaler = torch.amp.GradScaler("cpu")
    peaks = trials.PhasePeaks(torch, fake.stats())
    peaks.start()
    try:
        fake.alloc(100)
        scaler.scale(model(torch.randn(3, 4)).sum() * float("inf")).backward()
        fake.free(100)
        scaler.step(opt)
        scaler.update()
    finally:
        peaks.stop()
    assert peaks.phases() is None
    assert peaks.allocated() == 1100


def test_no_optimizer_hook_outlives_its_trial_whatever_cut_it_short(trials):
    """A hook left behind (an interrupt between its registration and anything after it)
    would reset the user's peak counters at every step of their training: the next trial,
    and the session's end, remove every hook a PhasePeaks registered."""
    import torch

    optim = importlib.import_module("torch.optim.optimizer")
    before = (dict(optim._global_optimizer_pre_hooks), dict(optim._global_optimizer_post_hooks))
    fake = FakeAllocator(0)
    trials.PhasePeaks(torch, fake.stats()).start()  # never stopped
    assert len(optim._global_optimizer_pre_hooks) == len(before[0]) + 1
    trials._remove_hooks()
    assert (dict(optim._global_optimizer_pre_hooks),
            dict(optim._global_optimizer_post_hooks)) == before


class _Counted(torch_optim_base := __import__("torch").optim.SGD):
    """SGD whose update allocates on the test's counter, as AdamW's temporaries do."""

    counter = None

    def step(self, closure=None):
        self.counter.alloc(300)
        self.counter.free(300)
        return super().step(closure)


def test_a_trial_reports_its_peaks_by_phase(trials):
    """Session.trial's watched path (on a GPU: CUDA's counters; here a counter the test
    drives): the reply's phase peaks and whole peaks, the hooks gone afterwards."""
    import torch

    fake = FakeAllocator(1000)
    model = torch.nn.Linear(4, 3)

    def activations(module, args, out):  # the forward's: 10 bytes a sample
        fake.alloc(10 * args[0].shape[0])
        fake.free(10 * args[0].shape[0])

    model.register_forward_hook(activations)
    opt = _Counted(model.parameters(), lr=0.1)
    opt.counter = fake
    ns = {"model": model, "opt": opt}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    trials._current().peak_stats = fake.stats()
    optim = importlib.import_module("torch.optim.optimizer")
    hooks = dict(optim._global_optimizer_pre_hooks)
    result = call(trials, ns, "trial", batch=8, steps=2)
    assert result["result"] == "ran", result
    assert result["phase_peaks"] == {"outside": 1080, "optimizer": 1300}, result
    assert (result["peak_allocated"], result["peak_reserved"]) == (1300, 1307), result
    assert dict(optim._global_optimizer_pre_hooks) == hooks
    fake.alloc(5000)  # the last trial's peak, still in the counters
    fake.free(5000)
    call(trials, ns, "close")
    assert fake.high == fake.current  # counting again from what the user holds


def test_a_compiled_optimizer_step_that_cannot_call_the_hooks_is_tried_without_them(trials):
    """torch.compile(fullgraph=True) over a custom optimizer's step refuses a call into a
    function dynamo may not trace, the hooks among them: the trial runs again unwatched
    (whole peaks only), where it would have failed a step the user's loop runs."""
    import torch

    class Plain(torch.optim.Optimizer):  # a Muon-style optimizer: a plain no_grad step
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    model = torch.nn.Linear(8, 4)
    opt = Plain(model.parameters())
    update = torch.compile(opt.step, backend="eager", fullgraph=True)

    def train_step(batch):
        model(torch.randn(batch, 8)).sum().backward()
        update()
        opt.zero_grad()

    fake = FakeAllocator(1000)
    ns = {"model": model, "opt": opt, "train_step": train_step}
    call(trials, ns, "prepare", spec={"kind": "step", "target": "train_step"})
    trials._current().peak_stats = fake.stats()
    result = call(trials, ns, "trial", batch=4, steps=2)
    assert result["result"] == "ran", result
    assert "phase_peaks" not in result, result
    assert trials._current().phase_hooks is False
    assert trials._current().trials == 1
    call(trials, ns, "close")


def _seq_first_prepare(trials, model, **spec):
    """prepare's reply for `model`, and the input shapes its forward saw in one trial of 5."""
    import torch

    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", **spec})
    if "refused" in reply:
        return reply, None
    call(trials, ns, "set_loss", plan={"kind": "mean"})
    seen = []
    handle = model.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    try:
        assert call(trials, ns, "trial", batch=5, steps=2)["result"] == "ran"
    finally:
        handle.remove()
        call(trials, ns, "close")
    assert all(torch.is_tensor(p) for p in model.parameters())
    return reply, seen[0]


def test_the_batch_goes_where_the_models_seq_first_layers_take_it(trials):
    """A layer with batch_first=False (PyTorch's default for RNNs, MultiheadAttention and
    Transformer layers) takes (seq, batch, ...): a loop written for it feeds that, and the
    trials do too. A model that turns a batch-first input round itself keeps it first."""
    import torch

    class Transposing(torch.nn.Module):  # a batch-first loop into a seq-first LSTM
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(6, 10)
        def forward(self, x):
            return self.rnn(x.transpose(0, 1))[0].transpose(0, 1)

    class SeqFirstRNN(torch.nn.Module):
        def __init__(self, batch_first=False):
            super().__init__()
            self.rnn = torch.nn.GRU(6, 10, batch_first=batch_first)
        def forward(self, x):
            return self.rnn(x)[0]

    reply, seen = _seq_first_prepare(trials, SeqFirstRNN(), input=[7, 6])
    assert seen == (7, 5, 6)
    assert reply["describe"]["batch_dim"] == 1
    assert reply["describe"]["batch_dim_from"] == "model.rnn (GRU, batch_first=False)"
    assert reply["output"]["shape"] == [7, 2, 10]
    # What the user said goes, even against the layer.
    reply, seen = _seq_first_prepare(trials, SeqFirstRNN(), input=[7, 6], batch_dim=0)
    assert seen == (5, 7, 6) and reply["describe"]["batch_dim"] == 0
    for model in (Transposing(), SeqFirstRNN(batch_first=True)):
        reply, seen = _seq_first_prepare(trials, model, input=[7, 6])
        assert seen == (5, 7, 6), type(model).__name__
        assert reply["describe"]["batch_dim"] == 0
        assert reply["describe"]["batch_dim_from"] is None
        assert reply["describe"]["batch_warning"] is None

    class Mixing(torch.nn.Module):  # reshapes its input batch-first: dim 1 cannot be the batch
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(6, 10)
        def forward(self, x):
            return self.rnn(x.reshape(x.shape[0], 7, 6))[0]

    reply, seen = _seq_first_prepare(trials, Mixing(), input=[42])
    assert seen == (5, 42) and reply["describe"]["batch_dim"] == 0
    assert "model.rnn (GRU, batch_first=False) takes (seq, batch, ...) and gets your batch as " \
        "its sequence (with the batch on dim 1 of the input, model fails)" in \
        reply["describe"]["batch_warning"]


def test_the_step_trains_on_the_loss_a_model_computes_from_its_targets(trials):
    """nanoGPT computes its training logits only when given targets: the trials pass them,
    as its loop does, and train on the loss it returns. Told --loss ce, they do not."""
    import torch
    import torch.nn.functional as F

    class Nano(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(30, 8)
            self.lm_head = torch.nn.Linear(8, 30)
        def forward(self, idx, targets=None):
            x = self.wte(idx)
            if targets is None:
                return self.lm_head(x[:, [-1], :]), None
            logits = self.lm_head(x)
            return logits, F.cross_entropy(logits.view(-1, 30), targets.view(-1))

    class LossAlone(torch.nn.Module):  # returns the loss itself when given targets
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 4)
        def forward(self, x, target=None):
            out = self.lin(x)
            return out if target is None else F.cross_entropy(out, target)

    ns = {"model": LossAlone()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [6]})
    own = reply["output"]["own_loss"]
    assert own["returned"] == "output" and own["targets"] == "ids < 4 shaped [2] at batch 2"
    assert own["reason"].startswith("given target, its forward returns the loss alone")
    assert call(trials, ns, "trial", batch=5, steps=2)["result"] == "ran"
    call(trials, ns, "close")

    for loss, logits in ((None, (5, 12, 30)), ("own", (5, 12, 30)), ("ce", (5, 1, 30))):
        model = Nano()
        ns = {"model": model}
        spec = {"kind": "module", "target": "model", "input": [12], "loss": loss}
        reply = call(trials, ns, "prepare", spec=spec)
        assert ("own_loss" in reply["output"]) == (loss != "ce"), reply
        # What the step's output keeps alive into the next forward, a sample's share: the
        # logits it trains on (float32), and the loss beside them (4 bytes over 2 samples).
        returned = 2 if loss != "ce" else 0
        assert reply["output"]["output_sample_bytes"] == 4 * logits[1] * 30 + returned, reply
        call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 30, "class_dim": -1})
        seen, targets = [], []
        hooks = [model.lm_head.register_forward_hook(lambda _m, _a, o: seen.append(o.shape)),
                 model.register_forward_pre_hook(
                     lambda _m, _a, kw: targets.append(kw.get("targets")), with_kwargs=True)]
        try:
            assert call(trials, ns, "trial", batch=5, steps=2)["result"] == "ran"
        finally:
            for hook in hooks:
                hook.remove()
            call(trials, ns, "close")
        assert seen and all(tuple(s) == logits for s in seen), (loss, seen)
        if loss != "ce":  # token ids in the vocabulary, shaped like the batch of input
            assert all(t.shape == (5, 12) and 0 <= t.min() and t.max() < 30 for t in targets)


def test_a_ctc_models_labels_are_made_shorter_than_its_frames(trials):
    """Wav2Vec2ForCTC takes `labels` and returns a CTC loss, which is inf for a transcript as
    long as its frames: the trials train with ids a quarter as long, which give a loss."""
    import torch
    import torch.nn.functional as F

    class CTC(torch.nn.Module):  # [batch, frames, features] -> frame scores, CTC with labels
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 3)
        def forward(self, x, labels=None):
            logits = self.proj(x)
            if labels is None:
                return logits
            frames = torch.full((x.shape[0],), x.shape[1])
            loss = F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), labels, frames,
                              torch.full((x.shape[0],), labels.shape[1]))
            return loss, logits

    model = CTC()
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [16, 8]})
    own = reply["output"]["own_loss"]
    assert own["targets"].startswith("ids < 3 shaped [2, 4] at batch 2, a quarter of the "
                                     "output's length"), own
    losses = []
    hook = model.register_forward_hook(lambda _m, _a, out: losses.append(
        out[0].item() if isinstance(out, tuple) else None))
    try:
        assert call(trials, ns, "trial", batch=5, steps=2)["result"] == "ran"
    finally:
        hook.remove()
        call(trials, ns, "close")
    trained = [v for v in losses if v is not None]
    assert trained and all(v == v and abs(v) != float("inf") for v in trained), losses

    class NotFinite(CTC):  # a loss no targets make finite: taken all the same, and said
        def forward(self, x, labels=None):
            out = super().forward(x, labels)
            return out if labels is None else (out[0] * float("nan"), out[1])

    ns = {"model": NotFinite()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [16, 8]})
    call(trials, ns, "close")
    own = reply["output"]["own_loss"]
    assert own["targets"] == ("ids < 3 shaped [2, 16] at batch 2, with which its loss is not "
                              "finite"), own


def test_the_step_trains_on_the_loss_a_model_computes_from_its_output(trials):
    """A masked autoencoder returns (loss, pred, mask) without targets: the step's backward
    runs from that loss (which reads only pred's first feature here, so the decoder's other
    rows get no gradient), unless a --loss names another; a scalar beside logits that do not
    flow into it (a mixture of experts' auxiliary loss) is not taken for the loss."""
    import torch

    class FirstFeature(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = torch.nn.Linear(6, 4), torch.nn.Linear(4, 6)
        def forward(self, x):
            pred = self.dec(self.enc(x).relu())
            return pred[:, 0].square().mean(), pred, torch.ones(x.shape[0])

    for loss, own in ((None, True), ("mse", False)):
        model = FirstFeature()
        ns = {"model": model}
        reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                                  "input": [6], "loss": loss})
        assert ("returned_loss" in reply["output"]) == own, reply
        assert reply["output"]["selected"] == "output[1]", reply
        # As gpukernel decides for an output that is no class scores (StepLoss::of).
        call(trials, ns, "set_loss", plan={"kind": "mse"}, returned="alone" if own else None)
        grads = []
        hook = model.dec.weight.register_hook(lambda g: grads.append(g.clone()))
        try:
            assert call(trials, ns, "trial", batch=5, steps=2)["result"] == "ran"
        finally:
            hook.remove()
            call(trials, ns, "close")
        assert grads, "no backward reached the decoder"
        rest = max(float(g[1:].abs().max()) for g in grads)
        assert (rest == 0.0) == own, (loss, rest)

    class AuxBeside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.head = torch.nn.Linear(6, 3), torch.nn.Linear(6, 5)
        def forward(self, x):
            return self.head(x), self.gate(x).softmax(-1).square().mean()

    ns = {"model": AuxBeside()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [6]})
    call(trials, ns, "close")
    assert "returned_loss" not in reply["output"] and reply["output"]["shape"] == [2, 5], reply

    # A reentrant checkpoint between the output and the loss hides the path from .grad():
    # the standard loss then, as before, not an engine failure.
    class Reentrant(FirstFeature):
        def forward(self, x):
            from torch.utils.checkpoint import checkpoint
            pred = self.dec(self.enc(x).relu())
            loss = checkpoint(lambda p: p[:, 0].square().mean(), pred, use_reentrant=True)
            return loss, pred

    ns = {"model": Reentrant()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [6]})
    assert "returned_loss" not in reply["output"], reply
    call(trials, ns, "set_loss", plan={"kind": "mse"})
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    call(trials, ns, "close")

    # One compiled graph returns the loss and the output: the check runs eagerly.
    model = torch.compile(FirstFeature(), backend="aot_eager")
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [6]})
    call(trials, ns, "close")
    assert reply["output"]["returned_loss"] == {"returned": "output[0]", "itself": False,
                                                "detached": False}, reply


def test_the_held_output_is_counted_as_the_loop_holds_it(trials):
    """What a forward's output keeps alive, a sample's share: every storage once, a Hugging
    Face cache's keys and values too, and not the model's own weights returned with it; a
    sparse tensor counted by its values, where it has no one storage."""
    import torch

    class Cache:  # transformers' DynamicCache since 4.56: layers holding keys and values
        def __init__(self, keys, values):
            self.layers = [type("Layer", (), {"keys": keys, "values": values})()]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.codebook = torch.nn.Parameter(torch.zeros(1000, 4))  # returned, fixed size
        def forward(self, x):
            y = self.lin(x)
            return {"logits": y, "view": y[:, :2], "codebook": self.codebook,
                    "cache": Cache(torch.zeros(x.shape[0], 8), torch.zeros(x.shape[0], 8)),
                    "sparse": y.detach().to_sparse()}

    model = Model()
    out = model(torch.randn(2, 4))
    sparse = out["sparse"]
    expected = 2 * 4 * 4 + 2 * (2 * 8 * 4) + sparse.numel() * sparse.element_size()
    assert trials._output_bytes(torch, out, model) == expected
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    assert reply["output"]["output_sample_bytes"] == expected // 2, reply
    call(trials, ns, "close")


@pytest.mark.parametrize("drops, alive", [(False, True), (True, False)])
def test_the_last_output_lives_into_the_next_forward_unless_the_loop_drops_it(trials, drops,
                                                                             alive):
    """By default each step's output is alive through its backward and into the next
    forward, as `out = model(x)` in a for loop keeps it; with --drops-output (`loss =
    model(**batch).loss`, `criterion(model(x), y)`) it is gone once the loss is computed,
    before backward, the loss a loop keeps to log being a scalar of its own."""
    import weakref

    import torch

    # (`seen` a deque: the trials put back the lists and dicts the model's own forward
    # writes to, a deque they leave.)
    last, seen, at_backward = [None], collections.deque(), []

    class Probe(torch.autograd.Function):  # sees, in backward, whether the output lives
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            at_backward.append(last[0]() is not None)
            return grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            seen.append(last[0] is not None and last[0]() is not None)
            out = Probe.apply(self.lin(x))
            last[0] = weakref.ref(out)
            return out

    ns = {"model": Model()}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4],
                                      "drops_output": drops})
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    last[0] = None
    seen.clear()
    assert call(trials, ns, "trial", batch=4, steps=3)["result"] == "ran"
    seen = list(seen)
    assert len(seen) >= 2 and seen[0] is False, seen
    assert set(seen[1:]) == {alive}, seen
    assert at_backward and set(at_backward) == {alive}, at_backward
    call(trials, ns, "close")


def test_a_compiled_model_is_not_recompiled_to_watch_its_layers(trials):
    """Hooks on a torch.compile'd model's layers, and arguments it was not called with (its
    labels), make dynamo trace it again (minutes for a large model): the probe runs it
    eagerly, with the same shapes."""
    import torch

    compiles = []

    def backend(graph, _inputs):
        compiles.append(graph)
        return graph.forward

    class SeqFirst(torch.nn.Module):  # dynamo traces attention (it leaves RNNs eager)
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(6, 2)
        def forward(self, x):
            return self.attn(x, x, x)[0]

    class CompiledInside(torch.nn.Module):  # only the encoder compiled, as users often do
        def __init__(self):
            super().__init__()
            self.encoder = torch.compile(SeqFirst(), backend=backend)
            self.head = torch.nn.Linear(6, 3)
        def forward(self, x):
            return self.head(self.encoder(x))

    class Labelled(torch.nn.Module):  # the probe also calls it with labels
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 4)
        def forward(self, x, labels=None):
            logits = self.lin(x)
            return logits, (None if labels is None else
                            torch.nn.functional.cross_entropy(logits.flatten(0, -2),
                                                              labels.flatten()))

    for model in (torch.compile(SeqFirst(), backend=backend), CompiledInside(),
                  torch.compile(Labelled(), backend=backend)):
        seq_first = not isinstance(getattr(model, "_orig_mod", model), Labelled)
        model(torch.randn(7, 2, 6) if seq_first else torch.randn(3, 7, 6))  # the user's loop
        compiled = len(compiles)
        ns = {"model": model}
        reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                                  "input": [7, 6]})
        assert reply["describe"]["batch_dim"] == (1 if seq_first else 0), reply
        # The compiled model's own forward is read, not its wrapper's (*args, **kwargs).
        assert reply["output"]["targets_parameter"] == (None if seq_first else "labels")
        assert len(compiles) == compiled, "the probe compiled the model again"
        call(trials, ns, "close")
    assert compiles, "dynamo compiled nothing: the test would prove nothing"


def test_token_ids_are_found_from_the_embedding_the_input_reaches_first(trials):
    """The first Embedding registered is not always the first layer: the tutorial's model
    registers its encoder first. Floats that fail in an Embedding are tried as its ids."""
    import torch

    class EmbeddingLast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.tok = torch.nn.Embedding(30, 8)
        def forward(self, x):
            return self.proj(self.tok(x))

    reply, seen = _seq_first_prepare(trials, EmbeddingLast(), input=[9])
    assert seen == (5, 9)
    d = reply["describe"]
    assert d["vocab"] == 30 and d["input_dtype"] == "int64 token ids"
    assert d["vocab_from"] == "tok, an Embedding and the first layer the input reaches"
    # An EmbeddingBag (a recommender's sparse features) takes ids too, though not an Embedding.
    bags = torch.nn.Sequential(torch.nn.EmbeddingBag(25, 4), torch.nn.Linear(4, 2))
    reply, seen = _seq_first_prepare(trials, bags, input=[6])
    assert seen == (5, 6) and reply["describe"]["vocab"] == 25
    # Floats that fail anywhere else are still the user's to fix, with what was tried.
    reply, _ = _seq_first_prepare(trials, torch.nn.Linear(8, 2), input=[5])
    assert reply["refused"].startswith("model(x) failed for x of shape (2, 5) (float32)")


def _pos_first(positions, features, classes):
    """A float sequence model whose learned position table is registered first."""
    import torch

    class PosFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Embedding(positions, 8)
            self.proj = torch.nn.Linear(features, 8)
            self.head = torch.nn.Linear(8, classes)
        def forward(self, x):
            return self.head((self.proj(x) + self.pos(torch.arange(x.shape[1]))).mean(1))

    return PosFirst()


def test_a_float_model_whose_first_layer_is_a_position_table_is_fed_floats(trials):
    """A learned position Embedding registered first reads as a token model; its ids fail
    where the input meets a Linear, so the probe tries floats, which it takes."""
    import torch

    reply, seen = _seq_first_prepare(trials, _pos_first(10, 3, 5), input=[10, 3])
    assert seen == (5, 10, 3)
    d = reply["describe"]
    assert d["vocab"] is None and d["input_dtype"] == "float32", d
    assert reply["output"]["shape"] == [2, 5]

    # Where floats fail too, the refusal says both, not "token ids" alone (CLIP's text tower
    # registered first, its forward needing its images as well).
    class NeedsBoth(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(30, 4)
            self.lin = torch.nn.Linear(4, 4)
        def forward(self, x):
            raise ValueError("You have to specify pixel_values")

    reply, _ = _seq_first_prepare(trials, NeedsBoth(), input=[3, 8, 8])
    assert reply["refused"].startswith(
        "model(x) failed for x of shape (2, 3, 8, 8), as token ids (its first layer is an "
        "Embedding): ValueError: You have to specify pixel_values; and as float32: ValueError: "
        "You have to specify pixel_values; check --input"), reply


def test_token_sequences_longer_than_the_position_table_are_refused_before_any_forward(trials):
    """On a GPU, a position past the table is a device-side assert that ends CUDA in the
    user's process: the length is checked against the table (and a Hugging Face config's
    stated limit, which OPT's offset table exceeds) before the probe runs the model."""
    import types
    import torch

    class GPT2ish(torch.nn.Module):
        def __init__(self, table=16, stated=None):
            super().__init__()
            self.wte = torch.nn.Embedding(30, 4)
            self.wpe = torch.nn.Embedding(table, 4)
            self.head = torch.nn.Linear(4, 30)
            self.calls = 0
            if stated is not None:
                self.config = types.SimpleNamespace(max_position_embeddings=stated)
        def forward(self, x):
            self.calls += 1
            return self.head(self.wte(x) + self.wpe(torch.arange(x.shape[1])))

    for model, length, limit in ((GPT2ish(), 17, 16), (GPT2ish(18, stated=16), 17, 16)):
        ns = {"m": model}
        reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "m",
                                                  "input": [length]})
        assert reply["refused"].startswith(
            f"m.wpe holds positions for {limit} tokens, and --input asks for sequences of "
            f"{length}"), reply
        assert f"Use --input {limit} (or less)" in reply["refused"]
        assert model.calls == 0
    # At the table's length it runs.
    reply, seen = _seq_first_prepare(trials, GPT2ish(), input=[16])
    assert "refused" not in reply and seen == (5, 16)

    # Only a table beside the token table counts: CLIP's vision tower has one of its own (17
    # patches), which a text of 20 tokens never meets; nor does a float model's own table,
    # with more features than positions, whose ids (guessed from it) are tried as floats.
    class TwoTowers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.text = torch.nn.Module()
            self.text.token_embedding = torch.nn.Embedding(30, 4)
            self.text.position_embedding = torch.nn.Embedding(32, 4)
            self.vision = torch.nn.Module()
            self.vision.position_embedding = torch.nn.Embedding(17, 4)
            self.head = torch.nn.Linear(4, 30)
        def forward(self, x):
            t = self.text
            return self.head(t.token_embedding(x) + t.position_embedding(torch.arange(x.shape[1])))

    reply, seen = _seq_first_prepare(trials, TwoTowers(), input=[20])
    assert "refused" not in reply and seen == (5, 20), reply

    # An image's shape given to a model whose first argument is token ids (CLIP's input_ids,
    # its images under pixel_values): the refusal says why the shape was read as ids and
    # points to a step of the user's, not only to a shorter "sequence".
    class ClipLike(TwoTowers):
        def forward(self, input_ids, pixel_values=None):
            return super().forward(input_ids)

    for shape, told in (([3, 40, 40], True), ([2, 40], False)):
        model = ClipLike()
        reply = call(trials, {"m": model}, "prepare",
                     spec={"kind": "module", "target": "m", "input": shape})
        refused = reply["refused"]
        assert refused.startswith("m.text.position_embedding holds positions for 32 tokens"), reply
        reason = (f"--input {'x'.join(map(str, shape))} was read as token ids because m takes its "
                  "first argument, input_ids, into an Embedding; if you meant an image")
        assert (reason in refused) == told, refused
        assert ("%maxbatch --step FN" in refused) == told, refused

    reply, seen = _seq_first_prepare(trials, _pos_first(8, 12, 3), input=[8, 12])
    assert "refused" not in reply and seen == (5, 8, 12), reply
    assert reply["describe"]["vocab"] is None


def test_segmentation_labels_come_at_the_inputs_size_when_the_models_loss_takes_them(trials):
    """SegFormer's logits are a quarter of the image's size each way, and its loss scales
    them up to the masks, which a loop passes at the image's size: the step does so too. A
    loss that cannot take them so gets masks at the logits' size."""
    import torch
    import torch.nn.functional as F

    class SegQuarter(torch.nn.Module):
        def __init__(self, upsamples=True):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 4, stride=4)
            self.upsamples = upsamples
        def forward(self, x, labels=None):
            logits = self.conv(x)
            if labels is None:
                return logits
            if self.upsamples:
                logits = F.interpolate(logits, size=labels.shape[-2:], mode="bilinear")
            return F.cross_entropy(logits, labels), logits

    for upsamples, masks in ((True, (5, 16, 16)), (False, (5, 4, 4))):
        model = SegQuarter(upsamples)
        ns = {"model": model}
        reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                                  "input": [3, 16, 16]})
        own = reply["output"]["own_loss"]
        assert own["targets"] == (
            "ids < 4 shaped [2, 16, 16] at batch 2, the input's size" if upsamples
            else "ids < 4 shaped [2, 4, 4] at batch 2"), own
        labels = _keyword_in_a_trial(trials, ns, model, "labels")
        assert labels and all(tuple(t.shape) == masks and t.max() < 4 for t in labels)


def _keyword_in_a_trial(trials, ns, model, keyword, batch=5):
    """What the prepared session's trial of `batch` passed `model` as `keyword`, every call;
    the session is closed after."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw.get(keyword)), with_kwargs=True)
    try:
        assert call(trials, ns, "trial", batch=batch, steps=2)["result"] == "ran"
    finally:
        handle.remove()
        call(trials, ns, "close")
    return seen


def test_a_models_loss_on_values_gets_values_as_its_targets(trials):
    """A regression's targets (or multi-label ones) are values shaped like the output, not
    class ids: where ids give no loss, the step trains on the loss the model computes from
    values."""
    import torch
    import torch.nn.functional as F

    class Reg(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(20, 3)
        def forward(self, x, targets=None):
            y = self.net(x)
            return y if targets is None else (y, F.mse_loss(y, targets))

    model = Reg()
    ns = {"model": model}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                                  "input": [20]})
    # Class ids, tried first, broadcast against the output and failed: their warning is not
    # passed on to the user.
    assert not [w for w in said if "target size" in str(w.message)], said
    own = reply["output"]["own_loss"]
    assert own["targets"] == "float32 values shaped like the output, [2, 3] at batch 2", own
    seen = _keyword_in_a_trial(trials, ns, model, "targets")
    assert seen and all(t.shape == (5, 3) and t.is_floating_point() for t in seen)


def test_a_forward_that_takes_keywords_only_is_refused_with_what_to_do(trials):
    import torch

    class KeywordsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
        def forward(self, *, pixel_values):
            return self.lin(pixel_values)

    reply, _ = _seq_first_prepare(trials, KeywordsOnly(), input=[4])
    assert reply["refused"].startswith(
        "model.forward takes no positional argument (only pixel_values, by keyword), while "
        "%maxbatch MODULE calls it with one tensor of --input: write a function"), reply


def test_a_forward_that_asks_for_a_second_optional_input_is_refused_naming_it(trials):
    """CLIPModel's forward takes input_ids and pixel_values, both optional in its signature,
    and fails without either: the refusal names the one it asked for. An encoder-decoder's
    failure names its decoder's ids as well, and still trains given its labels."""
    import torch
    import torch.nn.functional as F

    class TwoTowers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.text, self.image = torch.nn.Embedding(30, 4), torch.nn.Linear(6, 4)
        def forward(self, input_ids=None, pixel_values=None, attention_mask=None,
                    return_loss=None):
            if pixel_values is None:
                raise ValueError("You have to specify pixel_values")
            return self.text(input_ids).mean(1) @ self.image(pixel_values).T

    reply, _ = _seq_first_prepare(trials, TwoTowers(), input=[5], vocab=30)
    assert reply["refused"].startswith(
        "model.forward failed asking for pixel_values (ValueError: You have to specify "
        "pixel_values), while %maxbatch MODULE calls it with one tensor of --input only: "
        "write a function"), reply

    class EncoderDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30)
        def forward(self, input_ids=None, decoder_input_ids=None, labels=None):
            encoded = self.emb(input_ids)
            if decoder_input_ids is None and labels is None:
                raise ValueError("You have to specify either decoder_input_ids or "
                                 "decoder_inputs_embeds")
            logits = self.head(encoded + self.emb(F.pad(labels, (1, 0))[:, :-1]))
            return F.cross_entropy(logits.reshape(-1, 30), labels.reshape(-1)), logits

    ns = {"model": EncoderDecoder()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                               "input": [6], "vocab": 30})
    try:
        assert "refused" not in reply, reply
        assert reply["output"]["own_loss"]["parameter"] == "labels", reply
    finally:
        call(trials, ns, "close")


def test_the_loss_is_computed_on_the_first_tensor_that_is_not_a_scalar(trials):
    """A model returning `(aux_loss, logits)` (or a loss first in a dict) is sized on its
    logits, not on the scalar in front of them."""
    import torch

    logits, aux = torch.randn(2, 5), torch.tensor(0.3)
    assert trials._select_output(torch, (aux, logits)) == (logits, "output[1]")
    picked, where = trials._select_output(torch, {"loss": aux, "scores": logits})
    assert picked is logits and where == "output['scores']"
    assert trials._select_output(torch, [aux]) == (aux, "output[0]")  # nothing else to take
    with pytest.raises(trials.MaxBatchError, match="returned a tuple with no floating-point"):
        trials._select_output(torch, (torch.tensor([1, 2]),))


def test_auxiliary_heads_shaped_like_the_output_are_trained_by_the_loss(trials):
    """A head left out of the loss would keep its graph alive until the next forward, memory
    the user's own step (which trains it) frees in its backward."""
    import torch

    class SegWithAux(torch.nn.Module):
        """torchvision's segmentation models' output: {'out': ..., 'aux': ...}, the
        auxiliary head trained with the main one (loss = ce(out) + 0.5 * ce(aux))."""

        def __init__(self):
            super().__init__()
            self.body = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.head = torch.nn.Conv2d(8, 5, 1)
            self.aux = torch.nn.Conv2d(8, 5, 1)

        def forward(self, x):
            features = self.body(x).relu()
            return {"out": self.head(features), "aux": self.aux(features)}

    model = SegWithAux()
    # (A deque: the trials put back the lists and dicts hooks write to, a deque they leave.)
    reached = collections.deque()
    model.aux.register_full_backward_hook(lambda *_: reached.append("aux"))
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [3, 6, 6]})
    assert reply["output"]["selected"] == "output['out']"
    assert reply["output"]["heads"] == ["output['aux']"]
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 5, "class_dim": 1})
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    assert reached, "the auxiliary head's backward never ran: it was left out of the loss"
    call(trials, ns, "close")

    logits, other = torch.randn(2, 7), torch.randn(2, 7)
    assert [w for w, _ in trials._heads(torch, (logits, other), logits)] == ["output[1]"]
    # Inception's and GoogLeNet's named tuples: the heads by their field names.
    inception = collections.namedtuple("InceptionOutputs", ["logits", "aux_logits"])
    out = inception(logits, other)
    assert trials._select_output(torch, out) == (logits, "output.logits")
    assert [w for w, _ in trials._heads(torch, out, logits)] == ["output.aux_logits"]
    # A Hugging Face-like output: a scalar loss and tensors of other shapes are not heads.
    hf = {"loss": torch.tensor(1.0), "logits": logits, "hidden": torch.randn(2, 3)}
    assert trials._heads(torch, hf, logits) == []
    assert trials._heads(torch, logits, logits) == []


def test_a_buffer_the_forward_replaces_is_put_back_as_it_was(trials):
    """An EMA written as `self.ema = 0.9 * self.ema + ...` replaces the registered buffer's
    tensor object in its module: the original, with its values, goes back in its place."""
    import torch

    class Ema(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))
        def forward(self, x):
            h = self.lin(x)
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
            return h

    model = Ema()
    original = model.ema
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4],
                                              "optimizer": "sgd"})
    assert "refused" not in reply, reply
    call(trials, ns, "set_loss", plan={"kind": "mse"})
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    assert model.ema is original and model._buffers["ema"] is original
    assert torch.equal(original, torch.zeros(4))
    call(trials, ns, "close")
    assert model.ema is original and torch.equal(model.ema, torch.zeros(4))


def test_a_modules_cache_and_the_attributes_beside_it_come_back_together(trials):
    """A rotary-embedding-like cache: a longer sequence replaces the buffer and raises the
    length kept beside it; a buffer registered as None is filled; a plain tensor and a plain
    number count calls; a trial registers a new buffer. All of it is as it was after the trial,
    and the module still runs at a length between the two (half put back, it would not)."""
    import torch

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.max_len = 8
            self.register_buffer("table", torch.arange(8.0), persistent=False)
            self.register_buffer("last", None)
            self.seen = torch.zeros(())
            self.calls = 0
        def forward(self, x):  # x: [batch, length, 4]
            if x.shape[1] > self.max_len:
                self.max_len = x.shape[1]
                self.register_buffer("table", torch.arange(float(self.max_len)), persistent=False)
            self.last = x.detach()[:1]
            self.seen += 1
            self.calls += 1
            if not hasattr(self, "extra"):
                self.register_buffer("extra", torch.ones(1))
            return self.lin(x) * self.table[: x.shape[1], None]

    model = Cached()
    table, seen = model.table, model.seen
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [16, 4], "optimizer": "sgd"})
    assert "refused" not in reply, reply
    call(trials, ns, "set_loss", plan={"kind": "mse"})
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    call(trials, ns, "close")
    assert model.max_len == 8 and model.table is table and model.table.shape == (8,)
    assert model.last is None and "last" in model._buffers
    assert model.seen is seen and float(seen) == 0.0 and model.calls == 0
    assert not hasattr(model, "extra")
    assert model(torch.randn(1, 6, 4)).shape == (1, 6, 4)


def test_a_torchscript_module_in_the_notebook_leaves_every_restore_whole(trials):
    """TorchScript keeps a module's parameters in C++ wrappers, not dicts: a scripted module
    the step reaches, or sized itself, must not stop the rest of the state coming back."""
    import torch

    scripted = torch.jit.script(torch.nn.Linear(4, 2))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())  # no state yet: the trial makes it

    def step(batch):
        opt.zero_grad()
        (model(torch.randn(batch, 4)).sum() + scripted(torch.randn(batch, 4)).sum()).backward()
        opt.step()

    ns = {"step": step, "scripted": scripted, "model": model, "opt": opt}
    weights = [p.detach().clone() for p in (*model.parameters(), *scripted.parameters())]
    rng = torch.random.get_rng_state()
    reply = call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert "refused" not in reply, reply
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    assert len(opt.state) == 0 and torch.equal(torch.random.get_rng_state(), rng)
    assert call(trials, ns, "close")["closed"] is True
    assert all(torch.equal(a, b) for a, b in
               zip(weights, (*model.parameters(), *scripted.parameters())))
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "scripted",
                                              "input": [4], "optimizer": "sgd"})
    assert reply["output"]["shape"] == [2, 2], reply
    call(trials, ns, "close")


def test_a_forward_whose_decorator_supplies_an_argument_is_not_refused(trials):
    """The signature says (x, mask), but a decorator fills the mask: `model(x)` works, so the
    module is sized; the signature only explains a forward that failed."""
    import functools

    import torch

    def default_mask(forward):
        @functools.wraps(forward)
        def wrapper(self, x, mask=None):
            return forward(self, x, torch.ones_like(x) if mask is None else mask)
        return wrapper

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
        @default_mask
        def forward(self, x, mask):
            return self.lin(x * mask)

    ns = {"model": Masked()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4],
                                              "optimizer": "sgd"})
    assert reply.get("output", {}).get("shape") == [2, 2], reply
    call(trials, ns, "close")


def test_a_step_function_reaches_state_through_closures_partials_and_objects(trials):
    import functools

    import torch

    class Trainer:
        def __init__(self):
            self.model = torch.nn.Linear(2, 2)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def step(self, batch):
            self.opt.zero_grad()
            self.model(torch.randn(batch, 2)).sum().backward()
            self.opt.step()

    trainer = Trainer()
    hidden = torch.nn.Linear(3, 3)  # reached only through the closure

    def make_step():
        def step(batch, scale):
            hidden(torch.randn(batch, 3)).sum().mul(scale).backward()
        return step

    partial = functools.partial(make_step(), scale=2.0)
    found = trials.find_state(torch, {"trainer_step": trainer.step},
                              trials._StepRefs(trainer.step).refs)
    assert trainer.model in found["module"].values()
    assert trainer.opt in found["optimizer"].values()
    found = trials.find_state(torch, {}, trials._StepRefs(partial).refs)
    assert hidden in found["module"].values()


def _state_of(torch, *objects):
    """Everything a test compares after a session: tensors by value (and identity), the rest
    by value; modules, optimizers and schedulers through their state, generators by state."""
    import copy
    import random

    import numpy as np

    def of(obj):
        if isinstance(obj, torch.nn.Module):
            return ({k: v.detach().clone() for k, v in obj.state_dict().items()},
                    [(p.requires_grad, None if p.grad is None else p.grad.clone())
                     for p in obj.parameters()], [m.training for m in obj.modules()])
        if isinstance(obj, torch.optim.Optimizer):
            return (copy.deepcopy(obj.state_dict()), len(obj.param_groups),
                    [[id(p) for p in g["params"]] for g in obj.param_groups])
        if isinstance(obj, torch.Generator):
            return obj.get_state().clone()
        if isinstance(obj, np.random.Generator):
            return copy.deepcopy(obj.bit_generator.state)
        if isinstance(obj, random.Random):
            return obj.getstate()
        if torch.is_tensor(obj):
            return obj.detach().clone()
        if isinstance(obj, (list, tuple)):
            return [of(o) for o in obj]
        if hasattr(obj, "state_dict"):
            return copy.deepcopy(obj.state_dict())
        return copy.deepcopy(obj)
    return [of(o) for o in objects]


def _same(torch, a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(torch, a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            _same(torch, x, y) for x, y in zip(a, b))
    return a == b


def _step_session(trials, ns, target, batches=(2, 3)):
    """prepare, trials at `batches`, close, for a step function; the replies."""
    reply = call(trials, ns, "prepare", spec={"kind": "step", "target": target})
    assert "refused" not in reply, reply
    results = [call(trials, ns, "trial", batch=b, steps=2) for b in batches]
    closed = call(trials, ns, "close")
    return reply, results, closed


def test_state_two_levels_down_from_a_step_function_is_found_and_put_back(trials):
    """A Trainer's `self.parts["model"]` and a config's `cfg.train.model`: found through the
    step's references, put back with their scheduler's and optimizer's learning rate."""
    import types

    import torch
    import torch.nn.functional as F

    class Trainer:
        def __init__(self):
            m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.Linear(8, 3))
            self.parts = {"model": m, "opt": torch.optim.AdamW(m.parameters())}
            self.sched = torch.optim.lr_scheduler.StepLR(self.parts["opt"], 1, 0.5)

        def train_step(self, bs):
            m, o = self.parts["model"], self.parts["opt"]
            o.zero_grad()
            F.cross_entropy(m(torch.randn(bs, 8)), torch.randint(0, 3, (bs,))).backward()
            o.step()
            self.sched.step()

    trainer = Trainer()
    trainer.train_step(4)
    model = torch.nn.Linear(8, 3)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(
        model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))

    def make_step(cfg):
        def step(bs):
            cfg.train.opt.zero_grad()
            cfg.train.model(torch.randn(bs, 8)).sum().backward()
            cfg.train.opt.step()
        return step

    ns = {"trainer": trainer, "step": make_step(cfg)}
    ns["step"](2)
    for target, objects in (("trainer.train_step", [trainer.parts["model"], trainer.parts["opt"],
                                                     trainer.sched]),
                            ("step", [model, cfg.train.opt])):
        before = _state_of(torch, *objects)
        _, results, _ = _step_session(trials, ns, target)
        assert all(r["result"] == "ran" for r in results), results
        assert _same(torch, before, _state_of(torch, *objects)), target


def test_an_optimizer_no_reference_reaches_is_kept_before_its_first_step(trials):
    """An optimizer held where nothing the step names leads (a registry in another module):
    kept when it first steps, its weights and state put back, its lost gradients named."""
    import sys
    import types

    import torch

    registry = types.ModuleType("_gpukernel_test_registry")  # a module: find_state skips it
    model = torch.nn.Linear(4, 2)
    registry.pair = (model, torch.optim.Adam(model.parameters(), lr=0.1))
    sys.modules[registry.__name__] = registry
    try:
        def step(bs):
            import _gpukernel_test_registry as r
            m, o = r.pair
            o.zero_grad()
            m(torch.randn(bs, 4)).sum().backward()
            o.step()

        step(2)
        weight, state = model.weight.detach().clone(), _state_of(torch, registry.pair[1])
        _, results, closed = _step_session(trials, {"step": step}, "step")
        assert all(r["result"] == "ran" for r in results), results
        assert torch.equal(model.weight, weight)
        assert _same(torch, state, _state_of(torch, registry.pair[1]))
        assert any("Adam over 2 tensors" in n for n in closed["not_kept"]), closed
    finally:
        del sys.modules[registry.__name__]


def _hooked_model(torch, kept):
    """A model whose hooks keep what they saw in `kept`'s list, dict and object: a forward
    hook appending outputs, one writing activations through functools.partial, a bound
    method counting calls, and a gradient hook on a weight; and a layer of the user's own
    class whose forward appends its inputs to a global list."""
    import functools

    def save(name, module, args, out):
        kept["acts"][name] = out.detach()

    class Remembering(torch.nn.Module):  # a forward of the user's own that keeps what it saw
        def forward(self, x):
            _SEEN_BY_FORWARD.append(x.detach())
            return self.lin(x)

    class Remembers(Remembering):  # the layer's class: its base's forward runs
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 3)

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), Remembers())
    model[1].register_forward_hook(lambda m, i, o: kept["feats"].append(o))
    model[2].register_forward_hook(functools.partial(save, "head"))
    model[0].register_forward_hook(kept["counter"].hook)
    model[0].weight.register_hook(lambda g: kept["grads"].append(g.norm()))
    return model


class _Counter:
    def __init__(self):
        self.calls, self.seen = 0, []

    def hook(self, module, args, out):
        self.calls += 1
        self.seen.append(out.shape[0])


# What the forward of `_hooked_model`'s own layer keeps.
_SEEN_BY_FORWARD = []


def _hooks_kept(kept):
    return (list(kept["feats"]), dict(kept["acts"]), list(kept["grads"]),
            kept["counter"].calls, list(kept["counter"].seen), list(_SEEN_BY_FORWARD))


@pytest.mark.parametrize("kind", ["module", "step"])
def test_what_a_models_hooks_keep_is_put_back_after_its_trials(trials, kind):
    """Hooks and the user's own forwards run in every trial's forward and backward: what they
    keep (a list, a dict, an object's attributes, reached through a closure, functools.partial,
    a bound method and a forward's globals) is as it was after the trials, for the standard step and for a step function, and the
    session says it followed them. Before, the trials' outputs stayed in the user's list,
    alive on the GPU after the search."""
    import torch
    import torch.nn.functional as F

    kept = {"feats": [], "acts": {"head": "before"}, "grads": [], "counter": _Counter()}
    model = _hooked_model(torch, kept)
    opt = torch.optim.AdamW(model.parameters())
    before = _hooks_kept(kept)

    def step(bs):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(bs, 8)), torch.randint(0, 3, (bs,))).backward()
        opt.step()

    if kind == "module":
        ns = {"model": model, "opt": opt}
        reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                                  "input": [8]})
        call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
        results = [call(trials, ns, "trial", batch=b, steps=2) for b in (4, 6)]
        closed = call(trials, ns, "close")
    else:
        reply, results, closed = _step_session(trials, {"step": step}, "step")
    assert all(r["result"] == "ran" for r in results), results
    assert closed["not_kept"] == [], closed
    assert reply["describe"]["hooked"] is True, reply["describe"]
    assert _hooks_kept(kept) == before
    # Without hooks the flag stays down.
    plain = torch.nn.Linear(8, 3)
    reply = call(trials, {"plain": plain}, "prepare",
                 spec={"kind": "module", "target": "plain", "input": [8]})
    assert reply["describe"]["hooked"] is False, reply["describe"]
    call(trials, {"plain": plain}, "close")


def test_generators_tensors_and_attributes_a_step_reaches_are_put_back(trials):
    """Its own random generators (torch, NumPy, random), an EMA's shadow tensors in a list
    and its step counter, a module's list attribute a forward appends to, and a layer it
    unfreezes with a parameter group it adds (progressive unfreezing)."""
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F

    g, rng, prng = torch.Generator().manual_seed(1), np.random.default_rng(2), random.Random(3)

    class Seen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.seen = torch.nn.Linear(8, 8), []

        def forward(self, x):
            self.seen.append(x.shape[0])
            return self.lin(x)

    class Ema:  # diffusers' EMAModel's way: plain tensors in a list, a counter
        def __init__(self, params):
            self.shadow = [p.detach().clone() for p in params]
            self.optimization_step = 0

        def step(self, params):
            self.optimization_step += 1
            with torch.no_grad():
                for s, p in zip(self.shadow, params):
                    s.sub_(0.01 * (s - p))

    model = torch.nn.Sequential(Seen(), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model[2].parameters())
    ema = Ema(model.parameters())
    state = {"unfrozen": False}

    def step(bs):
        if not state["unfrozen"]:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-4})
            state["unfrozen"] = True
        x = torch.randn(bs, 8, generator=g) + torch.from_numpy(
            rng.standard_normal((bs, 8)).astype("float32")) * prng.random()
        opt.zero_grad()
        F.cross_entropy(model(x), torch.randint(0, 2, (bs,), generator=g)).backward()
        opt.step()
        ema.step(model.parameters())

    objects = [g, rng, prng, model, opt, ema.shadow]
    before = _state_of(torch, *objects)
    seen, counter, flags = list(model[0].seen), ema.optimization_step, dict(state)
    _, results, closed = _step_session(trials, {"step": step}, "step")
    assert all(r["result"] == "ran" for r in results), results
    assert closed["not_kept"] == [], closed
    after = _state_of(torch, *objects)
    for name, a, b in zip(("generator", "numpy", "random", "model", "optimizer", "ema"),
                          before, after):
        assert _same(torch, a, b), name
    assert model[0].seen == seen and ema.optimization_step == counter
    assert state == flags  # a dict the step reaches: its entries are put back too


def test_notebook_variables_a_step_assigns_are_put_back_with_the_state_they_describe(trials):
    """Progressive unfreezing as a notebook writes it (`global unfrozen`): the flag comes back
    with the frozen layer and the optimizer's one group, or the user's next step would not
    unfreeze; a global the step creates goes again."""
    ns = {}
    exec(compile("""
import torch, torch.nn.functional as F
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
model[0].requires_grad_(False)
opt = torch.optim.AdamW(model[2].parameters(), lr=1e-3)
unfrozen = False
def unfreeze_step(bs):
    global unfrozen, last_batch
    if not unfrozen:
        model[0].requires_grad_(True)
        opt.add_param_group({"params": model[0].parameters(), "lr": 1e-4})
        unfrozen = True
    last_batch = bs
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(bs, 8)), torch.randint(0, 3, (bs,))).backward()
    opt.step()
""", "<notebook cell>", "exec"), ns)
    _, results, _ = _step_session(trials, ns, "unfreeze_step")
    assert all(r["result"] == "ran" for r in results), results
    assert ns["unfrozen"] is False and "last_batch" not in ns
    assert len(ns["opt"].param_groups) == 1
    assert [p.requires_grad for p in ns["model"].parameters()] == [False, False, True, True]


def test_a_grad_scaler_and_scheduler_cut_mid_step_are_put_back(trials):
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    def step(batch):
        loss = model(torch.randn(batch, 4)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)  # cut before scaler.update(): its per-optimizer state says "stepped"
        sched.step()
        raise KeyboardInterrupt

    ns = {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "step": step}
    lr, scale = opt.param_groups[0]["lr"], scaler.get_scale()
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=2, steps=1)["result"] == "interrupted"
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 0
    assert scaler.get_scale() == scale
    call(trials, ns, "close")
    # The scaler works again as in a fresh loop (no "step() already called" error).
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()


def _state_equal(torch, a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_state_equal(torch, x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(torch, a[k], b[k]) for k in a)
    return a == b


def _needs_closure(opt):
    import inspect

    closure = inspect.signature(opt.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _training_step(torch, model, opt, sched=None):
    """`step(batch)`: one step of a 4-feature, 3-class classifier on random data, as a loop
    writes it; through a closure for an optimizer that takes one (LBFGS)."""
    closure = _needs_closure(opt)

    def step(batch):
        x, y = torch.randn(batch, 4), torch.randint(0, 3, (batch,))

        def loss():
            opt.zero_grad()
            value = torch.nn.functional.cross_entropy(model(x), y)
            value.backward()
            return value
        if closure:
            return opt.step(loss)
        loss()
        opt.step()
        if sched is not None:
            sched.step()

    return step


def _lbfgs_notebook():
    """A small net mid-training with LBFGS (as physics-informed nets are trained): its
    history, lists of tensors LBFGS appends to and pops from in place, is full."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.LBFGS(model.parameters(), history_size=4, max_iter=5)
    step = _training_step(torch, model, opt)
    for _ in range(3):
        step(8)
    assert len(opt.state[next(model.parameters())]["old_dirs"]) == 4
    return torch, model, opt, step


def test_an_optimizers_history_kept_in_lists_is_put_back_as_it_was(trials):
    """LBFGS keeps its history in lists it rewrites in place: a copy of the lists' tensors,
    not of the lists, is what puts the user's history back."""
    import copy

    torch, model, opt, step = _lbfgs_notebook()
    ns = {"model": model, "opt": opt, "step": step}
    before = copy.deepcopy(opt.state_dict())
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=8, steps=3)["result"] == "ran"
    after_trial = opt.state_dict()
    assert _state_equal(torch, before, after_trial), "the history after the trial"
    call(trials, ns, "close")
    assert _state_equal(torch, before, opt.state_dict())
    step(8)  # the user's loop goes on from it
    assert not _state_equal(torch, before, opt.state_dict())


def test_optimizer_state_in_tuples_and_dicts_is_put_back_as_it_was(trials):
    """A hand-written optimizer may keep tuples, named tuples and dicts of tensors in its
    state."""
    from collections import namedtuple

    import torch

    Ema = namedtuple("Ema", "fast slow")

    class Pairs(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "pair" not in state:
                        state["pair"] = (torch.zeros_like(p), torch.zeros_like(p))
                        state["moments"] = {"n": 0, "sum": torch.zeros_like(p)}
                        state["ema"] = Ema(torch.zeros_like(p), torch.zeros_like(p))
                    state["ema"].fast.lerp_(p.grad, 0.5)
                    state["ema"].slow.lerp_(p.grad, 0.1)
                    state["pair"][0].add_(p.grad)
                    state["pair"][1].add_(p.grad.square())
                    state["moments"]["n"] += 1
                    state["moments"]["sum"].add_(p.grad)
                    p.add_(state["pair"][0], alpha=-group["lr"])

    model = torch.nn.Linear(4, 3)
    opt = Pairs(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = {p: {"pair": tuple(t.clone() for t in s["pair"]),
                  "moments": {"n": s["moments"]["n"], "sum": s["moments"]["sum"].clone()},
                  "ema": Ema(*(t.clone() for t in s["ema"]))}
              for p, s in opt.state.items()}
    ns = {"model": model, "opt": opt}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    call(trials, ns, "set_loss", plan={"kind": "mse"})
    assert call(trials, ns, "trial", batch=4, steps=2)["result"] == "ran"
    call(trials, ns, "close")
    for p, saved in before.items():
        assert type(opt.state[p]["pair"]) is tuple and type(opt.state[p]["ema"]) is Ema
        assert _state_equal(torch, saved, opt.state[p])


def _torch_optimizers():
    import torch

    return sorted(name for name, cls in vars(torch.optim).items()
                  if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                  and cls is not torch.optim.Optimizer
                  and name != "SparseAdam")  # sparse gradients only


@pytest.mark.parametrize("kind", ["step", "module"])
@pytest.mark.parametrize("name", _torch_optimizers())
def test_every_torch_optimizer_mid_training_is_put_back_exactly(trials, name, kind):
    """Every optimizer torch.optim has (found, not listed: a new one is checked too), with a
    scheduler chain, mid-training: a trial of the user's step and of the standard step leaves
    the optimizer's state, the scheduler's and the model's tensor-equal."""
    import copy

    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 3))
    cls = getattr(torch.optim, name)
    # Muon orthogonalizes matrices: it takes the 2-D weights only (the rest go to AdamW).
    params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" else \
        list(model.parameters())
    opt = cls(params)
    sched = None
    if not _needs_closure(opt):
        lr = torch.optim.lr_scheduler
        sched = lr.SequentialLR(opt, [lr.LinearLR(opt), lr.StepLR(opt, 2)], milestones=[3])
    step = _training_step(torch, model, opt, sched)
    for _ in range(3):
        step(8)
    before = copy.deepcopy((opt.state_dict(), model.state_dict(),
                            sched and sched.state_dict()))
    ns = {"model": model, "opt": opt, "sched": sched, "step": step}
    spec = ({"kind": "step", "target": "step"} if kind == "step" else
            {"kind": "module", "target": "model", "input": [4]})
    reply = call(trials, ns, "prepare", spec=spec)
    assert "refused" not in reply, reply
    if kind == "module":
        call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    result = call(trials, ns, "trial", batch=8, steps=3)
    assert result["result"] == "ran", result
    call(trials, ns, "close")
    after = (opt.state_dict(), model.state_dict(), sched and sched.state_dict())
    assert _state_equal(torch, before, after)


class _Adapted:
    """A frozen base under a trainable low-rank adapter, as LoRA fine-tunes are set up."""

    def __new__(cls):
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.base = torch.nn.Linear(16, 3).requires_grad_(False)
                self.down = torch.nn.Linear(16, 2, bias=False)
                self.up = torch.nn.Linear(2, 3, bias=False)

            def forward(self, x):
                return self.base(x) + self.up(self.down(x))

        torch.manual_seed(0)
        return Model()


def test_the_standard_step_leaves_frozen_weights_uncopied_and_unchanged(trials):
    """The standard step cannot write a weight without requires_grad that no optimizer holds:
    a frozen base (LoRA's, a 4-bit one's) costs no host copy, and comes out bit-identical."""
    import torch

    model = _Adapted()
    base = [t.clone() for t in model.base.parameters()]
    ns = {"model": model, "opt": torch.optim.AdamW([*model.down.parameters(),
                                                     *model.up.parameters()])}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [16]})
    described = reply["describe"]
    assert described["fixed_bytes"] == (16 * 3 + 3) * 4, described
    assert described["snapshot_bytes"] == (16 * 2 + 2 * 3) * 4, described  # the adapter only
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    assert call(trials, ns, "trial", batch=8, steps=3)["result"] == "ran"
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(base, model.base.parameters()))
    # A frozen weight an optimizer holds is copied: the optimizer could still write it.
    ns["opt"] = torch.optim.AdamW(model.parameters())
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [16]})
    assert reply["describe"]["fixed_bytes"] == 0, reply["describe"]
    call(trials, ns, "close")
    # So is one still holding a gradient (from before it was frozen): a step without an
    # optimizer clears every gradient of the model, and the gradient comes back.
    del ns["opt"]
    model.base.weight.grad = torch.ones_like(model.base.weight)
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [16],
                                              "optimizer": "none"})
    assert reply["describe"]["fixed_bytes"] == 3 * 4, reply["describe"]  # the bias alone
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    assert call(trials, ns, "trial", batch=8, steps=2)["result"] == "ran"
    call(trials, ns, "close")
    assert torch.equal(model.base.weight.grad, torch.ones_like(model.base.weight))


def test_a_frozen_teacher_the_users_step_updates_in_place_is_put_back(trials):
    """`--step FN` may write any weight: a frozen EMA teacher, as BYOL and DINO update it."""
    import copy

    import torch

    student = _Adapted()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def step(batch):
        x = torch.randn(batch, 16)
        opt.zero_grad()
        torch.nn.functional.mse_loss(student(x), teacher(x)).backward()
        opt.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)

    step(4)
    before = [t.clone() for t in teacher.parameters()]
    ns = {"student": student, "teacher": teacher, "opt": opt, "step": step}
    reply = call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert reply["describe"]["fixed_bytes"] == 0, reply["describe"]
    assert call(trials, ns, "trial", batch=8, steps=3)["result"] == "ran"
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))


def _adapter_step(model, opt, then=lambda: None):
    """A user's `--step` for `_Adapted`: one step on random data, then `then()` (a write to
    the frozen base, say)."""
    import torch

    def step(batch):
        opt.zero_grad()
        model(torch.randn(batch, 16)).square().mean().backward()
        opt.step()
        then()

    return step


def test_a_frozen_base_the_users_step_leaves_alone_is_not_copied_back(trials, monkeypatch):
    """`--step FN` over LoRA adapters: the frozen base is kept once (it could be written) and,
    unchanged by the trials, never copied back; one the step writes through `.data` (which
    no version counter sees) is put back each time. (The GPU's path, run on the CPU.)"""
    import torch

    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda", "cpu"))
    model = _Adapted()
    base = [t.clone() for t in model.base.parameters()]
    opt = torch.optim.AdamW([*model.down.parameters(), *model.up.parameters()])
    ns = {"model": model, "opt": opt, "step": _adapter_step(model, opt)}
    described = call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})["describe"]
    assert described["watched_bytes"] == (16 * 3 + 3) * 4, described
    assert described["fixed_bytes"] == 0, described
    for batch in (4, 8):
        assert call(trials, ns, "trial", batch=batch, steps=3)["result"] == "ran"
    assert trials._session.snapshot.watched.put_back == 0
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(base, model.base.parameters()))

    # An EMA written the old way, through .data: no version bump.
    ns["step"] = _adapter_step(model, opt, lambda: model.base.weight.data.add_(1e-3))
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    for batch in (4, 8):
        assert call(trials, ns, "trial", batch=batch, steps=2)["result"] == "ran"
        assert torch.equal(model.base.weight, base[0])
    assert trials._session.snapshot.watched.put_back == 2  # the weight, not the bias
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(base, model.base.parameters()))


def test_close_gives_the_snapshots_page_locked_memory_back_once_it_is_dropped(trials,
                                                                               monkeypatch):
    """torch's host allocator keeps freed pinned blocks for the life of the process: close
    empties that cache, and only after the session's host copies are garbage (emptying it
    earlier would free nothing). A CPU-only torch has no pinned memory, so the CUDA checks
    are switched on for the close alone and the allocator's release is counted."""
    import weakref

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters())
    ns = {"model": model, "opt": opt}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    assert call(trials, ns, "trial", batch=4, steps=2)["result"] == "ran"
    copies = [weakref.ref(kept) for _, kept, _ in trials._session.snapshot.params]
    alive_at_release = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_host_emptyCache",
                        lambda: alive_at_release.append(sum(c() is not None for c in copies)),
                        raising=False)
    closed = call(trials, ns, "close")
    assert closed["closed"] is True and "pinned" in closed["timings_ms"]
    assert alive_at_release == [0], "emptied once, with every host copy already dropped"
    monkeypatch.undo()
    assert call(trials, ns, "close") == {"closed": False}  # a second close releases nothing


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "uint8",
                                   "bool", "int64", "complex64", "float8_e4m3fn"])
def test_a_fingerprint_changes_with_any_one_element(trials, dtype, monkeypatch):
    """Over several chunks (shrunk here to 64 words), a change of one element anywhere by
    its last bit, its sign flipped, two elements swapped within and across chunks, and two
    sign flips together (which cancel under weights that do not depend on the word read:
    2^63 times any odd weight is 2^63 modulo 2^64), each change the fingerprint; a copy in
    another memory layout of the same values in the same order does not."""
    import torch

    monkeypatch.setattr(trials, "_PRINT_CHUNK", 64)
    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda", "cpu"))
    kind = getattr(torch, dtype)
    t = torch.rand(3, 70) > 0.5 if kind is torch.bool else (torch.randn(3, 70) * 100).to(kind)
    key = trials._PrintKey(torch)
    print_of = lambda x: int(trials._fingerprint(torch, x, key))  # noqa: E731
    before = print_of(t)
    assert print_of(t.clone()) == before
    bytes_ = t.view(-1).view(torch.uint8)
    top = t.element_size() - 1  # the byte holding the sign on a little-endian machine

    def changed(*edits):
        c = t.clone()
        b = c.view(-1).view(torch.uint8)
        for at, mask in edits:
            b[at] ^= mask
        return c

    for i in (0, 63, 64, 150, bytes_.numel() - 1):
        assert print_of(changed((i, 1))) != before, i
        assert print_of(changed((i - i % t.element_size() + top, 0x80))) != before, i
    size = t.element_size()
    assert print_of(changed((top, 0x80), (size + top, 0x80))) != before
    assert print_of(changed((top, 0x80), (65 * size + top, 0x80))) != before
    for i, j in ((0, 1), (5, 100)):
        swapped = t.clone().view(-1)
        if not torch.equal(swapped[i:i + 1], swapped[j:j + 1]):
            swapped[i], swapped[j] = t.view(-1)[j].clone(), t.view(-1)[i].clone()
            assert print_of(swapped.view(3, 70)) != before, (i, j)
    # Bits read in memory order: a tensor laid out otherwise is read where it lies.
    if kind is not torch.bool:
        wide = (torch.randn(2, 3, 4, 5) * 10).to(kind)
        assert print_of(wide.to(memory_format=torch.channels_last)) == print_of(
            wide.to(memory_format=torch.channels_last).clone(
                memory_format=torch.preserve_format))
    assert trials._fingerprint(torch, t.expand(2, 3, 70), key) is None  # overlapping
    assert trials._fingerprint(torch, t[:, :16], key) is None  # gaps between rows


def test_words_that_cannot_be_read_in_place_get_no_fingerprint(trials, monkeypatch):
    """A quantized tensor, a view with gaps, and a tensor off a GPU as shipped: no
    fingerprint, so they are put back after every trial."""
    import torch

    key = trials._PrintKey(torch)
    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda", "cpu"))
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
    assert trials._flat_words(torch, q) is None
    assert trials._fingerprint(torch, torch.randn(3, 32)[:, :16], key) is None
    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda",))
    assert trials._fingerprint(torch, torch.randn(8), key) is None


def test_a_watched_weight_without_a_fingerprint_is_put_back_every_time(trials, monkeypatch):
    """Where a fingerprint cannot be taken (here a weight that is a slice of a wider tensor;
    off a GPU, any), the weight is put back after every trial, as any other, and a step that
    drifts it through `.data` leaves it as it was."""
    import torch

    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda", "cpu"))
    model = _Adapted()
    wide = torch.zeros(3, 32)
    wide[:, :16] = model.base.weight.detach()
    model.base.weight = torch.nn.Parameter(wide[:, :16], requires_grad=False)
    assert model.base.weight.stride() == (32, 1)
    base = [t.clone() for t in model.base.parameters()]
    opt = torch.optim.SGD(model.up.parameters(), lr=0.1)

    step = _adapter_step(model, opt, lambda: model.base.weight.data.mul_(0.5))
    ns = {"model": model, "opt": opt, "step": step}
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=4, steps=2)["result"] == "ran"
    assert torch.equal(model.base.weight, base[0])
    assert trials._session.snapshot.watched.put_back == 1  # the slice; the bias had a print
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(base, model.base.parameters()))
    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda",))  # as shipped, on the CPU
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=4, steps=2)["result"] == "ran"
    assert trials._session.snapshot.watched.put_back == 2  # the weight and the bias
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(base, model.base.parameters()))


@pytest.mark.parametrize("swap", ["shape", "dtype", "padded with zeros"])
def test_a_frozen_weight_the_step_replaces_through_data_comes_back_as_it_was(
        trials, swap, monkeypatch):
    """`p.data = other` in the step: the same tensor object with other storage, shape or
    dtype (zeros added leave a weighted sum as it was): its layout and values come back."""
    import torch

    monkeypatch.setattr(trials, "_PRINTED_DEVICES", ("cuda", "cpu"))
    model = _Adapted()
    weight = model.base.weight
    base = weight.detach().clone()
    opt = torch.optim.SGD(model.up.parameters(), lr=0.1)
    replacements = {"shape": lambda w: w.reshape(-1),
                    "dtype": lambda w: w.double(),
                    "padded with zeros": lambda w: torch.cat([w, torch.zeros(1, 16)])}

    def replace():
        weight.data = replacements[swap](weight.data)

    ns = {"model": model, "opt": opt, "step": _adapter_step(model, opt, replace)}
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=4, steps=1)["result"] == "ran"
    assert weight.dtype == base.dtype and weight.stride() == base.stride()
    assert torch.equal(weight, base)
    call(trials, ns, "close")
    assert model.base.weight is weight and torch.equal(weight, base)


def test_frozen_weights_an_optimizer_holds_or_with_a_gradient_are_not_watched(trials):
    """Only a frozen weight no optimizer holds and without a gradient is watched; the others
    are copied back after every trial as before (an optimizer may write one, a gradient is
    state of its own)."""
    import torch

    model = _Adapted()
    opt = torch.optim.SGD([*model.up.parameters(), model.base.bias], lr=0.1)
    model.base.weight.grad = torch.ones_like(model.base.weight)

    ns = {"model": model, "opt": opt, "step": _adapter_step(model, opt)}
    described = call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})["describe"]
    assert described["watched_bytes"] == 0, described
    call(trials, ns, "close")
    model.base.weight.grad = None
    described = call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})["describe"]
    assert described["watched_bytes"] == 16 * 3 * 4, described  # the weight, not the bias
    call(trials, ns, "close")


def test_the_standard_step_drives_an_optimizer_that_takes_a_closure(trials):
    """`%maxbatch MODULE` with the notebook's LBFGS steps it as LBFGS loops do, through a
    closure, says so with the size of its full history, and puts the history back."""
    import copy

    torch, model, opt, _ = _lbfgs_notebook()
    before = copy.deepcopy(opt.state_dict())
    # (A deque: the trials put back the lists and dicts hooks write to, a deque they leave.)
    calls = collections.deque()
    model.register_forward_hook(lambda *_: calls.append(1))
    ns = {"model": model, "opt": opt}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    described = reply["describe"]["optimizer"]
    # 4 pairs of two vectors the size of the 131 parameters, float32: 4192 bytes.
    assert described.startswith("the notebook's opt (LBFGS), stepped with a closure"), described
    assert described.endswith("its history was full, 4 pairs of gradient-sized vectors "
                              "(4.1 KiB), and the trials held all of it"), described
    call(trials, ns, "set_loss", plan={"kind": "ce", "classes": 3, "class_dim": -1})
    calls.clear()
    result = call(trials, ns, "trial", batch=8, steps=2)
    assert result["result"] == "ran", result
    assert len(calls) > result["steps"], "LBFGS called the closure more than once a step"
    call(trials, ns, "close")
    assert _state_equal(torch, before, opt.state_dict())


def test_an_lbfgs_history_not_full_yet_is_told_with_its_size_when_full(trials):
    import torch

    model = torch.nn.Linear(4, 3)  # 15 float32 parameters: 100 pairs of them fill 12000 bytes
    ns = {"model": model, "opt": torch.optim.LBFGS(model.parameters())}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    assert reply["describe"]["optimizer"].endswith(
        "its history, 0 of up to 100 pairs of gradient-sized vectors (11.7 KiB), fills over "
        "your next steps, beyond the part a trial's few steps add"), reply
    call(trials, ns, "close")


def test_fp16_with_an_optimizer_that_takes_a_closure_is_refused_with_the_way_out(trials):
    torch, model, opt, _ = _lbfgs_notebook()
    reply = call(trials, {"model": model, "opt": opt}, "prepare",
                 spec={"kind": "module", "target": "model", "input": [4], "amp": "fp16"})
    assert "a GradScaler cannot step LBFGS (its step takes a closure)" in reply["refused"]
    assert "--amp bf16" in reply["refused"] and "--step FN" in reply["refused"]


def test_refusals_come_back_as_data_and_close_the_session(trials):
    import sys

    reply = call(trials, {}, "prepare", spec={"kind": "module", "target": "nope", "input": [1]})
    assert reply == {"refused": "'nope' is not defined in this notebook"}
    assert call(trials, {}, "trial", batch=1) == {"refused": "no %maxbatch session is open in "
                                                             "this kernel"}
    assert "_gpukernel_maxbatch_test" not in sys.modules


def test_token_ids_are_recognised_behind_a_positional_parameter(trials):
    import torch

    class GPTish(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.zeros(8, 4))  # the root's own parameter
            self.tok = torch.nn.Embedding(30, 4)
            self.head = torch.nn.Linear(4, 30)

        def forward(self, x):
            return self.head(self.tok(x) + self.pos[: x.shape[1]])

    ns = {"m": GPTish()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "m", "input": [8]})
    assert reply["describe"]["vocab"] == 30 and reply["describe"]["vocab_from"] == "Embedding"
    assert reply["output"]["shape"] == [2, 8, 30]
    call(trials, ns, "close")


def test_the_heap_is_frozen_for_the_trials_only_even_over_an_earlier_freeze(trials):
    import gc
    import weakref

    import torch

    model = torch.nn.Linear(4, 3)
    ns = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    spec = {"kind": "module", "target": "model", "input": [4]}
    assert gc.get_freeze_count() == 0
    call(trials, ns, "prepare", spec=spec)
    # The trials' collections scan only what the trials make.
    assert gc.get_freeze_count() > 0
    call(trials, ns, "set_loss", plan={"kind": "mse"})

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle  # garbage made after the freeze, in a cycle: the next trial collects it
    alive = weakref.ref(cycle)
    del cycle
    assert call(trials, ns, "trial", batch=4, steps=2)["result"] == "ran"
    assert alive() is None
    late = Node()
    late.me, late.tensor = late, torch.zeros(4)  # garbage the last trial left: close takes it
    alive = weakref.ref(late)
    del late
    assert call(trials, ns, "close")["closed"] is True
    assert alive() is None
    assert gc.get_freeze_count() == 0, "the heap is thawed at close"
    # A freeze made before (ipykernel under Python 3.12 starts with some objects frozen) does
    # not keep the trials scanning the rest of the heap; close gives it all back.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        heap = Node()  # made after that freeze: the session's freeze takes it too
        call(trials, ns, "prepare", spec=spec)
        assert gc.get_freeze_count() > frozen
        call(trials, ns, "close")
        assert gc.get_freeze_count() == 0
        del heap
    finally:
        gc.unfreeze()


def test_an_interrupt_that_escaped_a_call_lets_its_tensors_go_at_close(trials):
    import sys
    import weakref

    import torch

    # As IPython keeps it after an interrupt escaped one of the module's silent calls: the
    # traceback's frames (here `trial`'s, holding the namespace) keep the tensors alive.
    big = torch.zeros(1000)
    alive = weakref.ref(big)
    ns = {"big": big}
    del big
    try:
        trials.trial(ns, 4)  # no session open: raises inside the module
    except Exception:
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
    del ns
    assert alive() is not None
    trials.close()
    assert alive() is None, "close clears the escaped call's frames"
    assert sys.last_traceback is None


def test_prepare_trial_and_close_say_where_their_time_went(trials):
    import torch

    model = torch.nn.Linear(4, 3)
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    assert {"session", "probe", "restore", "freeze", "settle"} <= set(reply["timings_ms"])
    assert all(v >= 0 for v in reply["timings_ms"].values())
    call(trials, ns, "set_loss", plan={"kind": "mse"})
    trial = call(trials, ns, "trial", batch=4, steps=2)
    assert set(trial["cleanup_ms"]) == {"collect", "empty_cache", "restore"}
    assert trial["settle_ms"] >= 0
    closed = call(trials, ns, "close")
    assert set(closed["timings_ms"]) == {"restore", "release", "settle", "pinned"}


def test_a_trial_ends_once_a_step_repeats_the_one_before(trials):
    import torch

    calls = collections.deque()  # not a list: the session puts those back
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        calls.append(batch)
        opt.zero_grad()
        model(torch.randn(batch, 4)).sum().backward()
        opt.step()

    ns = {"step": step, "model": model, "opt": opt}
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    # Nothing changes from one call to the next (no GPU memory, no scaler): the second
    # repeats the first, so the third is not run.
    result = call(trials, ns, "trial", batch=3, steps=3)
    assert result["result"] == "ran" and result["steps"] == 2 and list(calls) == [3, 3]
    calls.clear()
    assert call(trials, ns, "trial", batch=3, steps=1)["steps"] == 1 and list(calls) == [3]
    call(trials, ns, "close")


def test_a_step_that_skipped_the_optimizer_is_not_taken_as_steady(trials):
    import torch

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    calls = collections.deque()  # not a list: the session puts those back

    def step(batch):
        # An overflowing loss on every call, as the first fp16 steps of a large model: the
        # scaler skips the optimizer (no AdamW state yet) and halves its scale.
        calls.append(batch)
        opt.zero_grad()
        loss = model(torch.randn(batch, 4)).sum() * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    ns = {"step": step, "model": model, "opt": opt, "scaler": scaler}
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    result = call(trials, ns, "trial", batch=2, steps=3)
    assert result["result"] == "ran" and result["steps"] == 3 and len(calls) == 3
    assert scaler.get_scale() == 2.0 ** 16, "the scale the trial halved is put back"
    assert len(opt.state) == 0
    call(trials, ns, "close")


@pytest.mark.parametrize("marks, far, most, ran", [
    # (allocated bytes after each step, scales); the limit is 10**6 bytes
    ([(100, []), (100, []), (100, [])], True, 3, 2),
    ([(100, []), (5000, []), (5000, [])], True, 3, 3),  # state made at the second (a skipped first)
    ([(100, []), (1100, []), (1110, [])], True, 3, 2),  # within the slack of 1000 bytes: steady
    ([(100, [8.0]), (100, [4.0]), (100, [4.0])], True, 3, 3),  # the scale halved at the second
    ([(100, []), (5000, []), (5500, []), (5500, [])], True, 5, 3),
    ([(100, []), (100, []), (100, [])], False, 3, 3),  # near the limit: every step asked for
    ([(100, []), (5000, []), (9000, [])], True, 3, 3),  # never steady: all the steps asked for
])
def test_the_steady_stop_follows_the_marks_steps_leave(trials, marks, far, most, ran):
    class Steps:
        def __init__(self):
            self.made = 0

        def steps(self, batch):
            while True:
                self.made += 1
                yield

    session = trials.Session.__new__(trials.Session)  # the stopping rule alone
    session.step = Steps()
    session.on_gpu = lambda: False
    session._limit = lambda: 10 ** 6
    session._far_below = lambda limit: far
    left = iter(marks)
    session._mark = lambda: next(left)
    assert session._run_steps(2, most) == ran
    assert session.step.made == ran


@pytest.mark.parametrize("reserved, segments, far", [
    # the cache's peak so far, its segments now [(address, bytes, expandable)]; the limit is
    # 1000 bytes, and the trial began with segment 0x1 (200 bytes) held
    (900, [(0x1, 200, False)], True),  # nothing new: nothing of the trial's to strand
    (900, [(0x1, 200, False), (0x2, 100, False)], True),  # one more 100-byte block fits
    # Qwen2's case (maxbatch-truth-2026-12-07q): a cache at 0.936 of the limit could not make
    # its 0.133 logits block anew, and the third step failed
    (900, [(0x1, 200, False), (0x2, 150, False), (0x3, 20, False)], False),
    (960, [(0x1, 200, False)], False),  # above STEADY_HEADROOM
    (900, None, True),  # a snapshot this torch cannot give: the headroom alone
    (900, [(0x1, 200, False), (0x2, 150, True)], True),  # expandable segments strand nothing
])
def test_a_trial_ends_early_only_with_room_for_its_largest_allocation(trials, reserved,
                                                                       segments, far):
    class Peaks:
        def reserved(self):
            return reserved

    session = trials.Session.__new__(trials.Session)  # the rule alone
    session.trial_peaks = Peaks()
    session.held_segments = {(0x1, 200)}
    session._segments = lambda: segments
    assert session._far_below(1000) is far
    session.trial_peaks = None  # off the GPU nothing is read: far below
    assert session._far_below(1000) is True


@pytest.mark.parametrize("outcome, block", [("ran", 150), ("out_of_memory", None)])
def test_a_trial_that_ran_reports_its_largest_block_read_before_the_cache_is_emptied(
        trials, outcome, block):
    """`_clean_up` reads the trial's largest new segment (the room for a stranded block comes
    from it) while the cache still holds the trial's segments: the cache is emptied after.
    A trial that failed reports none (its segments are what its failure left)."""
    import types

    cache = {"segments": [(0x1, 200, False), (0x2, 150, False), (0x3, 20, False)]}
    session = trials.Session.__new__(trials.Session)  # the bookkeeping alone, as on a GPU
    session.on_gpu = lambda: True
    session.held_segments = {(0x1, 200)}
    session._segments = lambda: list(cache["segments"])
    session._settle = lambda collect=True: cache.update(segments=[(0x1, 200, False)])
    session.restore = lambda: None
    session.device = "cuda:0"
    session.torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(memory_allocated=lambda device: 200))
    result = {"batch": 8, "result": outcome}
    session._clean_up(result, None)
    assert result.get("largest_block") == block
    assert cache["segments"] == [(0x1, 200, False)] and session.settled
    assert result["allocated_after"] == 200 and "collect" in result["cleanup_ms"]


def test_the_early_end_skipped_no_third_step_that_failed_in_a_committed_run(trials):
    """The rule above, checked on every committed truth run's probes (bench/results: each ran
    three steps of the notebook's own loop on a GPU and marked every one) by the truth
    report's own check, with trials.py's constants: no probe the rule would end after two
    steps ran out of memory at its third. Before the room for the largest allocation was
    asked for, a Qwen2-shaped LM's probe at 35 did (maxbatch-truth-2026-12-07q)."""
    import json

    spec = importlib.util.spec_from_file_location(
        "_truth_report", REPO / "bench/gpu/truth_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert (report.HEADROOM, report.SLACK) == (trials.STEADY_HEADROOM, trials.STEADY_SLACK)
    runs = sorted((REPO / "bench/results").glob("maxbatch-truth-*.json"))
    rows = [r for run in runs for r in json.loads(run.read_text())["rows"]
            if r.get("engine") == "python" and "error" not in r]
    probes, ends, fitted, misses, _ = report.early_end_calls(rows)
    assert not misses, misses
    # The rule still ends most probes that fit (959 of the 1688 through -07u): it saves the
    # third step where it is spent for nothing.
    assert len(probes) >= 1700 and ends >= fitted // 2, (len(probes), ends, fitted)


def test_the_truth_report_marks_a_row_sized_while_another_process_held_the_card(capsys):
    """maxbatch-truth-2026-12-07x: our search sized against what a stopped call's kernel left
    (5.68 GiB of a 24 GiB cap) while the truth ran after it let go. A row whose notebook could
    reach less than the cap as it began is marked, and one that could reach it is not."""
    spec = importlib.util.spec_from_file_location(
        "_truth_report", REPO / "bench/gpu/truth_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    gib = 2**30
    run = {"date": "2026-12-07 17:00:00", "gpu": "H100", "cap_gib": 24.0, "torch": "2.11",
           "command": "python3 bench/gpu/maxbatch_truth.py a b c", "not_started": ["c"],
           "rows": [{"model": "a", "available_before": 6 * gib},
                    {"model": "b", "available_before": 78 * gib}]}
    report.header(run)
    shown = capsys.readouterr().out
    assert "**Not comparable:**" in shown and "a (6.0 GiB)" in shown, shown
    assert "b (" not in shown, shown
    assert "Not started (past DEADLINE_S): c" in shown, shown
    del run["not_started"]
    run["rows"] = run["rows"][1:]
    report.header(run)
    shown = capsys.readouterr().out
    assert "Not comparable" not in shown and "Not started" not in shown, shown


def test_a_step_that_draws_from_the_users_dataloader_leaves_it_drawing_the_same(trials):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    # A user's own pipeline: a shuffling DataLoader built at the batch size asked for, two
    # worker processes, as `FN(batch_size)` in a notebook would do it.
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    drawn = collections.deque()  # not a list: the session puts those back

    def step(batch):
        loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=2)
        x, y = next(iter(loader))
        drawn.append(x.shape[0])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def first_batch():
        return next(iter(DataLoader(data, batch_size=8, shuffle=True)))[0]

    ns = {"step": step, "model": model, "opt": opt, "data": data}
    rng = torch.random.get_rng_state()
    expected = first_batch()  # what the user's next draw gives, had no trial run
    torch.random.set_rng_state(rng)
    weights = [p.detach().clone() for p in model.parameters()]
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    result = call(trials, ns, "trial", batch=16, steps=3)
    assert result["result"] == "ran" and drawn and set(drawn) == {16}
    call(trials, ns, "close")
    # The shuffle order, the weights and the optimizer are as the trial found them.
    assert torch.equal(first_batch(), expected)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert len(opt.state) == 0


def test_an_iterator_that_runs_dry_over_the_trials_is_named_as_the_cause(trials):
    import torch

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    batches = iter([torch.randn(2, 4) for _ in range(3)])

    def step(batch):
        x = next(batches)  # three batches drawn once, as `it = iter(loader)` in a cell above
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    ns = {"step": step, "model": model, "opt": opt}
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=2, steps=2)["result"] == "ran"
    result = call(trials, ns, "trial", batch=2, steps=2)
    call(trials, ns, "close")
    assert result["result"] == "error", result
    error = result["error"]
    assert error["ename"] == "DataRanOut", error
    assert error["evalue"].startswith("next() raised StopIteration in your step after 3 calls "
                                      "over the trials: the iterator it draws from ran dry"), error
    assert error["where"].endswith("in step"), error  # the user's line that called next()


def test_an_optimizer_a_notebook_keeps_under_two_names_is_its_one_optimizer(trials):
    """`opts = {}` filled by a helper that also binds `gpt_opt` (maxbatch_truth's notebook):
    one optimizer reached two ways is not two optimizers, and it is named as the notebook
    names it, not by the path into the dict."""
    import torch

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    ns = {"opts": {"linear": opt}, "model": model, "model_opt": opt}  # the dict comes first
    found = trials.find_state(torch, ns)
    assert found["optimizer"] == {"model_opt": opt}, found["optimizer"]
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [4]})
    call(trials, ns, "close")
    assert reply["describe"]["optimizer"] == "the notebook's model_opt (AdamW)", reply


def test_a_closure_name_the_notebook_gives_another_object_keeps_both_objects(trials):
    """A distillation step built by a factory: its closure's `model` is the student, while
    the notebook's `model` is the teacher. Both are kept and put back, under their names."""
    import torch

    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(student.parameters())

    def make_step(model, teacher):
        def step(batch):
            x = torch.randn(batch, 4)
            opt.zero_grad()
            (model(x) - teacher(x).detach()).square().mean().backward()
            opt.step()
        return step

    ns = {"model": teacher, "big": student, "opt": opt, "step": make_step(student, teacher)}
    found = trials.find_state(torch, ns, trials._StepRefs(ns["step"]).refs)
    assert {id(m) for m in found["module"].values()} == {id(student), id(teacher)}, found
    assert found["module"]["big"] is student and found["module"]["model"] is teacher
    weights = [p.detach().clone() for p in student.parameters()]
    call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    assert call(trials, ns, "trial", batch=4, steps=2)["result"] == "ran"
    call(trials, ns, "close")
    assert all(torch.equal(a, b) for a, b in zip(weights, student.parameters()))
    assert len(opt.state) == 0


def test_a_second_stage_optimizer_is_taken_beside_the_first_stages_over_frozen_weights(trials):
    """A two-stage fine-tune: stage 1's optimizer still holds the whole model, stage 2 trains
    the head alone with its own. The backbone is frozen, so no step trains what the first
    holds beyond the head: the model is not split between them."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    stage1 = torch.optim.AdamW(model.parameters())
    model[0].requires_grad_(False)
    head_opt = torch.optim.AdamW(model[1].parameters())
    ns = {"model": model, "stage1": stage1, "head_opt": head_opt}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4],
                                              "optimizer_from": "head_opt"})
    call(trials, ns, "close")
    assert reply["describe"]["optimizer"] == "the notebook's head_opt (AdamW)", reply


def test_the_largest_block_is_the_largest_segment_the_trial_made(trials):
    """Each segment of the caching allocator is made for one request: the largest the trial
    made is its largest allocation. The user's own (there before) are not the trial's, and
    under expandable segments nothing is stranded, so there is no block to leave room for."""
    held = {(0x1000, 8 << 30)}
    segments = [(0x1000, 8 << 30, False), (0x9000, 14 << 30, False), (0x5000, 2 << 20, False)]
    assert trials._largest_new_segment(segments, held) == 14 << 30
    assert trials._largest_new_segment(segments[:1], held) == 0
    assert trials._largest_new_segment([(0x1000, 80 << 30, True)], set()) is None
    # The user's 8 GiB segment given back (a gradient freed) and a 20 GiB one made at its
    # address by the trial: the trial's, as gpuprobe's stranded::largest_new_segment has it.
    assert trials._largest_new_segment([(0x1000, 20 << 30, False)], held) == 20 << 30


def test_the_largest_new_segment_answers_the_cases_gpuprobe_answers(trials):
    """trials.py's rule and gpuprobe's stranded::largest_new_segment (the libtorch engine's)
    read the same cases, so the two engines measure a stranded block alike."""
    path = (Path(__file__).resolve().parents[2] / "crates" / "gpuprobe" / "tests" / "data"
            / "largest_new_segment.json")
    cases = json.loads(path.read_text())["cases"]
    assert len(cases) >= 5
    for case in cases:
        segments = [(a, size, expandable) for a, size, expandable in case["segments"]]
        held = {(a, size) for a, size in case["held"]}
        assert trials._largest_new_segment(segments, held) == case["expected"], case["name"]


def test_a_trial_reads_the_segments_of_its_own_gpu_from_the_allocators_snapshot(
        trials, monkeypatch):
    """The segments come from torch.cuda.memory_snapshot(), every GPU's: the session's card
    only; a snapshot this torch cannot give leaves the block unknown, not the search broken."""
    import torch

    ns = {"model": torch.nn.Linear(4, 3)}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "model", "input": [4]})
    session = trials._current()
    try:
        session.device = torch.device("cuda", 1)
        snapshot = [
            {"device": 0, "address": 0x10, "total_size": 40 << 30, "is_expandable": False},
            {"device": 1, "address": 0x20, "total_size": 2 << 30, "is_expandable": False},
            {"device": 1, "address": 0x30, "total_size": 6 << 30, "is_expandable": False},
        ]
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
        assert session._segments() == [(0x20, 2 << 30, False), (0x30, 6 << 30, False)]
        # Card 0's 40 GiB is not this card's.
        assert session._largest_block({(0x30, 6 << 30)}) == 2 << 30
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"device": 1}])
        assert session._segments() is None and session._largest_block(set()) is None
    finally:
        session.device = torch.device("cpu")
        call(trials, ns, "close")


def test_a_step_function_that_takes_more_than_the_batch_size_is_refused_before_any_trial(
        trials):
    import functools

    def supplies_the_model(fn):  # a decorator that fills in the first argument
        @functools.wraps(fn)
        def wrapper(batch):
            return fn(None, batch)
        return wrapper

    @supplies_the_model
    def wrapped(model, batch):
        return None

    ns = {"two": lambda model, batch: None, "bound": functools.partial(lambda m, b: None, 1),
          "star": lambda *batch: None, "kw": lambda batch, *, lr=1e-3: None, "wrapped": wrapped}
    with pytest.raises(trials.MaxBatchError, match=r"--step two: two\(model, batch\) cannot "
                                                   r"be called as two\(batch_size\)"):
        trials.FunctionStep(importlib.import_module("torch"), ns, {"target": "two"})
    for ok in ("bound", "star", "kw", "wrapped"):  # each can be called with the batch size alone
        trials.FunctionStep(importlib.import_module("torch"), ns, {"target": ok})


def test_a_compiled_module_is_said_to_be_stepped_compiled(notebook):
    """The trials run a torch.compile'd module's graphs, as the user's loop does; the report
    says so, and what a new batch size may cost."""
    _, kc = notebook
    # Made under a forked generator: the notebook's own must stay as `before` saw it.
    reply, _ = execute(kc, "with torch.random.fork_rng():\n"
                       "    compiled_seg = torch.compile(Seg(), backend='eager')", timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    try:
        text = report_of(kc, "%maxbatch compiled_seg --input 3x8x8")
        assert ("a standard step of compiled_seg (compiled by torch.compile: a new batch size "
                "may compile again, before its trial's steps)") in text, text
        plain = report_of(kc, "%maxbatch seg --input 3x8x8")
        assert "compiled" not in plain, plain
        # Only a layer compiled, as users compile a model's blocks.
        reply, _ = execute(kc, "with torch.random.fork_rng():\n"
                           "    part_seg = Seg()\n"
                           "    part_seg.conv = torch.compile(part_seg.conv, backend='eager')",
                           timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
        part = report_of(kc, "%maxbatch part_seg --input 3x8x8")
        assert ("a standard step of part_seg (parts of it compiled by torch.compile: a new "
                "batch size may compile them again, before its trial's steps)") in part, part
    finally:
        execute(kc, "del compiled_seg", timeout=60)
        execute(kc, "del part_seg", timeout=60)
    assert_untouched(kc)




def test_a_shape_as_python_prints_it_is_taken(notebook):
    """`--input (3, 8, 8)`, copied from a tensor's shape: one value, not three words."""
    _, kc = notebook
    for shape in ("(3, 8, 8)", "[3, 8, 8]", "3,8,8", "torch.Size([3, 8, 8])"):
        text = report_of(kc, f"%maxbatch seg --input {shape}")
        assert "input 3x8x8 per sample" in text, (shape, text)
    assert_untouched(kc)
