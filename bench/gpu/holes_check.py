"""Where the notebook's own loop fails below a batch that fits: the fragmentation holes of
the fp16 GPT with a GradScaler at the whole card (maxbatch-truth-2026-12-07b: %maxbatch's
recommendation, 216, ran out of memory at the loop's second step, while 220 and 232 ran
three). Runs maxbatch_truth.py's models and loop in this process (no kernel), once with the
default allocator and once with expandable_segments, and records for each batch the steps of
30 that ran and each step's allocator marks. Writes $OUT/holes_check.json.

    OUT=/tmp/h CAP_GIB=76 [PROBES=216,232] python3 bench/gpu/holes_check.py [ROW] [BATCH ...]
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("OUT", "."))
CAP_GIB = float(os.environ.get("CAP_GIB", "76"))


def child(row, batches):
    import maxbatch_truth as mt

    ns = {}
    exec(mt.MODELS.replace("CAP", repr(CAP_GIB)) + mt.LOOP, ns)
    setup = mt.ROWS[row][0]
    exec(setup, ns)
    key = mt.STEP_KEYS.get(row, row)
    ns["fits"](key, 2)
    results = []
    for kind, batch in batches:
        t0 = time.time()
        ns["marks"] = []
        failure = None
        if kind == "loop":
            done, failure = loop(ns, key, batch)
        else:  # the truth's probe: three steps in one call of the loop
            done = 3 if ns["fits"](key, batch) else 0
        marks = [list(m) for m in (ns.get("marks") or [])]
        results.append({"kind": kind, "batch": batch, "steps_ok": done, "marks": marks,
                        "failure": failure, "seconds": round(time.time() - t0, 2)})
        print(json.dumps(results[-1])[:600], flush=True)
    return results


def loop(ns, key, batch, n=30):
    """maxbatch_truth's steps_ok (one train() call a step, nothing held between them), with
    the cache's layout where a step runs out of memory: what it asked for, and the segments
    and free bytes in split blocks it could not use."""
    import gc
    import torch

    ns["opts"][key].state.clear()
    ns["fresh_scaler"](key)
    gc.collect(); torch.cuda.empty_cache()
    done, failure, first = 0, None, None
    try:
        for _ in range(n):
            ns["train"](key, batch, 1)
            done += 1
            if done == 1:
                first = layout(torch)
    except torch.OutOfMemoryError as err:  # its frames hold the step's tensors: as it failed
        failure = {"step": done + 1, "message": str(err).splitlines()[0][:300],
                   **layout(torch), "after_first_step": first}
        del err
    ns["opts"][key].zero_grad(set_to_none=True)
    ns["opts"][key].state.clear()
    gc.collect(); torch.cuda.empty_cache()
    return done, failure


def layout(torch):
    stats = torch.cuda.memory_stats()
    segments = torch.cuda.memory_snapshot()
    sizes = sorted((s["total_size"] for s in segments), reverse=True)
    free_in_split = sorted((sum(b["size"] for b in s["blocks"] if b["state"] == "inactive")
                            for s in segments if len(s["blocks"]) > 1), reverse=True)
    return {"allocated": stats.get("allocated_bytes.all.current", 0),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0),
            "largest_segments": sizes[:6], "largest_free_in_split": free_in_split[:6],
            "segments": len(sizes)}


def main():
    if os.environ.get("HOLES_CHILD"):
        plan = json.loads(os.environ["HOLES_CHILD"])
        print("RESULT " + json.dumps(child(plan["row"], plan["batches"])), flush=True)
        return 0
    row = sys.argv[1] if len(sys.argv) > 1 else "gpt_fp16_scaler"
    sizes = [int(b) for b in sys.argv[2:]] or [216, 216, 200, 208, 212, 220, 224, 232]
    # PROBES: the batches the truth's three-step probe also runs (the fp16 GPT's by default).
    probes = [int(b) for b in os.environ.get("PROBES", "216,232").split(",") if b]
    batches = [("loop", b) for b in sizes] + [("probe", b) for b in probes]
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "row": row, "cap_gib": CAP_GIB,
              "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                     "--format=csv,noheader"], capture_output=True,
                                    text=True).stdout.strip(), "runs": []}
    for conf in ("", "expandable_segments:True"):
        env = dict(os.environ, HOLES_CHILD=json.dumps({"row": row, "batches": batches}))
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        print(f"== allocator {conf or 'default'}", flush=True)
        proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                              text=True, timeout=170)
        sys.stdout.write(proc.stdout[-4000:])
        sys.stderr.write(proc.stderr[-2000:])
        result = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        report["runs"].append({"alloc_conf": conf or "default", "rc": proc.returncode,
                               "results": json.loads(result[0]) if result else None})
        (OUT / "holes_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
