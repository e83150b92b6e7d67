"""Why %maxbatch refuses token sequences longer than a model's position table, on the GPU.

A position past a learned table (GPT-2's `wpe`, BERT's `position_embeddings`) is an index out
of range. On the CPU that is an IndexError; on a GPU it is a device-side assert, after which
every CUDA call of the process fails: in a notebook, the user's session is lost. This runs,
on the GPU machine, in a plain process (no kernel, no search):

1. in a child process, the model's own forward at a length past its table: does CUDA still
   work in that process afterwards? (the danger, shown for real);
2. trials.py's prepare at that length, as `%maxbatch m --input LEN` calls it: refused before
   any forward, and CUDA still works here afterwards;
3. prepare and one trial at the table's own length: it runs.

    python3 bench/gpu/position_guard_check.py

Writes $OUT/position_guard_check.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trials_in_process import call, load_trials  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TABLE = 64


class GPT2ish(torch.nn.Module):
    def __init__(self, vocab=100, table=TABLE, d=32):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(table, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))


def unguarded_child():
    """The forward itself past the table, then any CUDA work: what a notebook is left with."""
    model = GPT2ish().to(DEVICE)
    found = {}
    try:
        model(torch.randint(0, 100, (2, TABLE + 1), device=DEVICE))
        torch.cuda.synchronize() if DEVICE == "cuda" else None
        found["forward"] = "ran"
    except Exception as err:  # noqa: BLE001 (what it raised is the finding)
        found["forward"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    try:
        (torch.ones(4, device=DEVICE) * 2).sum().item()
        found["cuda_after"] = "works"
    except Exception as err:  # noqa: BLE001
        found["cuda_after"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    print(json.dumps(found))


def main():
    if sys.argv[1:] == ["--child"]:
        unguarded_child()
        return 0
    child = subprocess.run([sys.executable, __file__, "--child"], capture_output=True,
                           text=True, timeout=120)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__,
               "unguarded": json.loads(child.stdout.strip().splitlines()[-1])
               if child.stdout.strip() else {"stderr": child.stderr[-2000:]}}
    trials = load_trials()
    model = GPT2ish().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters())
    ns = {"m": model, "opt": opt}
    spec = {"kind": "module", "target": "m", "input": [TABLE + 1]}
    results["too_long"] = call(trials, ns, "prepare", spec=spec)
    results["cuda_after_refusal"] = float((torch.ones(4, device=DEVICE) * 2).sum().item())
    spec["input"] = [TABLE]
    prepared = call(trials, ns, "prepare", spec=spec)
    results["at_table_length"] = {"refused": prepared.get("refused"),
                                  "trial": call(trials, ns, "trial", batch=4, steps=2)
                                  .get("result")}
    call(trials, ns, "close")
    (OUT / "position_guard_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    ok = ("refused" in results["too_long"] and results["cuda_after_refusal"] == 8.0
          and results["at_table_length"] == {"refused": None, "trial": "ran"})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
