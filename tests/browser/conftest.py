"""Fixtures for the real-browser tests: Debian's chromium driven by Playwright (no browser
download: scripts/setup installs both), JupyterLab opened through a real `tunnel up` against a
real sshd (the tunnel fixtures of tests/support/tunnel_fixtures.py), and the gpukernel
kernelspecs of the binary under test installed into a private prefix for the remote Jupyter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(0, str(REPO / "tests" / "tunnel"))

from tunnel_fixtures import jupyter_prefix, sshd, state_dir, tunnel, tunnel_bin  # noqa: E402,F401

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; Playwright's own browsers are not used


def gpukernel_binary() -> Path:
    """$GPUKERNEL_BIN, else the release (or debug) build in the cargo target dir."""
    if os.environ.get("GPUKERNEL_BIN"):
        path = Path(os.environ["GPUKERNEL_BIN"])
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        path = next((target / p / "gpukernel" for p in ("release", "debug")
                     if (target / p / "gpukernel").is_file()), target / "release" / "gpukernel")
    if not path.is_file():
        raise RuntimeError(f"gpukernel is not built ({path}): run scripts/setup")
    return path


@pytest.fixture
def remote_init(tmp_path, jupyter_prefix) -> str:
    """An --init command for `tunnel up` that gives the remote Jupyter the kernelspecs of the
    gpukernel under test (JUPYTER_PATH to a private prefix, as tests/python does locally) and a
    private JupyterLab settings and workspaces dir (nothing read from or written to ~/.jupyter;
    the news prompt is switched off so it covers nothing in the screenshots)."""
    prefix = tmp_path / "kernelspecs"
    gpukernel = gpukernel_binary()
    python = Path(jupyter_prefix) / "bin" / "python3"
    for extra in (["--magics-only"], ["--python", str(python)]):
        subprocess.run([str(gpukernel), "install", "--prefix", str(prefix), *extra],
                       check=True, capture_output=True, timeout=60)
    settings = tmp_path / "lab-settings"
    notification = settings / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    notification /= "notification.jupyterlab-settings"
    notification.write_text('{"fetchNews": "false", "checkForUpdates": false}\n')
    workspaces = tmp_path / "lab-workspaces"
    workspaces.mkdir()
    for path in (prefix, settings, workspaces):
        assert re.fullmatch(r"[\w/.+-]+", str(path)), path  # no quoting needed in the shell
    return (f"export JUPYTER_PATH={prefix}/share/jupyter JUPYTERLAB_SETTINGS_DIR={settings}"
            f" JUPYTERLAB_WORKSPACES_DIR={workspaces}")


@pytest.fixture
def browser():
    """Headless chromium (Debian's), one per test."""
    if not CHROMIUM.is_file():
        raise RuntimeError(f"{CHROMIUM} is missing (Debian package chromium): run scripts/setup")
    # Chromium's sandbox needs user namespaces it cannot have as root in a container.
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def screenshots(request, tmp_path) -> Path:
    """Where the test's screenshots go: $GPUNB_TEST_OUT/browser/<test> if set, else under the
    test's tmp_path (pytest keeps the last few). Printed, so `-s` or a failure report shows it."""
    out = os.environ.get("GPUNB_TEST_OUT")
    name = re.sub(r"[^\w.-]", "_", request.node.name)
    d = Path(out) / "browser" / name if out else tmp_path / "screenshots"
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.png"):
        old.unlink()
    print(f"screenshots: {d}")
    return d
