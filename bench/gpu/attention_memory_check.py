"""Why a transformer exported as TorchScript needs more memory per sample than the same model
in eager PyTorch: peak allocated bytes of two training steps (AdamW) of bench's TinyLM at two
batch sizes, eager vs torch.jit.script vs torch.jit.trace, in one process on one GPU.

Usage (repo root, on the GPU machine): python3 bench/gpu/attention_memory_check.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from maxbatch_check import tiny_lm  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def per_sample(module, params, batches=(16, 64)) -> dict:
    opt = torch.optim.AdamW(params)
    peaks = {}
    for b in batches:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(2):
            x = torch.randint(0, 32000, (b, 256), device="cuda")
            module(x).float().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        peaks[b] = torch.cuda.max_memory_allocated() - base
    lo, hi = batches
    return {"peak_bytes": peaks, "bytes_per_sample": (peaks[hi] - peaks[lo]) / (hi - lo)}


def main() -> int:
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    model = tiny_lm().cuda().train()
    results["eager"] = per_sample(model, model.parameters())
    scripted = torch.jit.script(model)
    results["script"] = per_sample(scripted, scripted.parameters())
    traced = torch.jit.trace(model, torch.randint(0, 32000, (2, 256), device="cuda"),
                             check_trace=False)
    results["trace"] = per_sample(traced, traced.parameters())
    (OUT / "attention_memory_check.json").write_text(json.dumps(results, indent=2))
    for k in ("eager", "script", "trace"):
        print(f"{k:<7} {results[k]['bytes_per_sample'] / 2**20:8.1f} MiB per sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())
