"""%oom's probe: run in the user's Python kernel after a cell failed, through the silent side
channel (a user_expression), to say whether the cell's exception was a CUDA out-of-memory error
and what the caching allocator and the notebook's namespace held at that moment.

Rules it keeps (the notebook must not notice it ran):
- never imports anything: torch and every other module is looked up in ``sys.modules``;
- touches CUDA only if torch has already initialised it (no new context);
- keeps no references: everything lives in this call's frame; the module removes itself from
  ``sys.modules`` before returning, so the notebook's ``sys.modules`` and namespace are as they
  were;
- never raises (a raising user_expression would overwrite ``sys.last_value``).

The exception is recognised by type (``torch.OutOfMemoryError``, also through ``__cause__`` /
``__context__``); the message is returned for the size and device it names, never to decide.
"""

import sys

# Names IPython keeps in the namespace for itself; outputs (Out, _, __) are still walked, after
# the user's own names, because they do keep tensors alive.
_IPYTHON_NAMES = {"In", "exit", "quit", "get_ipython", "_ih", "_dh", "_i", "_ii", "_iii"}
_MAX_TENSORS = 12
_MAX_CONTAINER = 10000


def _oom_in_chain(exc, oom_type):
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, oom_type):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _allocator(torch):
    devices = []
    try:
        count = torch.cuda.device_count()
    except Exception:
        return devices
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:
        segments = []
    for index in range(count):
        try:
            stats = torch.cuda.memory_stats(index)
        except Exception:
            continue
        largest = 0
        releasable = 0
        count_segments = 0
        for seg in segments:
            if seg.get("device") != index:
                continue
            count_segments += 1
            if seg.get("allocated_size", 0) == 0 and seg.get("active_size", 0) == 0:
                releasable += seg.get("total_size", 0)
            for block in seg.get("blocks", ()):
                if block.get("state") == "inactive":
                    largest = max(largest, block.get("size", 0))
        try:
            props = torch.cuda.get_device_properties(index)
            uuid, total = str(props.uuid), int(props.total_memory)
        except Exception:
            uuid, total = None, None
        try:
            fraction = float(torch.cuda.get_per_process_memory_fraction(index))
        except Exception:  # older torch: no getter
            fraction = None
        devices.append({
            "index": index,
            "uuid": uuid,
            "allocated": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved": int(stats.get("reserved_bytes.all.current", 0)),
            "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
            "inactive_split": int(stats.get("inactive_split_bytes.all.current", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "largest_free_block": int(largest),
            "releasable": int(releasable),
            "segments": count_segments,
            "total_memory": total,
            "memory_fraction": fraction,
        })
    return devices


class _Walk:
    """Live tensors by storage (each storage counted once, under the first name seen)."""

    def __init__(self, torch):
        self.tensor = torch.Tensor
        self.module = torch.nn.Module
        optim = getattr(torch, "optim", None)
        self.optimizer = getattr(optim, "Optimizer", ()) if optim is not None else ()
        self.seen = set()
        self.found = []

    def _storage(self, t):
        try:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            return key, int(storage.nbytes())
        except Exception:
            return None, 0

    def tensor_entry(self, name, t, kind):
        key, nbytes = self._storage(t)
        if key is None or key in self.seen:
            return
        self.seen.add(key)
        self.found.append({
            "name": name, "kind": kind, "shape": [int(s) for s in t.shape],
            "dtype": str(t.dtype).replace("torch.", ""), "device": str(t.device),
            "bytes": nbytes,
        })

    def group(self, name, kind, tensors):
        """Many tensors reported as one entry (a module's parameters, an optimizer's state)."""
        total = 0
        devices = set()
        n = 0
        for t in tensors:
            key, nbytes = self._storage(t)
            if key is None or key in self.seen:
                continue
            self.seen.add(key)
            total += nbytes
            devices.add(str(t.device))
            n += 1
        if n:
            self.found.append({"name": name, "kind": kind, "shape": [n], "dtype": "",
                               "device": ",".join(sorted(devices)), "bytes": total})

    def module_entries(self, name, m):
        params = list(m.parameters())
        self.group(name, "parameters", params)
        self.group(name + " (gradients)", "gradients",
                   [p.grad for p in params if p.grad is not None])
        self.group(name + " (buffers)", "buffers", list(m.buffers()))
        params = None

    def optimizer_entries(self, name, opt):
        tensors = []
        for state in getattr(opt, "state", {}).values():
            if isinstance(state, dict):
                tensors.extend(v for v in state.values() if isinstance(v, self.tensor))
        self.group(name + " (state)", "optimizer state", tensors)

    def value(self, name, v, depth=0):
        if isinstance(v, self.tensor):
            self.tensor_entry(name, v, "tensor")
        elif isinstance(v, self.module):
            self.module_entries(name, v)
        elif self.optimizer and isinstance(v, self.optimizer):
            self.optimizer_entries(name, v)
        elif depth == 0 and isinstance(v, (list, tuple)):
            for i, item in enumerate(v[:_MAX_CONTAINER]):
                self.value(f"{name}[{i}]", item, 1)
        elif depth == 0 and isinstance(v, dict):
            for i, (k, item) in enumerate(v.items()):
                if i >= _MAX_CONTAINER:
                    break
                self.value(f"{name}[{k!r}]", item, 1)


def _frames(tb):
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _model_and_batch(torch, user_ns, tb):
    """The outermost nn.Module running when the error was raised, its name in the notebook and
    the leading dimension of its first tensor input."""
    module_type = torch.nn.Module
    tensor = torch.Tensor
    model = None
    batch = None
    for frame in _frames(tb):
        local = frame.f_locals
        candidate = local.get("self")
        if not isinstance(candidate, module_type):
            continue
        inputs = list(local.get("args", ()) or ())
        code = frame.f_code
        inputs += [local.get(n) for n in code.co_varnames[1:code.co_argcount]]
        for x in inputs:
            if isinstance(x, tensor) and x.dim() >= 1:
                batch = int(x.shape[0])
                break
        model = candidate
        break
    name = None
    if model is not None:
        for key, value in list(user_ns.items()):
            if value is model and not key.startswith("_"):
                name = key
                break
    else:  # raised outside any forward (backward, optimizer step): the notebook's one model
        modules = [key for key, value in list(user_ns.items())
                   if isinstance(value, module_type) and not key.startswith("_")]
        if len(modules) == 1:
            name = modules[0]
    model = None
    return name, batch


def _batch_variable(user_ns):
    for key in ("batch_size", "BATCH_SIZE", "bs", "batch", "BATCH"):
        value = user_ns.get(key)
        if type(value) is int and value > 0:
            return key, value
    return None, None


def _traceback_tensors(walk, tb, user_ns):
    """Tensors that only the failed cell's traceback (sys.last_traceback) keeps alive."""
    before = len(walk.found)
    for frame in _frames(tb):
        if frame.f_locals is user_ns or frame.f_globals is frame.f_locals:
            continue
        where = frame.f_code.co_name
        for key, value in list(frame.f_locals.items()):
            if isinstance(value, walk.tensor) and value.device.type != "cpu":
                walk.tensor_entry(f"{where}: {key}", value, "held by the traceback")
    held = walk.found[before:]
    return sum(e["bytes"] for e in held), len(held)


def diagnose(user_ns, args):
    torch = sys.modules.get("torch")
    out = {"torch_imported": torch is not None, "torch_version": None, "exception": None,
           "is_oom": False, "cuda_initialized": False, "devices": [], "tensors": [],
           "traceback_bytes": 0, "traceback_tensors": 0, "model_name": None,
           "input_batch": None, "batch_variable": None, "batch_value": None,
           "alloc_conf": None, "current_device": None, "named_bytes_by_device": {},
           "has_traceback": False}
    if torch is None:
        return out
    out["torch_version"] = getattr(torch, "__version__", None)
    value = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if value is None:
        return out
    ename = type(value).__name__
    out["exception"] = {"type": f"{type(value).__module__}.{type(value).__qualname__}",
                        "name": ename, "message": str(value)[:4000],
                        "matches_reply": ename == args.get("ename")}
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError")
    oom = _oom_in_chain(value, oom_type)
    value = None
    out["is_oom"] = oom is not None
    if oom is None:
        return out
    out["exception"]["oom_message"] = str(oom)[:4000]
    oom = None
    os_module = sys.modules.get("os")
    if os_module is not None:
        out["alloc_conf"] = os_module.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    try:
        out["cuda_initialized"] = bool(torch.cuda.is_initialized())
    except Exception:
        out["cuda_initialized"] = False
    if out["cuda_initialized"]:
        out["devices"] = _allocator(torch)
        try:
            out["current_device"] = int(torch.cuda.current_device())
        except Exception:
            pass
    tb = getattr(sys, "last_traceback", None)
    walk = _Walk(torch)
    late = []
    for key, v in list(user_ns.items()):
        if key in _IPYTHON_NAMES or key.startswith("_i"):
            continue
        if key.startswith("_") or key == "Out":
            late.append((key, v))
            continue
        walk.value(key, v)
    for key, v in late:
        walk.value(key, v)
    late = None
    v = None
    by_device = {}
    for e in walk.found:
        for d in e["device"].split(","):
            by_device[d] = by_device.get(d, 0) + e["bytes"]
    out["named_bytes_by_device"] = by_device
    out["has_traceback"] = tb is not None
    out["traceback_bytes"], out["traceback_tensors"] = _traceback_tensors(walk, tb, user_ns)
    out["model_name"], out["input_batch"] = _model_and_batch(torch, user_ns, tb)
    tb = None
    out["batch_variable"], out["batch_value"] = _batch_variable(user_ns)
    walk.found.sort(key=lambda e: -e["bytes"])
    out["tensors"] = walk.found[:_MAX_TENSORS]
    out["tensor_bytes_total"] = sum(e["bytes"] for e in walk.found)
    walk = None
    return out


def _allocated(torch):
    try:
        if not torch.cuda.is_initialized():
            return {}
        return {i: (torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i))
                for i in range(torch.cuda.device_count())}
    except Exception:
        return {}


def release(user_ns, args):
    """``%oom --release``, asked for by the user: lets go of the failed cell's traceback (which
    keeps every frame's tensors, and their autograd graphs, alive) and returns the cache."""
    torch = sys.modules.get("torch")
    before = _allocated(torch) if torch is not None else {}
    had = any(getattr(sys, n, None) is not None for n in ("last_traceback", "last_exc"))
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    shell = user_ns.get("get_ipython")
    shell = shell() if callable(shell) else None
    formatter = getattr(shell, "InteractiveTB", None)
    if formatter is not None and getattr(formatter, "tb", None) is not None:
        formatter.tb = None
    shell = formatter = None
    gc = sys.modules.get("gc")
    if gc is not None:
        gc.collect()
    if torch is not None and before:
        torch.cuda.empty_cache()
    after = _allocated(torch) if torch is not None else {}
    return {"had_traceback": had, "devices": [
        {"index": i, "allocated_before": b[0], "reserved_before": b[1],
         "allocated_after": after.get(i, b)[0], "reserved_after": after.get(i, b)[1]}
        for i, b in sorted(before.items())]}


def call(user_ns, name, args_json):
    json = sys.modules["json"]
    try:
        args = json.loads(args_json)
        if name == "diagnose":
            result = {"ok": diagnose(user_ns, args)}
        elif name == "release":
            result = {"ok": release(user_ns, args)}
        else:
            raise ValueError(f"unknown function {name}")
    except BaseException as e:  # never raise into IPython: it would replace sys.last_value
        result = {"failed": f"{type(e).__name__}: {e}"}
    finally:
        sys.modules.pop(__name__, None)
    return json.dumps(result)
