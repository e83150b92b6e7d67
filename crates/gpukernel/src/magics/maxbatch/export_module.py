"""%maxbatch VARIABLE: a torch.nn.Module of the notebook, saved as TorchScript for gpukernel.

gpukernel runs this in the Python kernel through a silent user_expression, in a namespace of
its own, so the notebook gains no names and no history. The module is left exactly as it was:
scripting only compiles it; tracing runs one forward pass, so buffers (BatchNorm statistics),
the random number generators and training flags are put back afterwards; nothing touches
parameters, gradients or optimizers. The file is private (mkstemp: 0600) and gpukernel removes
it once it has loaded it.
"""


def export(user_ns, name, shape, vocab, train=True):
    import os
    import sys
    import tempfile

    torch = sys.modules.get("torch")
    parts = name.split(".")
    if parts[0] not in user_ns:
        raise NameError(f"{parts[0]!r} is not defined in this notebook")
    obj = user_ns[parts[0]]
    for part in parts[1:]:
        obj = getattr(obj, part)
    if torch is None or not isinstance(obj, torch.nn.Module):
        raise TypeError(f"{name} is a {type(obj).__name__}, not a torch.nn.Module")
    if vocab is None:
        vocab = _vocab(torch, obj)
    fd, path = tempfile.mkstemp(prefix="gpukernel-maxbatch-", suffix=".pt")
    os.close(fd)
    try:
        try:
            module, method = torch.jit.script(obj), "script"
            # Saving can fail where scripting passed (a scripted MultiheadAttention: "strides()
            # called on an undefined Tensor", torch 2.11): tracing saves it.
            module.save(path)
        except Exception as err:  # TorchScript rejects much of Python: fall back to tracing
            if shape is None:
                raise ValueError(
                    f"torch.jit.script cannot compile or save {name} ({_first_line(err)}); "
                    "pass --input SHAPE so it can be traced instead") from None
            try:
                module, method = _trace(torch, obj, shape, vocab, train), "trace"
                module.save(path)
            except Exception as trace_err:  # nanoGPT's (logits, None): no trace returns None
                raise ValueError(
                    f"the libtorch engine runs a TorchScript copy of {name}, and "
                    f"torch.jit.script cannot compile or save it ({_first_line(err)}), nor "
                    f"torch.jit.trace trace it ({_first_line(trace_err)}): drop --engine "
                    "libtorch, and the python engine runs it in your kernel as it is") from None
    except BaseException:
        os.unlink(path)
        raise
    return {"path": path, "method": method, "training": obj.training, "vocab": vocab,
            "parameters": sum(p.numel() for p in obj.parameters()),
            "seq_first": _seq_first(obj, name), "targets_parameter": _targets_parameter(obj),
            "lightning": _lightning(obj), **_held(torch, obj)}


def _lightning(module):
    """Whether the module is a LightningModule with a training_step of its own, whose step the
    python engine runs as its Trainer does (trials.py's `_lightning_training_step`)."""
    base = next((c for c in type(module).__mro__ if c.__name__ == "LightningModule"
                 and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")), None)
    step = getattr(type(module), "training_step", None)
    return base is not None and step is not None and step is not getattr(base, "training_step")


def _targets_parameter(module):
    """The forward's optional targets argument (nanoGPT's `targets`, Hugging Face's
    `labels`), as the python engine looks for it: this engine calls the forward without."""
    import inspect
    try:
        signature = inspect.signature(getattr(module, "_orig_mod", module).forward)
    except (TypeError, ValueError):
        return None
    return next((p.name for p in signature.parameters.values()
                 if p.name in ("targets", "labels", "target")
                 and p.default is not inspect.Parameter.empty), None)


def _seq_first(module, name):
    """The layers that take (seq, batch, ...) (batch_first=False, the default of PyTorch's
    RNNs, MultiheadAttention and Transformer layers): the engine puts the batch first."""
    return [f"{name}.{rel}" if rel else name for rel, m in module.named_modules()
            if getattr(m, "batch_first", None) is False]


def _held(torch, module):
    """What the notebook's process holds on the module's GPU, and how much of it is the
    module's own tensors (weights, buffers, gradients): the rest is room the user's loop does
    not have and a copy trained in another process does not miss."""
    tensors = list(module.parameters()) + list(module.buffers())
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    cuda = [t for t in tensors if t.is_cuda]
    if not cuda or not torch.cuda.is_initialized():
        return {}
    device = cuda[0].device
    seen, own = set(), 0
    for t in cuda:
        if t.device == device and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            own += t.numel() * t.element_size()
    return {"held_on_device": torch.cuda.memory_allocated(device), "own_bytes": own,
            "allocator_limit": _allocator_limit(torch, device),
            "expandable_segments": _expandable_segments(torch, device)}


def _expandable_segments(torch, device, environ=None):
    """Whether this process's caching allocator maps expandable segments, which strand no
    block: then the libtorch engine, whose own allocator may be set otherwise (a notebook
    that set PYTORCH_CUDA_ALLOC_CONF with %env before importing torch), leaves no room for
    one. Read from the segments the cache holds, else from the settings it started with."""
    try:
        segments = [s for s in torch.cuda.memory_snapshot() if s.get("device") == device.index]
    except (AttributeError, KeyError, TypeError, RuntimeError):
        segments = []
    if segments:
        return any(s.get("is_expandable") for s in segments)
    import os

    environ = os.environ if environ is None else environ
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for setting in environ.get(name, "").split(","):
            key, _, value = setting.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip() == "True"
    return False


def _allocator_limit(torch, device):
    """What this process's caching allocator may hold on `device`: what it holds plus what
    the device has free, within its memory fraction (a notebook sharing a card caps it so).
    The libtorch engine sizes its copy against this, not against the whole card."""
    free, total = torch.cuda.mem_get_info(device)
    limit = free + torch.cuda.memory_reserved(device)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = float(getter(device)) if getter is not None else 1.0
    return min(limit, int(total * fraction)) if fraction < 1.0 else limit


def _vocab(torch, module):
    """Token ids' range when the first layer holding weights is an Embedding (a leaf: a model
    may keep a positional embedding as its own parameter), as the python engine infers it."""
    first = next((m for m in module.modules() if next(m.children(), None) is None
                  and next(m.parameters(False), None) is not None), None)
    embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return first.num_embeddings if isinstance(first, embeddings) else None


def _first_line(err):
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _trace(torch, module, shape, vocab, train):
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    size = (2, *shape)  # two samples: BatchNorm refuses one in training mode
    try:
        example = (torch.randint(0, vocab, size, device=device) if vocab
                   else torch.randn(size, device=device, dtype=dtype))
        # Traced in the mode the trials run in (a trace records one mode's graph).
        module.train(train)
        with torch.no_grad():
            # strict=False: a dict output (a Hugging Face ModelOutput, torchvision's
            # {"out", "aux"}) is traced too; the engine selects from it as the python one does.
            return torch.jit.trace(module, example, check_trace=False, strict=False)
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        for m, training in modes:
            m.training = training
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
