"""A %maxbatch report as a user reads it, for the README. Run on the GPU machine.

A real gpu-python kernel (real jupyter_client) runs maxbatch_truth.py's notebook, defines each
ROW's model there and runs its `%maxbatch` cell as a user types it (no --json). Writes every
cell's text output to $OUT/maxbatch_example.txt: the report as the notebook shows it, with
the live display's last state replaced by the result.

    OUT=/tmp/x CAP_GIB=76 python3 bench/gpu/maxbatch_example.py [ROW ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels  # noqa: E402
import maxbatch_truth as truth  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def cell_text(outputs: list[dict]) -> str:
    """What the notebook shows for a cell: its printed text, then the last display (a live
    display is one output that its updates replace) and its value."""
    printed, shown = [], None
    for o in outputs:
        kind, content = o["msg_type"], o["content"]
        if kind == "stream":
            printed.append(content["text"])
        elif kind in ("display_data", "update_display_data", "execute_result"):
            shown = content.get("data", {}).get("text/plain", shown)
    return "".join(printed) + (shown or "")


def main() -> int:
    device_kernels.install()
    from kernel_client import execute, running_kernel

    rows = sys.argv[1:] or ["hf_llama_bf16"]
    report = []
    with running_kernel("gpu-python") as (_, kc):
        nb = truth.Notebook(kc, execute)
        nb.start()
        for row in rows:
            setup, args, _ = truth.ROWS[row]
            nb.ok(setup)
            outputs, err = nb.run(f"%maxbatch {args}")
            text = cell_text(outputs) if err is None else f"{err['ename']}: {err['evalue']}"
            report.append(f"In [ ]: %maxbatch {args}\n{text.rstrip()}\n")
            print(report[-1], flush=True)
            nb.run(f"drop({truth.STEP_KEYS.get(row, row)!r})")
    (OUT / "maxbatch_example.txt").write_text("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
