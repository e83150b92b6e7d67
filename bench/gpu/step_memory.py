"""Per-step memory of the truth bench's models, in a plain process (no kernel): how the peak
moves from the first step of a fresh optimizer to later steps, and whether a batch that fits
in one run fails in another (the allocator's nondeterminism). Run on the GPU machine:

    python3 bench/gpu/step_memory.py [MODEL:BATCH ...]

Writes $OUT/step_memory.json after each case.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import maxbatch_truth as mt  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
CASES = sys.argv[1:] or ["gpt_checkpointed:64", "gpt_checkpointed:72", "gpt_checkpointed:76",
                         "unet_fp32:499", "unet_fp32:507"]

PROBE = r"""
def per_step(name, batch, n, per_call):
    # n steps from a fresh optimizer; per_call: one train() call per step (the 30-step check)
    # or one call of n steps (the truth's probe). Records each step's peak and the retries.
    opts[name].state.clear()
    gc.collect(); torch.cuda.empty_cache()
    rows = []
    s0 = torch.cuda.memory_stats()
    try:
        if per_call:
            for i in range(n):
                torch.cuda.reset_peak_memory_stats()
                train(name, batch, 1)
                s = torch.cuda.memory_stats()
                rows.append({"step": i + 1, "peak_allocated": s["allocated_bytes.all.peak"],
                             "peak_reserved": s["reserved_bytes.all.peak"],
                             "alloc_retries": s["num_alloc_retries"] - s0["num_alloc_retries"]})
        else:
            torch.cuda.reset_peak_memory_stats()
            train(name, batch, n)
            s = torch.cuda.memory_stats()
            rows.append({"step": n, "peak_allocated": s["allocated_bytes.all.peak"],
                         "peak_reserved": s["reserved_bytes.all.peak"],
                         "alloc_retries": s["num_alloc_retries"] - s0["num_alloc_retries"]})
        failed = None
    except torch.OutOfMemoryError as e:
        failed = len(rows) + 1 if per_call else n
        rows.append({"oom": str(e).splitlines()[0][:200]})
    opts[name].zero_grad(set_to_none=True)
    opts[name].state.clear()
    gc.collect(); torch.cuda.empty_cache()
    return {"failed_at": failed, "rows": rows}
"""


def main() -> int:
    ns: dict = {}
    exec(mt.MODELS.replace("CAP", repr(mt.CAP_GIB)) + mt.LOOP + PROBE, ns)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cap_gib": mt.CAP_GIB, "cases": []}
    made = None
    for case in CASES:
        name, batch = case.split(":")
        batch = int(batch)
        if made != name:
            if made:
                ns["drop"](made)
            exec(mt.ROWS[name][0], ns)
            made = name
        for kind, n, per_call in (("loop", 6, True), ("probe3", 3, False), ("loop", 6, True),
                                  ("probe3", 3, False)):
            t0 = time.time()
            r = ns["per_step"](name, batch, n, per_call)
            r.update(model=name, batch=batch, kind=kind, seconds=round(time.time() - t0, 2))
            print(json.dumps(r), flush=True)
            results["cases"].append(r)
            (OUT / "step_memory.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
