"""%maxbatch on a CUDA machine, each run in a fresh process, through libgpuprobe_torch.so.

For ResNet-50 fp32+Adam, ResNet-50 bf16+Adam and a small transformer exported from Python as
TorchScript: our search (trials, wall time, maximum); the true maximum checked directly in fresh
processes (max fits, max+1 does not); 30 training steps at the recommendation; memory back to
baseline. Side by side in the same run: double-then-bisect (Lightning's algorithm) in the same
harness. Writes $OUT/maxbatch_check.json and prints a table.

Usage (repo root, on the GPU machine): python3 bench/gpu/maxbatch_check.py [--quick]
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
        print(f"    trial batch {e['batch']:>6}: {e['outcome']} fits={e['fits']} {e['ms']:.0f} ms",
              file=sys.stderr, flush=True)
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
    base = {"model": model, "input": None, "vocab": None, "dtype": None, "optimizer": "adam",
            "inference": False, "device": 0, "limit": None, "max_batch": 65536,
            "max_trials": 40, "baseline_search": False}
    base.update(kw)
    return base


def export_transformer(path: Path) -> None:
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

    torch.jit.script(TinyLM()).save(str(path))


def evaluate(name: str, config: dict, margin: float = 0.05) -> dict:
    print(f"\n== {name}", file=sys.stderr, flush=True)
    row: dict = {"name": name}
    t0 = time.perf_counter()
    ours = fresh({"op": "max_batch", **config})
    row["ours_wall_s"] = time.perf_counter() - t0
    if "error" in ours:
        row["error"] = ours["error"]
        return row
    report = ours["ok"]
    search = report["search"]
    row.update(ours_trials=len(search["trials"]), ours_max=search["max_fit"], exact=search["exact"],
               ours_elapsed_s=report["elapsed_ms"] / 1000, limit=report["limit"],
               after_allocated=report["after_allocated"], fit=search["fit"],
               ours_trial_list=[(t["batch"], t["outcome"].get("peak"), t["fits"]) for t in search["trials"]])
    t0 = time.perf_counter()
    base = fresh({"op": "max_batch", **config, "baseline_search": True})
    row["baseline_wall_s"] = time.perf_counter() - t0
    if "ok" in base:
        bs = base["ok"]["search"]
        row.update(baseline_trials=len(bs["trials"]), baseline_max=bs["max_fit"],
                   baseline_trial_list=[(t["batch"], t["fits"]) for t in bs["trials"]],
                   baseline_elapsed_s=base["ok"]["elapsed_ms"] / 1000)
    mx = search["max_fit"]
    if mx:
        at_max = fresh({"op": "steps", "setup": config, "batch": mx, "steps": 1})
        above = fresh({"op": "steps", "setup": config, "batch": mx + 1, "steps": 1})
        row["true_max_fits"] = at_max.get("ok", {}).get("out_of_memory") is False
        row["true_max_plus_one_ooms"] = above.get("ok", {}).get("out_of_memory") is True
        rec = mx - int(mx * margin)
        rec = rec - rec % 8 if rec >= 16 else max(rec, 1)
        run = fresh({"op": "steps", "setup": config, "batch": rec, "steps": 30})
        row["recommended"] = rec
        row["steps_at_recommended"] = run.get("ok", run)
    return row


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(call(json.loads(sys.argv[2]))))
        return 0
    quick = "--quick" in sys.argv
    import torch
    lib = str(Path(torch.__file__).parent / "lib")
    if lib not in os.environ.get("LD_LIBRARY_PATH", ""):
        os.environ["LD_LIBRARY_PATH"] = lib + ":" + os.environ.get("LD_LIBRARY_PATH", "")
        os.execv(sys.executable, [sys.executable, *sys.argv])
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    results["runs"].append(evaluate("resnet50 fp32 + Adam", setup({"kind": "builtin", "name": "resnet50"})))
    if not quick:
        results["runs"].append(evaluate("resnet50 bf16 + Adam", setup({"kind": "builtin", "name": "resnet50"}, dtype="bf16")))
        path = Path("/tmp/tiny_lm.pt")
        export_transformer(path)
        results["runs"].append(evaluate("transformer (TorchScript from Python), seq 256, AdamW",
                                        setup({"kind": "torch_script", "path": str(path)},
                                              input=[256], vocab=32000, optimizer="adamw")))
    (OUT / "maxbatch_check.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'run':<52} {'ours':>16} {'double+bisect':>18} {'max':>6} {'max ok':>7} {'+1 OOM':>7} {'30 steps':>9}")
    for r in results["runs"]:
        if "error" in r:
            print(f"{r['name']:<52} ERROR {r['error']}")
            continue
        steps = r.get("steps_at_recommended", {})
        print(f"{r['name']:<52} {r['ours_trials']:>3} tr {r['ours_elapsed_s']:>6.1f} s "
              f"{r.get('baseline_trials', '-'):>5} tr {r.get('baseline_elapsed_s', 0):>7.1f} s "
              f"{r['ours_max']:>6} {str(r.get('true_max_fits')):>7} {str(r.get('true_max_plus_one_ooms')):>7} "
              f"{str(steps.get('steps_run')) + ('/30 OOM' if steps.get('out_of_memory') else '/30'):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
