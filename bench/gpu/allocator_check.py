"""GPU-machine check of gpuprobe's caching-allocator shim, through the plugin's C ABI.

One Python process imports torch and loads libgpuprobe_torch.so with ctypes, so both use one
libtorch (checked: one copy of each torch library mapped) and one CUDA caching allocator. Checks:
no CUDA context before; the plugin's figures equal torch's own after a tensor is allocated;
an allocation made by the plugin shows in torch; empty_cache frees reserved-but-unused memory
(allocator and nvidia-smi); reset_peak; set_memory_fraction caps the allocator; an oversized
allocation arrives as the typed OOM (`kind: out_of_memory`).

Run on the CUDA machine from the repo root (torch 2.11; no Rust needed):
    python3 bench/gpu/allocator_check.py
with .device/libgpuprobe_torch.so (or GPUPROBE_TORCH_PLUGIN=path) built from this tree.
Writes $OUT/allocator_check.json (or ./allocator_check.json); exit status 1 if a check failed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(os.environ.get("GPUPROBE_TORCH_PLUGIN", ROOT / ".device" / "libgpuprobe_torch.so"))
OUT = Path(os.environ.get("OUT", "."))
GIB = 2**30
N = 2 * GIB  # the test tensor
TORCH_LIBS = ("libc10.so", "libc10_cuda.so", "libtorch_cpu.so", "libtorch_cuda.so")

checks: list[dict] = []
results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "checks": checks}


def check(name: str, ok: bool, detail="") -> bool:
    checks.append({"check": name, "ok": bool(ok), "detail": detail})
    return bool(ok)


def torch_lib_dir() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        sys.exit("torch is not installed for " + sys.executable)
    return str(Path(spec.origin).parent / "lib")


def mapped_torch_libs() -> dict[str, list[str]]:
    """Distinct mapped paths of each torch library in this process."""
    found: dict[str, set[str]] = {name: set() for name in TORCH_LIBS}
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        base = os.path.basename(path)
        if base in found:
            found[base].add(os.path.realpath(path))
    return {k: sorted(v) for k, v in found.items()}


def smi_process_bytes(pid: int) -> int | None:
    """This pid's GPU memory per nvidia-smi (None: not listed, e.g. no context)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = None
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            total = (total or 0) + int(parts[1]) * 2**20
    return total


class Plugin:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.gpuprobe_torch_abi_version.restype = ctypes.c_uint32
        # c_void_p, not c_char_p: the pointer must go back to gpuprobe_torch_free.
        self.lib.gpuprobe_torch_call.restype = ctypes.c_void_p
        self.lib.gpuprobe_torch_call.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.gpuprobe_torch_free.argtypes = [ctypes.c_void_p]
        self.abi = self.lib.gpuprobe_torch_abi_version()

    def call(self, request: dict) -> dict:
        raw = self.lib.gpuprobe_torch_call(json.dumps(request).encode(), None, None)
        if not raw:
            return {"error": {"kind": "null_reply", "message": "the plugin returned NULL"}}
        try:
            return json.loads(ctypes.string_at(raw).decode())
        finally:
            self.lib.gpuprobe_torch_free(raw)

    def stats(self, device: int = 0) -> dict:
        reply = self.call({"op": "allocator_stats"})
        devices = reply.get("ok", {}).get("devices", [])
        return devices[device] if device < len(devices) else {}


def main() -> int:
    lib_dir = torch_lib_dir()
    # The loader reads LD_LIBRARY_PATH at start-up only: re-exec once with torch/lib on it, so
    # the plugin's libtorch dependencies resolve even if torch had not loaded them already.
    if lib_dir not in os.environ.get("LD_LIBRARY_PATH", "").split(":") and "GPA_REEXEC" not in os.environ:
        env = dict(os.environ, GPA_REEXEC="1",
                   LD_LIBRARY_PATH=lib_dir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    try:
        run_checks(lib_dir)
    except Exception:  # keep what was measured; the failure is a check of its own
        check("script ran to the end", False, traceback.format_exc()[-2000:])
    return report()


def run_checks(lib_dir: str) -> None:
    import torch

    results["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "python": sys.version.split()[0]}
    try:
        results["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        results["gpu"] = f"nvidia-smi failed: {e}"
    results["plugin"] = str(PLUGIN)
    pid = os.getpid()
    plugin = check_loading(lib_dir)
    check_before_cuda(plugin, pid)
    # Held by torch through checks 2 and 3, then freed for empty_cache to give back.
    x = torch.empty(N, dtype=torch.uint8, device="cuda")
    total = check_figures(plugin)
    check_try_allocate(plugin)
    del x
    check_empty_cache(plugin, pid)
    check_reset_peak(plugin)
    check_memory_fraction(plugin, total)
    check_oom(plugin, total)


def check_loading(lib_dir: str) -> Plugin:
    """The plugin loads against the libtorch torch has mapped, and no second copy."""
    libs_before = mapped_torch_libs()
    plugin = Plugin(PLUGIN)
    libs_after = mapped_torch_libs()
    results["torch_libs_mapped"] = libs_after
    check("plugin ABI version 1", plugin.abi == 1, plugin.abi)
    check("one libtorch shared by torch and the plugin",
          libs_before == libs_after and all(len(v) == 1 for v in libs_after.values())
          and all(os.path.dirname(v[0]) == os.path.realpath(lib_dir) for v in libs_after.values()),
          libs_after)
    return plugin


def check_before_cuda(plugin: Plugin, pid: int) -> None:
    """Before CUDA is used: nothing initialised, no context, and asking creates none."""
    import torch

    before = plugin.call({"op": "allocator_stats"})
    check("before: allocator_stats says not initialised",
          before == {"ok": {"initialized": False, "devices": []}}, before)
    empty = plugin.call({"op": "empty_cache"})
    check("before: empty_cache is a no-op success", empty == before, empty)
    reset = plugin.call({"op": "reset_peak", "device": 0})
    check("before: reset_peak -> not_initialised",
          reset.get("error", {}).get("kind") == "not_initialised", reset)
    check("before: no CUDA context (torch not initialised, pid not in nvidia-smi)",
          not torch.cuda.is_initialized() and smi_process_bytes(pid) is None,
          {"torch_initialized": torch.cuda.is_initialized(), "smi": smi_process_bytes(pid)})


def check_figures(plugin: Plugin) -> int:
    """A tensor allocated by torch in this process: the plugin sees exactly torch's figures. Returns the device's total memory."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reply = plugin.call({"op": "allocator_stats"})
    results["allocator_stats_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    s = reply.get("ok", {}).get("devices", [{}])[0] if reply.get("ok", {}).get("devices") else {}
    ms = torch.cuda.memory_stats(0)
    free, total = torch.cuda.mem_get_info(0)
    mine = {
        "allocated": s.get("allocated_bytes", {}).get("current"),
        "allocated_peak": s.get("allocated_bytes", {}).get("peak"),
        "reserved": s.get("reserved_bytes", {}).get("current"),
        "reserved_peak": s.get("reserved_bytes", {}).get("peak"),
        "active": s.get("active_bytes", {}).get("current"),
        "inactive_split": s.get("inactive_split_bytes", {}).get("current"),
        "num_ooms": s.get("num_ooms"), "num_alloc_retries": s.get("num_alloc_retries"),
        "total": s.get("total"),
    }
    theirs = {
        "allocated": torch.cuda.memory_allocated(0), "allocated_peak": torch.cuda.max_memory_allocated(0),
        "reserved": torch.cuda.memory_reserved(0), "reserved_peak": torch.cuda.max_memory_reserved(0),
        "active": ms.get("active_bytes.all.current"), "inactive_split": ms.get("inactive_split_bytes.all.current"),
        "num_ooms": ms.get("num_ooms"), "num_alloc_retries": ms.get("num_alloc_retries"), "total": total,
    }
    results["after_alloc"] = {"plugin": mine, "torch": theirs, "plugin_free": s.get("free"), "torch_free": free}
    check("after alloc: initialized, one entry per visible device",
          reply.get("ok", {}).get("initialized") is True
          and len(reply["ok"]["devices"]) == torch.cuda.device_count(), reply.get("ok", reply))
    check(f"after alloc: allocated >= {N // GIB} GiB (non-zero)", (mine["allocated"] or 0) >= N, mine["allocated"])
    check("after alloc: every figure equals torch.cuda's in this process", mine == theirs,
          {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]})
    check("after alloc: free within 256 MiB of torch.cuda.mem_get_info",
          s.get("free") is not None and abs(s["free"] - free) <= 256 * 2**20, (s.get("free"), free))
    return total


def check_try_allocate(plugin: Plugin) -> None:
    """An allocation made by the plugin lands in the same allocator torch reports on."""
    import torch

    peak_before = torch.cuda.max_memory_allocated(0)
    tried = plugin.call({"op": "try_allocate", "device": 0, "bytes": GIB})
    check("plugin try_allocate 1 GiB succeeds and shows in torch's peak",
          "ok" in tried and torch.cuda.max_memory_allocated(0) >= peak_before + GIB,
          {"reply_error": tried.get("error"), "peak_before": peak_before,
           "peak_after": torch.cuda.max_memory_allocated(0)})


def check_empty_cache(plugin: Plugin, pid: int) -> None:
    """empty_cache gives back reserved-but-unused memory, as seen by torch and nvidia-smi. (Call with the tensor of check_figures deleted.)"""
    import torch

    torch.cuda.synchronize()
    cached = plugin.stats()
    unused = cached["reserved_bytes"]["current"] - cached["allocated_bytes"]["current"]
    smi_before = smi_process_bytes(pid)
    emptied = plugin.call({"op": "empty_cache"})
    after = emptied.get("ok", {}).get("devices", [{}])[0]
    freed = cached["reserved_bytes"]["current"] - after.get("reserved_bytes", {}).get("current", 0)
    smi_after = smi_process_bytes(pid)
    results["empty_cache"] = {"reserved_before": cached["reserved_bytes"]["current"], "unused_before": unused,
                              "reserved_after": after.get("reserved_bytes", {}).get("current"),
                              "freed": freed, "smi_before": smi_before, "smi_after": smi_after}
    check("empty_cache: reserved-but-unused was >= 3 GiB before", unused >= N + GIB, unused)
    check("empty_cache: freed the unused 3 GiB; torch agrees",
          freed >= N + GIB and torch.cuda.memory_reserved(0) == after.get("reserved_bytes", {}).get("current"),
          results["empty_cache"])
    if smi_before is not None and smi_after is not None:
        check("empty_cache: nvidia-smi process memory dropped by >= 95% of freed",
              smi_before - smi_after >= 0.95 * freed, (smi_before, smi_after, freed))
    else:
        check("empty_cache: nvidia-smi process memory dropped (skipped: pid not listed)", True,
              (smi_before, smi_after))


def check_reset_peak(plugin: Plugin) -> None:
    """reset_peak: the peak back to current, as torch sees it."""
    import torch

    y = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    del y
    reset = plugin.call({"op": "reset_peak", "device": 0}).get("ok", {}).get("devices", [{}])[0]
    check("reset_peak: peak back to current, as torch sees it",
          reset.get("allocated_bytes", {}).get("peak") == reset.get("allocated_bytes", {}).get("current")
          == torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0),
          (reset.get("allocated_bytes"), torch.cuda.max_memory_allocated(0)))


def check_memory_fraction(plugin: Plugin, total: int) -> None:
    """set_memory_fraction caps the allocator for torch and for the plugin alike."""
    import torch

    cap = plugin.call({"op": "set_memory_fraction", "device": 0, "fraction": 0.25})
    over_cap = int(0.4 * total)
    torch_oom = False
    try:
        z = torch.empty(over_cap, dtype=torch.uint8, device="cuda")
        del z
    except torch.cuda.OutOfMemoryError:
        torch_oom = True
    capped = plugin.call({"op": "try_allocate", "device": 0, "bytes": over_cap})
    uncap = plugin.call({"op": "set_memory_fraction", "device": 0, "fraction": 1.0})
    fits = plugin.call({"op": "try_allocate", "device": 0, "bytes": over_cap})
    plugin.call({"op": "empty_cache"})
    check("set_memory_fraction 0.25: 40% of the GPU OOMs in torch and in the plugin",
          "ok" in cap and torch_oom and capped.get("error", {}).get("kind") == "out_of_memory",
          {"cap": cap.get("error"), "torch_oom": torch_oom, "plugin": capped.get("error")})
    check("set_memory_fraction 1.0: the same allocation fits again",
          "ok" in uncap and "ok" in fits, {"uncap": uncap.get("error"), "fits": fits.get("error")})
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        results["torch_memory_fraction_after"] = getter(0)


def check_oom(plugin: Plugin, total: int) -> None:
    """An oversized allocation is the typed OOM, counted by the allocator."""
    import torch

    ooms_before = plugin.stats().get("num_ooms", 0)
    huge = plugin.call({"op": "try_allocate", "device": 0, "bytes": 4 * total})
    err = huge.get("error", {})
    results["oom_reply"] = huge
    check("oversized try_allocate -> kind out_of_memory",
          err.get("kind") == "out_of_memory" and "out of memory" in err.get("message", "").lower(), huge)
    check("oversized: num_ooms +1, equal to torch's",
          plugin.stats().get("num_ooms") == ooms_before + 1 == torch.cuda.memory_stats(0).get("num_ooms"),
          (ooms_before, plugin.stats().get("num_ooms"), torch.cuda.memory_stats(0).get("num_ooms")))
    bad = plugin.call({"op": "reset_peak", "device": torch.cuda.device_count()})
    check("a device that does not exist -> torch error, no crash",
          bad.get("error", {}).get("kind") == "torch", bad)


def report() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    failed = [c for c in checks if not c["ok"]]
    results["passed"] = len(checks) - len(failed)
    results["failed"] = len(failed)
    (OUT / "allocator_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({k: results.get(k) for k in ("versions", "gpu", "allocator_stats_ms")}, default=str))
    width = max([len(c["check"]) for c in checks] + [5])
    print(f"\n{'check':<{width}}  result")
    for c in checks:
        print(f"{c['check']:<{width}}  {'ok' if c['ok'] else 'FAIL  ' + json.dumps(c['detail'], default=str)[:300]}")
    print(f"\n{results['passed']} passed, {results['failed']} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
