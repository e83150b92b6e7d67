"""%envcheck's look at the notebook's own interpreter, through the silent side channel: which
Python it is, its sys.path, the variables that decide CUDA, and the torch already loaded (if
any). Imports nothing, leaves nothing behind (the module removes itself from sys.modules)."""

import sys

_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH", "CONDA_PREFIX",
              "CONDA_DEFAULT_ENV", "VIRTUAL_ENV", "PYTORCH_CUDA_ALLOC_CONF", "PATH")


def call(user_ns, name, args_json):
    json = sys.modules["json"]
    try:
        environ = sys.modules["os"].environ
        torch = sys.modules.get("torch")
        loaded = None
        if torch is not None:
            loaded = {"version": getattr(torch, "__version__", None),
                      "file": getattr(torch, "__file__", None),
                      "cuda": getattr(getattr(torch, "version", None), "cuda", None)}
        result = {"executable": sys.executable, "prefix": sys.prefix,
                  "cwd": sys.modules["os"].getcwd(),
                  "sys_path": [p for p in sys.path if isinstance(p, str)],
                  "env": {k: environ.get(k) for k in _VARIABLES}, "torch_loaded": loaded}
        torch = None
    except BaseException as e:  # never raise into IPython
        result = {"failed": f"{type(e).__name__}: {e}"}
    finally:
        sys.modules.pop(__name__, None)
    return json.dumps(result)
