"""Does the OOM diagnosis tell the truth, and does its advice work? Run on the GPU machine.

A real gpu-python kernel (gpukernel in front of ipykernel, real jupyter_client) runs a notebook
that hits real CUDA out-of-memory errors. Per case: the cell fails, the diagnosis display comes
under the traceback (latency measured from the error's header to the display's), then a second
cell reads torch.cuda.memory_stats / memory_snapshot (computed here, independently of the
probe) and nvidia-smi is queried, and the diagnosis's figures are compared with both. Then the
suggestions are followed in order: preparatory ones (`clear_traceback`: `%oom --release`) are
done and recorded, then the first fix is applied and the failing cell (or its fixed form) is run
again; the case passes when it runs.

Cases:
- `too_big`: a transformer-style MLP trained with AdamW at the first power-of-two batch that
  does not fit (found by doubling; half of it ran). Also a control: the same OOM again, then the
  halved batch with accumulation *without* `%oom --release`, to measure what releasing buys.
- `fragmented`: the card filled with cached segments carved into pieces, every other one kept
  (free memory in holes smaller than the request); the fix `expandable_segments` needs a kernel
  restart with PYTORCH_CUDA_ALLOC_CONF set, done here, then the same fill and request.
- `stale_holder`: another process of this user, whose command line looks like a kernel whose
  connection file is gone, holds most of the card; the notebook's allocation fails; the fix is
  to stop it (the script kills the pid the diagnosis names, only if it is the one it started).

Writes $OUT/oom_check.json after each case. Usage (repo root, GPU machine; .device/gpukernel
and .device/libgpuprobe_torch.so as for maxbatch_truth.py): python3 bench/gpu/oom_check.py
[CASE ...]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", "."))
MIB = 1 << 20
GIB = 1 << 30
TOLERANCE = 64 * MIB  # NVML vs nvidia-smi (MiB rounding, a moment apart)

NOTEBOOK = r"""
import gc, json, time
import torch, torch.nn as nn, torch.nn.functional as F
dev = torch.device("cuda")
D, SEQ = 1024, 256

class Net(nn.Module):
    def __init__(s, d=D, layers=8):
        super().__init__()
        s.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                 nn.Linear(4 * d, d)) for _ in range(layers)])
        s.head = nn.Linear(d, 10)
    def forward(s, x):
        return s.head(s.blocks(x).mean(1))

model = Net().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

def train_step(batch_size):
    x = torch.randn(batch_size, SEQ, D, device=dev)
    y = torch.randint(0, 10, (batch_size,), device=dev)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())

def train_accum(batch_size, steps):
    opt.zero_grad(set_to_none=True)
    for _ in range(steps):
        x = torch.randn(batch_size, SEQ, D, device=dev)
        y = torch.randint(0, 10, (batch_size,), device=dev)
        (F.cross_entropy(model(x), y) / steps).backward()
    opt.step()
    return True
"""

# Bench-side helpers (run in the notebook, but not the cells under test).
HELPERS = r"""
def _bench_fits(b):
    try:
        train_step(b)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect(); torch.cuda.empty_cache()

def _bench_first_failing(start=64):
    b = start
    while _bench_fits(b):
        b *= 2
        if b > 1 << 16:
            return None
    return b

def _bench_truth(i=0):
    s = torch.cuda.memory_stats(i)
    largest = releasable = 0
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] != i:
            continue
        if seg["allocated_size"] == 0 and seg.get("active_size", 0) == 0:
            releasable += seg["total_size"]
        for blk in seg["blocks"]:
            if blk["state"] == "inactive":
                largest = max(largest, blk["size"])
    free, total = torch.cuda.mem_get_info(i)
    return {"allocated": s["allocated_bytes.all.current"], "reserved": s["reserved_bytes.all.current"],
            "num_ooms": s["num_ooms"], "largest_free_block": largest, "releasable": releasable,
            "mem_get_info_free": free, "total": total}
"""

FRAGMENT = r"""
def _bench_fragment(piece=512 << 20, per_segment=16):
    big = []
    while True:           # cache whole segments of per_segment pieces until none fits
        try:
            big.append(torch.empty(piece * per_segment, dtype=torch.uint8, device=dev))
        except torch.OutOfMemoryError:
            break
    n = len(big)
    del big               # cached, free
    pieces = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(n * per_segment)]
    kept = pieces[::2]    # holes of one piece between kept pieces
    del pieces
    # Use what the driver has left but under 1 GiB, in chunks too big for the holes (so they
    # come from the driver), a fixed amount: the same workload with or without
    # expandable_segments (a fill-until-OOM would, with them, eat the holes' pages too).
    chunk = 520 << 20
    free = torch.cuda.mem_get_info()[0]
    rest = [torch.empty(chunk, dtype=torch.uint8, device=dev)
            for _ in range(max(0, (free - (256 << 20)) // chunk))]
    return kept, rest
_held, _rest = _bench_fragment()
"""


def smi() -> dict:
    gpus = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,memory.total,memory.used,memory.free",
         "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
         "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    parse = lambda text: [[c.strip() for c in line.split(",")]  # noqa: E731
                          for line in text.strip().splitlines() if line.strip()]
    return {"gpus": [{"index": int(g[0]), "uuid": g[1], "total": int(g[2]) * MIB,
                      "used": int(g[3]) * MIB, "free": int(g[4]) * MIB} for g in parse(gpus)],
            "apps": [{"pid": int(a[0]), "uuid": a[1], "used": int(a[2]) * MIB}
                     for a in parse(apps) if a[0].isdigit()]}


def when(msg: dict) -> datetime:
    d = msg["header"]["date"]
    return d if isinstance(d, datetime) else datetime.fromisoformat(d)


def run(kc, code, timeout=600):
    from kernel_client import execute  # on sys.path once device_kernels.install() ran

    return execute(kc, code, timeout=timeout)

def value(kc, expr):
    reply, outputs = run(kc, f"print(json.dumps({expr}))")
    if reply["content"]["status"] != "ok":
        raise RuntimeError(reply["content"])
    text = "".join(o["content"].get("text", "") for o in outputs if o["msg_type"] == "stream")
    return json.loads(text.strip().splitlines()[-1])

def failing_cell(kc, code):
    """Runs the cell expected to OOM; returns its reply, the diagnosis and the latency."""
    reply, outputs = run(kc, code)
    kinds = [m["msg_type"] for m in outputs]
    shown = [m for m in outputs if m["msg_type"] == "display_data"
             and "gpukernel-oom" in m["content"]["data"].get("text/html", "")]
    rec = {"status": reply["content"]["status"], "ename": reply["content"].get("ename"),
           "outputs": kinds, "diagnosed": bool(shown)}
    if shown and "error" in kinds:
        err = outputs[kinds.index("error")]
        rec["latency_s"] = (when(shown[0]) - when(err)).total_seconds()
        rec["right_after_traceback"] = kinds.index("display_data") == kinds.index("error") + 1
    return rec, (shown[0]["content"]["data"]["application/json"] if shown else None)

def compare(kc, d) -> dict:
    """The diagnosis's figures against memory_stats (read now, by the bench's own code)
    and nvidia-smi."""
    dev = d["device"]
    truth = value(kc, f"_bench_truth({dev.get('cuda_index') or 0})")
    s = smi()
    gpu = next((g for g in s["gpus"] if g["index"] == dev.get("nvml_index")), None)
    c = {"truth": truth, "nvidia_smi": s, "diagnosis_device": dev}
    for key, ours in [("allocated", "allocated_bytes"), ("reserved", "reserved_bytes"),
                      ("num_ooms", "num_ooms"), ("largest_free_block",
                                                 "largest_free_block_bytes"),
                      ("releasable", "releasable_bytes")]:
        c[f"{key}_matches"] = dev.get(ours) == truth[key]
    if gpu is not None and dev.get("nvml_free_bytes") is not None:
        c["nvml_free_vs_smi"] = dev["nvml_free_bytes"] - gpu["free"]
        c["nvml_free_matches"] = abs(c["nvml_free_vs_smi"]) <= TOLERANCE
    ours = {p["pid"]: p.get("used_memory") for p in d["processes"]}
    theirs = {a["pid"]: a["used"] for a in s["apps"] if gpu and a["uuid"] == gpu["uuid"]}
    c["processes_match"] = set(ours) == set(theirs) and all(
        ours[p] is not None and abs(ours[p] - theirs[p]) <= TOLERANCE for p in theirs)
    c["requested_bytes"] = d["requested_bytes"]
    c["allocator_confirms"] = d["allocator_confirms"]
    return c

def follow(kc, d, fix) -> dict:
    """Follows the suggestions in order: preparatory ones, then the first fix (`fix` does
    it for the kinds this case can act on)."""
    done = []
    for s in d["suggestions"]:
        if s["kind"] == "clear_traceback":
            reply, outputs = run(kc, "%oom --release --json")
            res = [o for o in outputs if o["msg_type"] == "execute_result"]
            done.append({"kind": s["kind"], "status": reply["content"]["status"],
                         "released": res[0]["content"]["data"]["application/json"]
                         if res else None})
            continue
        outcome = fix(s)
        done.append({"kind": s["kind"], "action": s, **outcome})
        break
    first_fix = done[-1] if done else {}
    return {"followed": done, "first_fix": first_fix.get("kind"),
            "cell_ran": bool(first_fix.get("ran"))}


def too_big(running_kernel) -> dict:
    """A batch too big for the card: the diagnosis, its advice followed, and a control."""
    case = {}
    with running_kernel("gpu-python") as (km, kc):
        reply, _ = run(kc, NOTEBOOK + HELPERS, timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
        b = value(kc, "_bench_first_failing()")
        case["batch"] = b
        rec, d = failing_cell(kc, f"batch_size = {b}\ntrain_step(batch_size)")
        case["cell"] = rec
        if d:
            case["diagnosis"] = d
            case["compare"] = compare(kc, d)

            def fix(s):
                if s["kind"] == "gradient_accumulation":
                    code = f"train_accum({s['batch']}, {s['steps']})"
                elif s["kind"] == "use_batch":
                    code = f"train_accum({s['batch']}, {s['accumulation_steps']})"
                elif s["kind"] == "empty_cache":
                    run(kc, "%emptycache")
                    code = f"train_step({b})"
                else:
                    return {"ran": False, "note": "not automated here"}
                reply, _ = run(kc, code)
                return {"code": code, "ran": reply["content"]["status"] == "ok",
                        "error": reply["content"].get("evalue")}
            case.update(follow(kc, d, fix))
            # Control: the same OOM, then the halved batch without releasing first.
            rec2, d2 = failing_cell(kc, f"train_step({b})")
            reply, _ = run(kc, f"train_accum({(b + 1) // 2}, 2)")
            case["control_without_release"] = {
                "oom_again": rec2["status"] == "error", "halved_ran": reply["content"]["status"] == "ok",
                "error": reply["content"].get("evalue"),
                "held_by_traceback": next((s.get("bytes") for s in (d2 or {}).get("suggestions", [])
                                           if s["kind"] == "clear_traceback"), None)}
    return case


def fragmented(running_kernel) -> dict:
    """Free memory in holes smaller than the request; the fix restarts the kernel with
    expandable segments."""
    case = {}
    d = None
    request = "_x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)"
    with running_kernel("gpu-python") as (km, kc):
        reply, _ = run(kc, NOTEBOOK + HELPERS + FRAGMENT, timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
        rec, d = failing_cell(kc, request)
        case["cell"] = rec
        if d:
            case["diagnosis"] = d
            case["compare"] = compare(kc, d)
    if d:
        def fix(s):
            if s["kind"] != "expandable_segments":
                return {"ran": False, "note": "not automated here"}
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
            with running_kernel("gpu-python", env=env) as (km2, kc2):
                reply, _ = run(kc2, NOTEBOOK + HELPERS + FRAGMENT, timeout=300)
                setup_ok = reply["content"]["status"] == "ok"
                reply, _ = run(kc2, request)
                return {"restarted_with": env["PYTORCH_CUDA_ALLOC_CONF"], "setup_ok": setup_ok,
                        "ran": reply["content"]["status"] == "ok",
                        "error": reply["content"].get("evalue")}
        # Preparatory %oom --release needs the first kernel; it is gone: a restart drops
        # the traceback anyway, so only the first fix is followed here.
        for s in d["suggestions"]:
            if s["kind"] != "clear_traceback":
                case.update({"first_fix": s["kind"], **fix(s)})
                case["cell_ran"] = case.get("ran", False)
                break
    return case


def stale_holder(running_kernel) -> dict:
    """Another process of this user holds most of the card; the fix stops it."""
    case = {}
    gone = Path(tempfile.gettempdir()) / f"kernel-gone-{os.getpid()}.json"
    holder_code = ("import torch, time, sys\n"
                   "free, total = torch.cuda.mem_get_info()\n"
                   "x = torch.empty(int(free * 0.9), dtype=torch.uint8, device='cuda')\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(900)\n")
    holder = subprocess.Popen([sys.executable, "-c", holder_code, "ipykernel_launcher", "-f",
                               str(gone)], stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError("the holder process could not take the card")
        with running_kernel("gpu-python") as (km, kc):
            reply, _ = run(kc, NOTEBOOK + HELPERS, timeout=300)
            assert reply["content"]["status"] == "ok", reply["content"]
            # More than is free now, less than is free once the holder is gone.
            size = value(kc, "int(torch.cuda.mem_get_info()[0]) + (2 << 30)")
            cell = f"_y = torch.empty({size}, dtype=torch.uint8, device=dev)"
            rec, d = failing_cell(kc, cell)
            case["cell"] = rec
            case["holder_pid"] = holder.pid
            if d:
                case["diagnosis"] = d
                case["compare"] = compare(kc, d)
                case["holder_marked"] = next((p for p in d["processes"]
                                              if p["pid"] == holder.pid), None)

                def fix(s):
                    if s["kind"] != "stop_process" or s["pid"] != holder.pid:
                        return {"ran": False, "note": "not the process this script started"}
                    holder.send_signal(signal.SIGTERM)
                    holder.wait(timeout=30)
                    time.sleep(1)
                    reply, _ = run(kc, cell)
                    return {"ran": reply["content"]["status"] == "ok",
                            "error": reply["content"].get("evalue")}
                case.update(follow(kc, d, fix))
    except Exception as e:  # record, and go on to the summary
        case["error"] = f"{type(e).__name__}: {e}"
    finally:
        if holder.poll() is None:
            holder.kill()
    return case


def summarize(cases: dict) -> dict:
    """Per case: diagnosed, how fast, which figures matched, the first fix and whether the
    cell then ran."""
    return {name: {"diagnosed": c.get("cell", {}).get("diagnosed"),
                  "latency_s": c.get("cell", {}).get("latency_s"),
                  "figures_match": {k: v for k, v in c.get("compare", {}).items()
                                    if k.endswith("_matches") or k == "processes_match"},
                  "first_fix": c.get("first_fix"), "cell_ran": c.get("cell_ran")}
           for name, c in cases.items()}


CASES = {"too_big": too_big, "fragmented": fragmented, "stale_holder": stale_holder}


def main() -> int:
    torch_version = device_kernels.install()
    from kernel_client import running_kernel

    wanted = sys.argv[1:] or list(CASES)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch_version,
               "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True,
                                     text=True).stdout.strip(),
               "command": "python3 bench/gpu/oom_check.py " + " ".join(sys.argv[1:]),
               "cases": {}}
    out_file = OUT / "oom_check.json"

    def save():
        out_file.write_text(json.dumps(results, indent=1, default=str))

    for name, case in CASES.items():
        if name in wanted:
            results["cases"][name] = case(running_kernel)
            save()
    results["summary"] = summarize(results["cases"])
    save()
    print(json.dumps(results["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
