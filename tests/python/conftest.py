"""Shared fixtures: the gpukernel binary, kernelspecs installed into a private JUPYTER_PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def find_binary(name: str, env_var: str) -> Path:
    """The binary named by env_var, else the newest release/debug build in the target dir."""
    explicit = os.environ.get(env_var)
    if explicit:
        return Path(explicit)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    candidates = [target / profile / name for profile in ("release", "debug")]
    existing = [c for c in candidates if c.exists()]
    if not existing:
        raise RuntimeError(
            f"{name} is not built: run scripts/setup (or cargo build -p {name}) or set {env_var}"
        )
    return max(existing, key=lambda p: p.stat().st_mtime)


GPUKERNEL = find_binary("gpukernel", "GPUKERNEL_BIN")

# Kernelspecs go into a private prefix, found through JUPYTER_PATH, before any test module
# creates a KernelManager (jupyter_kernel_test starts kernels in setUpClass).
_PREFIX = Path(tempfile.mkdtemp(prefix="gpukernel-specs-"))
for extra in (["--magics-only"], ["--python", sys.executable]):
    subprocess.run(
        [str(GPUKERNEL), "install", "--prefix", str(_PREFIX), *extra],
        check=True,
        capture_output=True,
    )
os.environ["JUPYTER_PATH"] = str(_PREFIX / "share" / "jupyter")
# Keep the user's own runtime/config out of the tests.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
os.environ["PYTHONUNBUFFERED"] = "1"


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    shutil.rmtree(_PREFIX, ignore_errors=True)


@pytest.fixture(scope="session")
def gpukernel() -> Path:
    return GPUKERNEL


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture()
def trials():
    """%maxbatch's python engine (trials.py), loaded afresh from the source for each test, as
    gpukernel installs it into a kernel: its session state is the test's own."""
    import importlib.util

    path = REPO / "crates/gpukernel/src/magics/maxbatch/trials.py"
    spec = importlib.util.spec_from_file_location("_gpukernel_maxbatch_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
