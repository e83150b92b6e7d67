"""How to copy a model's training state to host memory fastest, the first time. Run on the GPU.

%maxbatch snapshots parameters, gradients and optimizer state to host memory before its trials
and puts them back after each. This times, in fresh processes, for a GPT-sized state (166M
parameters with gradients and AdamW state, about 2.7 GB in ~400 tensors): the snapshot and one
restore, with (a) a pinned tensor per tensor (torch's caching host allocator), (b) one pinned
buffer carved into views, (c) pageable memory. Prints one JSON line per way.

Usage (repo root, GPU machine): python3 bench/gpu/pinned_probe.py
"""

import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
way = sys.argv[1]
torch.manual_seed(0)
shapes = [(32000, 768), (512, 768)] + [(768 * 3, 768), (768 * 3,), (768, 768), (768,),
          (3072, 768), (3072,), (768, 3072), (768,), (768,), (768,), (768,), (768,)] * 8 + [(32000, 768)]
# parameters, gradients, exp_avg, exp_avg_sq
state = [torch.randn(s, device="cuda") for s in shapes for _ in range(4)]
torch.cuda.synchronize()
nbytes = sum(t.numel() * t.element_size() for t in state)
t0 = time.perf_counter()
if way == "per_tensor":
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in state]
elif way == "one_buffer":
    sizes = [(t.numel() * t.element_size() + 511) // 512 * 512 for t in state]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    host, off = [], 0
    for t, n in zip(state, sizes):
        view = flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        host.append(view.copy_(t)); off += n
else:
    host = [t.to("cpu") for t in state]
torch.cuda.synchronize()
snap = time.perf_counter() - t0
t0 = time.perf_counter()
for t, h in zip(state, host):
    t.copy_(h, non_blocking=True)
torch.cuda.synchronize()
restore = time.perf_counter() - t0
ok = all(torch.equal(t.cpu(), h) for t, h in zip(state[:8], host[:8]))
print(json.dumps({"way": way, "tensors": len(state), "gb": nbytes / 1e9, "snapshot_s": snap,
                  "restore_s": restore, "equal": ok}))
"""

for way in ("per_tensor", "one_buffer", "pageable", "per_tensor", "one_buffer"):
    out = subprocess.run([sys.executable, "-c", CHILD, way], capture_output=True, text=True)
    print(out.stdout.strip() or out.stderr[-800:], flush=True)
