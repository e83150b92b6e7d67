"""%maxbatch on a step that does not grow with the batch, and on one capped by --max, on the GPU.

A new user's `--step FN` can ignore its argument: the batch comes from a DataLoader made once,
or at a size written into the step. Every trial then needs the same memory, the search doubles
up to `--max` (65536) and every batch fits. The report must not call that the largest batch
that fits, must recommend none, and must ask whether the step uses its argument. A step that does grow, capped by a
small `--max`, is told the cap without that question. Runs maxbatch_truth.py's notebook in a
real gpu-python kernel (real jupyter_client):

1. `%maxbatch --step flat_step`: the GPT of the truth rows, trained at 8 samples whatever
   batch the search asks for;
2. `%maxbatch --step gpt_step --max 64`: the same GPT's own step, whose maximum at 76 GiB is
   about 150, capped at 64;
3. `%maxbatch --step gpt_step`: the same step uncapped (its maximum found, no cap named).

    OUT=/tmp/x CAP_GIB=76 python3 bench/gpu/flat_step_check.py

Writes $OUT/flat_step_check.json (each cell's text and JSON) and exits non-zero where a report
says otherwise than above.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels  # noqa: E402
import maxbatch_truth as truth  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))

SETUP = """
make('gptstep', GPT, tokens(32000, 512))
def flat_step(batch_size):  # the user's mistake: the batch is made at 8, whatever is asked
    train("gptstep", 8, 1)
"""

CELLS = {
    "flat": ("--step flat_step", True, True),
    "capped": ("--step gpt_step --max 64", True, False),
    "found": ("--step gpt_step", False, False),
}


def report(nb, args):
    """The report's text and its JSON (`--json`: the result as the cell's value)."""
    outputs, err = nb.run(f"%maxbatch {args} --json")
    if err is not None:
        return {"error": f"{err['ename']}: {err['evalue']}"}
    data = [o for o in outputs if o["msg_type"] == "execute_result"][-1]["content"]["data"]
    return {"text": data["text/plain"], "json": data["application/json"]}


def main() -> int:
    device_kernels.install()
    from kernel_client import execute, running_kernel

    found, ok = {"cap_gib": truth.CAP_GIB}, True
    with running_kernel("gpu-python") as (_, kc):
        nb = truth.Notebook(kc, execute)
        nb.start()
        nb.ok(SETUP)
        found["gpu"] = nb.value("torch.cuda.get_device_name()")
        for name, (args, capped, flat) in CELLS.items():
            got = report(nb, args)
            text, value = got.get("text", ""), got.get("json", {})
            checks = {
                "capped": value.get("capped") is capped,
                "headline": ("every batch tried fits" in text) is capped
                and ("largest batch that fits" in text) is not capped,
                "flat_line": ("hardly grew" in text) is flat,
                # A step whose memory did not grow had no batch sized: none is recommended.
                "recommended": (value.get("recommended") is None) is flat,
            }
            got["checks"] = checks
            ok &= all(checks.values())
            found[name] = got
            print(f"In [ ]: %maxbatch {args}\n{text}\nchecks: {checks}\n", flush=True)
            (OUT / "flat_step_check.json").write_text(json.dumps(found, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
