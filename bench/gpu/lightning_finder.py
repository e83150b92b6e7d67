"""Lightning's BatchSizeFinder on the same models, loop and allocator cap as maxbatch_truth.py.

Run on the GPU machine, in its own process (Lightning owns the training loop there):
    python3 bench/gpu/lightning_finder.py [MODEL ...]
Per model: the batch size Lightning's `Tuner.scale_batch_size(mode="binsearch")` finds (3 steps
per trial, its default and the most our trials run), how many batch sizes it tried, and its wall
time. Writes $OUT/lightning_finder.json after each model. Its wheels (lightning, torchmetrics,
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
    "gpt_fp32": ("GPT()", "tokens", (512,), 32000, "32-true"),
    "vit_b16_fp32": ("ViT()", "images", (3, 224, 224), 1000, "32-true"),
    "resnet18_fp32": ("ResNet18()", "images", (3, 224, 224), 1000, "32-true"),
}


def main() -> int:
    ns: dict = {}
    exec(MODELS.replace("CAP", repr(CAP_GIB)), ns)  # the notebook's models, under its cap
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.tuner import Tuner

    class Samples(torch.utils.data.Dataset):
        def __init__(self, kind, shape, classes):
            self.kind, self.shape, self.classes = kind, shape, classes

        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            if self.kind == "tokens":
                return (torch.randint(0, self.classes, self.shape),
                        torch.randint(0, self.classes, self.shape))
            return torch.randn(self.shape), torch.randint(0, self.classes, ())

    class Module(L.LightningModule):
        def __init__(self, model, data):
            super().__init__()
            self.model, self.data, self.batch_size, self.tried = model, data, 2, []

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size,
                                               num_workers=4)

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
        module = Module(eval(factory, ns), Samples(kind, shape, classes))
        trainer = L.Trainer(accelerator="gpu", devices=1, precision=precision, max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        t0 = time.time()
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", steps_per_trial=3,
                                                init_val=2, max_trials=25)
        row = {"model": name, "engine": "lightning BatchSizeFinder (binsearch)",
               "max_batch": found, "trials": len(module.tried), "tried": module.tried,
               "seconds": time.time() - t0}
        print(json.dumps(row), file=sys.stderr, flush=True)
        results["rows"].append(row)
        (OUT / "lightning_finder.json").write_text(json.dumps(results, indent=1))
        del trainer, module
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
