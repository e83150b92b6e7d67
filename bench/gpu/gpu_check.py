"""GPU-machine check of gpukernel (run by bench/gpu/run_on_device.sh on a CUDA machine).

1. The torch build loads libtorch through its plugin and sees CUDA (`gpukernel info --json`).
2. gpu-python under a real jupyter_client: %gpumem before torch, after the Python kernel
   allocates N GiB (allocator figures vs torch's own, process memory vs nvidia-smi), after
   `del` + empty_cache; gpukernel itself holds no CUDA context throughout.
3. %gpumem latency (NVML path, magics-only kernel round trip) side by side with nvidia-smi
   and gpustat --json.

Writes gpu_check.json and gpu_check.md into $OUT (or the current directory).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("GPUKERNEL_BIN", ROOT / ".device" / "gpukernel"))
OUT = Path(os.environ.get("OUT", "."))
N_GIB = 4
results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def smi_apps() -> dict[int, int]:
    out = run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]).stdout
    apps = {}
    for line in out.strip().splitlines():
        pid, mem = [x.strip() for x in line.split(",")]
        apps[int(pid)] = int(mem) * 2**20
    return apps


def gpumem(kc) -> dict:
    from kernel_client import execute

    _, outputs = execute(kc, "%gpumem --json")
    return outputs[0]["content"]["data"]["application/json"]


def allocator_figures(km, kc) -> dict:
    """%gpumem against torch's own figures and nvidia-smi while the notebook holds N_GIB, and
    what %emptycache gives back after `del`."""
    from kernel_client import execute, stream_text

    checks: dict = {}
    proxy_pid = km.provisioner.process.pid
    before = gpumem(kc)
    child_pid = before["python_kernel"]["pid"]
    checks["torch_not_imported_before"] = before["python_kernel"]["torch"]["imported"] is False
    code = (f"import torch, json\nx = torch.empty({N_GIB} * 2**30, dtype=torch.uint8, device='cuda')\n"
            "torch.cuda.synchronize()\n"
            "print(json.dumps({'allocated': torch.cuda.memory_allocated(0), "
            "'reserved': torch.cuda.memory_reserved(0)}))")
    reply, outputs = execute(kc, code, timeout=120)
    truth = json.loads(stream_text(outputs).strip().splitlines()[-1])
    during = gpumem(kc)
    apps = smi_apps()
    dev = during["python_kernel"]["torch"]["devices"][0]
    nvml_child = next(p["used_memory"] for g in during["gpus"] for p in g["processes"] if p["pid"] == child_pid)
    checks["allocator_allocated"] = {"gpumem": dev["allocated"], "torch": truth["allocated"]}
    checks["allocator_reserved"] = {"gpumem": dev["reserved"], "torch": truth["reserved"]}
    checks["process_memory"] = {"gpumem_nvml": nvml_child, "nvidia_smi": apps.get(child_pid)}
    checks["allocated_within_1pct"] = abs(dev["allocated"] - truth["allocated"]) <= 0.01 * truth["allocated"]
    checks["reserved_within_1pct"] = abs(dev["reserved"] - truth["reserved"]) <= 0.01 * truth["reserved"]
    checks["process_within_1pct_of_smi"] = apps.get(child_pid) is not None and abs(nvml_child - apps[child_pid]) <= 0.01 * apps[child_pid]
    checks["gpukernel_has_no_cuda_context"] = proxy_pid not in apps and all(
        p["pid"] != proxy_pid for g in during["gpus"] for p in g["processes"])
    _, outputs = execute(kc, "%gpumem")
    checks["gpumem_text"] = outputs[0]["content"]["data"]["text/plain"]
    execute(kc, "del x")
    _, outputs = execute(kc, "%emptycache --json", timeout=60)
    checks["emptycache_report"] = outputs[0]["content"]["data"]["application/json"]
    after = gpumem(kc)
    nvml_after = next((p["used_memory"] for g in after["gpus"] for p in g["processes"] if p["pid"] == child_pid), 0)
    checks["process_memory_after_del_and_empty_cache"] = nvml_after
    checks["freed_fraction_of_N"] = (nvml_child - nvml_after) / (N_GIB * 2**30)
    return checks


def gauge_during_training(kc) -> dict:
    """The gauge keeps updating while a training loop runs in the next cell."""
    from kernel_client import execute

    checks: dict = {}
    _, outputs = execute(kc, "%gpumem --watch 0.2")
    msg_id = kc.execute("import time\nlin = torch.nn.Linear(4096, 4096).cuda()\n"
                        "opt = torch.optim.Adam(lin.parameters())\nt0 = time.time()\n"
                        "while time.time() - t0 < 3:\n"
                        "    loss = lin(torch.randn(512, 4096, device='cuda')).square().mean()\n"
                        "    loss.backward(); opt.step(); opt.zero_grad()\n"
                        "torch.cuda.synchronize(); print('trained')")
    updates, done = 0, False
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=10)
        updates += msg["msg_type"] == "update_display_data"
        done = (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle")
    execute(kc, "%gpumem --stop")
    checks["gauge_updates_during_3s_training"] = updates
    return checks


def maxbatch_checks(kc, proxy_pid: int) -> dict:
    """A libtorch magic gives gpukernel a CUDA context, and its memory comes back after; a
    notebook module sized mid-training is left exactly as it was."""
    from kernel_client import execute, stream_text

    checks: dict = {}
    # A libtorch magic gives gpukernel a CUDA context; afterwards its memory is back.
    _, outputs = execute(kc, "%maxbatch resnet18 --input 3x64x64 --max 256 --json", timeout=300)
    data = outputs[-1]["content"]["data"].get("application/json", {})
    checks["maxbatch_resnet18"] = {k: data.get(k) for k in ("max_batch", "recommended", "exact", "after_allocated_bytes")}
    checks["maxbatch_trials"] = len(data.get("trials", []))
    after_maxbatch = gpumem(kc)
    checks["gpukernel_allocator_after_maxbatch"] = after_maxbatch.get("gpukernel_allocator")
    checks["gpukernel_nvml_after_maxbatch"] = next(
        (p["used_memory"] for g in after_maxbatch["gpus"] for p in g["processes"] if p["pid"] == proxy_pid), None)
    # %maxbatch on a module of the notebook, on the GPU, mid-training: exported, searched,
    # timed, and left exactly as it was.
    code = ("import copy\n"
            "net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.BatchNorm2d(64), "
            "torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), "
            "torch.nn.Linear(64, 10)).cuda()\n"
            "net_opt = torch.optim.Adam(net.parameters())\n"
            "net(torch.randn(8, 3, 64, 64, device='cuda')).sum().backward(); net_opt.step()\n"
            "snap = lambda: (copy.deepcopy(net.state_dict()), [p.grad.clone() for p in net.parameters()],"
            " copy.deepcopy(net_opt.state_dict()['state']))\n"
            "eq = lambda a, b: torch.equal(a, b) if isinstance(a, torch.Tensor) else "
            "(all(eq(a[k], b[k]) for k in a) if isinstance(a, dict) else "
            "(all(eq(x, y) for x, y in zip(a, b)) if isinstance(a, (list, tuple)) else a == b))\n"
            "before = snap()")
    reply, _ = execute(kc, code, timeout=120)
    _, outputs = execute(kc, "%maxbatch net --input 3x64x64 --max 16384 --throughput --json",
                         timeout=600)
    data = outputs[-1]["content"]["data"].get("application/json", {})
    checks["maxbatch_notebook_module"] = {k: data.get(k) for k in (
        "max_batch", "recommended", "settled", "throughput", "assumptions", "after_allocated_bytes")}
    checks["maxbatch_notebook_module_stdout"] = stream_text(outputs)
    _, outputs = execute(kc, "print(eq(before, snap()))", timeout=60)
    checks["notebook_module_untouched"] = stream_text(outputs).strip() == "True"
    _, outputs = execute(kc, "import glob, tempfile; print(len(glob.glob(tempfile.gettempdir() + '/gpukernel-maxbatch-*')))")
    checks["export_files_left"] = stream_text(outputs).strip()
    return checks


def time_cmds(cmds: list[list[str]], n: int = 20) -> dict:
    """Time to run `cmds` one after another (what a tool needs for the same figures)."""
    ts = []
    errors = []
    for _ in range(n):
        t0 = time.perf_counter()
        for cmd in cmds:
            done = run(cmd)
            if done.returncode != 0:
                errors.append(done.stderr[-300:] or done.stdout[-300:])
        ts.append((time.perf_counter() - t0) * 1000)
    return {"p50": statistics.median(ts), "p95": sorted(ts)[int(0.95 * (n - 1))],
            "commands": cmds, "errors": errors[:1]}


def latency() -> dict:
    """3. Latency: %gpumem --json round trip vs nvidia-smi and gpustat as commands."""
    from kernel_client import execute, running_kernel

    lat: dict = {}
    with running_kernel("gpu-magics") as (km, kc):
        execute(kc, "%gpumem --json")  # opens NVML once
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            execute(kc, "%gpumem --json")
            times.append((time.perf_counter() - t0) * 1000)
        lat["gpumem_roundtrip_ms"] = {"p50": statistics.median(times), "p95": sorted(times)[47]}

    # nvidia-smi takes one --query-* kind per run: GPUs, then processes.
    lat["nvidia_smi_ms"] = time_cmds([
        ["nvidia-smi", "--query-gpu=index,name,memory.used,memory.free,memory.total,utilization.gpu",
         "--format=csv"],
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv"],
    ])
    gpustat = shutil.which("gpustat")
    lat["gpustat_json_ms"] = time_cmds([[gpustat, "--json"]]) if gpustat else {"error": "gpustat not installed"}
    return lat


def main() -> int:
    import torch  # only to find its lib dir; this process never touches CUDA

    torch_lib = str(Path(torch.__file__).parent / "lib")
    os.environ["LD_LIBRARY_PATH"] = torch_lib + ":" + os.environ.get("LD_LIBRARY_PATH", "")
    smi = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    results["gpu"] = smi.stdout.strip()
    results["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}

    # 1. libtorch through the plugin, CUDA visible.
    info = json.loads(run([str(BIN), "info", "--json"]).stdout)
    results["gpukernel_info"] = info
    results["cuda_available_via_plugin"] = info["libtorch"].get("info", {}).get("cuda_available")

    # 2. gpu-python with a real jupyter_client.
    prefix = Path(tempfile.mkdtemp(prefix="gpukernel-specs-"))
    for extra in (["--python", sys.executable], ["--magics-only"]):
        subprocess.run([str(BIN), "install", "--prefix", str(prefix), *extra], check=True)
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    from kernel_client import running_kernel

    with running_kernel("gpu-python") as (km, kc):
        checks = allocator_figures(km, kc)
        checks |= gauge_during_training(kc)
        checks |= maxbatch_checks(kc, km.provisioner.process.pid)
    results["gpu_python"] = checks
    results["latency"] = latency()
    shutil.rmtree(prefix, ignore_errors=True)

    (OUT / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
