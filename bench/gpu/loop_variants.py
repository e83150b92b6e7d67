"""Which detail of a training loop moves the largest batch that fits by a sample? Run on the GPU.

maxbatch-truth-2026-12-04k: on a Llama-style decoder with pure bf16 weights and fused AdamW,
`%maxbatch MODULE` (the standard step) fitted 68 where the notebook's own loop, and `--step`
over that loop, fit 67 and failed at 68. The standard step differs from that loop in three
details; each is tried alone here, on the same model, in one plain Python process under the
same 24 GiB cap, 3 steps from an optimizer without state per probe:

- `container`: the forward's whole output (logits and the KV cache the model made) is kept
  until the next forward returns, as `out = model(x)` in a loop keeps it; the notebook's loop
  keeps only `out.logits`;
- `input_first`: the batch is made before `zero_grad`, not after;
- `target_late`: the targets are made after the forward, not with the inputs.

Usage: python3 bench/gpu/loop_variants.py [BATCH ...]   (default 66 67 68 69)
Writes $OUT/loop_variants.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

CAP_GIB = 24.0
VOCAB, SEQ = 32000, 512


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048,
                                        num_hidden_layers=12, num_attention_heads=12,
                                        num_key_value_heads=4, max_position_embeddings=1024))


def steps(model, opt, batch, n, container, input_first, target_late):
    out = loss = None  # noqa: F841 (as in a loop: the last step's values live into the next)
    for _ in range(n):
        x = y = None
        if input_first:
            x = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
            if not target_late:
                y = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
        opt.zero_grad(set_to_none=True)
        if x is None:
            x = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
            if not target_late:
                y = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
        out = model(x)
        logits = out.logits
        if not container:
            out = logits
        if target_late:
            y = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        del logits
        loss.backward()
        opt.step()
        torch.cuda.synchronize()


def probe(model, opt, batch, **variant):
    opt.state.clear()
    gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    try:
        steps(model, opt, batch, 3, **variant)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    opt.zero_grad(set_to_none=True)
    opt.state.clear()
    gc.collect(); torch.cuda.empty_cache()
    return {"batch": batch, "fits": ok, "peak": peak, "reserved": reserved}


VARIANTS = {
    "notebook_loop": {"container": False, "input_first": False, "target_late": False},
    "container": {"container": True, "input_first": False, "target_late": False},
    "input_first": {"container": False, "input_first": True, "target_late": False},
    "target_late": {"container": False, "input_first": False, "target_late": True},
    "standard_step": {"container": True, "input_first": True, "target_late": True},
}


def main() -> int:
    batches = [int(b) for b in sys.argv[1:]] or [66, 67, 68, 69]
    torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / torch.cuda.mem_get_info()[1])
    model = llama().cuda().to(torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    probe(model, opt, 2, **VARIANTS["notebook_loop"])  # warm: kernels loaded, cuBLAS set up
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
               "cap_gib": CAP_GIB, "command": "python3 bench/gpu/loop_variants.py "
               + " ".join(sys.argv[1:]), "held": torch.cuda.memory_allocated(), "rows": []}
    out = Path(os.environ.get("OUT", ".")) / "loop_variants.json"
    for name, variant in VARIANTS.items():
        for batch in batches:
            row = {"variant": name, **probe(model, opt, batch, **variant)}
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
            out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
