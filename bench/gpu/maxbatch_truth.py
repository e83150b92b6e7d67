"""Is %maxbatch's number true for the user's own training step? Run on the GPU machine.

A real gpu-python kernel (gpukernel in front of ipykernel, real jupyter_client) runs a notebook
that defines models and trains them in its own eager loop (`train(name, batch, steps)`: data on
the GPU, zero_grad, forward under the row's autocast, cross-entropy, backward through a
GradScaler for fp16, AdamW step). Per row:
- `%maxbatch ... --json` (ours: trials, seconds, max, recommendation);
- the same magic with `--search double-bisect` (Lightning's algorithm with its defaults on the
  same step: from 2, doubling, bisecting to the exact maximum; the baseline's trials and
  seconds);
- the true maximum: an exact bisection of the notebook's own loop (3 steps per probe, from an
  optimizer without state, as the loop starts) in the
  same kernel, from a bracket it verifies itself (a batch that fits, one that does not);
- 30 steps of the notebook's loop at the recommendation;
- for some rows the libtorch engine (`--engine libtorch`) on the same model and loss;
- the competitor as it runs in the notebook (`lightning_procedure`: Lightning's binsearch with
  its per-trial garbage_collection_cuda, no gpukernel);
- Lightning's BatchSizeFinder itself on two models, in a separate process
  (bench/gpu/lightning_finder.py).

To fit the session's device minutes, the notebook caps its allocator at CAP_GIB
(torch.cuda.set_per_process_memory_fraction), as a user sharing the card would: every figure,
ours and the truth alike, is under the same cap. Writes $OUT/maxbatch_truth.json after each row.

Usage (repo root, GPU machine): python3 bench/gpu/maxbatch_truth.py [ROW ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", "."))
CAP_GIB = float(os.environ.get("CAP_GIB", "24"))
# SURVEY=1: a quicker run, without the baseline search and the libtorch rows. Every run records
# the memory curve of the truth's bisection (the data the search's deterministic tests use).
SURVEY = os.environ.get("SURVEY") == "1"
# TIMING=1: ours and the baseline only (no truth, no 30 steps, no libtorch rows): where the
# searches' time goes, from their timings_ms.
TIMING = os.environ.get("TIMING") == "1"
# LIBTORCH_ONLY=1: the libtorch engine's search alone on each row's module (no python engine,
# no truth): its trials and their phase peaks.
LIBTORCH_ONLY = os.environ.get("LIBTORCH_ONLY") == "1"
# DEADLINE_S: seconds after the notebook started past which no new row begins (the rows not
# started are listed in the JSON), so that a run ends inside the device's call limit: a call
# stopped at its limit can leave its kernel holding the card for the next call.
DEADLINE_S = float(os.environ.get("DEADLINE_S", "0"))

# LEAN=1: ours, the in-harness baseline, the truth and the 30 steps, without the Lightning
# procedure (a fresh kernel per row) and the libtorch rows: what fits the device's minutes
# where every step is long (CAP_GIB near the whole card).
LEAN = os.environ.get("LEAN") == "1"

MODELS = r"""
import copy, gc, math, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
import torch.utils.checkpoint as ckpt
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
dev = torch.device("cuda")
total = torch.cuda.mem_get_info()[1]
torch.cuda.set_per_process_memory_fraction(CAP * 2**30 / total)

class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.qkv, s.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        s.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        s.h = h
    def forward(s, x):
        B, T, D = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(B, T, 3, s.h, D // s.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + s.mlp(s.ln2(x))

class GPT(nn.Module):
    def __init__(s, vocab=32000, d=768, layers=8, heads=12, seq=512, checkpoint=False):
        super().__init__()
        s.tok, s.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        s.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        s.ln, s.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        s.checkpoint = checkpoint
    def forward(s, idx):
        x = s.tok(idx) + s.pos[: idx.shape[1]]
        for b in s.blocks:
            x = ckpt.checkpoint(b, x, use_reentrant=False) if s.checkpoint and s.training else b(x)
        return s.head(s.ln(x))

class ViT(nn.Module):  # ViT-B/16
    def __init__(s, img=224, patch=16, d=768, layers=12, heads=12, classes=1000):
        super().__init__()
        s.patch = nn.Conv2d(3, d, patch, patch)
        n = (img // patch) ** 2
        s.cls, s.pos = nn.Parameter(torch.zeros(1, 1, d)), nn.Parameter(torch.zeros(1, n + 1, d))
        s.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0,
                                      activation="gelu", batch_first=True, norm_first=True), layers)
        s.head = nn.Linear(d, classes)
    def forward(s, x):
        x = s.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([s.cls.expand(x.shape[0], -1, -1), x], 1) + s.pos
        return s.head(s.enc(x)[:, 0])

def conv(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))

class ResBlock(nn.Module):
    def __init__(s, i, o, stride):
        super().__init__()
        s.a = nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                            nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o))
        s.skip = nn.Sequential() if stride == 1 and i == o else nn.Sequential(
            nn.Conv2d(i, o, 1, stride, bias=False), nn.BatchNorm2d(o))
    def forward(s, x):
        return F.relu(s.a(x) + s.skip(x))

class ResNet18(nn.Module):
    def __init__(s, classes=1000):
        super().__init__()
        s.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
                               nn.MaxPool2d(3, 2, 1))
        chans, layers, i = [64, 128, 256, 512], [], 64
        for n, c in enumerate(chans):
            layers += [ResBlock(i, c, 1 if n == 0 else 2), ResBlock(c, c, 1)]
            i = c
        s.layers = nn.Sequential(*layers)
        s.head = nn.Linear(512, classes)
    def forward(s, x):
        return s.head(s.layers(s.stem(x)).mean((2, 3)))

class UNet(nn.Module):
    def __init__(s, classes=21, w=32):
        super().__init__()
        s.d1, s.d2, s.d3 = nn.Sequential(conv(3, w), conv(w, w)), nn.Sequential(conv(w, 2*w), conv(2*w, 2*w)), \
            nn.Sequential(conv(2*w, 4*w), conv(4*w, 4*w))
        s.u2, s.c2 = nn.ConvTranspose2d(4*w, 2*w, 2, 2), nn.Sequential(conv(4*w, 2*w), conv(2*w, 2*w))
        s.u1, s.c1 = nn.ConvTranspose2d(2*w, w, 2, 2), nn.Sequential(conv(2*w, w), conv(w, w))
        s.out = nn.Conv2d(w, classes, 1)
    def forward(s, x):
        a = s.d1(x); b = s.d2(F.max_pool2d(a, 2)); c = s.d3(F.max_pool2d(b, 2))
        b = s.c2(torch.cat([s.u2(c), b], 1)); a = s.c1(torch.cat([s.u1(b), a], 1))
        return s.out(a)

class UNetDS(UNet):
    # Deep supervision, as nnU-Net trains: the map at full resolution and at half, both in the
    # loss (the half-size map from the decoder's second stage).
    def __init__(s, classes=21, w=32):
        super().__init__(classes, w)
        s.out_half = nn.Conv2d(2*w, classes, 1)
    def forward(s, x):
        a = s.d1(x); b = s.d2(F.max_pool2d(a, 2)); c = s.d3(F.max_pool2d(b, 2))
        b = s.c2(torch.cat([s.u2(c), b], 1)); a = s.c1(torch.cat([s.u1(b), a], 1))
        return [s.out(a), s.out_half(b)]

class LSTMLM(nn.Module):
    def __init__(s, vocab=32000, d=512, hidden=1024, layers=2):
        super().__init__()
        s.emb = nn.Embedding(vocab, d)
        s.lstm = nn.LSTM(d, hidden, layers, batch_first=True)
        s.head = nn.Linear(hidden, vocab)
    def forward(s, x):
        return s.head(s.lstm(s.emb(x))[0])

class NanoGPT(nn.Module):
    # Karpathy's nanoGPT (model.py), GPT-2 small: forward(idx, targets=None) returns (logits,
    # loss), and without targets the logits of the last position only.
    def __init__(s, vocab=50304, block=1024, d=768, layers=12, heads=12):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        s.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        s.ln_f = nn.LayerNorm(d)
        s.lm_head = nn.Linear(d, vocab, bias=False)
        s.wte.weight = s.lm_head.weight  # weight tying, as nanoGPT
    def forward(s, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = s.wte(idx) + s.wpe(pos)
        for block in s.h:
            x = block(x)
        x = s.ln_f(x)
        if targets is not None:
            logits = s.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = s.lm_head(x[:, [-1], :]), None
        return logits, loss

class TutorialLM(nn.Module):
    # PyTorch's "Language Modeling with nn.Transformer" tutorial model, scaled up: fed
    # (seq, batch) token ids, its encoder seq-first (batch_first=False, the default), its
    # Embedding registered after the encoder, the positional table indexed by x.size(0).
    def __init__(s, vocab=32000, d=512, nhead=8, d_hid=2048, layers=6, max_len=5000):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(max_len, 1, d)
        pe[:, 0, 0::2] = torch.sin(pos * div)
        pe[:, 0, 1::2] = torch.cos(pos * div)
        s.register_buffer("pe", pe)
        s.drop = nn.Dropout(0.1)
        s.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, nhead, d_hid, 0.1), layers,
                                          enable_nested_tensor=False)
        s.embedding = nn.Embedding(vocab, d)
        s.d = d
        s.linear = nn.Linear(d, vocab)
    def forward(s, src):
        x = s.drop(s.embedding(src) * math.sqrt(s.d) + s.pe[:src.size(0)])
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(0), device=src.device)
        return s.linear(s.encoder(x, mask))

class MAE(nn.Module):
    # A masked autoencoder as facebookresearch/mae writes one (ViT-B encoder on the 25% of
    # 16x16 patches it keeps, an 8-layer 512-wide decoder on all of them): forward(imgs)
    # returns (loss, pred, mask), the loss on the masked patches only.
    def __init__(s, d=768, layers=12, dd=512, dlayers=8, p=16, n=196, ratio=0.75):
        super().__init__()
        s.p, s.keep = p, int(n * (1 - ratio))
        s.embed, s.pos = nn.Linear(3 * p * p, d), nn.Parameter(torch.zeros(1, n, d))
        s.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(
            d, 12, 4 * d, 0.0, batch_first=True, norm_first=True), layers, enable_nested_tensor=False)
        s.to_dec, s.mask_token = nn.Linear(d, dd), nn.Parameter(torch.zeros(1, 1, dd))
        s.dpos = nn.Parameter(torch.zeros(1, n, dd))
        s.decoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(
            dd, 16, 4 * dd, 0.0, batch_first=True, norm_first=True), dlayers, enable_nested_tensor=False)
        s.pred = nn.Linear(dd, 3 * p * p)
    def forward(s, imgs):
        b, p = imgs.shape[0], s.p
        patches = imgs.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 3 * p * p)
        n = patches.shape[1]
        order = torch.rand(b, n, device=imgs.device).argsort(1)
        keep = order[:, :s.keep]
        x = (s.embed(patches) + s.pos).gather(1, keep[..., None].expand(-1, -1, s.pos.shape[-1]))
        x = s.to_dec(s.encoder(x))
        full = s.mask_token.to(x.dtype).expand(b, n, -1).clone()
        full = full.scatter(1, keep[..., None].expand(-1, -1, x.shape[-1]), x)
        pred = s.pred(s.decoder(full + s.dpos))
        mask = torch.ones(b, n, device=imgs.device).scatter(1, keep, 0.0)
        loss = (((pred - patches) ** 2).mean(-1) * mask).sum() / mask.sum()
        return loss, pred, mask

"""

LOOP = r"""
# name -> (factory, data maker, amp dtype)
def tokens(vocab, seq):
    return lambda b: (torch.randint(0, vocab, (b, seq), device=dev), torch.randint(0, vocab, (b, seq), device=dev))
def images(size, classes):
    return lambda b: (torch.randn(b, 3, size, size, device=dev), torch.randint(0, classes, (b,), device=dev))
def noisy(size):  # a denoiser's batch: noisy images, and the noise it learns to predict
    return lambda b: (torch.randn(b, 3, size, size, device=dev), torch.randn(b, 3, size, size, device=dev))
def masks(size, classes):
    return lambda b: (torch.randn(b, 3, size, size, device=dev), torch.randint(0, classes, (b, size, size), device=dev))

models, opts, data, amps, scalers = {}, {}, {}, {}, {}
def make(name, factory, maker, amp=None, opt=None, weights=None):
    # `opt(model)`: the row's own optimizer (AdamW over every parameter if None); `weights`:
    # a dtype the whole model is cast to (pure low-precision training, no autocast).
    torch.manual_seed(0)
    m = factory().to(dev)
    if weights is not None:
        m = m.to(weights)
    models[name], data[name], amps[name] = m, maker, amp
    opts[name] = opt(m) if opt is not None else torch.optim.AdamW(m.parameters(), lr=1e-4)
    scalers[name] = torch.amp.GradScaler("cuda") if amp is torch.float16 else None
    globals()[name] = m
    globals()[name + "_opt"] = opts[name]
    # Nothing returned: a cell's value stays in IPython's output history (Out, _), and the
    # model with it after drop() (400 MB more held at every later row, 2026-12-04).

accumulate = {}  # name -> micro-batches per optimizer step (gradient accumulation)
own_loss = set()  # names trained with the model's own loss (a Hugging Face model given labels=)
own_loss_held = set()  # the same, the output kept into the next step (`outputs = model(**batch)`)
own_targets = set()  # names trained as nanoGPT is: model(x, targets) returns (logits, loss)
loss_only = set()  # of those, names whose loop keeps the loss only (`loss = model(x, y)[1]`)
returns_loss = set()  # names whose forward returns (loss, ...) without targets (MAE's loop)
returns_loss_held = set()  # of those, names whose loop keeps the whole output into the next step
hf_returns_loss = set()  # names whose Hugging Face output carries its loss without labels (ViTMAE)
mse = set()  # names trained on mean squared error against their target (a denoiser)
scheds = {}  # name -> LR scheduler stepped after every optimizer step
clip = set()  # names whose gradients are clipped to norm 1 before the optimizer step

# Rows new on 2026-12-08: LightningModules, whose loop is a Lightning Trainer's fit (name ->
# the Trainer's precision). Their model wraps one of this file's, trained with cross-entropy
# on its logits by training_step, and AdamW from configure_optimizers.
lightning_rows = {}
lightning_done = 0  # the steps the last fit completed

def lit_module(factory, lr=1e-4):
    import lightning as L
    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = factory()
        def forward(self, x):
            return self.model(x)
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)
    return Lit()

def fit_lightning(name, batch, steps):
    # The Trainer's fit as a notebook runs it, its batches from a DataLoader on the CPU (the
    # Trainer moves each to the GPU). Its teardown moves the model to the CPU: put back here.
    import lightning as L
    global lightning_done
    lightning_done = 0

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            for _ in range(steps):
                yield tuple(t.cpu() for t in data[name](batch))

    class Marks(L.Callback):
        def on_train_batch_end(self, *args):
            global lightning_done
            lightning_done += 1
            if marks is not None:
                mark_step(None)

    trainer = L.Trainer(accelerator=dev.type, devices=1, max_steps=steps, logger=False,
                        precision=lightning_rows[name], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Marks()])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(models[name], torch.utils.data.DataLoader(Batches(), batch_size=None))
    finally:
        models[name].to(dev)
        del trainer
    torch.cuda.synchronize()

def train(name, batch, steps):
    # The notebook's own loop, as a user writes it: `batch` samples per micro-batch, and
    # `accumulate[name]` micro-batches per optimizer step where the row accumulates.
    if name in lightning_rows:
        return fit_lightning(name, batch, steps)
    m, opt, scaler, amp = models[name], opts[name], scalers[name], amps[name]
    micro = accumulate.get(name, 1)
    m.train()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(micro):
            x, y = data[name](batch)
            with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
                if name in own_loss_held:  # Hugging Face's own PyTorch loop: `outputs` (the
                    out = m(input_ids=x, labels=x)  # logits) lives on into the next forward
                    loss = out.loss / micro
                elif name in own_loss:  # as Hugging Face users train: the model's loss (shifted)
                    loss = m(input_ids=x, labels=x).loss / micro
                elif name in loss_only:  # the logits dropped at once
                    loss = m(x, y)[1] / micro
                elif name in own_targets:  # as nanoGPT's train.py: the logits live on into
                    logits, loss = m(x, y)  # the next step's forward  # noqa: F841
                    loss = loss / micro
                elif name in returns_loss:  # MAE's engine_pretrain.py: `loss, _, _ = model(x)`
                    loss, _, _ = m(x)
                    loss = loss / micro
                elif name in returns_loss_held:  # the same, its output kept (to log `pred`)
                    out = m(x)
                    loss = out[0] / micro
                elif name in hf_returns_loss:  # a Hugging Face pre-training model: `.loss`
                    loss = m(pixel_values=x).loss / micro
                elif name in mse:  # a denoiser: the noise it predicts against the noise
                    out = m(x)
                    loss = F.mse_loss(out, y) / micro
                elif isinstance(out := m(x), list):  # deep supervision: every scale's map
                    loss = sum(F.cross_entropy(o, y[:, ::y.shape[1] // o.shape[2], ::y.shape[2] // o.shape[3]])
                               for o in out) / micro
                else:
                    out = getattr(out, "logits", out)  # a Hugging Face model's output
                    aux = None
                    if isinstance(out, dict):  # torchvision's segmentation models: {'out', 'aux'}
                        out, aux = out["out"], out.get("aux")
                    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]) if out.dim() == 3 else out,
                                           y.reshape(-1) if out.dim() == 3 else y) / micro
                    if aux is not None:  # torchvision's recipe: the aux head at weight 0.5
                        loss = loss + 0.5 * F.cross_entropy(aux, y) / micro
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
        if name in clip:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt); scaler.update()
        else:
            opt.step()
        if name in scheds:
            scheds[name].step()
        if marks is not None:
            mark_step(scaler)
    torch.cuda.synchronize()

# Where each step of a truth probe left the allocator (None: not recorded): the step's peak,
# then what the next step starts from (allocated, reserved, segments, free bytes in split
# blocks), the GradScaler's scale, and the step's peak reserved. It tells whether a step that left the same as the step
# before was followed by one that needed more (the rule %maxbatch ends its trials by).
marks = None
LAYOUT = ("allocated_bytes.all.current", "reserved_bytes.all.current", "segment.all.current",
          "inactive_split_bytes.all.current")

def mark_step(scaler):
    stats = torch.cuda.memory_stats()
    marks.append((torch.cuda.max_memory_allocated(), *(stats.get(k, 0) for k in LAYOUT),
                  scaler.get_scale() if scaler is not None else None,
                  torch.cuda.max_memory_reserved()))
    torch.cuda.reset_peak_memory_stats()

curve = []  # (batch, fits, peak allocated, peak reserved) of every fits() call
probe_marks = []  # (batch, fits, the marks of its steps) of every fits() call

def fresh_scaler(name):
    # A GradScaler starts each probe as the user's training starts: its scale decides whether
    # the first steps skip the optimizer (and so when AdamW's state is made).
    if scalers[name] is not None:
        scalers[name] = torch.amp.GradScaler("cuda")

def fits(name, batch, steps=3):
    # The user's loop as it starts after %maxbatch: the optimizer has no state yet (AdamW
    # makes it at the first step, among that step's freed activations), then two more steps.
    global marks
    opts[name].state.clear()
    fresh_scaler(name)
    gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    marks = []
    try:
        train(name, batch, steps)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    steps_marked, marks = tuple(marks), None
    peak = max([m[0] for m in steps_marked] + [torch.cuda.max_memory_allocated()])
    curve.append((batch, ok, peak, torch.cuda.max_memory_reserved()))
    probe_marks.append((batch, ok, steps_marked))
    opts[name].zero_grad(set_to_none=True)
    opts[name].state.clear()
    gc.collect(); torch.cuda.empty_cache()
    return ok

def true_max(name, start, survey=False):
    # Exact bisection of the notebook's own loop, from a bracket verified here. With `survey`,
    # also the memory curve below it (small batches and fractions of the maximum).
    curve.clear(); probe_marks.clear()
    probes, t0 = 0, time.time()
    if survey:
        for b in (4, 16, 64):
            fits(name, b)
    lo, hi = max(1, int(start)), None
    probes += 1
    while not fits(name, lo):
        hi, lo = lo, max(1, lo // 2); probes += 1
        if hi == 1: return {"true_max": 0, "probes": probes, "seconds": time.time() - t0}
    if hi is None:
        step = max(1, int(lo * 0.05))
        while True:
            probes += 1
            if fits(name, lo + step): lo, step = lo + step, step * 2
            else: hi = lo + step; break
    while hi - lo > 1:
        mid = (lo + hi) // 2; probes += 1
        if fits(name, mid): lo = mid
        else: hi = mid
    if survey:
        for f in (0.5, 0.8, 0.9, 0.95, 0.98):
            if int(f * lo) > 64:
                fits(name, int(f * lo))
    # The allocator's fragmentation can make a batch fail below one that fits (a GPT in fp16:
    # 66 failed at its first step where 68 ran). A user can count on no batch at or above the
    # smallest failure: the largest maximum with none below it is one less.
    holes = sorted(b for b, ok, *_ in curve if not ok and b < lo)
    return {"true_max": lo, "probes": probes, "seconds": time.time() - t0,
            "holes": holes, "true_max_below_holes": holes[0] - 1 if holes else lo,
            "curve": sorted(set(curve)), "step_marks": probe_marks}

def steps_ok(name, batch, n=30):
    # n steps of the notebook's loop from a fresh optimizer, as the user's training will run.
    opts[name].state.clear()
    fresh_scaler(name)
    gc.collect(); torch.cuda.empty_cache()
    done = 0
    try:
        if name in lightning_rows:  # one fit of n steps, as the user's Trainer runs
            train(name, batch, n)
        else:
            for _ in range(n):
                train(name, batch, 1); done += 1
    except torch.OutOfMemoryError:
        pass
    if name in lightning_rows:
        done = lightning_done
    opts[name].zero_grad(set_to_none=True)
    opts[name].state.clear()
    gc.collect(); torch.cuda.empty_cache()
    return done

def lightning_procedure(name, steps=3, max_trials=25):
    # The competitor as it runs, on the notebook's own loop: Lightning's BatchSizeFinder in
    # mode "binsearch" with its defaults (lightning/pytorch/tuner/batch_size_scaling.py): from
    # 2, doubling, then bisecting; garbage_collection_cuda() (gc.collect, empty_cache) before
    # every trial and after an out-of-memory error; trials go on from the weights and
    # optimizer state the last left; the model and optimizer saved before and loaded after
    # (Lightning writes a checkpoint file; host memory here, which is faster).
    t0 = time.perf_counter()
    m, opt = models[name], opts[name]
    host = lambda t: t.detach().to("cpu", copy=True)
    saved = ({k: host(v) for k, v in m.state_dict().items()},
             copy.deepcopy({"state": {k: {n: host(v) if torch.is_tensor(v) else v
                                          for n, v in st.items()}
                                      for k, st in opt.state_dict()["state"].items()},
                            "param_groups": opt.state_dict()["param_groups"]}))
    fresh_scaler(name)
    def cleanup():
        gc.collect(); torch.cuda.empty_cache()
    low, high, size, count, tried = 1, None, 2, 0, []
    while True:
        cleanup()
        tried.append(size)
        try:
            train(name, size, steps)
            count += 1
            if count > max_trials:
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                size = (high + low) // 2
            else:
                size *= 2
        except torch.OutOfMemoryError:
            cleanup()
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
    cleanup()
    m.load_state_dict(saved[0]); opt.load_state_dict(saved[1])
    opts[name].zero_grad(set_to_none=True)
    del saved
    cleanup()
    return {"max_batch": size, "trials": len(tried), "tried": tried,
            "seconds": time.perf_counter() - t0}

def drop(name):
    for d in (models, opts, data, amps, scalers, scheds, accumulate, features):
        d.pop(name, None)
    clip.discard(name); own_loss.discard(name); own_loss_held.discard(name)
    globals().pop(name, None); globals().pop(name + "_opt", None)
    gc.collect(); torch.cuda.empty_cache()

def gpt_step(batch):   # --step: the user's own function
    train("gptstep", batch, 1)

def freeze_but_top(m):  # a frozen backbone: embeddings and the first 6 blocks; AdamW on the rest
    for p in [*m.tok.parameters(), m.pos, *(p for b in m.blocks[:6] for p in b.parameters())]:
        p.requires_grad_(False)
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)

def gpt_frozen_step(batch):   # --step over a frozen backbone: its weights are watched, not copied back
    train("gptfrozen", batch, 1)

def gpt_accum_step(batch):   # --step with gradient accumulation: 4 micro-batches of `batch`
    train("gptaccum", batch, 1)

def gpt_compiled_step(batch):   # --step through torch.compile (the loop's model is compiled)
    train("gptc", batch, 1)

def hf_llama_step(batch):   # --step with the model's own loss, as Hugging Face users train
    train("hfls", batch, 1)

def hf_gpt2():  # a model from outside this file: Hugging Face GPT-2 (124M), built from its config
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_positions=512))

def hf_convnext():  # Hugging Face ConvNeXt-T (28M), built from its default config
    from transformers import ConvNextConfig, ConvNextForImageClassification
    return ConvNextForImageClassification(ConvNextConfig(num_labels=1000))

def hf_bert_mlm():  # Hugging Face BERT-base masked LM (110M), from its default config
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig())

def hf_distilbert_cls():  # Hugging Face DistilBERT sequence classifier, 2 labels
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    return DistilBertForSequenceClassification(DistilBertConfig(num_labels=2))

def hf_llama():  # a Llama-style decoder (125M: 12 layers, d 768, grouped-query attention)
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                        num_hidden_layers=12, num_attention_heads=12,
                                        num_key_value_heads=4, max_position_embeddings=1024))

def hf_swin():  # Hugging Face Swin-T (28M), windowed attention, from its default config
    from transformers import SwinConfig, SwinForImageClassification
    return SwinForImageClassification(SwinConfig(num_labels=1000))

def hf_bert_frozen():  # fine-tuning as users do: BERT-base classifier, embeddings and 8 of 12 layers frozen
    from transformers import BertConfig, BertForSequenceClassification
    m = BertForSequenceClassification(BertConfig(num_labels=4))
    for p in list(m.bert.embeddings.parameters()) + [p for l in m.bert.encoder.layer[:8] for p in l.parameters()]:
        p.requires_grad_(False)
    return m

def fused_adamw(m):  # AdamW in its fused kernel, as pure-bf16 training often runs it
    return torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

def trainable_sgd(m):  # SGD with Nesterov momentum over the parameters that train
    return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-2, momentum=0.9, nesterov=True)

def hf_resnet50_cl():  # Hugging Face ResNet-50, channels_last as vision users train it
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(num_labels=1000)).to(memory_format=torch.channels_last)

def images_cl(size, classes):
    return lambda b: (torch.randn(b, 3, size, size, device=dev).contiguous(memory_format=torch.channels_last),
                      torch.randint(0, classes, (b,), device=dev))

def gpt_sched_step(batch):   # --step with clipping and a OneCycle schedule, Adam without foreach
    train("gptsched", batch, 1)

def rn50_cl_step(batch):   # --step on a channels_last ResNet-50 under bf16 autocast
    train("rn50cl", batch, 1)

def hf_vitmae():  # Hugging Face ViTMAEForPreTraining (ViT-B encoder, 8-layer decoder, 75% masked)
    from transformers import ViTMAEConfig, ViTMAEForPreTraining
    return ViTMAEForPreTraining(ViTMAEConfig())

def hf_t5():  # Hugging Face T5-small (60M), an encoder-decoder trained with its own loss
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=32128, decoder_start_token_id=0, pad_token_id=0))

def hf_llama_bf16w_step(batch):   # --step on the pure-bf16 Llama with fused AdamW
    train("llbw", batch, 1)

def hf_t5_step(batch):   # --step: seq2seq with labels, as T5 users train
    train("t5", batch, 1)

def hf_mixtral():  # a mixture of experts (Mixtral-style, 8 experts, top 2; 8 layers, d 512),
    # trained as its users train it: labels and the router's load-balancing loss. Its experts
    # see as many tokens as the router sends them, so a step's memory moves with the data.
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                                            num_hidden_layers=8, num_attention_heads=8,
                                            num_key_value_heads=4, num_local_experts=8,
                                            num_experts_per_tok=2, max_position_embeddings=1024,
                                            output_router_logits=True))

def hf_qwen2():  # Qwen2.5-0.5B's shape (494M, 24 layers, d 896, 2 KV heads) and its 151,936-token
    # vocabulary with tied embeddings: the logits, not the layers, set what a sample costs.
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                        num_hidden_layers=24, num_attention_heads=14,
                                        num_key_value_heads=2, max_position_embeddings=1024,
                                        tie_word_embeddings=True))

# Rows new on 2026-12-08: features taken from a model by forward hooks, the forums'
# `get_activation` pattern: each step's outputs of the hooked layers stay in a notebook dict
# until the next step's hooks replace them, so they are held through the next forward.
features = {}  # name -> {layer: the layer's last output}

def hook_features(name, layers):
    store = features.setdefault(name, {})
    def get_activation(layer):
        def hook(model, input, output):
            store[layer] = output.detach()
        return hook
    for layer in layers:
        getattr(models[name], layer).register_forward_hook(get_activation(layer))

def fingerprint(name):
    # What a trial could change in the user's state, summed: equal before and after %maxbatch.
    m, opt = models[name], opts[name]
    with torch.no_grad():
        params = sum(float(p.double().sum()) for p in m.parameters())
        buffers = sum(float(b.double().sum()) for b in m.buffers() if b.is_floating_point())
    return {"params": params, "buffers": buffers, "grads": sum(p.grad is not None for p in m.parameters()),
            "opt_state": len(opt.state), "lr": [g["lr"] for g in opt.param_groups],
            "sched": scheds[name].last_epoch if name in scheds else None,
            "scale": scalers[name].get_scale() if scalers[name] is not None else None,
            "frozen": sum(not p.requires_grad for p in m.parameters()), "training": m.training,
            "rng": int(torch.cuda.get_rng_state().double().sum()),
            "features": {k: [list(t.shape), float(t.double().sum())]
                         for k, t in features.get(name, {}).items()}}

def seq_tokens(vocab, seq):  # (seq, batch) token ids, as the nn.Transformer tutorial batches them
    return lambda b: (torch.randint(0, vocab, (seq, b), device=dev), torch.randint(0, vocab, (seq, b), device=dev))

def sentences(vocab, seq, classes):  # token ids and one label per sequence
    return lambda b: (torch.randint(0, vocab, (b, seq), device=dev), torch.randint(0, classes, (b,), device=dev))

# Rows new to the suite on 2026-12-05: torchvision's own models with the optimizers of its
# reference recipes, as a new user would bring them (the device's torchvision, not carried).
def tv(name, **kw):
    def factory():
        import torchvision
        return getattr(torchvision.models, name)(weights=None, **kw)
    return factory

def tv_deeplabv3():  # DeepLabV3-ResNet50, 21 classes: its forward returns {'out': [B, 21, H, W]}
    import torchvision
    return torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
                                                              num_classes=21)

def tv_fcn_aux():  # FCN-ResNet50 with its auxiliary head: {'out', 'aux'}, both trained
    import torchvision
    return torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None,
                                                        num_classes=21, aux_loss=True)

def tv_r3d18():  # a 3D-conv video classifier (5-D input: clips of 16 frames)
    import torchvision
    return torchvision.models.video.r3d_18(weights=None, num_classes=400)

def clips(frames, size, classes):
    return lambda b: (torch.randn(b, 3, frames, size, size, device=dev), torch.randint(0, classes, (b,), device=dev))

def rmsprop_recipe(m):  # torchvision's MobileNetV3 recipe
    return torch.optim.RMSprop(m.parameters(), lr=0.064, alpha=0.9, eps=0.0316, momentum=0.9, weight_decay=1e-5)

def sgd_recipe(m):  # torchvision's segmentation and video recipes
    return torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)

# Rows new on 2026-12-07: timm's models as its training recipes build them (stochastic depth;
# timm's own gradient checkpointing), from the timm wheel carried in .whl/hf.
def timm_model(name, checkpointing=False, **kw):
    def factory():
        import timm
        m = timm.create_model(name, pretrained=False, **kw)
        m.set_grad_checkpointing(checkpointing)
        return m
    return factory
"""

# row: (name, setup code, magic arguments, libtorch too?, lightning?)
ROWS = {
    "resnet18_fp32": ("make('resnet18_fp32', ResNet18, images(224, 1000))",
                      "resnet18_fp32 --input 3x224x224", False),
    "vit_b16_fp32": ("make('vit_b16_fp32', ViT, images(224, 1000))",
                     "vit_b16_fp32 --input 3x224x224", True),
    "vit_b16_bf16": ("make('vit_b16_bf16', ViT, images(224, 1000), torch.bfloat16)",
                     "vit_b16_bf16 --input 3x224x224 --amp bf16", True),
    "gpt_fp32": ("make('gpt_fp32', GPT, tokens(32000, 512))", "gpt_fp32 --input 512", True),
    "gpt_fp16_scaler": ("make('gpt_fp16_scaler', GPT, tokens(32000, 512), torch.float16)",
                        "gpt_fp16_scaler --input 512 --amp fp16", False),
    "lstm_fp32": ("make('lstm_fp32', LSTMLM, tokens(32000, 128))", "lstm_fp32 --input 128", False),
    "unet_fp32": ("make('unet_fp32', UNet, masks(128, 21))", "unet_fp32 --input 3x128x128", False),
    "gpt_checkpointed": ("make('gpt_checkpointed', lambda: GPT(checkpoint=True), tokens(32000, 512))",
                         "gpt_checkpointed --input 512", False),
    "gpt_step": ("make('gptstep', GPT, tokens(32000, 512))", "--step gpt_step", False),
    # Added 2026-12-06: a frozen backbone sized through --step (trials.py's _Watched).
    "gpt_frozen_step": ("make('gptfrozen', GPT, tokens(32000, 512), opt=freeze_but_top)",
                        "--step gpt_frozen_step", False),
    "gpt_accum_step": ("make('gptaccum', GPT, tokens(32000, 512)); accumulate['gptaccum'] = 4",
                       "--step gpt_accum_step", False),
    "gpt_compiled_step": ("make('gptc', GPT, tokens(32000, 512)); "
                          "models['gptc'] = torch.compile(models['gptc'])",
                          "--step gpt_compiled_step --trial-timeout 300", False),
    # The notebook's model itself compiled (not a --step): `%maxbatch` on the compiled module,
    # whose standard step runs its compiled graphs as the loop does (2026-12-06).
    "gpt_compiled_module": ("make('gpt_compiled_module', GPT, tokens(32000, 512)); "
                            "models['gpt_compiled_module'] = gpt_compiled_module = "
                            "torch.compile(models['gpt_compiled_module'])",
                            "gpt_compiled_module --input 512 --trial-timeout 300", False),
    # The Hugging Face rows below train in a loop that computes cross-entropy on the logits
    # itself, so they ask for that loss (`--loss ce`, added 2026-12-06): since then the
    # standard step trains a model whose forward takes labels on the loss it returns, as a
    # loop that passes labels does (the rows `hf_llama_bf16w_labels*`).
    "hf_gpt2_fp32": ("make('hf_gpt2_fp32', hf_gpt2, tokens(50257, 512))",
                     "hf_gpt2_fp32 --input 512 --loss ce", False),
    "hf_bert_mlm_fp32": ("make('hf_bert_mlm_fp32', hf_bert_mlm, tokens(30522, 512))",
                         "hf_bert_mlm_fp32 --input 512 --loss ce", False),
    "hf_distilbert_cls_bf16": ("make('hf_distilbert_cls_bf16', hf_distilbert_cls, "
                               "sentences(30522, 512, 2), torch.bfloat16)",
                               "hf_distilbert_cls_bf16 --input 512 --amp bf16 --loss ce", False),
    "hf_llama_bf16": ("make('hf_llama_bf16', hf_llama, tokens(32000, 512), torch.bfloat16)",
                      "hf_llama_bf16 --input 512 --amp bf16 --loss ce", False),
    "hf_llama_step": ("make('hfls', hf_llama, tokens(32000, 512), torch.bfloat16); own_loss.add('hfls')",
                      "--step hf_llama_step", False),
    "hf_convnext_bf16": ("make('hf_convnext_bf16', hf_convnext, images(224, 1000), torch.bfloat16)",
                         "hf_convnext_bf16 --input 3x224x224 --amp bf16 --loss ce", False),
    "hf_swin_bf16": ("make('hf_swin_bf16', hf_swin, images(224, 1000), torch.bfloat16)",
                     "hf_swin_bf16 --input 3x224x224 --amp bf16 --loss ce", False),
    # Rows new to the suite on 2026-12-04 (a new user's set-ups: a frozen backbone with SGD,
    # pure bf16 weights with fused AdamW, clipping and a scheduler, channels_last).
    "hf_bert_frozen_sgd": ("make('hf_bert_frozen_sgd', hf_bert_frozen, sentences(30522, 256, 4), opt=trainable_sgd)",
                           "hf_bert_frozen_sgd --input 256 --loss ce", False),
    "hf_llama_bf16_weights": ("make('hf_llama_bf16_weights', hf_llama, tokens(32000, 512), weights=torch.bfloat16, "
                              "opt=fused_adamw)",
                              "hf_llama_bf16_weights --input 512 --loss ce", False),
    "gpt_sched_step": ("make('gptsched', GPT, tokens(32000, 512), "
                       "opt=lambda m: torch.optim.Adam(m.parameters(), lr=3e-4, foreach=False)); "
                       "scheds['gptsched'] = torch.optim.lr_scheduler.OneCycleLR(opts['gptsched'], "
                       "max_lr=3e-4, total_steps=10**6); clip.add('gptsched')",
                       "--step gpt_sched_step", False),
    "hf_llama_bf16w_step": ("make('llbw', hf_llama, tokens(32000, 512), weights=torch.bfloat16, "
                            "opt=fused_adamw)",
                            "--step hf_llama_bf16w_step", False),
    "hf_t5_step": ("make('t5', hf_t5, tokens(32128, 512)); own_loss.add('t5')", "--step hf_t5_step", False),
    "resnet18_fp16_scaler": ("make('resnet18_fp16_scaler', ResNet18, images(224, 1000), torch.float16)",
                             "resnet18_fp16_scaler --input 3x224x224 --amp fp16", False),
    "hf_resnet50_cl_step": ("make('rn50cl', hf_resnet50_cl, images_cl(224, 1000), torch.bfloat16)",
                            "--step rn50_cl_step", False),
    # Rows new to the suite on 2026-12-05: torchvision models (see tv() above).
    "tv_efficientnet_b0_fp32": ("make('tv_efficientnet_b0_fp32', tv('efficientnet_b0'), images(224, 1000))",
                                "tv_efficientnet_b0_fp32 --input 3x224x224", False),
    "tv_mobilenet_v3_bf16": ("make('tv_mobilenet_v3_bf16', tv('mobilenet_v3_large'), images(224, 1000), "
                             "torch.bfloat16, opt=rmsprop_recipe)",
                             "tv_mobilenet_v3_bf16 --input 3x224x224 --amp bf16", False),
    "tv_deeplabv3_fp32": ("make('tv_deeplabv3_fp32', tv_deeplabv3, masks(256, 21), opt=sgd_recipe)",
                          "tv_deeplabv3_fp32 --input 3x256x256", False),
    "tv_fcn_aux_fp32": ("make('tv_fcn_aux_fp32', tv_fcn_aux, masks(256, 21), opt=sgd_recipe)",
                        "tv_fcn_aux_fp32 --input 3x256x256", False),
    "tv_r3d18_fp32": ("make('tv_r3d18_fp32', tv_r3d18, clips(16, 112, 400), opt=sgd_recipe)",
                      "tv_r3d18_fp32 --input 3x16x112x112", False),
    # Row new to the suite on 2026-12-06: a seq-first model fed (seq, batch), which the
    # standard step now feeds the same way (the batch on dim 1, found from its encoder).
    # Row new to the suite on 2026-12-06: nanoGPT, whose forward computes the training
    # logits only when given targets; the standard step now passes them, as its loop does.
    # Rows new to the suite on 2026-12-06 (second part), for the loss the standard step infers:
    # a denoiser (its output shaped like its input: mean squared error, where its 3 channels
    # read as 3 classes before), and deep supervision (the half-size map trained too).
    "denoiser_unet_fp32": ("make('denoiser_unet_fp32', lambda: UNet(classes=3), noisy(128)); mse.add('denoiser_unet_fp32')",
                           "denoiser_unet_fp32 --input 3x128x128", False),
    "unet_deepsup_fp32": ("make('unet_deepsup_fp32', UNetDS, masks(128, 21))",
                          "unet_deepsup_fp32 --input 3x128x128", False),
    # Pure bf16 weights trained as Hugging Face users train, `model(input_ids=x, labels=x).loss`:
    # its loss upcasts the bf16 logits to float32 and keeps that copy's softmax. The default
    # step (the model's own loss, 2026-12-06) against the one before it (`--loss ce`: cross-
    # entropy on the bf16 logits), each in the same labels loop.
    "hf_llama_bf16w_labels": ("make('hf_llama_bf16w_labels', hf_llama, tokens(32000, 512), weights=torch.bfloat16, "
                              "opt=fused_adamw); own_loss.add('hf_llama_bf16w_labels')",
                              "hf_llama_bf16w_labels --input 512", False),
    "hf_llama_bf16w_labels_ce": ("make('hf_llama_bf16w_labels_ce', hf_llama, tokens(32000, 512), weights=torch.bfloat16, "
                                 "opt=fused_adamw); own_loss.add('hf_llama_bf16w_labels_ce')",
                                 "hf_llama_bf16w_labels_ce --input 512 --loss ce", False),
    # Its loop as nanoGPT's train.py writes it, `logits, loss = model(X, Y)`: the logits
    # (206 MB a sample) live on into the next step's forward (fixed 2026-12-06: the first run
    # of this row trained `loss = model(X, Y)[1]`, which is now the next row).
    "nanogpt_fp32": ("make('nanogpt_fp32', NanoGPT, tokens(50304, 1024)); own_targets.add('nanogpt_fp32')",
                     "nanogpt_fp32 --input 1024", False),
    # The same model in a loop that drops the logits at once: the standard step keeps them,
    # as nanoGPT's loop does, and its report says how many more such a loop can fit.
    "nanogpt_loss_only_fp32": ("make('nanogpt_loss_only_fp32', NanoGPT, tokens(50304, 1024)); "
                               "own_targets.add('nanogpt_loss_only_fp32'); loss_only.add('nanogpt_loss_only_fp32')",
                               "nanogpt_loss_only_fp32 --input 1024", False),
    # A masked autoencoder, whose forward returns the loss it computes from its prediction
    # (2026-12-06, 3a29632/52759cc: the standard step trains on that loss; not yet run).
    "mae_vitb_bf16": ("make('mae_vitb_bf16', MAE, images(224, 1000), torch.bfloat16); "
                      "returns_loss.add('mae_vitb_bf16')",
                      "mae_vitb_bf16 --input 3x224x224 --amp bf16", False),
    # The same in a loop that keeps the output (`out = model(x)`) into the next step, as the
    # standard step does: whether that is the difference between the two (2026-12-06).
    "mae_vitb_bf16_held": ("make('mae_vitb_bf16_held', MAE, images(224, 1000), torch.bfloat16); "
                           "returns_loss_held.add('mae_vitb_bf16_held')",
                           "mae_vitb_bf16_held --input 3x224x224 --amp bf16", False),
    # The same pre-training from a model outside this file: transformers' ViTMAEForPreTraining,
    # whose output carries the loss it computes from its logits (2026-12-06).
    "hf_vitmae_bf16": ("make('hf_vitmae_bf16', hf_vitmae, images(224, 1000), torch.bfloat16); "
                       "hf_returns_loss.add('hf_vitmae_bf16')",
                       "hf_vitmae_bf16 --input 3x224x224 --amp bf16", False),
    # The four loops above that drop the output at once, each sized with --drops-output
    # (2026-12-06), which lets each step's output go before the next forward as they do: the
    # same models and loops under rows of their own names.
    "nanogpt_loss_only_dropped": ("make('nanogpt_loss_only_dropped', NanoGPT, tokens(50304, 1024)); "
                                  "own_targets.add('nanogpt_loss_only_dropped'); "
                                  "loss_only.add('nanogpt_loss_only_dropped')",
                                  "nanogpt_loss_only_dropped --input 1024 --drops-output", False),
    "mae_vitb_bf16_dropped": ("make('mae_vitb_bf16_dropped', MAE, images(224, 1000), torch.bfloat16); "
                              "returns_loss.add('mae_vitb_bf16_dropped')",
                              "mae_vitb_bf16_dropped --input 3x224x224 --amp bf16 --drops-output", False),
    "hf_vitmae_bf16_dropped": ("make('hf_vitmae_bf16_dropped', hf_vitmae, images(224, 1000), torch.bfloat16); "
                               "hf_returns_loss.add('hf_vitmae_bf16_dropped')",
                               "hf_vitmae_bf16_dropped --input 3x224x224 --amp bf16 --drops-output", False),
    "hf_llama_bf16w_labels_dropped": ("make('hf_llama_bf16w_labels_dropped', hf_llama, tokens(32000, 512), "
                                      "weights=torch.bfloat16, opt=fused_adamw); "
                                      "own_loss.add('hf_llama_bf16w_labels_dropped')",
                                      "hf_llama_bf16w_labels_dropped --input 512 --drops-output", False),
    # A model and loop --drops-output was not written against: GPT-2 (124M) trained on its own
    # labels loss, as Hugging Face users train it (2026-12-06, the review's check).
    "hf_gpt2_labels_dropped": ("make('hf_gpt2_labels_dropped', hf_gpt2, tokens(50257, 512)); "
                               "own_loss.add('hf_gpt2_labels_dropped')",
                               "hf_gpt2_labels_dropped --input 512 --drops-output", False),
    # A model whose memory moves with its data (2026-12-07): a mixture of experts, whose experts
    # get as many tokens as the router sends them, under bf16 autocast with its own loss.
    "hf_mixtral_bf16_labels": ("make('hf_mixtral_bf16_labels', hf_mixtral, tokens(32000, 512), torch.bfloat16); "
                               "own_loss.add('hf_mixtral_bf16_labels')",
                               "hf_mixtral_bf16_labels --input 512 --amp bf16", False),
    "hf_mixtral_bf16_labels_dropped": ("make('hf_mixtral_bf16_labels_dropped', hf_mixtral, tokens(32000, 512), "
                                       "torch.bfloat16); own_loss.add('hf_mixtral_bf16_labels_dropped')",
                                       "hf_mixtral_bf16_labels_dropped --input 512 --amp bf16 --drops-output", False),
    "tutorial_seqfirst_fp32": ("make('tutorial_seqfirst_fp32', TutorialLM, seq_tokens(32000, 256))",
                               "tutorial_seqfirst_fp32 --input 256", False),
    # Models no run had tried before the search's step along the cache's line (f0f9135), as a
    # new user would bring them (2026-12-07): a Qwen2.5-0.5B-shaped LM on its own labels loss
    # under bf16 autocast, and torchvision's own ViT-B/16 (not this file's) under bf16.
    "hf_qwen2_bf16_labels": ("make('hf_qwen2_bf16_labels', hf_qwen2, tokens(151936, 512), torch.bfloat16); "
                             "own_loss.add('hf_qwen2_bf16_labels')",
                             "hf_qwen2_bf16_labels --input 512 --amp bf16", False),
    # Its loop keeps only the loss (`m(input_ids=x, labels=x).loss`), as the row above's does:
    # the same model sized for that loop with --drops-output.
    "hf_qwen2_bf16_labels_dropped": ("make('hf_qwen2_bf16_labels_dropped', hf_qwen2, tokens(151936, 512), "
                                     "torch.bfloat16); own_loss.add('hf_qwen2_bf16_labels_dropped')",
                                     "hf_qwen2_bf16_labels_dropped --input 512 --amp bf16 --drops-output", False),
    # The same model in the loop of Hugging Face's "Training in native PyTorch" tutorial and
    # Accelerate's examples, `outputs = model(**batch); loss = outputs.loss`, which keeps the
    # logits into the next forward: the standard step's default.
    "hf_qwen2_bf16_labels_held": ("make('hf_qwen2_bf16_labels_held', hf_qwen2, tokens(151936, 512), "
                                  "torch.bfloat16); own_loss_held.add('hf_qwen2_bf16_labels_held')",
                                  "hf_qwen2_bf16_labels_held --input 512 --amp bf16", False),
    "tv_vit_b16_bf16": ("make('tv_vit_b16_bf16', tv('vit_b_16'), images(224, 1000), torch.bfloat16)",
                        "tv_vit_b16_bf16 --input 3x224x224 --amp bf16", False),
    "timm_vit_b16_bf16": ("make('timm_vit_b16_bf16', timm_model('vit_base_patch16_224', "
                          "drop_path_rate=0.1), images(224, 1000), torch.bfloat16)",
                          "timm_vit_b16_bf16 --input 3x224x224 --amp bf16", False),
    "timm_convnext_t_ckpt_fp32": ("make('timm_convnext_t_ckpt_fp32', timm_model('convnext_tiny', True, "
                                  "drop_path_rate=0.1), images(224, 1000))",
                                  "timm_convnext_t_ckpt_fp32 --input 3x224x224", False),
    # Rows new on 2026-12-08: more of timm's models under its own gradient checkpointing (the
    # ConvNeXt row's cache held a third more than its allocated peak), and torchvision's
    # ResNet-50 with forward hooks keeping its stages' outputs (hook_features above).
    "timm_resnet50_ckpt_fp32": ("make('timm_resnet50_ckpt_fp32', timm_model('resnet50', True, "
                                "drop_path_rate=0.05), images(224, 1000))",
                                "timm_resnet50_ckpt_fp32 --input 3x224x224", False),
    "timm_vit_s16_ckpt_bf16": ("make('timm_vit_s16_ckpt_bf16', timm_model('vit_small_patch16_224', True, "
                               "drop_path_rate=0.1), images(224, 1000), torch.bfloat16)",
                               "timm_vit_s16_ckpt_bf16 --input 3x224x224 --amp bf16", False),
    # LightningModules trained by a Lightning Trainer's fit (lit_module above): %maxbatch's
    # standard step runs their training_step as the Trainer does (2026-12-08).
    "lit_gpt_fp32": ("make('lit_gpt_fp32', lambda: lit_module(GPT), tokens(32000, 512)); "
                     "lightning_rows['lit_gpt_fp32'] = '32-true'",
                     "lit_gpt_fp32 --input 512", False),
    "lit_vit_bf16": ("make('lit_vit_bf16', lambda: lit_module(ViT), images(224, 1000)); "
                     "lightning_rows['lit_vit_bf16'] = 'bf16-mixed'",
                     "lit_vit_bf16 --input 3x224x224 --amp bf16", False),
    "tv_resnet50_hooked_fp32": ("make('tv_resnet50_hooked_fp32', tv('resnet50'), images(224, 1000)); "
                                "hook_features('tv_resnet50_hooked_fp32', "
                                "('layer1', 'layer2', 'layer3', 'layer4'))",
                                "tv_resnet50_hooked_fp32 --input 3x224x224", False),
}
# The --step rows: the notebook variable their function trains.
STEP_KEYS = {"gpt_step": "gptstep", "gpt_accum_step": "gptaccum", "gpt_frozen_step": "gptfrozen",
             "gpt_compiled_step": "gptc", "hf_llama_step": "hfls", "gpt_sched_step": "gptsched",
             "hf_resnet50_cl_step": "rn50cl", "hf_t5_step": "t5", "hf_llama_bf16w_step": "llbw"}
# What a new user might try first on a row's model, and the message they get (recorded as the
# row's `first_try`): T5 makes its decoder's input from its labels, so before the standard
# step passed labels (dcc51e5) MODULE mode refused it and pointed to --step; now it sizes T5
# on its own loss, its labels shaped like the input, which the row's loop can compare.
FIRST_TRY = {"hf_t5_step": "t5 --input 512"}


def confirming_trials(confirmation):
    """The trials that ran the recommendation itself: those that failed, and the one that
    fitted unless the search had run it already."""
    c = confirmation or {}
    return len(c.get("failed", [])) + int(bool(c.get("batch")) and not c.get("during_search"))


def magic_row(v, wall_seconds):
    """The row's fields from `%maxbatch --json`'s value."""
    return {"max_batch": v["max_batch"], "recommended": v["recommended"],
            # The search's trials and those that ran the recommendation itself.
            "trials": len(v["trials"]) + confirming_trials(v.get("confirmation")),
            "seconds": v["elapsed_ms"] / 1000,
            "wall_seconds": wall_seconds, "loss": v["assumptions"]["loss"],
            "precision": v["assumptions"]["precision"],
            "optimizer": v["assumptions"]["optimizer"], "limit": v["limit_bytes"],
            "held": v.get("held"), "trial_ms": v.get("trial_ms"),
            "trial_steps": v.get("trial_steps"),
            "confirmation": v.get("confirmation"), "room": v.get("room"),
            "margin_batch": v.get("margin_batch"), "room_held": v.get("room_held"),
            "timings_ms": v.get("timings_ms"),
            "notes": v.get("notes"),
            # [batch, result, peak, reserved, {outside, optimizer} peaks or None]
            "trial_list": [[t["batch"], t["outcome"]["result"], t["outcome"].get("peak"),
                            t["outcome"].get("reserved"), t["outcome"].get("phases")]
                           for t in v["trials"]]}


class Notebook:
    """The benchmark's notebook in one gpu-python kernel: cells, values and %maxbatch."""

    def __init__(self, kc, execute):
        self.kc, self._execute = kc, execute

    def run(self, code, timeout=900):
        reply, outputs = self._execute(self.kc, code, timeout=timeout)
        if reply["content"]["status"] != "ok":
            return None, reply["content"]
        return outputs, None

    def ok(self, code, timeout=900):
        _, err = self.run(code, timeout)
        assert err is None, err

    def value(self, expr):
        outputs, err = self.run(f"print(__import__('json').dumps({expr}))")
        if err:
            raise RuntimeError(err)
        printed = "".join(o["content"]["text"] for o in outputs
                          if o["msg_type"] == "stream" and o["content"]["name"] == "stdout")
        return json.loads(printed.strip().splitlines()[-1])

    def start(self):
        self.ok(MODELS.replace("CAP", repr(CAP_GIB)) + LOOP, timeout=300)

    def magic(self, args):
        t0 = time.time()
        outputs, err = self.run(f"%maxbatch {args} --json")
        if err:
            return {"error": f"{err.get('ename')}: {err.get('evalue')}", "seconds": time.time() - t0}
        data = [o for o in outputs if o["msg_type"] == "execute_result"][-1]["content"]["data"]
        return magic_row(data["application/json"], time.time() - t0)


def log(text):
    print(text, file=sys.stderr, flush=True)


def lightning_in_fresh_kernel(running_kernel, execute, setup, key):
    """The competitor as it runs in a notebook (not inside our harness), in a kernel of its
    own: in ours every batch shape ours and the baseline tried is set up already (cuDNN's
    per-shape setup: about 3 s each on ConvNeXt)."""
    with running_kernel("gpu-python") as (_, lkc):
        nb = Notebook(lkc, execute)
        nb.start()
        nb.ok(setup)
        nb.value(f"fits({key!r}, 2)")  # warmed as ours was
        return nb.value(f"lightning_procedure({key!r})")


def interrupt_check(km, nb, collect):
    """Interrupts a search in its middle, once the live display shows trials have begun;
    times the reply and checks the model came back bit for bit and nothing stayed on the GPU."""
    kc = nb.kc
    nb.run("make('vit_i', ViT, images(224, 1000))")
    found = {"allocated_before": nb.value("torch.cuda.memory_allocated()")}
    checksum = "sum(float(p.double().sum()) for p in vit_i.parameters())"
    before = nb.value(checksum)
    msg = kc.execute("%maxbatch vit_i --input 3x224x224")
    shown, deadline = 0, time.time() + 60
    while shown < 2 and time.time() < deadline:
        m = kc.get_iopub_msg(timeout=60)
        if m["parent_header"].get("msg_id") == msg and \
                m["msg_type"] in ("display_data", "update_display_data"):
            shown += 1
    time.sleep(1.0)
    t0 = time.time()
    km.interrupt_kernel()
    reply, _ = collect(kc, msg, timeout=60)
    found |= {"reply_seconds": time.time() - t0, "display_updates_before": shown,
              "status": reply["content"]["status"], "ename": reply["content"].get("ename")}
    found["next_cell_ok"] = nb.run("print(1)")[1] is None
    found["parameters_unchanged"] = nb.value(checksum) == before
    nb.run("drop('vit_i')")
    # What the kernel holds after the model is dropped, next to what it held before.
    found["allocated_after_drop"] = nb.value("torch.cuda.memory_allocated()")
    found["gc_freeze_count"] = nb.value("gc.get_freeze_count()")
    found["last_error_kept"] = nb.value("repr(getattr(__import__('sys'), 'last_type', None))")
    return found


def searches(nb, key, args, lightning):
    """Ours, and unless SURVEY the baseline (in-harness) and the Lightning procedure. The
    user's state is fingerprinted before and after ours (`state_unchanged`)."""
    before = nb.value(f"fingerprint({key!r})")
    ours = nb.magic(args)
    after = nb.value(f"fingerprint({key!r})")
    row = dict(ours)
    # Page-locked host memory left in the kernel: the snapshot's is given back at close.
    row["pinned_host_after"] = nb.value(
        "torch.cuda.host_memory_stats().get('allocated_bytes.current')")
    row["state_unchanged"] = before == after
    if before != after:
        row["state_before_after"] = [before, after]
    log(f"   ours {ours}")
    if SURVEY:
        return row
    base = nb.magic(args + " --search double-bisect")
    row |= {"baseline_trials": base.get("trials"), "baseline_seconds": base.get("seconds"),
            "baseline_max": base.get("max_batch"), "baseline_timings_ms": base.get("timings_ms")}
    if ours.get("max_batch"):
        row["time_vs_baseline"] = ours["seconds"] / max(1e-9, base.get("seconds") or 1e-9)
    if LEAN:
        return row
    lp = lightning()
    row["lightning_procedure"] = lp
    if ours.get("max_batch"):
        row["time_vs_lightning_procedure"] = ours["seconds"] / max(1e-9, lp["seconds"])
    log(f"   lightning procedure {lp}")
    return row


def truth(nb, key, row):
    """The loop's exact maximum, its curve and step marks, and 30 steps at the recommendation
    (and, with AT_MAX / AT_TRUE, at our maximum and the truth's)."""
    t = nb.value(f"true_max({key!r}, {row.get('max_batch') or 8}, True)")
    row |= {"true_max": t["true_max"], "true_max_probes": t["probes"], "holes": t["holes"],
            "true_max_below_holes": t["true_max_below_holes"], "curve": t.get("curve", []),
            "step_marks": t.get("step_marks", [])}
    if row.get("recommended"):
        row["steps_ok_at_recommended"] = nb.value(f"steps_ok({key!r}, {row['recommended']})")
    if row.get("max_batch") and os.environ.get("AT_MAX"):
        row["steps_ok_at_max"] = nb.value(f"steps_ok({key!r}, {row['max_batch']})")
    if t["true_max"] and os.environ.get("AT_TRUE"):
        row["steps_ok_at_true_max"] = nb.value(f"steps_ok({key!r}, {t['true_max']})")
    if row.get("max_batch") and t["true_max"]:
        row["ratio"] = row["max_batch"] / t["true_max"]  # and below holes: truth_report
    return row


def libtorch_row(nb, name, args, true_max):
    """The libtorch engine on the same module; no --limit: a notebook module is sized
    against its kernel's allocator budget. Alone (LIBTORCH_ONLY), its recommendation runs the
    notebook's own loop for 30 steps, and so does the margin's batch where the room for a
    stranded block held the recommendation below it."""
    lt = nb.magic(args + " --engine libtorch --trial-timeout 120")
    row = {"model": name, "engine": "libtorch", "args": args, **lt, "true_max": true_max}
    if lt.get("max_batch") and true_max:
        row["ratio"] = lt["max_batch"] / true_max
    key = STEP_KEYS.get(name, name)
    if LIBTORCH_ONLY and lt.get("recommended"):
        row["steps_ok_at_recommended"] = nb.value(f"steps_ok({key!r}, {lt['recommended']})")
        if lt.get("room_held"):
            row["steps_ok_at_margin_batch"] = nb.value(f"steps_ok({key!r}, {lt['margin_batch']})")
    log(f"   libtorch {lt}")
    return row


def main() -> int:
    torch_version = device_kernels.install()
    from kernel_client import collect, execute, running_kernel

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    wanted = sys.argv[1:] or list(ROWS)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": smi, "cap_gib": CAP_GIB,
               "torch": torch_version, "command": "python3 bench/gpu/maxbatch_truth.py "
               + " ".join(sys.argv[1:]), "lp_kernel": "fresh", "rows": []}
    out_file = OUT / "maxbatch_truth.json"

    def save():
        out_file.write_text(json.dumps(results, indent=1))

    with running_kernel("gpu-python") as (km, kc):
        nb = Notebook(kc, execute)
        nb.start()
        if os.environ.get("INTERRUPT_CHECK"):
            results["interrupt"] = interrupt_check(km, nb, collect)
            save()
            if results["interrupt"]["allocated_after_drop"] > 2**30:
                # Every row after would be sized against the cut trial's leftovers.
                log(f"   interrupt left memory behind: {results['interrupt']}")
                return 1
        began = time.time()
        for name in wanted:
            if DEADLINE_S and time.time() - began > DEADLINE_S:
                log(f"== {name}: not started, past DEADLINE_S={DEADLINE_S:.0f} s")
                results.setdefault("not_started", []).append(name)
                save()
                continue
            setup, args, libtorch = ROWS[name]
            log(f"== {name}")
            nb.ok(setup)
            key = STEP_KEYS.get(name, name)
            # One small step of the loop first, so that neither search (ours runs first) pays
            # alone for what any first step in the process pays (CUDA modules loaded, cuBLAS
            # and cuDNN set up): warm both, as a notebook that has run its loop once is.
            nb.value(f"fits({key!r}, 2)")
            if LIBTORCH_ONLY:
                results["rows"].append(libtorch_row(nb, name, args, None))
                save()
                nb.run(f"drop({key!r})")
                continue
            # What the notebook's allocator could reach as the row began (free plus its own
            # cache): another process holding the card (a kernel a stopped call left running)
            # sizes ours against less than the cap (-07x).
            row = {"model": name, "engine": "python", "args": args,
                   "available_before": nb.value(
                       "torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()")}
            if name in FIRST_TRY:
                row["first_try"] = {"args": FIRST_TRY[name], **nb.magic(FIRST_TRY[name])}
                log(f"   first try {row['first_try']}")
            row |= searches(nb, key, args, lambda: lightning_in_fresh_kernel(
                running_kernel, execute, setup, key))
            if not TIMING:
                truth(nb, key, row)
                log(f"   row {json.dumps({k: v for k, v in row.items() if k != 'trial_list'})}")
            results["rows"].append(row)
            save()
            if libtorch and not (SURVEY or TIMING or LEAN):
                results["rows"].append(libtorch_row(nb, name, args, row["true_max"]))
                save()
            nb.run(f"drop({key!r})")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
