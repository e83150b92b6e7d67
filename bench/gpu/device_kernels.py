"""The gpukernel kernelspecs on the GPU machine, for the bench scripts that drive a notebook.

That machine has torch (and its libtorch) but no Rust: the stripped binary and the libtorch
plugin come in `.device/`. `install()` points the dynamic loader at torch's lib dir, installs
the kernelspecs into a private prefix on JUPYTER_PATH, and makes tests/python's Jupyter client
helpers importable; it returns torch's version.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("GPUKERNEL_BIN", ROOT / ".device" / "gpukernel"))


def install() -> str:
    import torch  # only for its lib dir and version

    torch_lib = str(Path(torch.__file__).parent / "lib")
    os.environ["LD_LIBRARY_PATH"] = torch_lib + ":" + os.environ.get("LD_LIBRARY_PATH", "")
    os.environ["GPUKERNEL_TORCH_PLUGIN"] = str(ROOT / ".device" / "libgpuprobe_torch.so")
    prefix = Path(tempfile.mkdtemp(prefix="gpukernel-specs-"))
    subprocess.run([str(BIN), "install", "--prefix", str(prefix), "--python", sys.executable],
                   check=True)
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    return torch.__version__
