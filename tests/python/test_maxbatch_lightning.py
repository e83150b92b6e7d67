"""%maxbatch on a LightningModule: its standard step is the one its Trainer runs under automatic
optimization (training_step, then zero_grad, then backward and the optimizer step), with the
optimizer its configure_optimizers() makes. A real Lightning Trainer runs the same module on
the CPU first, and the trials must meet training_step as it did; then the module's state,
what its training_step appended and what configure_optimizers set, must be as before.

The first half drives trials.py in-process (conftest's `trials`) with real torch and Lightning
on the CPU; the last test goes through a real gpu-python kernel and reads the report."""

from __future__ import annotations

import collections
import inspect
import json
import warnings

import pytest

from kernel_client import execute, running_kernel, stream_text

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")
F = torch.nn.functional

CE = {"kind": "ce", "classes": 10, "class_dim": -1}


def call(trials, ns, name, **args):
    return json.loads(trials.call(ns, name, json.dumps(args)))


class Classifier(L.LightningModule):
    """As Lightning's tutorials write one: a loss logged, an optimizer and a scheduler, and
    what a user's training_step often keeps (each step's loss, for an epoch's mean)."""

    def __init__(self, configured=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))
        self.losses = []
        # What each training_step met: whether the last step's gradients were still alive,
        # and the batch's shapes and dtypes. A deque: the trials put lists back.
        self.seen = collections.deque()
        self.configured = configured

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((self.net[0].weight.grad is not None, tuple(x.shape), x.dtype,
                          tuple(y.shape), y.dtype))
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss)
        return loss

    def configure_optimizers(self):
        if self.configured is not None:
            return self.configured(self)
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.last_optimizer = opt  # kept on the module, as some users do
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}


def _fit_on_cpu(model, batch, steps):
    """A real Trainer's fit, as a notebook runs it (no logger, checkpoints or progress bar)."""
    data = torch.utils.data.TensorDataset(torch.randn(batch * steps, 32),
                                          torch.randint(0, 10, (batch * steps,)))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch))
    return trainer


def _state(model):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()])


def _same_state(a, b):
    (wa, ga), (wb, gb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(wa, wb))
            and all((x is None and y is None) or (x is not None and y is not None
                                                  and torch.equal(x, y))
                    for x, y in zip(ga, gb)))


def test_the_trials_meet_training_step_as_a_real_trainer_does(trials):
    """The Trainer zeroes the gradients after training_step, so from the second step on the
    last step's gradients are alive through the forward: memory a step that zeroes them first
    would not count. The trials' steps meet the same, with the batch as (input, target)."""
    torch.manual_seed(0)
    model = Classifier()
    _fit_on_cpu(model, batch=4, steps=3)
    by_trainer = [seen[0] for seen in model.seen]
    assert by_trainer == [False, True, True], by_trainer
    model.seen.clear()
    # The next fit starts from no gradients, as the first did (a fit leaves its last ones).
    model.zero_grad(set_to_none=True)
    before = _state(model)
    losses, optimizer = list(model.losses), model.last_optimizer  # the fit's
    # After fit the module is still attached to its Trainer, where `self.log` outside the
    # loop raises: the trials run training_step as a test of it would, unattached.
    assert model._trainer is not None
    ns = {"lit": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    assert reply["describe"]["lightning"] is True
    assert reply["describe"]["optimizer"] == "SGD (lr 0.1) from lit.configure_optimizers()"
    # Its probe of the target training_step takes (one call at batch 2) is no trial's step.
    assert call(trials, ns, "set_loss", plan=CE)["target_values"] is False
    model.seen.clear()
    result = call(trials, ns, "trial", batch=6, steps=3)
    assert result["result"] == "ran", result
    # Two steps or three: a trial ends at the second where it left memory as the first did.
    ours = [seen[0] for seen in model.seen]
    assert len(ours) >= 2 and ours == by_trainer[:len(ours)], (ours, by_trainer)
    assert set(seen[1:] for seen in model.seen) == {
        ((6, 32), torch.float32, (6,), torch.int64)}
    call(trials, ns, "close")
    # Put back: the weights and gradients, the list training_step appends to, the attribute
    # configure_optimizers set (it would keep the trials' optimizer state alive), the Trainer.
    assert _same_state(before, _state(model))
    assert len(model.losses) == len(losses) == 3
    assert all(a is b for a, b in zip(model.losses, losses))
    assert model.last_optimizer is optimizer
    assert model._trainer is not None


@pytest.mark.parametrize("amp, scaler", [("bf16", False), ("fp16", True)])
def test_mixed_precision_runs_training_step_under_autocast_as_the_trainers_precision_does(
        trials, amp, scaler):
    """`--amp bf16` is Trainer(precision="bf16-mixed"): training_step under autocast; `--amp
    fp16` is "16-mixed": the same through a GradScaler, whose step the Trainer skips when the
    scaled gradients are not finite."""
    model = Classifier()
    before = _state(model)
    ns = {"lit": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32],
                                              "amp": amp})
    assert reply["describe"]["grad_scaler"] is scaler
    call(trials, ns, "set_loss", plan=CE)
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    assert len(model.seen) >= 2
    call(trials, ns, "close")
    assert _same_state(before, _state(model))


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


@pytest.mark.parametrize("configured", [
    _adamw,
    lambda m: [_adamw(m)],
    lambda m: ([opt := _adamw(m)], [torch.optim.lr_scheduler.StepLR(opt, 1)]),
    lambda m: {"optimizer": (opt := _adamw(m)), "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "step"}},
    lambda m: [{"optimizer": _adamw(m)}],
], ids=["one", "list", "lists", "dict", "list-of-dicts"])
def test_each_form_configure_optimizers_returns_gives_its_optimizer(trials, configured):
    ns = {"lit": Classifier(configured)}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    assert reply["describe"]["optimizer"] == "AdamW (lr 0.001) from lit.configure_optimizers()"
    call(trials, ns, "set_loss", plan=CE)
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    call(trials, ns, "close")


def _needs_a_trainer(m):
    opt = _adamw(m)
    total = m.trainer.estimated_stepping_batches  # only a Trainer knows
    return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=total)]


@pytest.mark.parametrize("configured, said", [
    (lambda m: [_adamw(m), _adamw(m)],
     "lit.configure_optimizers() returns 2 optimizers, which a Trainer steps only under manual "
     "optimization. Write FN(batch_size)"),
    (_needs_a_trainer,
     "lit.configure_optimizers() raised RuntimeError: Classifier is not attached to a "
     "`Trainer`. Name the optimizer with --optimizer-from VAR (one of yours) or --optimizer "
     "adamw|adam|sgd"),
    (lambda m: "adamw",
     "lit.configure_optimizers() returned a str, not an optimizer"),
], ids=["two", "needs-trainer", "not-an-optimizer"])
def test_an_optimizer_configure_optimizers_cannot_give_is_refused_with_what_to_do(
        trials, configured, said):
    model = Classifier(configured)
    before = _state(model)
    reply = call(trials, {"lit": model}, "prepare",
                 spec={"kind": "module", "target": "lit", "input": [32]})
    assert said in reply["refused"], reply
    assert _same_state(before, _state(model))


def test_an_optimizer_asked_for_is_taken_instead_of_configure_optimizers(trials):
    model = Classifier(_needs_a_trainer)
    ns = {"lit": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32],
                                              "optimizer": "adam"})
    assert reply["describe"]["optimizer"] == "a new Adam (lr 1e-3)"
    assert reply["describe"]["lightning"] is True  # still the Trainer's step, with this one
    call(trials, ns, "set_loss", plan=CE)
    model.seen.clear()
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    assert model.seen
    call(trials, ns, "close")


class MultiLabel(Classifier):
    """Twenty labels at once: binary cross-entropy against a float target like the logits."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((None, tuple(x.shape), x.dtype, tuple(y.shape), y.dtype))
        return F.binary_cross_entropy_with_logits(self(x), y)


class Regression(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((None, tuple(x.shape), x.dtype, tuple(y.shape), y.dtype))
        return F.mse_loss(self(x), y)


@pytest.mark.parametrize("module, values", [(Classifier, False), (MultiLabel, True),
                                            (Regression, True)])
def test_a_training_step_that_refuses_class_ids_gets_values_shaped_like_the_output(
        trials, module, values):
    """The output's 10 columns read as classes, and a classifier takes class ids; a
    multi-label or regression step refuses them, and gets floats shaped like the output."""
    model = module()
    before = _state(model)
    ns = {"lit": model}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    assert call(trials, ns, "set_loss", plan=CE)["target_values"] is values
    model.seen.clear()
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    expected = ((3, 10), torch.float32) if values else ((3,), torch.int64)
    assert {seen[3:] for seen in model.seen} == {expected}
    call(trials, ns, "close")
    assert _same_state(before, _state(model))


class BatchOnly(Classifier):
    """`training_step(self, batch)`: the Trainer passes the index only where it is taken."""

    def training_step(self, batch):
        x, y = batch
        self.seen.append((None, tuple(x.shape), x.dtype, tuple(y.shape), y.dtype))
        return F.cross_entropy(self(x), y)


def test_a_training_step_without_the_batch_index_is_called_without_it(trials):
    model = BatchOnly()
    ns = {"lit": model}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    assert call(trials, ns, "set_loss", plan=CE)["target_values"] is False
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    call(trials, ns, "close")


def test_a_pytorch_lightning_module_gets_its_trainers_step_too(trials):
    """`import pytorch_lightning as pl` (the package's older name, installed with it)."""
    pl = pytest.importorskip("pytorch_lightning")

    class Old(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 10)

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ns = {"old": Old()}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "old", "input": [32]})
    assert reply["describe"]["lightning"] is True
    assert reply["describe"]["optimizer"] == "SGD (lr 0.01) from old.configure_optimizers()"
    call(trials, ns, "close")


class ManualClassifier(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class DictBatchClassifier(Classifier):
    def training_step(self, batch, batch_idx):
        return {"loss": F.cross_entropy(self(batch["image"]), batch["label"])}


class DictLossClassifier(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((None, tuple(x.shape), x.dtype, tuple(y.shape), y.dtype))
        logits = self(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits.detach()}


def test_manual_optimization_is_refused_pointing_to_a_step_function(trials):
    reply = call(trials, {"lit": ManualClassifier()}, "prepare",
                 spec={"kind": "module", "target": "lit", "input": [32]})
    assert ("lit turns automatic optimization off: its training_step steps its optimizers "
            "itself through self.optimizers(), which only a Trainer provides. Write "
            "FN(batch_size) that makes one batch of yours and runs your step, e.g. `def "
            "step(n): loss = lit.training_step(make_batch(n), 0);") in reply["refused"], reply


def test_a_training_step_that_returns_a_dict_is_trained_on_its_loss(trials):
    model = DictLossClassifier()
    before = _state(model)
    ns = {"lit": model}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    call(trials, ns, "set_loss", plan=CE)
    model.seen.clear()
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    assert model.seen  # its own step ran, on its dict's loss
    call(trials, ns, "close")
    assert _same_state(before, _state(model))


def test_a_batch_the_training_step_cannot_take_is_explained(trials):
    """A training_step that takes a dict gets the (input, target) %maxbatch makes: the trial's
    error says so and how to size that step, and the state is put back."""
    model = DictBatchClassifier()
    before = _state(model)
    ns = {"lit": model}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    call(trials, ns, "set_loss", plan=CE)
    result = call(trials, ns, "trial", batch=3, steps=2)
    assert result["result"] == "error", result
    assert result["error"]["ename"] == "TypeError"
    assert result["error"]["hint"].startswith(
        "lit.training_step got the batch (input, target) that %maxbatch makes"), result
    call(trials, ns, "close")
    assert _same_state(before, _state(model))


class NeedsTrainer(Classifier):
    def training_step(self, batch, batch_idx):
        self.log("lr", self.lr_schedulers().get_last_lr()[0])  # only a Trainer has them
        return super().training_step(batch, batch_idx)


def test_a_training_step_that_reaches_the_trainer_is_told_so(trials):
    ns = {"lit": NeedsTrainer()}
    call(trials, ns, "prepare", spec={"kind": "module", "target": "lit", "input": [32]})
    call(trials, ns, "set_loss", plan=CE)
    result = call(trials, ns, "trial", batch=3, steps=2)
    assert result["result"] == "error", result
    assert result["error"]["hint"].startswith(
        "lit.training_step ran without a Trainer, which it reaches. Write FN(batch_size)"), result
    call(trials, ns, "close")


def test_lightnings_own_demo_transformer_whose_forward_takes_two_inputs_is_refused(trials):
    """A module not written here: Lightning's demo transformer, whose forward (its own, not
    missing) takes the input and the target. Its forward is probed and refused as any such
    forward is; taken for a missing one, it was trained on class ids it cannot take."""
    from lightning.pytorch.demos import LightningTransformer

    with torch.random.fork_rng():
        model = LightningTransformer(vocab_size=100)
    reply = call(trials, {"demo": model}, "prepare",
                 spec={"kind": "module", "target": "demo", "input": [35]})
    assert reply["refused"].startswith("demo.forward needs 2 arguments (inputs, target)"), reply


def test_a_plain_module_with_a_training_step_method_keeps_the_standard_step(trials):
    """Only a LightningModule's training_step is its Trainer's step: a plain torch module's
    method of that name is the user's own, and not called."""
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 10)
            self.calls = collections.deque()

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            self.calls.append(batch_idx)
            raise AssertionError("not a Trainer's step")

    model = Plain()
    ns = {"model": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "model",
                                              "input": [32]})
    assert reply["describe"]["lightning"] is False
    call(trials, ns, "set_loss", plan=CE)
    assert call(trials, ns, "trial", batch=3, steps=2)["result"] == "ran"
    call(trials, ns, "close")
    assert not model.calls


class LitAutoEncoder(L.LightningModule):
    """Lightning's front-page example: no forward, its training_step calls the layers."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(28 * 28, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 3))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 28 * 28))
        self.targets = collections.deque()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.targets.append((tuple(y.shape), y.dtype))
        x = x.view(x.size(0), -1)
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_lightning_module_without_a_forward_is_trained_through_its_training_step(trials):
    """No output to make a target for: each sample's target is class 0, which a training_step
    that ignores it (an autoencoder's `x, _ = batch`) or takes class ids can both use."""
    model = LitAutoEncoder()
    before = _state(model)
    ns = {"ae": model}
    reply = call(trials, ns, "prepare", spec={"kind": "module", "target": "ae",
                                              "input": [1, 28, 28]})
    assert reply["output"] is None, reply
    assert reply["describe"]["lightning_target"] == (
        "class 0 for each sample (ae has no forward to read an output from)")
    result = call(trials, ns, "trial", batch=5, steps=2)
    assert result["result"] == "ran", result
    assert set(model.targets) == {((5,), torch.int64)}
    call(trials, ns, "close")
    assert _same_state(before, _state(model))


# The notebook defines the same modules as this file, from their source.
NOTEBOOK = "\n".join([
    "import collections, torch, torch.nn.functional as F",
    "import lightning as L",
    *(inspect.getsource(cls) for cls in (Classifier, MultiLabel, LitAutoEncoder)),
    "lit, ml, ae = Classifier(), MultiLabel(), LitAutoEncoder()",
    "weights = [p.detach().clone() for p in lit.parameters()]",
])


def test_the_report_says_the_trainers_step_and_optimizer_in_a_real_kernel():
    with running_kernel("gpu-python") as (_, kc):
        reply, _ = execute(kc, NOTEBOOK, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        reply, outputs = execute(kc, "%maxbatch lit --input 32", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        text = " ".join(stream_text(outputs).split())
        assert ("step: lit.training_step((input, target), 0) as a Lightning Trainer runs it: "
                "training_step, zero_grad (the last step's gradients alive through the "
                "forward), backward, optimizer step;") in text, text
        assert ("loss what lit.training_step returns, on a batch (input, target) whose target "
                "is made for cross-entropy over the last dimension (10 classes)") in text, text
        assert "optimizer SGD (lr 0.1) from lit.configure_optimizers()" in text, text
        # No warning of Lightning's about logging without a Trainer reaches the cell.
        assert "self.log" not in text, text
        reply, outputs = execute(kc, "%maxbatch ae --input 1x28x28", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        text = " ".join(stream_text(outputs).split())
        assert ("loss what ae.training_step returns, on a batch (input, target) whose target "
                "is class 0 for each sample (ae has no forward to read an output from)") in text
        reply, outputs = execute(kc, "%maxbatch ml --input 32", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        text = " ".join(stream_text(outputs).split())
        assert ("whose target is values shaped like the output (it refused class ids for the "
                "cross-entropy the output looks like)") in text, text
        _, outputs = execute(kc, "print(all(torch.equal(a, b) for a, b in "
                                 "zip(weights, lit.parameters())))", timeout=60)
        assert stream_text(outputs).strip() == "True", outputs
