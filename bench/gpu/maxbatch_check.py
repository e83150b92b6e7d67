"""%maxbatch on a CUDA machine, each run in a fresh process, through libgpuprobe_torch.so.

For ResNet-50 fp32+Adam, ResNet-50 bf16 autocast+Adam and a small transformer exported from a
Python session (by gpukernel's own export_module.py, as `%maxbatch VARIABLE` does): our search
as %maxbatch runs it (1% tolerance: trials, wall time, maximum); the true maximum found by an
exact double-then-bisect search (Lightning's algorithm) in the same harness and checked
directly in fresh processes (max fits, max+1 does not); 30 training steps at the
recommendation; memory after. Lightning's own BatchSizeFinder runs on the same architecture in
the same run where lightning (and torchvision, for ResNet-50) is installed. Writes
$OUT/maxbatch_check.json and prints a table.

Usage (repo root, on the GPU machine): python3 bench/gpu/maxbatch_check.py [--quick] [--ours-only]
(--quick: ResNet-50 fp32 only; --ours-only: our search alone, for looking at its trials)
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(os.environ.get("GPUPROBE_TORCH_PLUGIN", ROOT / ".device" / "libgpuprobe_torch.so"))
OUT = Path(os.environ.get("OUT", "."))
PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def call(request: dict) -> dict:
    """Runs one plugin request in this process, printing progress events."""
    lib = ctypes.CDLL(str(PLUGIN))
    lib.gpuprobe_torch_call.restype = ctypes.c_void_p
    lib.gpuprobe_torch_call.argtypes = [ctypes.c_char_p, PROGRESS, ctypes.c_void_p]
    lib.gpuprobe_torch_free.argtypes = [ctypes.c_void_p]

    def on_event(event: bytes, _data) -> int:
        e = json.loads(event)
        print(f"    event {json.dumps(e)}", file=sys.stderr, flush=True)
        return 0

    callback = PROGRESS(on_event)
    raw = lib.gpuprobe_torch_call(json.dumps(request).encode(), callback, None)
    try:
        return json.loads(ctypes.string_at(raw).decode())
    finally:
        lib.gpuprobe_torch_free(raw)


def fresh(request: dict) -> dict:
    """The same request in a new process (its own CUDA context, nothing left from before)."""
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(request)],
                         capture_output=True, text=True, env={**os.environ, "RUST_BACKTRACE": "0"})
    sys.stderr.write(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def setup(model: dict, **kw) -> dict:
    base = {"model": model, "input": None, "vocab": None, "dtype": None, "amp": None,
            "optimizer": "adam", "inference": False, "device": 0, "limit": None,
            "max_batch": 65536, "max_trials": 40, "tolerance": 0.0, "baseline_search": False}
    base.update(kw)
    return base


OURS_ONLY = False
EXPORT_MODULE = ROOT / "crates/gpukernel/src/magics/export_module.py"


def tiny_lm():
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self, vocab: int = 32000, d: int = 512, layers: int = 6):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            layer = torch.nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers)
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(tokens)))

    return TinyLM()


def export_transformer() -> str:
    """A model living in a Python session, exported the way `%maxbatch model` exports it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_module", EXPORT_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.export({"model": tiny_lm()}, "model", [256], 32000)
    print(f"    exported by torch.jit.{result['method']} to {result['path']}", file=sys.stderr)
    return result["path"]


def lightning_finder(arch: str, precision: str) -> dict:
    """Lightning's BatchSizeFinder (binsearch, 2 steps per trial, as ours) on the same
    architecture, in this (fresh) process."""
    import torch
    try:
        import lightning as L
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        return {"skipped": "lightning is not installed"}
    if arch == "resnet50":
        try:
            import torchvision
        except ImportError:
            return {"skipped": "torchvision is not installed"}
        make, sample = torchvision.models.resnet50, lambda n, dev: torch.randn(n, 3, 224, 224, device=dev)
    else:
        make, sample = tiny_lm, lambda n, dev: torch.randint(0, 32000, (n, 256), device=dev)
    sizes: list[int] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make()
            self.batch_size = 2

        def train_dataloader(self):
            # Indices only: the batch itself is made on the GPU, as in our harness.
            return torch.utils.data.DataLoader(range(1 << 24), batch_size=self.batch_size)

        def training_step(self, idx, _):
            sizes.append(len(idx))
            return self.model(sample(len(idx), self.device)).float().mean()

        def configure_optimizers(self):
            return (torch.optim.AdamW if arch != "resnet50" else torch.optim.Adam)(self.parameters(), 1e-3)

    trainer = L.Trainer(accelerator="gpu", devices=1, precision=precision, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    t0 = time.perf_counter()
    found = Tuner(trainer).scale_batch_size(Module(), mode="binsearch", init_val=2,
                                            steps_per_trial=2, max_trials=40)
    elapsed = time.perf_counter() - t0
    trials = sum(1 for i, b in enumerate(sizes) if i == 0 or b != sizes[i - 1])
    return {"found": found, "seconds": elapsed, "trials": trials, "version": L.__version__}


def evaluate(name: str, config: dict, lightning: tuple[str, str] | None,
             margin: float = 0.05) -> dict:
    print(f"\n== {name}", file=sys.stderr, flush=True)
    row: dict = {"name": name}
    t0 = time.perf_counter()
    # As %maxbatch runs it by default: within 1% of the true maximum.
    ours = fresh({"op": "max_batch", **config, "tolerance": 0.01})
    row["ours_wall_s"] = time.perf_counter() - t0
    if "error" in ours or OURS_ONLY:
        row.update(ours=ours)
        row["error"] = ours.get("error")
        return row
    report = ours["ok"]
    search = report["search"]
    row.update(ours_trials=len(search["trials"]), ours_max=search["max_fit"],
               settled=search.get("settled"), ours_elapsed_s=report["elapsed_ms"] / 1000,
               limit=report["limit"], after_allocated=report["after_allocated"],
               after_reserved=report["after_reserved"], fit=search["fit"],
               ours_trial_list=[(t["batch"], t["outcome"].get("peak"), t["fits"]) for t in search["trials"]],
               ours_trial_reserved=report.get("trial_reserved"), ours_trial_ms=report["trial_ms"])
    print("  -- double-then-bisect, exact", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    base = fresh({"op": "max_batch", **config, "baseline_search": True})
    row["baseline_wall_s"] = time.perf_counter() - t0
    true_max = None
    if "ok" in base:
        bs = base["ok"]["search"]
        true_max = bs["max_fit"]
        row.update(baseline_trials=len(bs["trials"]), baseline_max=true_max,
                   baseline_exact=bs["exact"],
                   baseline_trial_list=[(t["batch"], t["fits"]) for t in bs["trials"]],
                   baseline_elapsed_s=base["ok"]["elapsed_ms"] / 1000)
    if true_max:
        # A search trial is two steps from a fresh model: check the boundary the same way.
        at_max = fresh({"op": "steps", "setup": config, "batch": true_max, "steps": 2})
        above = fresh({"op": "steps", "setup": config, "batch": true_max + 1, "steps": 2})
        row["true_max_fits_fresh"] = at_max.get("ok", {}).get("out_of_memory") is False
        row["true_max_plus_one_ooms_fresh"] = above.get("ok", {}).get("out_of_memory") is True
        row["ours_within_1pct"] = abs(true_max - (search["max_fit"] or 0)) <= 0.01 * true_max
        row["ours_vs_true_percent"] = 100.0 * ((search["max_fit"] or 0) - true_max) / true_max
    mx = search["max_fit"]
    if mx:
        rec = mx - int(mx * margin)
        rec = rec - rec % 8 if rec >= 16 else max(rec, 1)
        run = fresh({"op": "steps", "setup": config, "batch": rec, "steps": 30})
        row["recommended"] = rec
        row["steps_at_recommended"] = run.get("ok", run)
    if lightning:
        print("  -- Lightning BatchSizeFinder", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--lightning", *lightning],
                             capture_output=True, text=True, timeout=600)
        sys.stderr.write(out.stderr[-2000:])
        lines = out.stdout.strip().splitlines()
        row["lightning"] = json.loads(lines[-1]) if lines else {"error": out.stderr[-500:]}
    return row


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(call(json.loads(sys.argv[2]))))
        return 0
    if sys.argv[1:2] == ["--lightning"]:
        print(json.dumps(lightning_finder(sys.argv[2], sys.argv[3])))
        return 0
    quick = "--quick" in sys.argv
    global OURS_ONLY
    OURS_ONLY = "--ours-only" in sys.argv
    import torch
    lib = str(Path(torch.__file__).parent / "lib")
    if lib not in os.environ.get("LD_LIBRARY_PATH", ""):
        os.environ["LD_LIBRARY_PATH"] = lib + ":" + os.environ.get("LD_LIBRARY_PATH", "")
        os.execv(sys.executable, [sys.executable, *sys.argv])
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    resnet = {"kind": "builtin", "name": "resnet50"}
    results["runs"].append(evaluate("resnet50 fp32 + Adam", setup(resnet),
                                    ("resnet50", "32-true")))
    if not quick:
        results["runs"].append(evaluate("resnet50 bf16 autocast + Adam", setup(resnet, amp="bf16"),
                                        ("resnet50", "bf16-mixed")))
        path = export_transformer()
        try:
            results["runs"].append(evaluate(
                "transformer exported from Python, seq 256, AdamW",
                setup({"kind": "torch_script", "path": path}, input=[256], vocab=32000,
                      optimizer="adamw"),
                ("tiny_lm", "32-true")))
        finally:
            os.unlink(path)
    (OUT / "maxbatch_check.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'run':<48} {'ours':>15} {'double+bisect':>16} {'Lightning':>16} "
          f"{'ours max':>8} {'true max':>8} {'fits':>5} {'+1 OOM':>6} {'30 steps':>9}")
    for r in results["runs"]:
        if "error" in r:
            print(f"{r['name']:<48} ERROR {r['error']}")
            continue
        steps = r.get("steps_at_recommended", {})
        lt = r.get("lightning", {})
        lcol = (f"{lt['trials']:>3} tr {lt['seconds']:>6.1f} s" if "trials" in lt
                else str(lt.get("skipped", lt.get("error", "-")))[:16])
        print(f"{r['name']:<48} {r['ours_trials']:>3} tr {r['ours_elapsed_s']:>6.1f} s "
              f"{r.get('baseline_trials', '-'):>4} tr {r.get('baseline_elapsed_s', 0):>6.1f} s "
              f"{lcol:>16} {r['ours_max']:>8} {str(r.get('baseline_max')):>8} "
              f"{str(r.get('true_max_fits_fresh')):>5} {str(r.get('true_max_plus_one_ooms_fresh')):>6} "
              f"{str(steps.get('steps_run')) + ('/30 OOM' if steps.get('out_of_memory') else '/30'):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
