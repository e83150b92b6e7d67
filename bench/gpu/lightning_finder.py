"""Lightning's BatchSizeFinder on the same models, loop and allocator cap as maxbatch_truth.py.

Run on the GPU machine, in its own process (Lightning owns the training loop there):
    python3 bench/gpu/lightning_finder.py [MODEL ...]
Per model: the batch size Lightning's `Tuner.scale_batch_size(mode="binsearch")` finds (3 steps
per trial, its default and the most our trials run), how many batch sizes it tried, and its wall
time. The batches are made on the GPU, as the notebook's loop makes them (the run of
2026-12-04 loaded them through four DataLoader workers), and one untimed step at batch 2 comes
first, as for our search (not in the runs of 2026-12-06q and -06t). Writes $OUT/lightning_finder.json
after each model. Its wheels (lightning, torchmetrics,
aiohttp and theirs) are not in `.whl/`: `.whl/lightning/` on the run that needs them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maxbatch_truth import CAP_GIB, MODELS  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
ROWS = {  # model -> (factory expression, data kind, sample shape, classes, precision)
    "resnet18_fp32": ("ResNet18()", "images", (3, 224, 224), 1000, "32-true"),
    "vit_b16_fp32": ("ViT()", "images", (3, 224, 224), 1000, "32-true"),
    "vit_b16_bf16": ("ViT()", "images", (3, 224, 224), 1000, "bf16-mixed"),
    "gpt_fp32": ("GPT()", "tokens", (512,), 32000, "32-true"),
    "gpt_fp16_scaler": ("GPT()", "tokens", (512,), 32000, "16-mixed"),
    "lstm_fp32": ("LSTMLM()", "tokens", (128,), 32000, "32-true"),
    "unet_fp32": ("UNet()", "masks", (3, 128, 128), 21, "32-true"),
    "gpt_checkpointed": ("GPT(checkpoint=True)", "tokens", (512,), 32000, "32-true"),
}


def main() -> int:
    ns: dict = {}
    exec(MODELS.replace("CAP", repr(CAP_GIB)), ns)  # the notebook's models, under its cap
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.tuner import Tuner

    class Indices(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            return i

    def batch_on_gpu(kind, shape, classes):
        # The batch is made on the GPU from its indices, as the notebook's loop makes its
        # data: neither side pays for host-side loading, so only the finders differ.
        def collate(indices):
            b = len(indices)
            if kind == "tokens":
                return (torch.randint(0, classes, (b, *shape), device="cuda"),
                        torch.randint(0, classes, (b, *shape), device="cuda"))
            x = torch.randn(b, *shape, device="cuda")
            if kind == "masks":
                return x, torch.randint(0, classes, (b, *shape[1:]), device="cuda")
            return x, torch.randint(0, classes, (b,), device="cuda")
        return collate

    class Module(L.LightningModule):
        def __init__(self, model, collate):
            super().__init__()
            self.model, self.collate, self.batch_size, self.tried = model, collate, 2, []

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Indices(), batch_size=self.batch_size,
                                               collate_fn=self.collate)

        def training_step(self, batch, _):
            x, y = batch
            if not self.tried or self.tried[-1] != x.shape[0]:
                self.tried.append(x.shape[0])
            out = self.model(x)
            if out.dim() == 3:
                return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            return F.cross_entropy(out, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cap_gib": CAP_GIB,
               "lightning": L.__version__, "torch": torch.__version__,
               "command": "python3 bench/gpu/lightning_finder.py " + " ".join(sys.argv[1:]),
               "rows": []}
    for name in sys.argv[1:] or list(ROWS):
        factory, kind, shape, classes, precision = ROWS[name]
        torch.manual_seed(0)
        module = Module(eval(factory, ns), batch_on_gpu(kind, shape, classes))

        def trainer():
            return L.Trainer(accelerator="gpu", devices=1, precision=precision, max_steps=1,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)

        # One untimed step at batch 2 first, as maxbatch_truth.py warms the notebook's loop
        # before our search: neither side's time holds the first step's CUDA, cuBLAS and
        # cuDNN setup.
        trainer().fit(module)
        module.tried.clear()
        t0 = time.time()
        found = Tuner(trainer()).scale_batch_size(module, mode="binsearch", steps_per_trial=3,
                                                init_val=2, max_trials=25)
        row = {"model": name, "engine": "lightning BatchSizeFinder (binsearch)",
               "max_batch": found, "trials": len(module.tried), "tried": module.tried,
               "seconds": time.time() - t0}
        print(json.dumps(row), file=sys.stderr, flush=True)
        results["rows"].append(row)
        (OUT / "lightning_finder.json").write_text(json.dumps(results, indent=1))
        del module
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
