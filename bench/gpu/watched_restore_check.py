"""What `%maxbatch --step` pays between trials for a frozen base under LoRA adapters, with
and without the fingerprints that let it skip putting back an unchanged base (trials.py's
`_Watched`). Our own harness, in a plain process on the GPU machine (no kernel, no search):
trials.py's prepare, trials at fixed batches and close, driven as gpukernel drives them, on a
stack of frozen bf16 linear layers (BASE_GIB, 8 by default) with trainable rank-16 adapters
and AdamW on the adapters, as a LoRA fine-tune is set up. The same process runs both ways:
"fingerprints" is the code as shipped; "copy back" makes every fingerprint fail, which puts
the base back after every trial, as before `_Watched`. Then a step that writes the base
through `.data` (an EMA teacher): it must come back bit for bit. Each run also records the
page-locked host memory before and after close (close gives the snapshot's back) and its
prepare time (each run pins its host copies afresh).

    python3 bench/gpu/watched_restore_check.py

Writes $OUT/watched_restore_check.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trials_in_process import call, load_trials  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
BASE_GIB = float(os.environ.get("BASE_GIB", "8"))
WIDTH = 4096
BATCHES = (4, 16, 64, 32, 48)
SEQ = 16
# The GPU's; on a machine without one, a smoke run of the script itself (BASE_GIB=0.05).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Adapted(torch.nn.Module):
    """Frozen linear layers, each with a trainable low-rank adapter beside it."""

    def __init__(self, layers, rank=16):
        super().__init__()
        self.base = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16)
            for _ in range(layers)).requires_grad_(False)
        self.down = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, rank, bias=False, dtype=torch.bfloat16)
            for _ in range(layers))
        self.up = torch.nn.ModuleList(
            torch.nn.Linear(rank, WIDTH, bias=False, dtype=torch.bfloat16)
            for _ in range(layers))
        for up in self.up:
            torch.nn.init.zeros_(up.weight)

    def forward(self, x):
        for base, down, up in zip(self.base, self.down, self.up):
            x = torch.nn.functional.gelu(base(x) + up(down(x)))
        return x


def pinned():
    """Page-locked host memory torch's host allocator holds (in use and cached)."""
    if DEVICE != "cuda":
        return None
    return torch.cuda.host_memory_stats().get("allocated_bytes.current")


def run(trials, ns):
    """prepare, the trials, close: where the time between trials went."""
    began = time.perf_counter()
    prepared = call(trials, ns, "prepare", spec={"kind": "step", "target": "step"})
    prepare_s = time.perf_counter() - began
    if "refused" in prepared:
        raise SystemExit(f"refused: {prepared['refused']}")
    restore_ms, results = [], []
    for batch in BATCHES:
        reply = call(trials, ns, "trial", batch=batch, steps=3)
        results.append(reply["result"])
        restore_ms.append(reply["cleanup_ms"]["restore"])
    put_back = trials._session.snapshot.watched.put_back
    pinned_open = pinned()
    closed = call(trials, ns, "close")
    return {"prepare_s": prepare_s, "restore_ms": restore_ms, "results": results,
            "pinned_before_close": pinned_open, "pinned_after_close": pinned(),
            "watched_bytes": prepared["describe"].get("watched_bytes"),
            "snapshot_bytes": prepared["describe"]["snapshot_bytes"],
            "put_back": put_back, "close_ms": closed.get("timings_ms")}


def main() -> int:
    trials = load_trials()
    layers = max(1, int(BASE_GIB * 2**30 / (WIDTH * WIDTH * 2)))
    torch.manual_seed(0)
    model = Adapted(layers).to(DEVICE)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(batch):
        x = torch.randn(batch, SEQ, WIDTH, device=DEVICE, dtype=torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()

    step(2)  # warm: CUDA and cuBLAS set up, the optimizer's state made, as after a first run
    ns = {"model": model, "opt": opt, "step": step}
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "no GPU (smoke run)"
    print(f"{gpu}; base {layers} x {WIDTH}x{WIDTH} bf16", flush=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu,
               "torch": torch.__version__, "command": "python3 bench/gpu/watched_restore_check.py",
               "base_layers": layers, "batches": BATCHES}

    def save():
        (OUT / "watched_restore_check.json").write_text(json.dumps(results, indent=1))

    checksum = lambda: [float(p.double().sum()) for p in model.base.parameters()]  # noqa: E731
    before = checksum()
    results["fingerprints"] = run(trials, ns)
    print("fingerprints", results["fingerprints"], flush=True)
    save()
    shipped = trials._fingerprint
    trials._fingerprint = lambda *args, **kwargs: None  # the base put back after every trial
    results["copy_back"] = run(trials, ns)
    trials._fingerprint = shipped
    print("copy back", results["copy_back"], flush=True)
    results["base_unchanged"] = checksum() == before
    save()

    def ema(batch):  # writes the base through .data, which no version counter sees
        step(batch)
        for p in model.base.parameters():
            p.data.mul_(0.5)  # exact in bf16, where 0.999 would round back to 1

    ns["step"] = ema
    results["ema"] = run(trials, ns)
    results["base_unchanged_after_ema"] = checksum() == before
    print("ema", results["ema"], results["base_unchanged"], results["base_unchanged_after_ema"],
          flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
