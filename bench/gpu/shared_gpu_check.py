"""%maxbatch on a GPU another process shares, on the GPU machine.

On a shared server another user's training can hold most of the card. The python engine sizes
against what it leaves (free memory plus what the kernel's allocator holds), which is right
for that moment; the report must say that the limit came from memory in use outside the
kernel and name who holds it, and say nothing of it once the card is the kernel's again. In a
real gpu-python kernel (real jupyter_client) running maxbatch_truth.py's notebook:

1. a separate process takes all but LEAVE_GIB (default 20) of the GPU's free memory and sleeps;
2. `%maxbatch --step gpt_step`: its limit is what that process left, and a note names the
   process (pid, command, bytes);
3. `%maxbatch resnet18` (a built-in: the libtorch engine, in gpukernel's own process): the
   same note about gpukernel's allocator, naming that process (and the notebook's kernel);
4. that process is killed; `%maxbatch --step gpt_step` again: the limit is the notebook's cap,
   no such note, and a larger maximum.

    OUT=/tmp/x CAP_GIB=76 python3 bench/gpu/shared_gpu_check.py

Writes $OUT/shared_gpu_check.json; exits non-zero where a report says otherwise than above.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels  # noqa: E402
import maxbatch_truth as truth  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
LEAVE_GIB = float(os.environ.get("LEAVE_GIB", "20"))

HOLDER = """
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
x = torch.empty(free - int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
print("held", x.numel(), flush=True)
time.sleep(900)
"""


def search(nb, args="--step gpt_step"):
    outputs, err = nb.run(f"%maxbatch {args} --json")
    if err is not None:
        return {"error": f"{err['ename']}: {err['evalue']}"}
    data = [o for o in outputs if o["msg_type"] == "execute_result"][-1]["content"]["data"]
    value = data["application/json"]
    notes = value.get("notes") or []
    outside = [n for n in notes if "was in use outside" in n]
    return {"max_batch": value.get("max_batch"), "recommended": value.get("recommended"),
            "limit_bytes": value.get("limit_bytes"), "outside_note": outside[0] if outside else None,
            "text": data["text/plain"]}


def main() -> int:
    device_kernels.install()
    from kernel_client import execute, running_kernel

    found = {"cap_gib": truth.CAP_GIB, "leave_gib": LEAVE_GIB}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(LEAVE_GIB)],
                              stdout=subprocess.PIPE, text=True)
    try:
        said = holder.stdout.readline().split()
        assert said[:1] == ["held"], "the holding process did not start"
        found["holder_pid"], found["holder_bytes"] = holder.pid, int(said[1])
        with running_kernel("gpu-python") as (_, kc):
            nb = truth.Notebook(kc, execute)
            nb.start()
            nb.ok("make('gptstep', GPT, tokens(32000, 512))")
            found["gpu"] = nb.value("torch.cuda.get_device_name()")
            found["shared"] = shared = search(nb)
            print(json.dumps(shared, indent=1), flush=True)
            found["libtorch"] = libtorch = search(nb, "resnet18 --input 3x224x224")
            print(json.dumps(libtorch, indent=1), flush=True)
            holder.kill()
            holder.wait(timeout=60)
            found["alone"] = alone = search(nb)
            print(json.dumps(alone, indent=1), flush=True)
    finally:
        if holder.poll() is None:
            holder.kill()
    note = shared.get("outside_note") or ""
    found["checks"] = checks = {
        "shared_note_names_the_holder": f"pid {found['holder_pid']}" in note,
        "libtorch_note_names_the_holder": f"pid {found['holder_pid']}"
        in (libtorch.get("outside_note") or ""),
        "libtorch_limit_is_what_was_left": (libtorch.get("limit_bytes") or 1 << 62)
        < (LEAVE_GIB + 1) * 2**30,
        "shared_limit_is_what_was_left": (shared.get("limit_bytes") or 1 << 62)
        < (LEAVE_GIB + 1) * 2**30,
        "alone_no_note": alone.get("outside_note") is None and "error" not in alone,
        "alone_larger": (alone.get("max_batch") or 0) > (shared.get("max_batch") or 0),
    }
    print(checks, flush=True)
    (OUT / "shared_gpu_check.json").write_text(json.dumps(found, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
