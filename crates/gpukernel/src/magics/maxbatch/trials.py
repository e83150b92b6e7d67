"""%maxbatch's python engine: the trials run inside the user's own Python kernel.

gpukernel's search (Rust) picks the batch sizes and draws the progress; this module runs each
trial as real eager training steps of the user's model in the user's process, and answers with
what torch's caching allocator measured. gpukernel installs the source as a private module
(in ``sys.modules`` under a private key, removed by ``close``) and calls it through silent user_expressions, so
the notebook gains no names, no history and no execution count.

The user's state survives every trial exactly. ``prepare`` copies to host memory (never a
second GPU copy) the parameters (the standard step leaves out those it cannot write: frozen
ones no optimizer holds, or all of them for --inference; a step function's frozen ones are
kept, and put back only where a trial changed their layout or fingerprint), buffers,
gradients, optimizer state (through the lists and dicts it may hold, as LBFGS's history) and
hyper-parameters, GradScaler and LR-scheduler state, the random number generators (torch CPU
and CUDA, Python's ``random``, NumPy's global one), every module's training flag and its
layout (which tensor sits under each registered name, its plain attributes); after each trial
(success, out of memory, an error in the user's step, an interrupt) they are put back in place.

A trial is one of:
- ``step``: the user's own function ``FN(batch_size)``, called as their loop would call it (the
  previous call's return value alive until the next returns);
- ``module``: a standard step built from the module, shaped like the usual training loop:
  ``zero_grad(set_to_none=True)``; forward (under ``torch.autocast`` with ``amp``); the loss;
  backward (through a ``GradScaler`` for fp16); the optimizer step. As in a ``for`` loop, the
  previous step's output is still alive while the next forward runs. The probe's forward
  (``probe_output``) reads from the model what its loop feeds it: token ids for an Embedding
  the input reaches first (never longer than a learned position table: past it a GPU's
  lookup is a device-side assert), the batch on dim 1 for a seq-first layer, and targets for a
  forward that takes them (nanoGPT's `targets`, a Hugging Face model's `labels`), whose own
  loss the step then trains on; without targets, a scalar loss the forward returns computed
  from its output (MAE's `(loss, pred, mask)`), which the step trains on alone, or adds to
  the cross-entropy on class scores it is computed from (a z-loss), as gpukernel decides.
  A LightningModule's standard step is its Trainer's under automatic optimization
  (``_training_steps``): ``training_step((input, target), 0)``, the optimizer's ``zero_grad``
  (after it: the last step's gradients live through the forward), backward, the optimizer
  step, the optimizer from its ``configure_optimizers()``; the target made as the loss
  inferred from the forward's output would take it.

A trial runs up to ``steps`` steps, and ends sooner, far below the limit, at the first step
(from the second on) that leaves memory as the step before left it (``_run_steps``).

Out of memory is recognised by type (``torch.OutOfMemoryError``) or, for an exception of
another type that wraps one, by the allocator's own ``num_ooms`` counter going up; never by the
message's text. A step that returns has trained its batch, whatever it caught on the way.
"""

import gc
import importlib
import inspect
import sys
import time
import warnings


# A trial's steps end early (Session._run_steps) only with the cache at most this fraction of
# the limit, and when a step left the allocated bytes within this fraction of the limit of
# where the step before left them.
STEADY_HEADROOM = 0.95
STEADY_SLACK = 0.001

# The batch of the forward pass that reads the output's shape: BatchNorm refuses one sample in
# training mode.
PROBE_BATCH = 2

# The names a forward takes its training targets under: nanoGPT's and minGPT's `targets`,
# Hugging Face's `labels`.
TARGET_PARAMETERS = ("targets", "labels", "target")

# What to do with a model that a single input tensor cannot drive.
STEP_HINT = ("write a function FN(batch_size) that runs one training step of yours (inputs, "
             "loss, backward, optimizer step) and run %maxbatch --step FN")


def _lightning_hint(name):
    """For a LightningModule whose step the standard one cannot run as its Trainer does."""
    return (f"Write FN(batch_size) that makes one batch of yours and runs your step, e.g. "
            f"`def step(n): loss = {name}.training_step(make_batch(n), 0); opt.zero_grad(); "
            f"loss.backward(); opt.step()`, and run %maxbatch --step step")


class MaxBatchError(Exception):
    """A problem with what the user asked for, said in a way they can act on."""


class _ForwardFailed(MaxBatchError):
    """The probe's forward failed on the input alone: `failure` (the exception's first line),
    and the parts of the message a refusal that tried targets next is built from."""

    def __init__(self, failure, head, check, message=None):
        super().__init__(message or f"{head}; check {check}, or if it takes more than one "
                         f"input: {STEP_HINT}")
        self.failure, self.head, self.check = failure, head, check


def _a(obj):
    """'a list', 'an int': the article and the name of an object's type."""
    name = "Python module" if isinstance(obj, type(sys)) else type(obj).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _torch():
    torch = sys.modules.get("torch")
    if torch is None:
        raise MaxBatchError("torch is not imported in this notebook: %maxbatch sizes a model or "
                            "a step function of the notebook, so import torch and build it first")
    return torch


def _lookup(user_ns, name):
    parts = name.split(".")
    if parts[0] not in user_ns:
        raise MaxBatchError(f"{parts[0]!r} is not defined in this notebook")
    obj = user_ns[parts[0]]
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            raise MaxBatchError(f"{'.'.join(parts[:i])} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


# --- the state a trial may touch, and its host-memory copy ------------------------------------

def _host(t):
    # A GPU tensor's copy goes to pinned (page-locked) memory: putting it back after every
    # trial is then one DMA at full bus speed instead of a staged copy through pageable memory.
    if t.is_cuda:
        try:
            host = t.new_empty(t.shape, device="cpu", pin_memory=True)
        except RuntimeError:  # page-locked memory refused (a limit on it): pageable then
            return t.detach().to("cpu", copy=True)
        return host.copy_(t.detach())
    return t.detach().to("cpu", copy=True)


def _put(current, saved, device):
    """Puts a saved tensor back: in place where the tensor is still the same kind, else new."""
    if (current is not None and current.shape == saved.shape and current.dtype == saved.dtype
            and current.device == device):
        current.copy_(saved, non_blocking=True)
        return current
    # A copy even where `saved` is on that device already (CPU state): the step must never
    # write into the snapshot itself.
    return saved.to(device, non_blocking=True, copy=True)


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


class _Kept:
    """The host copy of one tensor and the device it came from."""
    __slots__ = ("device", "host")

    def __init__(self, t):
        self.device, self.host = t.device, _host(t)


def _is_namedtuple(value):
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_sequence(value):
    """A list or tuple the containers' walk rebuilds (other subclasses stay as they are)."""
    return type(value) in (list, tuple) or _is_namedtuple(value)


def _map_leaves(value, is_leaf, leaf):
    """`value` with every leaf replaced by `leaf(it)`, through lists, tuples (named ones too)
    and dicts, which are rebuilt; anything else as it is."""
    if is_leaf(value):
        return leaf(value)
    if _is_sequence(value):
        items = [_map_leaves(v, is_leaf, leaf) for v in value]
        return type(value)(*items) if _is_namedtuple(value) else type(value)(items)
    if type(value) is dict:
        return {k: _map_leaves(v, is_leaf, leaf) for k, v in value.items()}
    return value


def _keep(torch, value):
    """A copy of an optimizer's state value: tensors to host memory, and the lists, tuples
    and dicts around them rebuilt (LBFGS keeps its history in lists it appends to and pops
    from in place: kept by reference, a trial's steps would rewrite the user's history)."""
    return _map_leaves(value, torch.is_tensor, _Kept)


def _kept_bytes(kept):
    sizes = []
    _map_leaves(kept, lambda v: isinstance(v, _Kept),
                lambda k: sizes.append(k.host.numel() * k.host.element_size()))
    return sum(sizes)


def _bring_back(current, kept):
    """The value `kept` stands for, on its device again: a tensor in place where `current`
    is still one of its kind; in containers, new tensors, as `_keep` found them."""
    if isinstance(kept, _Kept):
        return _put(current, kept.host, kept.device)
    return _map_leaves(kept, lambda v: isinstance(v, _Kept),
                       lambda k: _put(None, k.host, k.device))


def _needs_closure(opt):
    """Whether `opt.step` must be given a closure that recomputes the loss (LBFGS)."""
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _holds_data(torch, t):
    """Whether a tensor holds values a trial could change and a copy could keep: not one on
    the meta device, nor a lazy module's parameter before its first forward."""
    lazy = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())
    return not t.is_meta and not isinstance(t, lazy)


class _Layout:
    """What one module holds besides its tensors' values: which tensor sits under each
    registered name (None included), and its plain attributes, numbers and strings and
    tensors it never registered. A forward can change them together: a rotary embedding that
    meets a longer sequence replaces its cache buffer and raises `max_seq_len_cached`; an EMA
    written `self.ema = 0.9 * self.ema + ...` replaces its buffer. Put back together, the
    module is as it was, not half so. (TorchScript modules keep theirs in C++ wrappers, which
    only their values' copies reach.)"""

    def __init__(self, torch, module, values=True):
        """`values`: whether plain tensors' values are kept too (a module's; a plain object's
        tensors are kept apart, within the loose tensors' budget)."""
        self.module = module
        attrs = module.__dict__
        self.registered = {kind: dict(attrs[kind]) for kind in ("_parameters", "_buffers")
                           if type(attrs.get(kind)) is dict}
        # A plain tensor's values too where it is a leaf: one made by the forward from the
        # weights (old weight_norm's `weight`) keeps its graph, and only its identity.
        self.plain = {k: (v, _host(v) if values and torch.is_tensor(v) and v.grad_fn is None
                          and _holds_data(torch, v) else None)
                      for k, v in attrs.items()
                      if isinstance(v, _SCALARS) or torch.is_tensor(v)}
        # Lists and dicts it holds, by their contents (a forward that appends what it saw, or
        # keeps activations for a hook, would keep the trials' tensors alive).
        self.contents = {k: (v, _contents(v)) for k, v in attrs.items()
                         if type(v) in (list, dict)}
        self.names = set(attrs)

    def restore(self, torch):
        # After every trial, over every module: the scans for names a trial added run only
        # where the names differ (632 modules of a 48-layer GPT-2 on the CPU: 0.75 ms a
        # restore, 4 ms with both scans every time).
        attrs = self.module.__dict__
        for kind, saved in self.registered.items():
            held = attrs[kind]
            if held.keys() != saved.keys():
                for name in [n for n in held if n not in saved]:
                    del held[name]  # registered during the trial
            for name, t in saved.items():
                if held.get(name, held) is not t:
                    held[name] = t
        if attrs.keys() != self.names:
            for k in [k for k, v in attrs.items() if k not in self.plain
                      and (isinstance(v, _SCALARS) or torch.is_tensor(v))]:
                del attrs[k]  # set during the trial
        for k, (v, value) in self.plain.items():
            if attrs.get(k, attrs) is not v:
                attrs[k] = v
            if value is not None:
                with torch.no_grad():
                    v.copy_(value, non_blocking=True)
        for k, (v, kept) in self.contents.items():
            if attrs.get(k, attrs) is not v:
                attrs[k] = v
            _put_contents(v, kept)


_ABSENT = object()  # a global the step assigns that did not exist before it


def _contents(container):
    """A list's or dict's entries, by reference (`_put_contents` puts them back)."""
    return list(container) if type(container) is list else dict(container)


def _put_contents(container, kept):
    """Puts `kept` back into `container` in place, where its entries changed."""
    if type(container) is list:
        if len(container) != len(kept) or any(a is not b for a, b in zip(container, kept)):
            container[:] = kept
    elif container.keys() != kept.keys() or any(container[k] is not kept[k] for k in kept):
        container.clear()
        container.update(kept)


# Words a fingerprint reads per chunk: its temporaries (one chunk's weights and products,
# int64) take 64 MiB on the tensor's device whatever the tensor's size, and are freed with it.
_PRINT_CHUNK = 1 << 22
# Devices where reading a tensor for its fingerprint is cheaper than copying it back: a GPU
# reads at its memory's bandwidth, a CPU computes the weighted sum ten times slower than it
# copies (the tests add "cpu" to run the GPU's path).
_PRINTED_DEVICES = ("cuda",)


class _PrintKey:
    """The secret random odd weights of one session's fingerprints: drawn from a generator of
    their own (the user's random streams stay untouched), so no change a step makes can line
    up with them, as it could with fixed ones (+3 and -1 at positions whose fixed weights are
    in the ratio 1:3 cancel)."""

    def __init__(self, torch):
        import os
        self.torch = torch
        self.seed = int.from_bytes(os.urandom(8), "little") >> 1

    def weights(self, device):
        """One chunk's weights on `device`, int64, every one odd: the same on every call."""
        torch = self.torch
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        w = torch.randint(-2**63, 2**63 - 1, (_PRINT_CHUNK,), dtype=torch.int64,
                          device=device, generator=gen)
        return w.bitwise_or_(1)

    def factors(self, chunks, device):
        """Each chunk's own odd factor (so that chunks weighted alike do not cancel)."""
        import random
        rng = random.Random(self.seed)
        values = [(rng.getrandbits(64) | 1) - (1 << 63) for _ in range(chunks)]
        # -2^63 + odd is odd: the shift only brings the value into int64's range.
        return self.torch.tensor(values, dtype=self.torch.int64, device=device)


def _flat_words(torch, t):
    """`t`'s bytes in memory order as 16-bit words (8-bit for 1-byte elements), a view, or
    None where they cannot be read in place: a tensor subclass (a quantized wrapper's
    parameter), quantized or sparse storage, or elements that overlap or leave gaps."""
    if type(t.data) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return None
    sizes, strides = t.shape, t.stride()
    expected = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return None  # not dense: a slice, a broadcast, an expanded view
        expected *= size
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    if t.element_size() == 1:
        return flat.view(torch.uint8)
    if t.element_size() % 2:
        return None
    return flat.view(torch.uint8).view(torch.int16) if t.element_size() != 2 \
        else flat.view(torch.int16)


def _fingerprint(torch, t, key, weights=None):
    """A fingerprint of `t`'s bits, computed on its own device: the sum over its 16-bit words
    (8-bit for 1-byte elements; so NaN payloads and -0.0 count), each times a secret random
    odd weight (`key`'s: its place in its chunk's, times its chunk's own), modulo 2^64
    (torch's int64 arithmetic wraps). A change of one word, being less than 2^16, always
    changes it; a change of several escapes only if their weighted differences cancel modulo
    2^64, which for weights the change cannot know has a chance of at most 2^-48 (a word's
    change has at most 15 factors of 2, leaving 48 of the 63 random bits of an odd weight
    to match). A 0-d int64
    tensor, not synchronized; None where the bits cannot be read in place (`_flat_words`) or
    are cheaper copied back than read (not on a GPU). `weights`: `key.weights(t.device)`,
    made here if not given."""
    if t.device.type not in _PRINTED_DEVICES:
        return None
    words = _flat_words(torch, t)
    if words is None:
        return None
    if weights is None:
        weights = key.weights(t.device)
    n = weights.numel()
    # Two kernels a chunk (products, their sum), then one sum over the chunks.
    parts = [(words[at:at + n] * weights[:min(n, words.numel() - at)]).sum()
             for at in range(0, words.numel(), n)]
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return (torch.stack(parts) * key.factors(len(parts), t.device)).sum()


class _Watched:
    """Frozen weights a user's step may write but seldom does (a frozen base under LoRA
    adapters; a BYOL or DINO teacher it updates in place): kept in host memory as every
    parameter is, but after a trial put back only where their fingerprint, or their shape,
    strides or dtype, changed. Measured on an H100 for an 8 GiB bf16 base
    (bench/results/watched-restore-check-2026-12-06): 85 ms a trial to fingerprint it,
    against 175 ms to copy it back from pinned memory; a base the step writes every trial
    pays both. A tensor whose fingerprint cannot be taken (no room for its 64 MiB on the GPU,
    an odd kind of tensor, off a GPU) is put back after every trial, as any other."""

    def __init__(self, torch, tensors):
        self.torch = torch
        self.key = _PrintKey(torch)
        self.kept = [(t, _host(t), self._layout(t)) for t in tensors]
        self.prints = self._prints()
        self.put_back = 0  # tensors put back so far, for the report and the tests

    @staticmethod
    def _layout(t):
        return (tuple(t.shape), t.stride(), t.dtype, t.device)

    def _prints(self):
        torch = self.torch
        prints, weights, failed = [], {}, set()
        for t, _, _ in self.kept:
            print_ = None
            if t.device not in failed:
                try:
                    if t.device not in weights and t.device.type in _PRINTED_DEVICES:
                        weights[t.device] = self.key.weights(t.device)
                    print_ = _fingerprint(torch, t, self.key, weights.get(t.device))
                except Exception:  # no room on the device, a tensor kind torch cannot view
                    failed.add(t.device)  # once: every try would count another OOM
            prints.append(print_)
        del weights
        # One synchronization a device for all of them (a base split over several GPUs).
        read = {}
        for device in {p.device for p in prints if p is not None}:
            at = [i for i, p in enumerate(prints) if p is not None and p.device == device]
            read |= zip(at, torch.stack([prints[i] for i in at]).tolist())
        return [read.get(i) for i in range(len(prints))]

    def bytes(self):
        return sum(h.numel() * h.element_size() for _, h, _ in self.kept)

    def restore(self):
        """Puts back what the trial changed (all of it where the fingerprints fail)."""
        if not self.kept:
            return
        torch = self.torch
        reshaped = [self._layout(t) != layout for t, _, layout in self.kept]
        with torch.no_grad():
            for (t, host, (shape, stride, dtype, device)), changed in zip(self.kept, reshaped):
                if changed:  # `t.data = ...` in the step: the old layout and values back
                    t.data = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                    t.copy_(host)
        now = self._prints()
        with torch.no_grad():
            for (t, host, _), before, after, done in zip(self.kept, self.prints, now, reshaped):
                if done:
                    self.put_back += 1
                elif before is None or after is None or before != after:
                    t.copy_(host, non_blocking=True)  # `_settle` synchronizes after
                    self.put_back += 1
                if t.grad is not None:  # none when kept: a step that set one leaves none
                    t.grad = None


class Snapshot:
    """Host copies of everything a trial can change, and how to put it back."""

    def __init__(self, torch, modules, optimizers, scalers, schedulers, fixed=lambda p: False,
                 reached=None):
        """`fixed(p)`: whether the step cannot write parameter `p` (the standard step and a
        frozen weight no optimizer holds): it is not copied, so a frozen base under LoRA
        adapters costs no host memory and no copy per trial. A frozen weight the step may
        write (the user's own step) and no optimizer holds is watched (`_Watched`).
        `reached`: find_state's generators, loose tensors and plain objects of a step function
        (name -> object per kind)."""
        self.torch = torch
        reached = reached or {}
        params, buffers, watched, seen = [], [], [], set()
        optimized = set().union(*map(_held_parameters, optimizers))
        self.fixed_bytes = 0
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen and _holds_data(torch, p):
                    seen.add(id(p))
                    if fixed(p):
                        self.fixed_bytes += p.numel() * p.element_size()
                        continue
                    if not p.requires_grad and p.grad is None and id(p) not in optimized:
                        watched.append(p)
                        continue
                    params.append(p)
            for b in module.buffers():
                if id(b) not in seen and _holds_data(torch, b):
                    seen.add(id(b))
                    buffers.append(b)
        for opt in optimizers:  # parameters an optimizer holds outside any module found
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        self.seen = seen
        loose, self.loose_left_out = self._loose(reached.get("tensor", {}))
        self.params = [(p, _host(p), None if p.grad is None else _host(p.grad)) for p in params]
        self.watched = _Watched(torch, watched + loose)
        self.requires_grad = [(p, p.requires_grad) for p in params + watched]
        self.buffers = [(b, _host(b)) for b in buffers]
        every = list({id(m): m for module in modules for m in module.modules()}.values())
        self.layouts = [_Layout(torch, m) for m in every]
        self.layouts += [_Layout(torch, o, values=False)
                         for o in reached.get("object", {}).values()
                         if not hasattr(o, "__next__")]  # an iterator's half would mislead
        self.flags = [(m, m.training) for m in every]
        self.containers = [(c, _contents(c)) for c in reached.get("container", {}).values()]
        self.globals = [(g, name, g.get(name, _ABSENT))
                        for g, name in reached.get("global", {}).values()]
        self.optimizers = [(opt, self._optimizer_state(opt)) for opt in optimizers]
        self.scalers = [(s, s.state_dict()) for s in scalers]
        self.schedulers = [(s, s.state_dict()) for s in schedulers]
        self.rng = self._rng()
        getters = _generator_kinds(torch)
        self.generators = [(g, put, get(g)) for g in reached.get("generator", {}).values()
                           for cls, get, put in getters if isinstance(g, cls)]
        self.adopted = []  # optimizers first met stepping during a trial (`adopt_optimizer`)

    # Loose tensors (an EMA's shadow weights, a queue) kept at most: a step that names its
    # dataset's tensors would otherwise copy the whole dataset to host memory.
    LOOSE_BYTES = 4 << 30

    def _loose(self, tensors):
        """The loose tensors to keep, smallest first within LOOSE_BYTES, and the names of
        those left out."""
        torch = self.torch
        fresh = sorted(((n, t) for n, t in tensors.items()
                        if id(t) not in self.seen and _holds_data(torch, t)),
                       key=lambda nt: nt[1].numel() * nt[1].element_size())
        kept, left_out, total = [], [], 0
        for name, t in fresh:  # each tensor once: find_state keeps an object under one name
            size = t.numel() * t.element_size()
            self.seen.add(id(t))
            if total + size > self.LOOSE_BYTES:
                left_out.append(name)
                continue
            total += size
            kept.append(t)
        return kept, left_out

    def adopt_optimizer(self, opt):
        """Keeps an optimizer met stepping during a trial that find_state did not reach (a
        registry of the user's own): called before its step, so its state and its parameters'
        values are still as they were (their gradients are the trial's)."""
        if any(opt is o for o, _ in self.optimizers):
            return
        self.optimizers.append((opt, self._optimizer_state(opt)))
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in self.seen and _holds_data(self.torch, p):
                    self.seen.add(id(p))
                    self.params.append((p, _host(p), None))
                    self.requires_grad.append((p, p.requires_grad))
        self.adopted.append(f"{type(opt).__name__} over "
                            f"{sum(len(g['params']) for g in opt.param_groups)} tensors")

    def _optimizer_state(self, opt):
        torch = self.torch
        state = {p: {k: _keep(torch, v) for k, v in entry.items()}
                 for p, entry in opt.state.items()}
        groups = [({k: _keep(torch, v) for k, v in g.items() if k != "params"},
                   list(g["params"])) for g in opt.param_groups]
        return state, groups

    def _rng(self):
        torch = self.torch
        rng = {"torch": torch.random.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if "random" in sys.modules:
            rng["random"] = sys.modules["random"].getstate()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            rng["numpy"] = numpy.random.get_state()
        return rng

    def bytes(self):
        n = self.watched.bytes()
        n += sum(h.numel() * h.element_size() for _, h, _ in self.params)
        n += sum(g.numel() * g.element_size() for _, _, g in self.params if g is not None)
        n += sum(h.numel() * h.element_size() for _, h in self.buffers)
        n += sum(h.numel() * h.element_size() for layout in self.layouts
                 for _, h in layout.plain.values() if h is not None)
        for _, (state, groups) in self.optimizers:
            n += _kept_bytes(list(state.values())) + _kept_bytes([g for g, _ in groups])
        return n

    def restore(self):
        """Puts everything back. Optimizer state a trial created (an optimizer that had not
        stepped yet) goes too, so every trial starts as the user's loop will: its first step
        makes that state among the step's freed activations, exactly where the user's own first
        step will, and the next step runs in the cache that leaves. (Kept between trials
        instead, it would sit in one block made at the smallest trial: measured on an H200,
        that overstates a fresh loop's maximum by up to 12% for LMs trained with AdamW.)"""
        torch = self.torch
        # First: its fingerprints synchronize, which must not wait for the copies below.
        self.watched.restore()
        with torch.no_grad():
            # Copies from pinned memory run asynchronously; `_settle` synchronizes after.
            for p, value, grad in self.params:
                p.copy_(value, non_blocking=True)
                if grad is None:
                    p.grad = None
                else:
                    p.grad = _put(p.grad, grad, p.device)
            for b, value in self.buffers:
                b.copy_(value, non_blocking=True)
        for m, training in self.flags:
            m.training = training
        for opt, (state, groups) in self.optimizers:
            for p in [p for p in opt.state if p not in state]:
                del opt.state[p]  # state the trial created: its memory goes now
            for p, entry in state.items():
                current = opt.state[p]
                for k in [k for k in current if k not in entry]:
                    del current[k]
                for k, v in entry.items():
                    current[k] = _bring_back(current.get(k), v)
            del opt.param_groups[len(groups):]  # a group the step added (unfreezing)
            for group, (saved, group_params) in zip(opt.param_groups, groups):
                for k, v in saved.items():
                    group[k] = _bring_back(group.get(k), v)
                if len(group["params"]) != len(group_params) or any(
                        a is not b for a, b in zip(group["params"], group_params)):
                    group["params"] = list(group_params)
            held = _held_parameters(opt)
            for p in [p for p in opt.state if id(p) not in held]:
                del opt.state[p]
        for p, flag in self.requires_grad:
            if p.requires_grad != flag:
                p.requires_grad_(flag)
        for scaler, state in self.scalers:
            scaler.load_state_dict(state)
            per_optimizer = getattr(scaler, "_per_optimizer_states", None)
            if per_optimizer is not None:
                per_optimizer.clear()  # a step cut between scaler.step and scaler.update
        for scheduler, state in self.schedulers:
            scheduler.load_state_dict(state)
        torch.random.set_rng_state(self.rng["torch"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])
        if "random" in self.rng:
            sys.modules["random"].setstate(self.rng["random"])
        if "numpy" in self.rng:
            sys.modules["numpy"].random.set_state(self.rng["numpy"])
        for generator, put, state in self.generators:
            put(generator, state)
        # Last: the rest is back whatever an odd module's attributes do here.
        for layout in self.layouts:
            layout.restore(torch)
        for container, kept in self.containers:
            _put_contents(container, kept)
        for g, name, value in self.globals:
            if value is _ABSENT:
                g.pop(name, None)
            elif g.get(name, _ABSENT) is not value:
                g[name] = value


def _stateful_kinds(torch):
    kinds = {"module": torch.nn.Module, "optimizer": torch.optim.Optimizer}
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        kinds["scaler"] = scaler
    cuda_scaler = getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)
    if cuda_scaler is not None and cuda_scaler is not scaler:
        kinds["cuda_scaler"] = cuda_scaler
    scheduler = getattr(torch.optim.lr_scheduler, "LRScheduler", None)
    if scheduler is not None:
        kinds["scheduler"] = scheduler
    return kinds


# How far through containers and attributes the objects a step function names are searched
# for state (a Trainer's `self.parts["model"]`, a config's `cfg.train.model`), and how many
# objects at most: a step that names a dataset must not have every sample walked.
REACH_DEPTH = 4
REACH_OBJECTS = 20000


def _generator_kinds(torch):
    """Random generators a step may draw from besides the global ones: (class, get, set)."""
    import random
    kinds = [(torch.Generator, lambda g: g.get_state(), lambda g, s: g.set_state(s)),
             (random.Random, lambda r: r.getstate(), lambda r, s: r.setstate(s))]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds += [(numpy.random.Generator, lambda g: g.bit_generator.state,
                   lambda g, s: setattr(g.bit_generator, "state", s)),
                  (numpy.random.RandomState, lambda r: r.get_state(),
                   lambda r, s: r.set_state(s))]
    return kinds


def find_state(torch, user_ns, extra=()):
    """Every module, optimizer, GradScaler and LR scheduler a step could touch: the notebook's
    variables and the objects they hold one level down (a Trainer's model and optimizer), and
    what `extra` (a step function's closure and globals) reaches REACH_DEPTH levels down. From
    `extra` also: random generators of its own, tensors outside any module (an EMA's shadow
    weights in a list), and plain objects whose attributes it may change (the EMA's step
    counter). Returns name -> object per kind."""
    kinds = _stateful_kinds(torch)
    generators = tuple(cls for cls, _, _ in _generator_kinds(torch))
    found = {k: {} for k in ("module", "optimizer", "scaler", "scheduler", "generator",
                             "tensor", "object", "container")}
    depth_seen = {}
    budget = [REACH_OBJECTS]
    kept = {}  # id -> (kind, name): an object reached by two paths is kept once

    def keep(kind, name, obj):
        """Under the shortest of its paths' names (`opt` rather than `opts['gpt']`, and
        the notebook's name on a tie, its variables being visited first); a name another
        object holds already (a closure's `model` beside the notebook's) is numbered."""
        before = kept.get(id(obj))
        if before is not None:
            if _hops(before[1]) <= _hops(name):
                return
            del found[before[0]][before[1]]
        table, base, n = found[kind], name, 1
        while name in table:
            n += 1
            name = f"{base} ({n})"
        table[name] = obj
        kept[id(obj)] = (kind, name)

    def visit(name, obj, depth, reached):
        try:
            inspect(name, obj, depth, reached)
        except Exception:  # an odd object (a lazy proxy, say) is not state we can keep
            pass

    def inspect(name, obj, depth, reached):
        if isinstance(obj, type) or type(obj).__name__ == "module" or isinstance(obj, _SCALARS):
            return
        if depth_seen.get(id(obj), -1) >= depth or budget[0] <= 0:
            return
        budget[0] -= 1
        depth_seen[id(obj)] = depth
        for kind, cls in kinds.items():
            if isinstance(obj, cls):
                keep("scaler" if kind == "cuda_scaler" else kind, name, obj)
                return
        if torch.is_tensor(obj):
            if reached:
                keep("tensor", name, obj)
            return
        if isinstance(obj, generators):
            if reached:
                keep("generator", name, obj)
            return
        if depth == 0:
            return
        if reached and type(obj) in (list, dict):  # a history, a flag the step keeps
            keep("container", name, obj)
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:256]:
                visit(f"{name}[{k!r}]", v, depth - 1, reached)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj[:256]):
                visit(f"{name}[{i}]", v, depth - 1, reached)
        elif hasattr(obj, "__dict__") and not callable(obj):
            attrs = vars(obj)
            if reached and type(attrs) is dict:
                keep("object", name, obj)
            for k, v in list(attrs.items())[:256]:
                visit(f"{name}.{k}", v, depth - 1, reached)
        elif callable(obj) and hasattr(obj, "__self__"):  # a bound method: its object
            visit(f"{name}.__self__", obj.__self__, depth, reached)

    for name, obj in list(user_ns.items()):
        if not name.startswith("_"):
            visit(name, obj, 1, False)
    for name, obj, own in extra:
        visit(name, obj, REACH_DEPTH if own else 1, own)
    return found


def _hops(name):
    """How many steps a found object's name takes from a root: `opt` 0, `opts['gpt']` 1,
    `step.__self__.model` 2."""
    return name.count(".") + name.count("[")


class _StepRefs:
    """What a step function reaches beyond the notebook's variables: `refs`, [(name, object,
    whether the user's own code reaches it)] (closure cells, functools.partial arguments, a
    bound method's object, globals it names; a library function's are searched only for
    modules and optimizers, as a notebook variable is), and `assigned`, [(globals, name)] of
    the globals the user's code assigns (`global unfrozen`): put back with the state they
    describe."""

    def __init__(self, fn, name="step"):
        self.refs, self.assigned = [], []
        seen = set()
        stack = [(name, fn, True)]
        while stack and len(self.refs) < 1024:
            name, f, own = stack.pop()
            if id(f) in seen:
                continue
            seen.add(id(f))
            if hasattr(f, "func") and hasattr(f, "args"):  # functools.partial
                stack.append((f"{name}.func", f.func, own))
                self.refs += [(f"{name}.args[{i}]", a, own) for i, a in enumerate(f.args)]
                self.refs += [(f"{name}.keywords[{k!r}]", v, own)
                              for k, v in (f.keywords or {}).items()]
                continue
            if hasattr(f, "__self__") and not isinstance(f.__self__, type(sys)):
                self.refs.append((f"{name}.__self__", f.__self__, own))
            f = (getattr(f, "__wrapped__", None) or getattr(f, "_torchdynamo_orig_callable", None)
                 or f)
            code = getattr(f, "__code__", None)
            if code is None:
                continue
            own = own and not _is_library(code.co_filename)
            for cell_name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                self.refs.append((cell_name, value, own))
                if callable(value):
                    stack.append((cell_name, value, own))
            globals_ = getattr(f, "__globals__", {})
            for g in code.co_names:
                if g in globals_:
                    value = globals_[g]
                    self.refs.append((g, value, own))
                    if callable(value) and not isinstance(value, type):
                        stack.append((g, value, own))
            if own:
                self.assigned += [(globals_, g) for g in _globals_stored(code)]


def _globals_stored(code):
    """The global names a code object (and the functions defined in it) assigns or deletes."""
    import dis
    names = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            names.add(instruction.argval)
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _globals_stored(const)
    return names


# The tables of a module (and of torch, for every module) whose hooks a forward or backward
# runs.
_MODULE_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                       "_backward_hooks")
_GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                       "_global_backward_pre_hooks", "_global_backward_hooks")


def _model_code_refs(torch, modules, optimizers):
    """What the user's code inside the model reaches, as `_StepRefs` of it all, (refs,
    assigned): a step runs the forward and backward hooks of every layer of its modules (and
    torch's global ones), their parameters' gradient hooks, its optimizers' step hooks, and the
    forward each layer runs where the user's own code defines it. A hook or forward that keeps
    what it saw (`feats.append(out)`, `acts[name] = out.detach()`, attention maps in a global
    list, a counter) changes the user's state at every trial's step, and keeps a trial's
    activations alive on the GPU after the search."""
    code = []  # (name, function)

    def add(where, table):
        if isinstance(table, dict):
            code.extend((f"a hook on {where}", h) for h in list(table.values())
                        if callable(h) and not hasattr(h, _HOOK_MARK))

    for root, module in modules.items():
        for rel, m in module.named_modules():
            where = f"{root}.{rel}" if rel else root
            for table in _MODULE_HOOK_TABLES:
                add(where, m.__dict__.get(table))
            for p in m.__dict__.get("_parameters", {}).values():
                if torch.is_tensor(p):
                    add(where, getattr(p, "_backward_hooks", None))
                    add(where, getattr(p, "_post_accumulate_grad_hooks", None))
    nn_module = importlib.import_module("torch.nn.modules.module")
    for table in _GLOBAL_HOOK_TABLES:
        add("torch.nn", getattr(nn_module, table, None))
    for name, opt in optimizers.items():
        add(name, getattr(opt, "_optimizer_step_pre_hooks", None))
        add(name, getattr(opt, "_optimizer_step_post_hooks", None))
    # The forwards of the user's own classes (a library's reach nothing of the user's), as
    # each layer resolves it: a subclass without a forward of its own runs its base's.
    forwards = {}
    for module in modules.values():
        for m in module.modules():
            forward = getattr(type(m), "forward", None)
            forwards.setdefault(id(forward), forward)
    # A LightningModule's training_step is the step's code too (`self.losses.append(loss)`).
    for module in modules.values():
        step = getattr(type(module), "training_step", None)
        forwards.setdefault(id(step), step)
    for forward in forwards.values():
        co = getattr(forward, "__code__", None)
        if co is not None and not _is_library(co.co_filename):
            code.append((getattr(forward, "__qualname__", "forward"), forward))
    refs, assigned = [], []
    for name, fn in code[:256]:
        one = _StepRefs(fn, name)
        refs += one.refs
        assigned += one.assigned
    return refs, assigned


def _step_and_state(torch, user_ns, spec):
    """The step a session runs, the state its trials put back (name -> object per kind), and
    whether the model's own code (hooks, forwards) reaches state of the user's beyond it."""
    if spec["kind"] == "step":
        step = FunctionStep(torch, user_ns, spec)
        refs = _StepRefs(step.fn)
        found = find_state(torch, user_ns, refs.refs)
        code_refs, code_assigned = _model_code_refs(torch, found["module"], found["optimizer"])
        # Whether the model's code reaches state the step's own references do not.
        hooked = any(a not in refs.assigned for a in code_assigned)
        if code_refs:  # again with what the model's code reaches, each object kept once
            with_code = find_state(torch, user_ns, refs.refs + code_refs)
            hooked |= _kept_count(with_code) > _kept_count(found)
            found = with_code
        found["global"] = {name: (g, name) for g, name in refs.assigned + code_assigned}
        return step, found, hooked
    step = ModuleStep(torch, user_ns, spec, find_state(torch, user_ns))
    # The standard step touches the module, its optimizer, what their hooks and the module's
    # own forwards reach, and nothing else.
    found = {"module": {step.name: step.model}, "optimizer": {}, "scaler": {}, "scheduler": {}}
    if step.optimizer is not None:
        found["optimizer"][step.optimizer_name] = step.optimizer
    code_refs, code_assigned = _model_code_refs(torch, found["module"], found["optimizer"])
    reached = find_state(torch, {}, code_refs) if code_refs else {}
    for kind in ("generator", "tensor", "object", "container"):
        found[kind] = reached.get(kind, {})
    found["global"] = {name: (g, name) for g, name in code_assigned}
    hooked = _kept_count(found) > len(found["module"]) + len(found["optimizer"])
    return step, found, hooked


def _kept_count(found):
    """How many objects find_state's result keeps, of every kind."""
    return sum(len(table) for table in found.values())


# --- the standard step built from a module -------------------------------------------------

def _output_items(out):
    """A container output's entries as [(how to reach it, value)]: a dict's (a Hugging Face
    ModelOutput is one) by key, a named tuple's by field, a tuple's or list's by index."""
    if isinstance(out, dict):
        return [(f"output[{k!r}]", v) for k, v in out.items()]
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return [(f"output.{k}", v) for k, v in zip(out._fields, out)]
    if isinstance(out, (tuple, list)):
        return [(f"output[{i}]", v) for i, v in enumerate(out)]
    return []


def _output_bytes(torch, out, model, depth=4):
    """The bytes the tensors of a forward's output hold (each storage once): what a loop's
    `out = model(x)` keeps alive into the next step's forward. A Hugging Face cache is walked
    too; the model's own weights and buffers (returned as they are) are not counted, since
    they do not grow with the batch."""
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
             if t.layout == torch.strided and t.device.type != "meta"}
    storages = {}

    def walk(value, depth):
        if torch.is_tensor(value):
            if value.device.type == "meta":
                return
            try:
                storage = value.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (NotImplementedError, RuntimeError):  # sparse or jagged: no one storage
                key, size = id(value), value.numel() * value.element_size()
            if key not in owned:
                storages[key] = size
        elif depth > 0:
            for v in [v for _, v in _output_items(value)] or _cache_tensors(value):
                walk(v, depth - 1)
    walk(out, depth)
    return sum(storages.values())


def _cache_tensors(value):
    """The keys and values a Hugging Face cache object holds (its `layers` since 4.56, its
    `key_cache` and `value_cache` lists before), which a training forward returns with the
    logits where the config's use_cache is on."""
    layers = getattr(value, "layers", None)
    if isinstance(layers, list):
        return [t for layer in layers for t in (getattr(layer, "keys", None),
                                                getattr(layer, "values", None))]
    return [*(getattr(value, "key_cache", None) or []), *(getattr(value, "value_cache", None) or [])]


def _select_output(torch, out):
    """The tensor a loss is computed on: the output itself, `.logits` / ['logits'], or the
    first floating-point tensor of a tuple or dict that is not a scalar (a model that returns
    `(aux_loss, logits)` puts a loss first). Returns (tensor, how it was found)."""
    if torch.is_tensor(out):
        return out, "output"
    logits = getattr(out, "logits", None)
    if torch.is_tensor(logits):
        return logits, "output.logits"
    if isinstance(out, dict) and torch.is_tensor(out.get("logits")):
        return out["logits"], "output['logits']"
    floats = [(where, v) for where, v in _output_items(out)
              if torch.is_tensor(v) and v.is_floating_point()]
    for where, v in sorted(floats, key=lambda f: f[1].dim() == 0):  # stable: scalars last
        return v, where
    raise MaxBatchError(f"the model returned {_a(out)} with no floating-point "
                        "tensor to compute a loss on; use --step FN with your own step")


def _scalar(torch, v):
    """Whether `v` is a floating-point scalar tensor: a loss, or a term of one."""
    return torch.is_tensor(v) and v.dim() == 0 and v.is_floating_point()


def _then(candidates, fallback):
    """`(index, candidate)` of `candidates` as the list stands when each is reached (a caller
    may insert after the current one), then `(None, fallback())` where that gives one."""
    i = 0
    while i < len(candidates):
        yield i, candidates[i]
        i += 1
    last = fallback()
    if last is not None:
        yield None, last


def _shorter_ids(target, batch_at, high):
    """Target ids a quarter as long along their sequence, for a loss that needs them shorter
    than the output (CTC); None where the targets are no sequence of ids."""
    if high is None or len(target) != 2 or target[1 - batch_at] < 4:
        return None
    shorter = list(target)
    shorter[1 - batch_at] //= 4
    return (f"ids < {high} shaped {shorter} at batch {PROBE_BATCH}, a quarter of the output's "
            f"length (with ids as long, its loss is not finite, as CTC's is: a transcript is "
            f"shorter than its frames)", shorter, batch_at, high)


def _ids_below(words, high):
    """A probe's targets as the trials draw them: the zeros (or ids < 1) it probed with are
    ids below `high` there."""
    for probed in ("zero ids", "ids < 1 "):
        if words.startswith(probed):
            return f"ids < {high}{' ' if probed.endswith(' ') else ''}{words[len(probed):]}"
    return words


def _returned_loss(torch, out):
    """The scalar loss a model returned with its output (`(logits, loss)`, a Hugging Face
    output's `.loss`) or alone: (tensor, how it was found), or None."""
    if _scalar(torch, out):
        return out, "output"
    if _scalar(torch, getattr(out, "loss", None)):
        return out.loss, "output.loss"
    return next(((v, where) for where, v in _output_items(out) if _scalar(torch, v)), None)


def _flows_into(torch, tensor, loss):
    """Whether `tensor` is in `loss`'s graph (a gradient reaches it; nothing accumulates in
    any `.grad`). Backward hooks on the way run once, as in any backward."""
    if not tensor.requires_grad:
        return False
    try:
        return torch.autograd.grad(loss, tensor, retain_graph=True, allow_unused=True)[0] \
            is not None
    except Exception:  # noqa: BLE001 (a reentrant checkpoint between them: .grad() cannot say)
        return False


def _heads(torch, out, selected):
    """The output's other tensors like `selected`: auxiliary heads shaped like it
    (torchvision's segmentation `{'out', 'aux'}`, Inception's `aux_logits`), and a
    deep-supervised net's maps at other resolutions (nnU-Net's, UNet++'s: the same batch and
    classes, `[batch, classes, H/2, W/2]`), which a user's loss trains with the main one. Left
    out of the loss, a head's graph would stay alive with the output until the next forward,
    memory the user's step frees in its backward. Returns [(where, tensor)], a head of another
    size named with it: `output[1] at 16x16`."""
    heads = []
    for where, v in _output_items(out):
        if not torch.is_tensor(v) or v is selected or not v.is_floating_point():
            continue
        if v.shape == selected.shape:
            heads.append((where, v))
        elif _rescaled(v.shape, selected.shape):
            heads.append((f"{where} at {'x'.join(map(str, v.shape[2:]))}", v))
    return heads


def _rescaled(shape, main):
    """Whether `shape` is the dense map `main` (`[batch, classes, *spatial]`) at another
    resolution. gpuprobe's output.rs decides alike for the libtorch engine."""
    return len(shape) == len(main) >= 4 and shape[:2] == main[:2] and shape[2:] != main[2:]


def _dtype_name(dtype):
    """A torch dtype as the report says it: float32, bfloat16, int64."""
    return str(dtype).replace("torch.", "")


def _names_positions(rel):
    """Whether a layer's dotted name says it holds positions (BERT's position_embeddings,
    GPT-2's wpe, BART's and Whisper's embed_positions, a pos_emb of one's own)."""
    import re
    return any(part.startswith("pos") or part == "wpe"
               for part in re.split(r"[._]", rel.lower()))


def _token_layers(torch):
    """The layers that take token ids (EmbeddingBag is not an Embedding)."""
    return (torch.nn.Embedding, torch.nn.EmbeddingBag)


class _Watch:
    """Forward pre-hooks for one forward pass: for each layer with `batch_first=False`, which
    of its input's first two dimensions holds the batch (None when neither or both match it);
    with `leaves`, also the first leaf module handed the input tensor itself. Nothing is hooked
    where nothing is asked (hooks make torch.compile recompile)."""

    def __init__(self, torch, model, name, x, leaves):
        self.torch, self.name, self.x = torch, name, x
        self.first_layer = None  # (its dotted name within the model, the module)
        self.seq_first = []  # (description, the dimension the batch was found on)
        self._watched = []
        for rel, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                continue  # TorchScript takes no hooks (its layers are not watched)
            leaf = leaves and next(module.children(), None) is None
            seq_first = getattr(module, "batch_first", None) is False
            if leaf or seq_first:
                self._watched.append((rel, module, leaf, seq_first))
        self._handles = []

    @property
    def hooked(self):
        return bool(self._watched)

    def __enter__(self):
        self._handles = [watched[1].register_forward_pre_hook(self._hook(*watched),
                                                              with_kwargs=True)
                         for watched in self._watched]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False

    def _hook(self, rel, module, leaf, seq_first):
        torch = self.torch
        where = f"{self.name}.{rel}" if rel else self.name

        def hook(_module, args, kwargs):
            values = [*args, *kwargs.values()]
            if leaf and self.first_layer is None and any(v is self.x for v in values):
                self.first_layer = (rel, module)
            first = next((v for v in values if torch.is_tensor(v)), None)
            if seq_first and first is not None and first.dim() >= 3:
                hits = [d for d in (0, 1) if first.shape[d] == PROBE_BATCH]
                self.seq_first.append((f"{where} ({type(module).__name__}, batch_first="
                                       "False)", hits[0] if len(hits) == 1 else None))
            return None

        return hook

    def batch_on_sequence(self):
        """The seq-first layers that took the batch as their sequence (dim 0)."""
        return [what for what, dim in self.seq_first if dim == 0]


_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning")


def _lightning_base(model):
    """The LightningModule class (of `lightning` or `pytorch_lightning`) the module derives
    from, or None."""
    return next((c for c in type(model).__mro__ if c.__name__ == "LightningModule"
                 and c.__module__.split(".")[0] in _LIGHTNING_PACKAGES), None)


def _lightning_training_step(model):
    """The module's own `training_step`, where it is a LightningModule whose class defines
    one; else None."""
    base = _lightning_base(model)
    fn = getattr(type(model), "training_step", None)
    if base is None or fn is None or fn is getattr(base, "training_step", None):
        return None
    return getattr(model, "training_step")


def _takes_batch_idx(fn):
    """Whether a training_step takes the batch's index after the batch: the Trainer passes it
    only where it does (`def training_step(self, batch)` is Lightning too)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (len([p for p in params if p.kind in positional]) >= 2
            or any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params))


def _forward_missing(torch, model):
    """Whether the module's class defines no forward of its own, only LightningModule's or
    torch's, which raise (Lightning's LitAutoEncoder: its training_step calls the layers)."""
    forward = getattr(type(model), "forward", None)
    base = _lightning_base(model)
    return forward in (None, torch.nn.Module.forward, getattr(base, "forward", None))


def _configured_optimizers(torch, conf, name):
    """The optimizers in what `configure_optimizers()` returned, in each form Lightning takes:
    one, a list or tuple of them, ([optimizers], [schedulers]), a dict with "optimizer" (and
    "lr_scheduler"), a list of such dicts, or None."""
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if conf is None or isinstance(conf, schedulers):
        return []
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    if isinstance(conf, dict):
        if "optimizer" in conf:
            return _configured_optimizers(torch, conf["optimizer"], name)
        if "scheduler" in conf:  # a scheduler's config: {"scheduler": ..., "interval": ...}
            return []
    if isinstance(conf, (list, tuple)):
        return [o for c in conf for o in _configured_optimizers(torch, c, name)]
    raise MaxBatchError(f"{name}.configure_optimizers() returned {_a(conf)}, not an optimizer, "
                        "a list of them, or a dict with 'optimizer': name the optimizer with "
                        "--optimizer-from VAR or --optimizer adamw|adam|sgd")


def _training_step_loss(torch, out, name):
    """The loss in what `training_step` returned, as a Trainer reads it: a tensor, a dict's
    'loss', or None (the Trainer then skips backward and the optimizer step)."""
    if out is None or torch.is_tensor(out):
        return out
    if isinstance(out, dict) and torch.is_tensor(out.get("loss")):
        return out["loss"]
    raise MaxBatchError(f"{name}.training_step returned {_a(out)}: a Trainer takes a loss "
                        "tensor, a dict with a 'loss' tensor, or None")


class ModuleStep:
    """One standard training step of a notebook module (see the module docstring)."""

    def __init__(self, torch, user_ns, spec, found):
        self.torch = torch
        self.name = spec["target"]
        model = _lookup(user_ns, self.name)
        if not isinstance(model, torch.nn.Module):
            raise MaxBatchError(f"{self.name} is {_a(model)}, not a torch.nn.Module "
                                "(for a function that runs your own step, use --step)")
        self.model = model
        tensors = [*model.parameters(), *model.buffers()]
        on_meta = sum(t.is_meta for t in tensors)
        if on_meta:
            raise MaxBatchError(f"{on_meta} of {self.name}'s {len(tensors)} weights and buffers "
                                "are on the meta device (offloaded, or never materialized): "
                                "%maxbatch trains the model where it is, so put all of it on the "
                                "GPU first (load its weights, or to_empty(device='cuda') and "
                                "initialize)")
        if any(not _holds_data(torch, t) for t in tensors):
            raise MaxBatchError(f"{self.name} has lazy modules not initialized yet: run one "
                                "forward pass with a real batch first, so their weights exist")
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        floats = [p for p in model.parameters() if p.is_floating_point()]
        self.dtype = floats[0].dtype if floats else torch.float32
        self.inference = bool(spec.get("inference"))
        # --drops-output: the user's loop keeps only the loss of each forward.
        self.drops_output = bool(spec.get("drops_output"))
        self.amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.get("amp"))
        self.input = spec.get("input")
        self.vocab = spec.get("vocab")
        self.vocab_from = None
        # Token ids guessed from the first layer registered: tried as floats too if they fail
        # (a positional table may be registered before the layer the input reaches).
        self.vocab_guessed = False
        if self.input is None:
            raise MaxBatchError(f"%maxbatch {self.name} needs --input SHAPE, the shape of one "
                                "sample (e.g. 3x224x224 for images, 512 with --vocab N for "
                                "token ids)")
        # Where the batch goes in the input: None until the probe reads it from the model's
        # seq-first layers (0 unless one takes (seq, batch, ...)).
        self.batch_dim = spec.get("batch_dim")
        self.batch_dim_from = None
        self.batch_warning = None  # a seq-first layer that gets the batch as its sequence
        if self.batch_dim is not None and not 0 <= self.batch_dim <= len(self.input):
            raise MaxBatchError(f"--batch-dim {self.batch_dim} is not a dimension of a batch of "
                                f"--input {'x'.join(map(str, self.input))}: it goes from 0 to "
                                f"{len(self.input)}")
        if self.vocab is None:
            # The first layer that holds weights (a leaf: a model may keep a positional
            # embedding as its own parameter).
            first = next((m for m in model.modules() if next(m.children(), None) is None
                          and next(m.parameters(False), None) is not None), None)
            if isinstance(first, _token_layers(torch)):
                self.vocab, self.vocab_from = first.num_embeddings, type(first).__name__
                self.vocab_guessed = True
        if not self.inference and not any(p.requires_grad for p in model.parameters()):
            raise MaxBatchError(f"{self.name} has no trainable parameters (none with "
                                "requires_grad), so a training step has nothing to train: "
                                "unfreeze what you train, or size a forward pass with "
                                "--inference")
        self.loss_plan = None
        self.returned_use = None  # how the step uses a loss the forward returns (set_loss)
        self.loss_requested = spec.get("loss")
        # The model's own loss, when the step trains on it: the forward's targets argument
        # and how its targets are made (`_targets`).
        self.own = None
        self.own_tried = []  # the targets tried on the forward, and what it said
        # Read once: every probe forward asks (a compiled model is probed eagerly with one).
        self.targets_parameter = self._targets_parameter()
        # A LightningModule's step is its training_step (the forward still reads the output
        # its target is made for); --inference sizes its forward alone.
        self.lightning_step = None if self.inference else _lightning_training_step(model)
        if self.lightning_step is not None and not getattr(model, "automatic_optimization", True):
            raise MaxBatchError(f"{self.name} turns automatic optimization off: its "
                                "training_step steps its optimizers itself through "
                                "self.optimizers(), which only a Trainer provides. "
                                f"{_lightning_hint(self.name)}")
        # The batch's index, where training_step takes one.
        self.step_index = ((0,) if self.lightning_step is not None
                           and _takes_batch_idx(self.lightning_step) else ())
        # The modules a Trainer's fit left attached to it (`_run_training_step`), found once.
        self.attached = ([m for m in model.modules() if m.__dict__.get("_trainer") is not None]
                         if self.lightning_step is not None else [])
        # No forward to read an output from: training_step gets class 0 as each target.
        self.forwardless = self.lightning_step is not None and _forward_missing(torch, model)
        self.output_shape = None  # the selected output's at PROBE_BATCH (probe_output)
        self.target_values = False  # training_step's target: values like the output (set_loss)
        self.optimizer, self.optimizer_name, self.optimizer_owned = self._optimizer(
            user_ns, spec, found)
        mine = [self.optimizer] if self.optimizer is not None else []
        self.optimized = set().union(*map(_held_parameters,
                                          (*found["optimizer"].values(), *mine)))
        self.closure = self.optimizer is not None and _needs_closure(self.optimizer)
        self.scaler = None
        if self.amp is torch.float16 and not self.inference:
            if self.closure:
                raise MaxBatchError(
                    f"--amp fp16 steps through a GradScaler, and a GradScaler cannot step "
                    f"{type(self.optimizer).__name__} (its step takes a closure): use --amp "
                    f"bf16, or {STEP_HINT}")
            self.scaler = torch.amp.GradScaler(self.device.type)

    def fixed(self, p):
        """Whether the standard step cannot write `p`: without gradients (--inference) no
        parameter changes; in training, one without requires_grad that no optimizer of the
        notebook holds gets no gradient and no update (and the forward only reads it). One
        still holding a gradient is kept: a step without an optimizer clears every gradient
        of the model."""
        if p.grad is not None:
            return False
        return self.inference or (not p.requires_grad and id(p) not in self.optimized)

    def _required_arguments(self):
        """The forward's arguments without a default, as its signature reads (a decorator or
        a pre-hook may supply some: read only to explain a forward that failed)."""
        signature = self._forward_signature()
        if signature is None:
            return []
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                 inspect.Parameter.KEYWORD_ONLY)
        return [p.name for p in signature.parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in kinds]

    def _optimizer(self, user_ns, spec, found):
        torch = self.torch
        if self.inference:
            return None, "none (inference, no gradients)", False
        params = {id(p) for p in self.model.parameters()}
        # Frozen weights an optimizer still holds (a first stage's, over the whole model) do
        # not split the model between optimizers: no step trains them.
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        name = spec.get("optimizer_from")
        if self.lightning_step is not None and not name and spec.get("optimizer") is None:
            return self._configured_optimizer()
        if name:
            opt = _lookup(user_ns, name)
            if not isinstance(opt, torch.optim.Optimizer):
                raise MaxBatchError(f"{name} is {_a(opt)}, not a torch.optim.Optimizer")
            held = _held_parameters(opt) & params
            if not held:
                raise MaxBatchError(f"{name} optimizes none of {self.name}'s parameters")
            # A model split between optimizers (Muon's matrices, AdamW the rest): a step of
            # one leaves the others' state out of the memory it measures.
            rest = sorted(n for n, o in found["optimizer"].items()
                          if (_held_parameters(o) & trainable) - held)
            if rest:
                raise MaxBatchError(f"{name} holds {len(held & trainable)} of {self.name}'s "
                                    f"{len(trainable)} trainable parameter tensors, and "
                                    f"{', '.join(rest)} hold{'s' if len(rest) == 1 else ''} "
                                    f"others: a step of {name} alone would leave their "
                                    f"optimizer state out. {_STEP_ALL_OPTIMIZERS}")
            return opt, f"the notebook's {name} ({type(opt).__name__})", False
        kind = spec.get("optimizer")
        if kind is None:  # the notebook's own optimizer of this model, if there is just one
            mine = {n: o for n, o in found["optimizer"].items() if _held_parameters(o) & params}
            if len(mine) > 1:
                names = ", ".join(sorted(mine))
                trained = [_held_parameters(o) & trainable for o in mine.values()]
                if not any(t >= set().union(*trained) for t in trained):
                    raise MaxBatchError(f"{self.name}'s trainable parameters are split between "
                                        f"optimizers ({names}): a step of one alone would "
                                        f"leave the others' state out. {_STEP_ALL_OPTIMIZERS}")
                raise MaxBatchError(f"several optimizers hold {self.name}'s parameters "
                                    f"({names}): name yours with --optimizer-from VAR, or pick "
                                    "a new one with --optimizer")
            if mine:
                n, opt = next(iter(mine.items()))
                return opt, f"the notebook's {n} ({type(opt).__name__})", False
            kind = "adamw"
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if kind == "none" or not trainable:
            return None, "none (gradients only)", True
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
        extra = {"momentum": 0.9} if kind == "sgd" else {}
        return cls(trainable, lr=1e-3, **extra), f"a new {cls.__name__} (lr 1e-3)", True

    def _configured_optimizer(self):
        """The optimizer `configure_optimizers()` makes, as a Trainer's fit begins with one: a
        new one, over the module's parameters. What the call sets on the module (`self.opt =
        ...`) is undone at once: the trials' optimizer state would live on in it."""
        model = self.model
        attrs = model.__dict__
        before = dict(attrs)
        try:
            conf = model.configure_optimizers()
        except Exception as err:
            said = str(err).strip().rstrip(".")
            raise MaxBatchError(f"{self.name}.configure_optimizers() raised {type(err).__name__}: "
                                f"{said}. Name the optimizer with --optimizer-from VAR (one of "
                                "yours) or --optimizer adamw|adam|sgd") from None
        finally:
            for key in [k for k in attrs if k not in before]:
                del attrs[key]
            for key, value in before.items():
                if attrs.get(key, attrs) is not value:
                    attrs[key] = value
        opts = _configured_optimizers(self.torch, conf, self.name)
        if not opts:
            return None, f"none ({self.name}.configure_optimizers() returned none)", True
        if len(opts) > 1:
            raise MaxBatchError(f"{self.name}.configure_optimizers() returns {len(opts)} "
                                "optimizers, which a Trainer steps only under manual "
                                f"optimization. {_lightning_hint(self.name)}")
        opt = opts[0]
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        lr = f" (lr {lr:g})" if isinstance(lr, (int, float)) else ""
        return opt, f"{type(opt).__name__}{lr} from {self.name}.configure_optimizers()", True

    def make_input(self, batch):
        torch = self.torch
        shape = list(self.input)
        shape.insert(self.batch_dim or 0, batch)
        if self.vocab:
            return torch.randint(0, self.vocab, shape, device=self.device)
        return torch.randn(shape, device=self.device, dtype=self.dtype)

    def probe_output(self):
        """The output's shape and dtype for a batch of PROBE_BATCH (state is put back by the
        caller's snapshot). The forward runs in the step's own mode, gradients on for training:
        the kernels it loads are the step's (a first no_grad forward under autocast loaded
        others, 0.6-0.7 s on an H200), and its graph goes with the output.

        Two things about the input are read from the model here, as the forward meets them:
        token ids, when floats fail in an Embedding that the input reaches first (a model may
        register its Embedding after the layers it feeds, so the first one registered is not
        it); and where the batch goes, when a seq-first layer (batch_first=False: PyTorch's
        RNNs, MultiheadAttention and Transformer layers by default) took it as its sequence."""
        torch = self.torch
        if self.forwardless:
            return None
        self.model.train(not self.inference)
        try:
            out, watch = self._watched_forward()
        except MaxBatchError as refused:
            # An encoder-decoder (T5, BART) makes its decoder's input from its labels: without
            # them its forward fails, with them it trains.
            if (self.inference or self.targets_parameter is None
                    or not isinstance(refused, _ForwardFailed)):
                raise
            if self.loss_requested not in (None, "own"):
                raise MaxBatchError(
                    f"{refused.head}; {self.name}.forward also takes {self.targets_parameter}, "
                    f"which --loss {self.loss_requested} does not pass: drop --loss to train on "
                    f"the loss it returns given them, or {STEP_HINT}") from None
            return self._own_loss_alone(refused)
        if self.batch_dim is None:
            self.batch_dim = 0
            misplaced = watch.batch_on_sequence()
            if misplaced:
                out = watch = None
                out = self._batch_on_dim_1(misplaced[0])
        tensor, where = _select_output(torch, out)
        self.output_shape = list(tensor.shape)
        heads = [] if self.inference else [w for w, _ in _heads(torch, out, tensor)]
        parameter = None if self.inference else self.targets_parameter
        reply = {"shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype),
                 "selected": where, "heads": heads, "targets_parameter": parameter,
                 "like_input": self._like_input(tensor.shape),
                 "output_sample_bytes": _output_bytes(torch, out, self.model) // PROBE_BATCH}
        if parameter is not None and self.loss_requested in (None, "own"):
            tensor = out = None  # their graph goes before the forward with targets
            reply.update(self._probe_own_loss(parameter, reply["shape"], where))
        elif self.loss_requested == "own" and self.inference:
            raise MaxBatchError("--inference runs no loss: drop --loss own")
        elif (not self.inference and self.loss_requested in (None, "own")
              and self._returns_its_loss(out, tensor, reply)):
            pass
        elif self.loss_requested == "own":
            raise MaxBatchError(
                f"--loss own trains on the loss {self.name} returns, given targets or computed "
                f"from its output, and {self.name}.forward takes no targets (no optional "
                f"{' or '.join(TARGET_PARAMETERS)}) and returns no such loss: pick --loss ce, "
                f"mse or mean, or {STEP_HINT}")
        if "own_loss" not in reply and not self.inference:
            # Scalars with a gradient the step's loss leaves out (an auxiliary loss): named.
            # The one it uses goes by identity: a Hugging Face output names it two ways
            # (`output.loss`, `output['loss']`).
            used = _returned_loss(torch, out)[0] if "returned_loss" in reply else None
            reply["left_out"] = [w for w, v in _output_items(out)
                                 if _scalar(torch, v) and v.requires_grad and v is not used]
        return reply

    def _returns_its_loss(self, out, tensor, reply):
        """Whether the forward, without targets, returns a scalar loss computed from the
        output it returns (MAE's `(loss, pred, mask)`), or the output itself is a scalar (a
        diffusion or autoregressive wrapper whose forward is the loss); `reply` then says
        where (`returned_loss`). gpukernel decides how the step uses it (`set_loss`): alone,
        or added to a cross-entropy on class scores that flow into it (a z-loss). A scalar the
        output does not flow into (a mixture of experts' auxiliary loss) is left out."""
        torch = self.torch
        found = _returned_loss(torch, out)
        if found is None or not found[0].requires_grad:
            return False
        itself = found[0] is tensor
        # An output without a gradient (detached for logging) leaves that loss the only thing
        # a loop can train on.
        detached = not itself and not tensor.requires_grad
        if not itself and not detached and not _flows_into(torch, tensor, found[0]):
            # One compiled graph returning both hides the path inside its autograd node: the
            # same forward run eagerly shows it.
            if not self._compiled() or not self._flows_eagerly():
                return False
        reply["returned_loss"] = {"returned": found[1], "itself": itself, "detached": detached}
        return True

    def _compiled(self):
        """What torch.compile wraps: "whole" (the model), "part" (modules in it) or None."""
        wraps = lambda m: isinstance(getattr(m, "_orig_mod", None), self.torch.nn.Module)  # noqa: E731
        if wraps(self.model):
            return "whole"
        return "part" if any(wraps(m) for m in self.model.modules()) else None

    def _flows_eagerly(self):
        """`_returns_its_loss`'s check on an eager forward of the compiled model."""
        torch = self.torch
        out, failure = self._forward(self.make_input(PROBE_BATCH), None, eager=True)
        if failure is not None:
            return False
        found = _returned_loss(torch, out)
        return (found is not None and found[0].requires_grad
                and _flows_into(torch, _select_output(torch, out)[0], found[0]))

    def _like_input(self, shape):
        """Whether an output of `shape` holds a float input again, sample for sample, maybe
        flattened (a VAE's [batch, 784] of [batch, 1, 28, 28]): a reconstruction
        (autoencoder, denoiser, a diffusion model's noise), whose loss is not cross-entropy
        even where its channels would read as classes."""
        import math
        if self.vocab or self.input is None or len(shape) < 2:
            return False
        return (shape[self.batch_dim or 0] == PROBE_BATCH
                and math.prod(shape) == PROBE_BATCH * math.prod(self.input))

    def _forward_signature(self):
        """The forward's signature: the model's own under torch.compile (whose wrapper takes
        *args, **kwargs); None for a builtin or C++ forward, which has nothing to read."""
        model = getattr(self.model, "_orig_mod", self.model)
        try:
            return inspect.signature(model.forward)
        except (TypeError, ValueError):
            return None

    def _targets_parameter(self):
        """The forward's optional argument for training targets, if it has one."""
        signature = self._forward_signature()
        if signature is None:
            return None
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return next((p.name for p in signature.parameters.values()
                     if p.name in TARGET_PARAMETERS and p.kind in kinds
                     and p.default is not inspect.Parameter.empty), None)

    def _target_candidates(self, shape):
        """How targets could be made, most likely first: [(words, shape at PROBE_BATCH, the
        batch's dimension in it, values below)]. Their values stay below the output's class
        count: an index out of range is a device-side assert on the GPU, fatal to the CUDA
        context of the user's process, where a wrong shape is an ordinary exception."""
        classes = shape[-1] if shape is not None and len(shape) >= 2 else None
        candidates = []
        if self.vocab and (classes or shape is None):
            x_shape = list(self.input)
            x_shape.insert(self.batch_dim or 0, PROBE_BATCH)
            # None: no output without targets, so no class count yet: the probe's targets
            # are zeros, in range whatever the head's size (`_probe_own_loss` reads it then).
            high = min(self.vocab, classes) if classes else 1
            words = f"ids < {high}" if classes else "zero ids"
            candidates.append((f"{words} shaped like the input", x_shape,
                               self.batch_dim or 0, high))
        if shape is None:
            return candidates
        if len(shape) in (2, 3):
            target, high = shape[:-1], shape[-1]
        elif len(shape) >= 4:  # [batch, classes, H, W, ...]: a class per position
            target, high = [shape[0], *shape[2:]], shape[1]
            spatial = list(self.input[1:])
            if (not self.vocab and len(self.input) == len(shape) - 1 and shape[0] == PROBE_BATCH
                    and spatial != shape[2:] and high > 1):
                # A segmentation model's masks come at the image's size, and its loss scales
                # the logits up to them (SegFormer's: a quarter of the size each way), which
                # is the memory a loop that passes them trains with.
                candidates.append((f"ids < {high} shaped {[PROBE_BATCH, *spatial]} at batch "
                                   f"{PROBE_BATCH}, the input's size", [PROBE_BATCH, *spatial],
                                   0, high))
        else:
            return candidates
        at = [d for d in (self.batch_dim or 0, 0) if d < len(target)
              and target[d] == PROBE_BATCH][:1]
        if at and high > 1:
            candidates.append((f"ids < {high} shaped {target} at batch {PROBE_BATCH}",
                               target, at[0], high))
        if shape[0] == PROBE_BATCH:
            # A regression's targets, or multi-label ones (BCE): values, not class ids.
            candidates.append((f"{_dtype_name(self.dtype)} values shaped like "
                               f"the output, {list(shape)} at batch {PROBE_BATCH}",
                               list(shape), 0, None))
        return candidates

    def _own_loss_alone(self, refused):
        """The reply for a model that runs only with targets (probe_output's), or a refusal
        built on `refused` (the `_ForwardFailed` without them): a detection model's targets
        are nothing a shape can make."""
        parameter = self.targets_parameter
        if self.batch_dim is None:
            self.batch_dim = 0
        own = self._probe_own_loss(parameter, None, None, failed=refused.failure)
        if "own_loss" not in own:
            # torchvision's detection models refuse to train without targets, and theirs
            # (boxes and labels per image) are nothing a shape can make.
            tried = ("; ".join(self.own_tried) if self.own_tried
                     else "none could be shaped: without them its forward gives no output to "
                     "shape them by, and the input is not token ids")
            raise MaxBatchError(
                f"{refused.head}; and with {parameter} too ({tried}); check {refused.check}, or "
                f"if it needs its {parameter} in another form (a detection model's boxes and "
                f"labels per image) or more than one input: {STEP_HINT}")
        return {"selected": "output", "heads": [], "targets_parameter": parameter,
                "like_input": False, **own}

    def _probe_own_loss(self, parameter, shape, where, failed=None):
        """Runs the forward with targets, as a loop that passes them does, and trains on the
        loss it returns (unless --loss names another): a forward that takes targets is
        written to be given them. The standard loss on its output would size another step:
        nanoGPT's forward computes the logits of the last position only without targets; a
        Hugging Face model's loss upcasts bf16 logits to float32; an encoder-decoder's
        forward fails without them (`failed`: how, where `shape` is None)."""
        torch = self.torch
        tried = self.own_tried = []  # what each candidate's forward said, for a refusal
        candidates = self._target_candidates(shape)
        not_finite = None  # the first that gave an inf or nan loss: used if none does better
        for at, (words, target, batch_at, high) in _then(candidates, lambda: not_finite):
            own = {"parameter": parameter, "targets": words, "shape": target,
                   "batch_at": batch_at, "high": high}
            x = self.make_input(PROBE_BATCH)
            # Guesses: what a wrong one warns of (a shape the loss would broadcast) is not the
            # user's to read, and the trials' steps warn of what the right one does.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, failure = self._forward(x, None,
                                             {parameter: self._targets(own, PROBE_BATCH)})
            if failure is not None:
                tried.append(f"{words}: {failure}")
                continue
            found = _returned_loss(torch, out)
            if found is None:
                tried.append(f"{words}: no scalar loss in what it returned")
                continue
            if at is not None and not bool(torch.isfinite(found[0].detach())):
                # A CTC loss is inf where the transcript is as long as the frames: ids a
                # quarter as long are tried next, as a transcript is shorter than its audio.
                # Only if no candidate gives a finite loss is the first such one taken (the
                # memory it sizes is the step's all the same), and the report says so.
                if not_finite is None:
                    not_finite = (f"{words}, with which its loss is not finite", target,
                                  batch_at, high)
                    shorter = _shorter_ids(target, batch_at, high)
                    if shorter is not None:
                        candidates.insert(at + 1, shorter)
                tried.append(f"{words}: its loss is {found[0].item()}")
                out = found = None
                continue
            trained, trained_where = _select_output(torch, out)
            if shape is None:  # probed with zeros: the ids the trials draw stay below both
                own["high"] = min(self.vocab, trained.shape[-1]) if trained.dim() else 1
                own["targets"] = words = _ids_below(words, own["high"])
            self.own = own
            reason = self._own_loss_reason(parameter, (shape, where), trained, found, failed)
            reply = {"parameter": parameter, "targets": words, "returned": found[1],
                     "reason": reason}
            return {"own_loss": reply, "shape": list(trained.shape), "selected": trained_where,
                    "dtype": _dtype_name(trained.dtype), "heads": [],
                    "output_sample_bytes": _output_bytes(torch, out, self.model) // PROBE_BATCH}
        if self.loss_requested == "own":
            raise MaxBatchError(
                f"--loss own: {self.name}(x, {parameter}=...) gave no loss ("
                f"{'; '.join(tried) or 'no targets to try for this output'})"
                + (f", and without {parameter} it fails ({failed})" if failed else "")
                + f": {STEP_HINT}")
        return {}

    def _own_loss_reason(self, parameter, output, trained, found, failed):
        """Why the step trains on the loss the forward returns with `parameter` (None where
        --loss own asked for it): what the forward gives without them (`output`: its shape
        and where it was read, or None) against what it trains on with them (`trained`),
        and how the loss was found (`found`)."""
        shape, where = output
        if self.loss_requested == "own":
            return None
        if failed is not None:
            return (f"without {parameter} its forward fails ({failed}); given them it returns "
                    f"the loss, which a loop that passes them trains on")
        if found[1] == "output" or trained is found[0]:  # all a loop given them has
            return (f"given {parameter}, its forward returns the loss alone, which a loop that "
                    f"passes them trains on")
        if list(trained.shape) != shape:
            return (f"without {parameter} its forward returns {where} {shape}, not the "
                    f"{list(trained.shape)} it trains on with them: --loss ce computes "
                    f"cross-entropy on that instead")
        # The same logits either way, but not the same loss: a Hugging Face model's upcasts
        # bf16 logits to float32 and keeps that copy's softmax for backward (about 2.5 times
        # the memory of cross-entropy on the bf16 logits). A loop that passes the targets
        # (Trainer's, the Hugging Face examples') trains on it.
        return (f"a loop that passes {parameter} trains on the loss its forward returns; "
                f"--loss ce sizes cross-entropy on {where} instead, if yours computes its own")

    def _targets(self, own, batch):
        torch = self.torch
        shape = list(own["shape"])
        shape[own["batch_at"]] = batch
        if own["high"] is None:  # values, not class ids
            return torch.randn(shape, device=self.device, dtype=self.dtype)
        return torch.randint(0, own["high"], shape, device=self.device)

    def _step_forward(self, x, batch):
        """The step's forward: with targets where it trains on the model's own loss."""
        if self.own is None:
            return self.model(x)
        return self.model(x, **{self.own["parameter"]: self._targets(self.own, batch)})

    def _batch_on_dim_1(self, layer):
        """The probe's output with the batch on dim 1 of the input, where `layer` takes it
        ((seq, batch, ...), as the loops written for such a layer feed it). A model that
        fails so, or still hands the layer the batch as its sequence, is fed batch-first, as
        its own loop must feed it, and the report warns that the layer attends across the
        samples of a batch (nn.TransformerEncoderLayer's default, batch_first=False, under a
        model built for (batch, seq, ...) is a common slip)."""
        self.batch_dim, self.batch_dim_from = 1, layer
        try:
            out, watch = self._watched_forward()
            if not watch.batch_on_sequence():
                return out
            how = "still gets it so"
        except MaxBatchError:
            how = "fails"
        out = watch = None
        self.batch_dim, self.batch_dim_from = 0, None
        self.batch_warning = (
            f"{layer} takes (seq, batch, ...) and gets your batch as its sequence (with the "
            f"batch on dim 1 of the input, {self.name} {how}), so it mixes the samples of a "
            f"batch; sized batch-first, as your loop must feed it: if the mixing is not meant, "
            f"build that layer with batch_first=True")
        out, _ = self._watched_forward()
        return out

    def _watched_forward(self, tokens_tried=False):
        """One forward of a batch of PROBE_BATCH in the step's mode, watched (`_Watch`).
        Floats that fail in an Embedding the input reaches first are tried once as token
        ids."""
        torch = self.torch
        if self.vocab:
            self._check_positions()
        x = self.make_input(PROBE_BATCH)
        watch = _Watch(torch, self.model, self.name, x, leaves=False)
        out, failure = self._forward(x, watch)
        if failure is None:
            return out, watch
        if self.vocab_guessed and not tokens_tried:
            return self._as_floats(tuple(x.shape), failure)
        if self.vocab is None and not tokens_tried and any(
                isinstance(m, _token_layers(torch)) for m in self.model.modules()):
            # Which layer the input reaches first: hooked on a second try, which fails as the
            # first did (a model need not register its layers in the order it runs them).
            finder = _Watch(torch, self.model, self.name, x, leaves=True)
            self._forward(x, finder)
            if finder.first_layer is not None and isinstance(finder.first_layer[1],
                                                             _token_layers(torch)):
                rel, first = finder.first_layer
                self.vocab = first.num_embeddings
                self.vocab_from = (f"{rel}, an {type(first).__name__} and the first layer the "
                                   "input reaches")
                return self._watched_forward(tokens_tried=True)
        raise self._forward_failed(tuple(x.shape), failure)

    def _as_floats(self, shape, failure):
        """The probe's forward with floats, where token ids guessed from the first layer
        registered failed: a model may register a positional table before the layer its
        input reaches (a float sequence model with a learned position Embedding). Floats
        that fail in an Embedding say the ids were right, and their failure is the one told."""
        torch = self.torch
        guessed = self.vocab, self.vocab_from
        self.vocab, self.vocab_from, self.vocab_guessed = None, None, False
        try:
            return self._watched_forward(tokens_tried=True)
        except _ForwardFailed as err:
            as_floats = err.failure
        fed = []
        handles = [m.register_forward_pre_hook(
            lambda _m, args: fed.append(bool(args) and torch.is_tensor(args[0])
                                        and args[0].is_floating_point()))
            for m in self.model.modules() if isinstance(m, _token_layers(torch))]
        try:
            self._forward(self.make_input(PROBE_BATCH), None, eager=True)
        finally:
            for handle in handles:
                handle.remove()
        self.vocab, self.vocab_from = guessed
        self.vocab_guessed = True
        refusal = self._forward_failed(shape, failure)
        if any(fed) or not isinstance(refusal, _ForwardFailed):  # or no single tensor will do
            raise refusal
        raise _ForwardFailed(
            failure,
            f"{self.name}(x) failed for x of shape {shape}, as token ids (its first layer is "
            f"an {guessed[1]}): {failure}; and as {_dtype_name(self.dtype)}: {as_floats}",
            "--input (the shape of one sample) and --vocab N for token ids")

    def _check_positions(self):
        """Refuses token sequences longer than a learned position table holds: past it the
        lookup is an index out of range, on the GPU a device-side assert that ends CUDA in
        the user's process for good (a wrong shape is an ordinary exception)."""
        length = self.input[-1]
        config = getattr(self.model, "config", None)
        # A Hugging Face model's own limit: OPT's and BART's tables hold 2 more (an offset).
        stated = [getattr(config, a, None) for a in ("max_position_embeddings", "n_positions")]
        stated = [n for n in stated if isinstance(n, int) and n > 0]
        for rel, module in self._position_tables():
            limit = min([module.num_embeddings, *stated])
            if length > limit:
                raise MaxBatchError(
                    f"{self.name}.{rel} holds positions for {limit} tokens, and --input asks "
                    f"for sequences of {length}: a position past its table is an index out of "
                    f"range, which on a GPU ends CUDA in your kernel for good. Use --input "
                    f"{'x'.join(map(str, [*self.input[:-1], limit]))} (or less), the longest "
                    f"sequence {self.name} takes{self._not_an_image()}")

    def _not_an_image(self):
        """For a refusal that reads --input as token ids: where a sample's shape has three
        dimensions or more, it names what sent them there, since such a shape is more likely
        an image meant for another argument (CLIP's pixel_values) than a sequence."""
        if len(self.input) < 3:
            return ""
        signature = self._forward_signature()
        first = next(iter(signature.parameters), None) if signature is not None else None
        argument = f"its first argument, {first}," if first else "its input"
        return (f". --input {'x'.join(map(str, self.input))} was read as token ids because "
                f"{self.name} takes {argument} into an Embedding; if you meant an image or "
                f"other floats that {self.name} takes under another argument: {STEP_HINT}")

    def _position_tables(self):
        """The learned position tables that token ids are looked up beside: an Embedding
        named for positions with a token Embedding under the same parent (GPT-2's wte and
        wpe; BERT's, CLIP's text tower's), not one the input never reaches (CLIP's vision
        tower's, a float model's own)."""
        torch = self.torch
        by_parent = {}
        # Tied tables (BART's encoder and decoder share the token table) under every name.
        for rel, module in self.model.named_modules(remove_duplicate=False):
            if isinstance(module, torch.nn.Embedding):
                parent, _, leaf = rel.rpartition(".")
                by_parent.setdefault(parent, []).append((_names_positions(leaf), rel, module))
        tables = []
        for layers in by_parent.values():
            positions = [(rel, module) for is_table, rel, module in layers if is_table]
            if len(positions) < len(layers):
                tables.extend(positions)
        return tables

    def _forward(self, x, watch, targets=None, eager=False):
        """(the output, None), or (None, the failure's text): only the text is kept, since
        the exception's frames hold the forward's tensors. `targets`: keyword arguments for
        the forward (its targets), which ask for a training forward. `eager`: a compiled
        model or submodule runs eagerly."""
        import contextlib
        torch, model = self.torch, self.model
        stance = contextlib.nullcontext()
        if eager or targets or (watch is not None and watch.hooked) or self.targets_parameter:
            # Hooks inside a torch.compile'd model or submodule make dynamo trace it again
            # (minutes for a large model; and it cannot import this private module), as do
            # arguments it has not been called with; and a forward that takes targets may be
            # stepped with them, so its graph without them would be compiled for nothing: the
            # probe runs it eagerly, with the same shapes.
            set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
            if set_stance is not None:
                stance = set_stance("force_eager")
            elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
                model = model._orig_mod
        watching = watch if watch is not None else contextlib.nullcontext()
        grad = bool(targets) or not self.inference
        try:
            with stance, watching, torch.set_grad_enabled(grad), self._autocast():
                return model(x, **(targets or {})), None
        except Exception as err:
            lines = str(err).strip().splitlines()
            return None, f"{type(err).__name__}: {lines[0] if lines else ''}"

    def _forward_failed(self, shape, failure):
        needed = self._required_arguments()
        if len(needed) > 1:
            return MaxBatchError(
                f"{self.name}.forward needs {len(needed)} arguments ({', '.join(needed)}), "
                f"while %maxbatch MODULE calls it with one tensor of --input: {STEP_HINT}")
        keywords = self._keyword_only()
        if keywords is not None:
            return MaxBatchError(
                f"{self.name}.forward takes no positional argument (only {keywords}, by "
                f"keyword), while %maxbatch MODULE calls it with one tensor of --input: "
                f"{STEP_HINT}")
        others = self._inputs_named_in(failure)
        if others:
            # CLIPModel's "You have to specify pixel_values": an optional argument the forward
            # cannot do without besides the one tensor fed. (T5's decoder_input_ids come from
            # its labels, which the caller still tries.)
            head = f"{self.name}.forward failed asking for {' and '.join(others)} ({failure})"
            return _ForwardFailed(
                failure, head, "--input (the shape of one sample)",
                f"{head}, while %maxbatch MODULE calls it with one tensor of --input only: "
                f"{STEP_HINT}")
        what = "token ids" if self.vocab else _dtype_name(self.dtype)
        head = f"{self.name}(x) failed for x of shape {shape} ({what}): {failure}"
        if self.vocab:
            check = "--input (the shape of one sample) and --vocab"
        elif len(self.input) == 1:  # a sequence's length: maybe token ids
            check = "--input (the shape of one sample; --vocab N for token ids)"
        else:
            check = "--input (the shape of one sample)" + self._channels_first_hint()
        return _ForwardFailed(failure, head, check)

    def _channels_first_hint(self):
        """Where --input reads as channels-last (an image as PIL and NumPy hold it, 224x224x3)
        and the model's first convolution takes as many channels as its last dimension: the
        shape channels-first, as PyTorch's convolutions take it."""
        conv = next((m for m in self.model.modules()
                     if isinstance(m, self.torch.nn.modules.conv._ConvNd)), None)
        shape = list(self.input)
        if conv is None or len(shape) != conv.weight.dim() - 1:
            return ""
        channels = conv.in_channels
        if shape[0] == channels or shape[-1] != channels:
            return ""
        moved = "x".join(map(str, [channels, *shape[:-1]]))
        where = next((n for n, m in self.model.named_modules() if m is conv), "")
        return (f": its first convolution ({where or type(conv).__name__}) takes {channels} "
                f"channels first, so --input {moved} for this sample")

    def _inputs_named_in(self, failure):
        """The forward's optional arguments, other than the one fed, that its failure names:
        inputs it needs together with that one."""
        import re
        signature = self._forward_signature()
        if signature is None:
            return []
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        params = [p for p in signature.parameters.values() if p.kind in kinds]
        fed = params[0].name if params else None
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", failure))
        return [p.name for p in params[1:]
                if p.name in words and p.name != fed and p.name not in TARGET_PARAMETERS
                and p.default is not inspect.Parameter.empty]

    def _keyword_only(self):
        """The forward's keyword-only arguments, where it takes no positional one (a builtin
        forward's signature cannot be read: None)."""
        signature = self._forward_signature()
        if signature is None:
            return None
        params = signature.parameters.values()
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                      inspect.Parameter.VAR_POSITIONAL)
        if any(p.kind in positional for p in params):
            return None
        names = [p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]
        return ", ".join(names) if names else "keyword arguments"

    def _autocast(self):
        import contextlib
        if self.amp is None:
            return contextlib.nullcontext()
        return self.torch.autocast(self.device.type, dtype=self.amp)

    def _loss(self, out):
        """The plan's loss on the selected output, summed over the heads shaped like it; or
        the loss the model returned."""
        if self.own is not None or self.returned_use == "alone":
            return _returned_loss(self.torch, out)[0]
        tensor, _ = _select_output(self.torch, out)
        loss = self._loss_on(tensor)
        for _, head in _heads(self.torch, out, tensor):
            loss = loss + self._loss_on(head)
        if self.returned_use == "added":
            loss = loss + _returned_loss(self.torch, out)[0]
        return loss

    def _loss_on(self, tensor):
        torch = self.torch
        F = torch.nn.functional
        plan = self.loss_plan or {"kind": "mean"}
        if plan["kind"] == "ce":
            target = self._plan_target(list(tensor.shape), tensor.dtype, tensor.device)
            if plan.get("class_dim", -1) == 1 and tensor.dim() > 2:
                return F.cross_entropy(tensor, target)
            return F.cross_entropy(tensor.reshape(-1, tensor.shape[-1]), target.reshape(-1))
        if plan["kind"] == "mse":
            return F.mse_loss(tensor, torch.randn_like(tensor))
        return tensor.float().mean()

    def _plan_target(self, shape, dtype, device):
        """A target for an output of `shape` as the loss plan takes it: class ids for
        cross-entropy (over dim 1 of a dense map, else the last), else values shaped like it."""
        torch = self.torch
        plan = self.loss_plan or {"kind": "mean"}
        if plan["kind"] != "ce":
            return torch.randn(shape, dtype=dtype, device=device)
        # Targets stay below the output's own class count (a head's may differ from the main
        # output's): out of range is a device-side assert, fatal to the CUDA context.
        if plan.get("class_dim", -1) == 1 and len(shape) > 2:
            return torch.randint(0, min(plan["classes"], shape[1]), (shape[0], *shape[2:]),
                                 device=device)
        return torch.randint(0, min(plan["classes"], shape[-1]), shape[:-1], device=device)

    def batch_target(self, batch):
        """The target of the (input, target) batch a LightningModule's training_step gets:
        the forward's own targets where it takes them, else the loss plan's for its output at
        this batch."""
        if self.own is not None:
            return self._targets(self.own, batch)
        if self.output_shape is None:  # no forward: a class id per sample, valid for any count
            return self.torch.zeros(batch, dtype=self.torch.int64, device=self.device)
        shape = list(self.output_shape)
        at = self.batch_dim or 0
        if at < len(shape) and shape[at] == PROBE_BATCH:
            shape[at] = batch
        if self.target_values:
            return self.torch.randn(shape, dtype=self.dtype, device=self.device)
        return self._plan_target(shape, self.dtype, self.device)

    def steps(self, batch):
        """The steps, one per `next()`, without end: the caller stops them."""
        torch = self.torch
        model, opt, scaler = self.model, self.optimizer, self.scaler
        if self.inference:
            model.eval()
            out = None  # noqa: F841 (alive into the next forward, as in a loop)
            while True:  # no context left open across a yield: the caller's grad mode stays
                x = self.make_input(batch)
                with torch.no_grad(), self._autocast():
                    out = model(x)
                yield
        model.train()
        if self.lightning_step is not None:
            yield from self._training_steps(batch)
        if self.closure:
            yield from self._closure_steps(batch)
        out = loss = None  # as in a for loop: the last step's output lives into the next
        while True:
            x = self.make_input(batch)
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            with self._autocast():
                out = self._step_forward(x, batch)
                loss = self._loss(out)
                if self.drops_output:  # only the loss kept, as `loss = model(**batch).loss`:
                    out = None  # noqa: F841 (the output goes before backward)
            if scaler is not None:
                scaler.scale(loss).backward()
                if opt is not None:
                    scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                if opt is not None:
                    opt.step()
            yield

    def _training_steps(self, batch):
        """A LightningModule's steps as its Trainer runs them under automatic optimization
        (lightning.pytorch.loops.optimization.automatic's Closure): training_step, then the
        optimizer's zero_grad, so that the last step's gradients are alive through the
        forward, then backward; the optimizer step (through the GradScaler for fp16, skipped
        where training_step returned None). What training_step returned lives into the next
        step, as the loop keeps a batch's outputs."""
        torch, model, opt, scaler = self.torch, self.model, self.optimizer, self.scaler
        zero_grad = getattr(model, "optimizer_zero_grad", None)
        out = None  # noqa: F841 (alive into the next step)

        def closure():
            nonlocal out
            out = self._run_training_step(x, y)
            loss = _training_step_loss(torch, out, self.name)
            if loss is None:
                return None
            if opt is None:
                model.zero_grad(set_to_none=True)
            elif zero_grad is not None:
                zero_grad(0, 0, opt)
            else:
                opt.zero_grad(set_to_none=True)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            return loss

        while True:
            x, y = self.make_input(batch), self.batch_target(batch)
            if opt is not None and self.closure:
                opt.step(closure)
            elif closure() is not None and opt is not None:
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            yield

    def _run_training_step(self, x, y):
        """`training_step((x, y), 0)` under the step's autocast. A module a Trainer's fit left
        attached to it runs detached: outside the fit's loop `self.log` raises there, where
        detached it warns and returns (as in a test of the step), and that warning is quiet."""
        attached = self.attached
        trainers = [m.__dict__["_trainer"] for m in attached]
        try:
            for m in attached:
                m.__dict__["_trainer"] = None
            with warnings.catch_warnings(), self._autocast():
                warnings.filterwarnings("ignore", r"You are trying to `self\.log\(\)`")
                return self.lightning_step((x, y), *self.step_index)
        finally:
            for m, trainer in zip(attached, trainers):
                m.__dict__["_trainer"] = trainer

    def choose_target(self):
        """Whether training_step takes values shaped like the output as its target (a
        multi-label or regression loss: binary cross-entropy, mean squared error) where it
        refuses the loss plan's class ids: tried once at PROBE_BATCH, class ids first, and the
        first that runs is kept (neither: the class ids, and the first trial says why)."""
        torch = self.torch
        x = self.make_input(PROBE_BATCH)
        for values in (False, True):
            self.target_values = values
            try:
                _training_step_loss(torch, self._run_training_step(x, self.batch_target(PROBE_BATCH)),
                                    self.name)
                return values
            except torch.OutOfMemoryError:
                raise
            except Exception:
                continue
        self.target_values = False
        return False

    def _closure_steps(self, batch):
        """The steps of an optimizer that calls back for the loss (LBFGS), as its loops are
        written: `opt.step(closure)`, the closure running zero_grad, forward, loss and
        backward, perhaps several times a step; its output dies with each call."""
        opt = self.optimizer

        def closure():
            opt.zero_grad(set_to_none=True)
            with self._autocast():
                loss = self._loss(self._step_forward(x, batch))
            loss.backward()
            return loss

        while True:
            x = self.make_input(batch)
            opt.step(closure)
            yield

    def _optimizer_note(self):
        """How the step drives an optimizer that takes a closure. LBFGS's history grows over
        its first steps (a pair of flat vectors per iteration, up to history_size) while a
        trial runs two or three: its size when full is what the user's later steps hold
        beyond the trial's."""
        opt = self.optimizer
        if not self.closure:
            return ""
        note = ", stepped with a closure"
        pairs = opt.defaults.get("history_size")
        if not isinstance(pairs, int):
            return note
        params = [p for g in opt.param_groups for p in g["params"]]
        size = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        held = len(opt.state.get(params[0], {}).get("old_dirs", ())) if params else 0
        full = f"{pairs} pairs of gradient-sized vectors ({_bytes(2 * pairs * size)})"
        if held >= pairs:
            return note + f"; its history was full, {full}, and the trials held all of it"
        return note + (f"; its history, {held} of up to {full}, fills over your next "
                       f"steps, beyond the part a trial's few steps add")

    def scalers(self):
        return [self.scaler] if self.scaler is not None else []

    def describe(self):
        return {"optimizer": self.optimizer_name + self._optimizer_note(),
                "vocab": self.vocab or None, "vocab_from": self.vocab_from,
                "batch_dim": self.batch_dim or 0, "batch_dim_from": self.batch_dim_from,
                "batch_warning": self.batch_warning,
                "weights_dtype": _dtype_name(self.dtype),
                "input_dtype": "int64 token ids" if self.vocab else
                _dtype_name(self.dtype),
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "grad_scaler": self.scaler is not None,
                "compiled": self._compiled(),
                "lightning": self.lightning_step is not None,
                "lightning_target": (f"class 0 for each sample ({self.name} has no forward to "
                                     "read an output from)") if self.forwardless else None}


class FunctionStep:
    """The user's own `FN(batch_size)`, called as their loop would call it."""

    def __init__(self, torch, user_ns, spec):
        self.name = spec["target"]
        fn = _lookup(user_ns, self.name)
        if not callable(fn) or isinstance(fn, torch.nn.Module):
            raise MaxBatchError(f"--step {self.name}: {self.name} is {_a(fn)}, not a "
                                "function; pass a function FN(batch_size) that runs one full "
                                "training step")
        signature = _unbindable(fn)
        if signature is not None:
            raise MaxBatchError(f"--step {self.name}: {self.name}{signature} cannot be called as "
                                f"{self.name}(batch_size), which is how every trial calls it; "
                                "pass a function of the batch size alone, e.g. "
                                f"`step = lambda batch_size: {self.name}(..., batch_size)` with "
                                "your other arguments filled in, then %maxbatch --step step")
        self.fn = fn
        self.device = None
        self.calls = 0  # over all trials: an iterator the step draws from runs dry across them

    def fixed(self, p):
        """Nothing: the user's own step may write any parameter (a frozen EMA teacher
        updated in place, as BYOL and DINO do)."""
        return False

    def steps(self, batch):
        """The calls, one per `next()`, without end: the caller stops them."""
        result = None  # alive until the next call returns, as in a loop
        while True:
            try:
                result = self.fn(batch)
            except StopIteration as err:
                # Inside this generator Python would turn it into "generator raised
                # StopIteration" (PEP 479), which names neither the cause nor the fix.
                when = (f"after {self.calls} call{'s' if self.calls > 1 else ''} over the "
                        "trials" if self.calls else "at its first call")
                raise DataRanOut(f"next() raised StopIteration in your step {when}: the "
                                 "iterator it draws from ran dry (each trial draws from it, and "
                                 "an iterator is not put back); start a fresh iterator when one "
                                 "runs out, or make the batch in the step").with_traceback(
                                     err.__traceback__) from None
            self.calls += 1
            yield result

    def scalers(self):
        return []  # the step's own are among the state found through its references

    def describe(self):
        return {"optimizer": "whatever your step uses", "parameters": None}


def _held_parameters(optimizer):
    """The ids of the tensors `optimizer` updates."""
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


_STEP_ALL_OPTIMIZERS = ("If your loop steps more than one, write a function FN(batch_size) "
                        "that runs your whole step and use --step FN")


def _largest_new_segment(segments, held):
    """The largest of the cache's `segments` [(address, bytes, expandable)] not among `held`
    ((address, bytes) there before the trial; a segment given back and made again at the same
    address for another request is new): the trial's largest single allocation, as the cache
    rounds it (each segment is made for one request), which the cache can strand as it
    fragments (gpuprobe's `stranded::largest_new_segment`, the same rule). None under
    expandable segments, which map pages instead and strand none."""
    if any(expandable for _, _, expandable in segments):
        return None
    return max((size for address, size, _ in segments if (address, size) not in held),
               default=0)


class DataRanOut(RuntimeError):
    """A step's `next()` on its data raised StopIteration."""


def _unbindable(fn):
    """`fn`'s signature as text where it cannot take one positional argument, else None (also
    where Python cannot read it, as for some builtins: the first call tells then)."""
    def binds(follow_wrapped):
        try:
            signature = inspect.signature(fn, follow_wrapped=follow_wrapped)
        except (TypeError, ValueError):
            return None
        try:
            signature.bind(1)
        except TypeError:
            return str(signature)
        return None

    # A decorator that fills in arguments (functools.wraps) takes what its wrapper takes.
    wrapped = binds(True)
    return None if wrapped is None or binds(False) is None else wrapped


# --- the session: prepare, trials, close -------------------------------------------------

# The attribute that marks the optimizer hooks PhasePeaks registers.
_HOOK_MARK = "_gpukernel_phase_peaks"


def _remove_hooks():
    """Removes every optimizer hook PhasePeaks registered, found by its mark in torch's own
    tables: called when a trial's steps end, before each trial and when the session ends, so
    that an interrupt landing anywhere (between a registration and its bookkeeping, say)
    cannot leave one resetting the user's peak counters at every step of their training."""
    optim = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim
    tables = [getattr(optim, name, None) for name in
              ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    for attempt in range(3):  # an interrupt landing here must not leave a hook behind
        try:
            for table in tables:
                for key in [k for k, hook in (table or {}).items() if hasattr(hook, _HOOK_MARK)]:
                    table.pop(key, None)
            return
        except KeyboardInterrupt:
            if attempt == 2:
                raise


class PhasePeaks:
    """A trial's peak allocated memory apart outside an optimizer's step and inside it.

    gpuprobe's search fits a line to each: the update's peak (weights, gradients, optimizer
    state and its temporaries) barely grows with the batch, and where it is the step's peak at
    the small opening batches, a line through whole peaks is too flat and overshoots. Every
    optimizer's ``step`` runs torch's global step hooks (a GradScaler's too, when it steps;
    an LBFGS closure's forward counts as inside), so the phases are marked for any loop, the
    user's own ``--step`` included. Where the phase changes, its peak is read and the
    allocator's peak counters reset, so the trial's whole peaks (allocated and reserved) are
    kept here: the allocator's own then cover only the phase since the last change.
    ``stats``: ``peaks()``, the peak allocated and reserved bytes since the last ``reset()``
    (the CUDA allocator's, or a test's). Without ``hooks`` only the whole peaks are kept."""

    def __init__(self, torch, stats, hooks=True):
        self.torch = torch
        self._peaks, self._reset = stats
        self.hooks = hooks
        self.depth = 0  # optimizer steps entered and not left (a wrapper steps its inner one)
        self.stepped = False
        self.by_phase = [0, 0]  # allocated: outside, inside
        self._reserved = 0

    @staticmethod
    def cuda_counters(torch, device):
        """CUDA's allocator counters as ``stats`` takes them: ``(peaks, reset)``."""
        cuda = torch.cuda

        def peaks():
            # One nested read: max_memory_allocated and max_memory_reserved each build and
            # sort the flat dict of every counter (0.44 ms a call on an H100), and this runs
            # twice per optimizer step.
            stats = cuda.memory_stats_as_nested_dict(device)
            return tuple(stats.get(k, {}).get("all", {}).get("peak", 0)
                         for k in ("allocated_bytes", "reserved_bytes"))

        return peaks, lambda: cuda.reset_peak_memory_stats(device)

    def start(self):
        self._reset()
        if not self.hooks:
            return
        optim = importlib.import_module("torch.optim.optimizer")
        # A step torch.compile traces must not trace the hooks (only where dynamo is loaded
        # already: importing it costs a second).
        dynamo = sys.modules.get("torch._dynamo")
        for register, hook in ((optim.register_optimizer_step_pre_hook, self._entered),
                               (optim.register_optimizer_step_post_hook, self._left)):
            hook = dynamo.disable(hook) if dynamo is not None else _plain(hook)
            setattr(hook, _HOOK_MARK, True)
            register(hook)

    def stop(self):
        _remove_hooks()
        self._fold()

    def _fold(self):
        allocated, reserved = self._peaks()
        inside = int(self.depth > 0)
        self.by_phase[inside] = max(self.by_phase[inside], allocated)
        self._reserved = max(self._reserved, reserved)

    def _switch(self, depth):
        self._fold()
        self._reset()
        self.depth = depth

    def _entered(self, optimizer, args, kwargs):
        self.stepped = True
        self._switch(self.depth + 1)

    def _left(self, optimizer, args, kwargs):
        self._switch(max(0, self.depth - 1))

    def allocated(self):
        self._fold()
        return max(self.by_phase)

    def reserved(self):
        self._fold()
        return self._reserved

    def phases(self):
        """{"outside", "optimizer"} peaks, or None where no optimizer stepped (a GradScaler
        that skipped every step, a step function without a torch optimizer)."""
        if not self.stepped:
            return None
        return {"outside": self.by_phase[0], "optimizer": self.by_phase[1]}


def _plain(method):
    """A function calling `method`: a bound method takes no attributes (the hook's mark)."""
    return lambda *args: method(*args)


class Session:
    def __init__(self, user_ns, spec):
        torch = _torch()
        self.torch = torch
        step, found, self.hooked = _step_and_state(torch, user_ns, spec)
        self.step = step
        self.found = found
        self.cuda = torch.cuda.is_available()
        device = spec.get("device")
        if step.device is not None:
            self.device = step.device
        elif self.cuda:
            self.device = torch.device("cuda", device if device is not None
                                       else torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if isinstance(step, ModuleStep) and self.cuda and self.device.type != "cuda":
            # A Trainer moves a LightningModule to the GPU as fit starts and back as it ends.
            trainer = (" (a Lightning Trainer moves it there as fit starts, and back to the "
                       "CPU as fit ends)" if step.lightning_step is not None else "")
            raise MaxBatchError(f"{step.name} is on the {self.device.type}, not a GPU{trainer}: "
                                f"move it first ({step.name}.cuda() or .to('cuda')), as for "
                                "training")
        # The standard step's own GradScaler is put back too: every trial starts at its
        # initial scale, so the first steps skip the optimizer as the user's first steps will.
        self.scalers = list(found["scaler"].values()) + step.scalers()
        self.snapshot = Snapshot(torch, list(found["module"].values()),
                                 list(found["optimizer"].values()), self.scalers,
                                 list(found["scheduler"].values()), step.fixed,
                                 reached=found)
        self.trials = 0
        self.settled = False
        self.saved_fraction = None  # the allocator's cap before --limit changed it
        self.trial_peaks = None  # the running trial's PhasePeaks (None off the GPU)
        self.held_segments = None  # the cache's segments as the running trial began
        self.peak_stats = None  # a test's allocator counters, in place of CUDA's
        # Whether trials mark the optimizer's step with hooks: off after a step that
        # torch.compile(fullgraph=True) traces failed on them.
        self.phase_hooks = True

    def on_gpu(self):
        return self.device.type == "cuda"

    def _budget(self):
        """(free, total, reserved, fraction, limit) on the session's GPU: the limit is what
        the allocator may hold, free plus reserved, within its memory fraction."""
        torch, d = self.torch, self.device
        free, total = torch.cuda.mem_get_info(d)
        reserved = torch.cuda.memory_reserved(d)
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = float(getter(d)) if getter is not None else 1.0
        limit = free + reserved
        if fraction < 1.0:
            limit = min(limit, int(total * fraction))
        return free, total, reserved, fraction, limit

    def _limit(self):
        """What the allocator may hold (0 off the GPU)."""
        return self._budget()[4] if self.on_gpu() else 0

    def memory(self):
        torch = self.torch
        if not self.on_gpu():
            return {"device": str(self.device)}
        d = self.device
        free, total, reserved, fraction, limit = self._budget()
        stats = torch.cuda.memory_stats(d)
        uuid = getattr(torch.cuda.get_device_properties(d), "uuid", None)
        return {"device": str(d), "name": torch.cuda.get_device_name(d), "total": total,
                "uuid": None if uuid is None else str(uuid),
                "free": free, "fraction": fraction, "limit": limit,
                "allocated": torch.cuda.memory_allocated(d), "reserved": reserved,
                "num_ooms": stats.get("num_ooms", 0), "pinned": self._pinned()}

    def _pinned(self):
        """Page-locked host memory torch's host allocator holds (in use and cached), or None
        where this torch cannot tell."""
        stats = getattr(self.torch.cuda, "host_memory_stats", None)
        try:
            return None if stats is None else int(stats().get("allocated_bytes.current", 0))
        except RuntimeError:
            return None

    def describe(self):
        kinds = {"generator": "random generator", "tensor": "tensors outside any module",
                 "object": "attributes of", "container": "entries of",
                 "global": "variables it assigns"}
        names = {kinds.get(k, k): [_names(v)] if k in kinds else sorted(v)
                 for k, v in self.found.items() if v}
        stateless = sorted(name for name, opt in self.found["optimizer"].items()
                           if not opt.state and any(p.requires_grad for g in opt.param_groups
                                                    for p in g["params"]))
        return {"device": str(self.device), "cuda": self.cuda, "state": names,
                "hooked": self.hooked,
                "gpus": self._gpus(), "optimizers_without_state": stateless,
                "snapshot_bytes": self.snapshot.bytes(),
                "fixed_bytes": self.snapshot.fixed_bytes,
                "watched_bytes": self.snapshot.watched.bytes(), **self.step.describe(),
                "torch": self.torch.__version__}

    def _gpus(self):
        """The GPUs the found modules' weights and buffers sit on (a model split over
        several, as `device_map="auto"` splits one, while the trials read one of them)."""
        gpus = {str(t.device) for m in self.found["module"].values()
                for t in (*m.parameters(), *m.buffers()) if t.is_cuda}
        return sorted(gpus)

    def _num_ooms(self):
        if not self.on_gpu():
            return 0
        return self.torch.cuda.memory_stats(self.device).get("num_ooms", 0)

    def _is_oom(self, err, ooms_before):
        oom_type = getattr(self.torch, "OutOfMemoryError", None) or self.torch.cuda.OutOfMemoryError
        if isinstance(err, DataRanOut):  # after an allocation the step caught, still not OOM
            return False
        return isinstance(err, oom_type) or self._num_ooms() > ooms_before

    def freeze_heap(self):
        """Moves every object alive now (the notebook's whole heap) out of the collector's
        view, so that the collection after each trial, and those the step itself triggers,
        scan only what the trials made: a full one costs 170 ms in a notebook with a model on
        an H200 (bench/gpu/cleanup_probe.py), paid after every trial. Frozen whatever was
        frozen before (Python 3.12 starts with 375 objects frozen of its own), so `thaw_heap`
        also gives those back to the collector: freezing only ever saves collection time."""
        gc.collect()
        gc.freeze()
        self.froze = True

    def thaw_heap(self):
        """Gives the heap back to the collector; whether it collected (the session's garbage)."""
        if getattr(self, "froze", False):
            # What the trials left is collected before the heap comes back into view (cheap:
            # the frozen heap is not scanned); the heap itself needs no collection, it was
            # collected when frozen and the restore frees by reference count.
            gc.collect()
            gc.unfreeze()
            self.froze = False
            return True
        return False

    def _settle(self, collect=True):
        if collect:
            gc.collect()
        if self.on_gpu():
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()

    def release_pinned(self):
        """Gives the page-locked host memory of the dropped snapshot back to the system.
        torch's host allocator keeps freed pinned blocks cached for the life of the process,
        so without this a search over an 8 GiB model would leave 8 GiB of RAM locked
        (unswappable, counted against the job's memory limit) in the user's kernel for good.
        Only blocks nobody holds go (a DataLoader's pinned batches in use stay); as with the
        GPU cache emptied at close, the next search pins afresh."""
        torch = self.torch
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            empty()

    def restore(self):
        for attempt in range(3):  # an interrupt landing in the restore must not leave it half done
            try:
                self.snapshot.restore()
                return
            except KeyboardInterrupt:
                if attempt == 2:
                    raise

    def _mark(self):
        """What a step leaves behind that the next step starts from: the bytes allocated,
        and every GradScaler's scale (a step that skipped the optimizer on an overflow halves
        it, and the optimizer's state is made at a later step)."""
        allocated = self.torch.cuda.memory_allocated(self.device) if self.on_gpu() else 0
        return allocated, [s.get_scale() for s in self.scalers if s.is_enabled()]

    def _segments(self):
        """The caching allocator's segments on the session's GPU, [(address, bytes,
        expandable)]; none off the GPU, None where this torch's snapshot cannot be read (the
        room for a stranded block is then left out, not the search)."""
        if not self.on_gpu():
            return []
        torch = self.torch
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            return [(s["address"], s["total_size"], bool(s.get("is_expandable")))
                    for s in torch.cuda.memory_snapshot() if s.get("device") == index]
        except (KeyError, TypeError, RuntimeError):
            return None

    def _largest_block(self, held_segments):
        segments = self._segments()
        if segments is None or held_segments is None:
            return None
        return _largest_new_segment(segments, held_segments)

    def _far_below(self, limit):
        """Whether the steps so far kept the cache far enough below `limit` that a step
        needing a little more than the one before cannot reach it: at most STEADY_HEADROOM
        of it, and with room under it for one more of the trial's largest allocations (the
        cache can strand one as it fragments, and the next step then needs a segment of that
        size anew: Qwen2's float32 logits, 0.13 of the limit, failed the third step with the
        cache at 0.936 of it, maxbatch-truth-2026-12-07q)."""
        if self.trial_peaks is None:
            return True
        reserved = self.trial_peaks.reserved()
        if reserved > STEADY_HEADROOM * limit:
            return False
        block = self._largest_block(self.held_segments)
        return block is None or reserved + block <= limit

    def _run_steps(self, batch, most, until_steady=True):
        """Runs up to `most` steps, synchronized; returns how many ran (`self.steps_ran` counts
        them as they go, for a trial cut short). With `until_steady` they end after a step
        that repeats the one before: from the second on, one that left the allocated bytes
        within STEADY_SLACK of the limit of where the step before left them, every scale as
        it was, and the cache at most STEADY_HEADROOM of the limit. Measured on an H200 over
        the 189 two-step probes of the truth runs maxbatch-truth-2026-12-04c to -04f, which
        marked every step's peak cache (12 to 16 models, 3 steps each), this rule at 0.95
        ends 111 of the 181 that fitted (90 at 0.9, 138 at 0.98); no probe it ends ran out of
        memory at step 3, a third step never peaked more than 1.6 MiB above the first two nor
        grew the cache by more than 346 MiB (1.4% of 24 GiB; 680 MiB at 0.98), and each of
        the 7 that failed at step 3 had a step before it with the cache at 0.996 of the limit
        or above. So trials near the limit run all their steps, and the rest end where the
        third step would be spent for nothing. (Requiring the allocator's exact layout
        instead ended 1 of 86.) Over the 1713 probes of every committed truth run through
        maxbatch-truth-2026-12-07q, the rule ended 993, and one of them failed at step 3:
        Qwen2 with its output held (a 0.13-of-the-limit logits block stranded at a cache of
        0.936); also asking the cache to leave room for the trial's largest allocation
        (`_far_below`; truth_report.py estimates the block from the row's `room`) ends 946
        of them, and none of those failed."""
        self.steps_ran = 0
        limit = self._limit() if until_steady else 0
        steps = self.step.steps(batch)
        last = None
        try:
            for _ in steps:
                self.steps_ran += 1
                if self.on_gpu():
                    self.torch.cuda.synchronize(self.device)
                if self.steps_ran >= most:
                    break
                if until_steady:
                    allocated, scales = mark = self._mark()
                    if (last is not None and scales == last[1]
                            and abs(allocated - last[0]) <= STEADY_SLACK * limit
                            and self._far_below(limit)):
                        break
                    last = mark
        finally:
            steps.close()  # its frame holds the last output: freed with the trial's garbage
        return self.steps_ran

    def trial(self, batch, steps, timed=0):
        self.trials += 1
        began = time.perf_counter()
        if not self.settled:  # the previous trial's end left the cache empty and nothing to collect
            self._settle()
        self.settled = False
        _remove_hooks()  # any that an interrupt left behind
        # The cache holds only what the user holds now: what the trial adds is its own.
        held_segments = self._segments()
        self.held_segments = (None if held_segments is None
                              else {(a, size) for a, size, _ in held_segments})
        self.trial_peaks = peaks = self._phase_peaks()
        retry = False
        before_ooms = self._num_ooms()
        result = {"batch": batch, "settle_ms": (time.perf_counter() - began) * 1000.0}
        started = time.perf_counter()
        try:
            if peaks is not None:
                peaks.start()
            if isinstance(self.step, FunctionStep) and self.phase_hooks:
                self._adopt_unreached_optimizers()
            result["steps"] = self._run_steps(batch, steps)
            if timed:
                if peaks is not None:
                    peaks.stop()  # timed unwatched: the hooks cost a fast step about 1 ms
                t0 = time.perf_counter()
                self._run_steps(batch, timed, until_steady=False)
                result["samples_per_s"] = batch * timed / (time.perf_counter() - t0)
            # The step returned, so the batch trained. Allocations refused and caught inside
            # it (cuDNN tries a workspace and falls back to a smaller one) are counted, not
            # failures: the user's loop would have gone on just the same.
            result["result"] = "ran"
            result["caught_ooms"] = self._num_ooms() - before_ooms
        except KeyboardInterrupt as err:
            result["steps"] = self.steps_ran + 1  # the step it cut
            result["result"] = "interrupted"
            _drop_frames(err)
            del err
        except BaseException as err:  # the step's own failure: reported, the state put back
            result["steps"] = self.steps_ran + 1  # the step that failed
            failure, retry = self._failure(err, before_ooms, peaks)
            result.update(failure)
            _drop_frames(err)
            del err
        finally:
            if peaks is not None:
                peaks.stop()  # the hooks go, whatever ended the steps
            _remove_hooks()
        result["ms"] = (time.perf_counter() - started) * 1000.0
        self._clean_up(result, peaks)
        if retry:
            self.phase_hooks = False
            self.trials -= 1
            return self.trial(batch, steps, timed)
        return result

    def _failure(self, err, before_ooms, peaks):
        """What a step's exception makes of its trial: the result's fields, and whether the
        trial runs again without the phase hooks."""
        if self._is_oom(err, before_ooms):
            return {"result": "out_of_memory",
                    "message": str(err).strip().splitlines()[0] if str(err) else ""}, False
        # A step torch.compile(fullgraph=True) traces cannot call the hooks (a custom
        # optimizer's compiled step): the trial runs again without them.
        retry = (peaks is not None and peaks.hooks
                 and type(err).__module__.startswith("torch._dynamo"))
        error = {"ename": type(err).__name__, "evalue": str(err), "where": _where(err)}
        if getattr(self.step, "lightning_step", None) is not None:
            # Lightning's words where a step reads self.trainer (self.lr_schedulers(), say).
            needs = "not attached to a `Trainer`" in str(err)
            got = ("ran without a Trainer, which it reaches" if needs else
                   "got the batch (input, target) that %maxbatch makes, the target as the loss "
                   "inferred from the forward's output takes it")
            error["hint"] = (f"{self.step.name}.training_step {got}. "
                             f"{_lightning_hint(self.step.name)}")
        return {"result": "error", "error": error}, retry

    def _clean_up(self, result, peaks):
        """After a trial's steps: its peaks and largest block into `result`, its garbage
        collected, the cache emptied and the user's state put back (`cleanup_ms`: where the
        time between two trials goes)."""
        clock = _Clock()
        if result["result"] == "ran" and self.on_gpu():
            result["largest_block"] = self._largest_block(self.held_segments)
            clock.lap("segments")
        if peaks is not None:
            result["peak_allocated"] = peaks.allocated()
            result["peak_reserved"] = peaks.reserved()
            if peaks.phases() is not None:
                result["phase_peaks"] = peaks.phases()
        gc.collect()  # the step's garbage (cycles too) goes before the state comes back
        clock.lap("collect")
        self._settle(collect=False)
        clock.lap("empty_cache")
        self.restore()
        # The restore frees by reference count (no cycles): no second collection.
        self._settle(collect=False)
        self.settled = True
        clock.lap("restore")
        result["cleanup_ms"] = clock.laps
        if self.on_gpu():
            result["allocated_after"] = self.torch.cuda.memory_allocated(self.device)

    def _adopt_unreached_optimizers(self):
        """An optimizer the step steps that find_state did not reach is kept before its first
        step (torch's global pre-hook runs for every optimizer), and put back with the rest."""
        optim = importlib.import_module("torch.optim.optimizer")
        dynamo = sys.modules.get("torch._dynamo")
        adopt = self.snapshot.adopt_optimizer
        hook = (lambda opt, args, kwargs: adopt(opt))
        hook = dynamo.disable(hook) if dynamo is not None else hook
        setattr(hook, _HOOK_MARK, True)
        optim.register_optimizer_step_pre_hook(hook)

    def _counters(self):
        """The allocator's peak counters, ``(peaks, reset)``: a test's, CUDA's, or None."""
        if self.peak_stats is not None:
            return self.peak_stats
        if self.on_gpu():
            return PhasePeaks.cuda_counters(self.torch, self.device)
        return None

    def _phase_peaks(self):
        counters = self._counters()
        return None if counters is None else PhasePeaks(self.torch, counters, self.phase_hooks)

    def restart_peak_counters(self):
        """The allocator's peak counters start again from what the user holds: the trials
        reset them at every phase, and the last trial's peak left in them would be read as
        the user's by their next `max_memory_allocated()`. (Their peak from before the
        session cannot be put back: torch has no call that sets it.)"""
        counters = self._counters()
        if counters is not None:
            counters[1]()


def _drop_frames(err):
    """An exception's frames hold the step's tensors (the activations of the step it cut
    short): they go before the state is put back."""
    err.__traceback__ = err.__context__ = err.__cause__ = None


def _release_escaped(module_globals):
    """An interrupt that escaped one of this module's calls (landing between two statements
    of a restore, say) left its traceback where IPython keeps the last error (sys.last_*),
    holding this module's frames and, through them, tensors: the user never saw that error
    (the call was silent), so its frames are cleared and it is forgotten."""
    import traceback
    last = tb = getattr(sys, "last_traceback", None)
    while tb is not None and tb.tb_frame.f_globals is not module_globals:
        tb = tb.tb_next
    if tb is None:
        return
    traceback.clear_frames(last)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)


def _is_library(filename):
    """Whether a frame's file belongs to an installed package (torch, transformers, ...) or
    Python itself, rather than to the user's notebook or their own modules."""
    import sysconfig
    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return ("site-packages" in filename or "dist-packages" in filename
            or any(r and filename.startswith(r) for r in roots))


def _where(err):
    """The innermost frame of the user's code in a traceback, as 'file:line in function': the
    line of theirs that called into torch, not torch's own (a library's innermost frame
    when the user's code is not on the stack at all)."""
    tb, last, last_own = err.__traceback__, None, None
    while tb is not None:
        if tb.tb_frame.f_globals is not globals():
            last = tb
            if not _is_library(tb.tb_frame.f_code.co_filename):
                last_own = tb
        tb = tb.tb_next
    last = last_own or last
    if last is None:
        return None
    code = last.tb_frame.f_code
    return f"{code.co_filename}:{last.tb_lineno} in {code.co_name}"


_session = None


def prepare(user_ns, spec):
    """Starts a session: finds what to run and what to keep, snapshots it, and (for a module)
    runs one forward pass to see the output. Returns what gpukernel needs for the search."""
    global _session
    _end_session()
    clock = _Clock()
    session = Session(user_ns, spec)
    _session = session
    clock.lap("session")  # finding the state and copying it to host memory
    reply = {"describe": session.describe(), "memory": session.memory(), "output": None}
    clock.lap("describe")
    if isinstance(session.step, ModuleStep):
        try:
            reply["output"] = session.step.probe_output()
            reply["describe"].update(session.step.describe())  # what the probe found
            clock.lap("probe")
        finally:
            session.restore()
            clock.lap("restore")
    session.freeze_heap()  # one full collection, which also takes the probe's garbage
    clock.lap("freeze")
    session._settle(collect=False)
    session.settled = True  # the first trial starts from an empty cache, nothing to collect
    clock.lap("settle")
    reply["memory"] = session.memory()
    reply["timings_ms"] = clock.laps
    return reply


class _Clock:
    """Named laps in ms: where the fixed cost of a search goes."""

    def __init__(self):
        self.laps, self._last = {}, time.perf_counter()

    def lap(self, name):
        now = time.perf_counter()
        self.laps[name] = (now - self._last) * 1000.0
        self._last = now


def set_loss(user_ns, plan, returned=None):
    """The loss the standard step computes: `plan` on the selected output (and its heads);
    with `returned` "alone", the scalar the forward returns instead, or "added" to it."""
    session = _current()
    step = session.step
    step.loss_plan, step.returned_use = plan, returned
    reply = {"loss": plan, "returned": returned}
    # A LightningModule's training_step may take another target than the plan's class ids.
    if (isinstance(step, ModuleStep) and step.lightning_step is not None
            and step.output_shape is not None and step.own is None and plan["kind"] == "ce"):
        try:
            reply["target_values"] = step.choose_target()
        finally:
            session.restore()
            session.settled = False  # the first trial collects the probe's garbage first
    return reply


def trial(user_ns, batch, steps=2, timed=0):
    return _current().trial(int(batch), int(steps), int(timed))


def memory(user_ns):
    return _current().memory()


def set_cap(user_ns, bytes):
    """--limit: caps the allocator at `bytes` (set_per_process_memory_fraction) until close, so
    a smaller card's out-of-memory errors happen for real in the user's own step."""
    session = _current()
    torch = session.torch
    if not session.on_gpu():
        raise MaxBatchError("--limit needs the model on a GPU")
    d = session.device
    total = torch.cuda.mem_get_info(d)[1]
    if session.saved_fraction is None:
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        session.saved_fraction = float(getter(d)) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, bytes / total), d)
    return session.memory()


def close(user_ns=None):
    """Ends the session: the state is put back once more, the copies dropped, and the cache
    emptied. Safe to call more than once."""
    sys.modules.pop(__name__, None)  # gpukernel's key for this module: the kernel keeps nothing
    return _end_session()


def _end_session():
    global _session
    _release_escaped(globals())
    session, _session = _session, None
    if session is None:
        return {"closed": False}
    clock = _Clock()
    try:
        session.restore()
        clock.lap("restore")
    finally:
        _remove_hooks()
        collected = session.thaw_heap()
        if session.saved_fraction is not None:
            session.torch.cuda.set_per_process_memory_fraction(session.saved_fraction,
                                                               session.device)
        # Whatever stopped the restore: the report has told the user the counters restart.
        session.restart_peak_counters()
    snapshot = session.snapshot
    not_kept = ([f"tensors beyond {_bytes(snapshot.LOOSE_BYTES)} your step reaches outside any "
                 f"module: {_names(snapshot.loose_left_out)}"] if snapshot.loose_left_out else [])
    not_kept += [f"the gradients of the parameters of an optimizer your step stepped that "
                 f"%maxbatch could not reach from it ({o}; kept from its first step on, "
                 f"its state and weights are back)" for o in snapshot.adopted]
    del session.snapshot, snapshot
    clock.lap("release")
    session._settle(collect=not collected)  # a session that never froze: a full collection
    session.restart_peak_counters()  # again, from what the user holds once the cache is empty
    clock.lap("settle")
    session.release_pinned()  # after the settle: the copies are garbage and their DMA is done
    clock.lap("pinned")
    return {"closed": True, "memory": session.memory(), "timings_ms": clock.laps,
            "not_kept": not_kept}


def _names(names, shown=4):
    """A list of names for a report, the first few and how many more."""
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _current():
    if _session is None:
        raise MaxBatchError("no %maxbatch session is open in this kernel")
    return _session


def call(user_ns, name, args_json):
    """The one entry point gpukernel's expressions use: a function of this module by name with
    JSON arguments; the reply is JSON text. A problem of the user's request comes back as
    {"refused": ...}; anything else raises (gpukernel shows it as an engine failure)."""
    import json
    functions = {"prepare": prepare, "set_loss": set_loss, "set_cap": set_cap, "trial": trial,
                 "memory": memory, "close": close}
    try:
        return json.dumps(functions[name](user_ns, **json.loads(args_json)))
    except MaxBatchError as err:
        if name != "close":
            try:
                close(user_ns)
            except Exception:
                pass
        return json.dumps({"refused": str(err)})
