"""%envcheck against real broken environments built here, through real kernels (jupyter_client).

- A venv with two torch distributions on sys.path: the real torch (the test env's, reached by a
  .pth file) and a stale second one (a torch-2.5.1.dist-info on another .pth path, as a pip
  install over a conda one leaves behind). The magics-only kernel checks the venv's python on
  PATH and names both copies and the one to remove.
- The same in the gpu-python kernel, through the notebook's own sys.path (read by the silent
  side channel), leaving the notebook's names and sys.modules as they were.
- A venv whose torch reports CUDA 13.0 under a driver faked (GPUKERNEL_TEST_DRIVER_CUDA=12.2) to
  support 12.2 at most: the problem and the right wheel index.
- --export round trip: a venv with two small packages, exported as pinned requirements, a new
  venv installed from the file, the same packages (skipped where no package index is reachable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kernel_client import execute, running_kernel

SITE = sysconfig.get_paths()["purelib"]  # the test env's site-packages, with the real torch


def make_venv(path: Path, pip: bool = False) -> Path:
    args = [sys.executable, "-m", "venv", str(path)]
    if not pip:
        args.insert(3, "--without-pip")
    subprocess.run(args, check=True, capture_output=True)
    return path


def site_packages(venv: Path) -> Path:
    found = list((venv / "lib").glob("python3*/site-packages"))
    assert found, venv
    return found[0]


def torch_venv(tmp: Path, name: str) -> Path:
    """A venv whose sys.path reaches the test env's real torch through a .pth file."""
    venv = make_venv(tmp / name)
    (site_packages(venv) / "real_torch.pth").write_text(SITE + "\n")
    return venv


def stale_torch(tmp: Path) -> Path:
    """A second torch distribution: only its metadata, on a directory of its own."""
    extra = tmp / "stale-site"
    meta = extra / "torch-2.5.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n\n")
    (meta / "INSTALLER").write_text("pip\n")
    return extra


def env_for(venv: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX",)}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env.update(extra)
    return env


def report(kc, line: str = "%envcheck --json", timeout: float = 180) -> dict:
    reply, outputs = execute(kc, line, timeout=timeout)
    assert reply["content"]["status"] == "ok", reply["content"]
    results = [m for m in outputs if m["msg_type"] == "execute_result"]
    assert results, outputs
    return results[0]["content"]["data"]["application/json"]


def problems(r: dict) -> dict[str, dict]:
    return {f["check"]: f for f in r["findings"] if f["level"] == "problem"}


def test_two_torch_distributions_in_a_venv(tmp_path):
    venv = torch_venv(tmp_path, "two-torch")
    extra = stale_torch(tmp_path)
    (site_packages(venv) / "zz_stale.pth").write_text(f"{extra}\n")
    with running_kernel("gpu-magics", env=env_for(venv)) as (km, kc):
        r = report(kc)
    assert r["kernel"] == "gpu-magics"
    assert r["python"]["prefix"] == str(venv)
    assert r["env"]["kind"] == "venv"
    assert sorted(d["version"] for d in r["torch_dists"]) == ["2.11.0", "2.5.1"]
    found = problems(r)["two_torch"]
    assert "the one imported" in found["summary"] and str(extra) in found["summary"]
    assert f"rm -rf {extra / 'torch-2.5.1.dist-info'}" in found["fix"]
    assert SITE not in found["fix"]  # never suggests removing the one in use


def test_two_torch_through_the_notebooks_own_sys_path():
    extra_dir = None
    with running_kernel("gpu-python") as (km, kc):
        import tempfile

        extra_dir = Path(tempfile.mkdtemp(prefix="envcheck-"))
        extra = stale_torch(extra_dir)
        reply, _ = execute(kc, f"import sys, torch\nsys.path.append({str(extra)!r})", timeout=90)
        assert reply["content"]["status"] == "ok"
        before = execute(kc, "print(sorted(globals()), sorted(sys.modules))")[1]
        r = report(kc)
        after = execute(kc, "print(sorted(globals()), sorted(sys.modules))")[1]
        # --export FILE, relative: in the notebook's working directory (not gpukernel's).
        reply, _ = execute(kc, f"import os; os.chdir({str(extra_dir)!r})")
        assert reply["content"]["status"] == "ok"
        exported = report(kc, "%envcheck --json --export pinned.txt")["export"]
        assert exported.startswith(f"wrote {extra_dir / 'pinned.txt'} (pinned requirements")
        assert "torch==2.11.0" in (extra_dir / "pinned.txt").read_text()
    assert r["kernel"] == "gpu-python"
    assert r["session"]["executable"] == sys.executable
    assert str(extra) in r["session"]["sys_path"]
    assert r["session"]["torch_loaded"]["file"].startswith(SITE)
    assert "two_torch" in problems(r)
    text = lambda outs: "".join(m["content"].get("text", "") for m in outs)  # noqa: E731
    names_before, names_after = (text(o).split("] [")[0] for o in (before, after))
    modules_before, modules_after = (text(o).split("] [")[1] for o in (before, after))
    assert modules_before == modules_after
    # Only IPython's record of the cells run in between (_i5, _i6 ...).
    added = set(eval(names_after + "]")) - set(eval(names_before + "]"))  # noqa: S307
    assert all(n.startswith("_i") for n in added), added


def test_torch_newer_than_the_driver(tmp_path):
    venv = torch_venv(tmp_path, "new-torch")
    env = env_for(
        venv, GPUKERNEL_TEST_DRIVER_CUDA="12.2", GPUKERNEL_TEST_DRIVER_VERSION="535.104.05"
    )
    with running_kernel("gpu-magics", env=env) as (km, kc):
        r = report(kc)
        reply, outputs = execute(kc, "%envcheck", timeout=180)
    assert r["driver"]["cuda"] == "12.2"
    assert r["driver"]["source"].startswith("GPUKERNEL_TEST_DRIVER_CUDA")
    assert r["torch"]["cuda"] == "13.0"
    found = problems(r)["cuda_driver"]
    assert "built for CUDA 13.0" in found["summary"] and "535.104.05" in found["summary"]
    assert "12.2" in found["summary"]
    assert "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu126" in found["fix"]
    shown = [m for m in outputs if m["msg_type"] == "display_data"][0]["content"]["data"]
    assert "[PROBLEM] cuda_driver" in shown["text/plain"]
    assert "gpukernel-envcheck" in shown["text/html"]


def test_pip_torch_over_condas_and_a_conda_export(tmp_path):
    """A conda-style prefix (conda-meta records pytorch) whose torch was installed by pip."""
    env = torch_venv(tmp_path, "condaenv")
    meta = env / "conda-meta"
    meta.mkdir()
    (meta / "pytorch-2.5.1-py3.11_cuda12.1_0.json").write_text(json.dumps(
        {"name": "pytorch", "version": "2.5.1", "build": "py3.11_cuda12.1_0",
         "channel": "https://conda.anaconda.org/pytorch/linux-64"}))
    (meta / "python-3.11.7-h0.json").write_text(json.dumps(
        {"name": "python", "version": "3.11.7", "build": "h0",
         "channel": "https://conda.anaconda.org/conda-forge/linux-64"}))
    exported = tmp_path / "environment.yml"
    with running_kernel("gpu-magics", env=env_for(env)) as (km, kc):
        r = report(kc, f"%envcheck --json --export {exported}")
    assert r["env"]["kind"] == "conda"
    found = problems(r)["conda_pip_torch"]
    assert "pytorch 2.5.1" in found["summary"] and "torch 2.11.0" in found["summary"]
    assert "conda install --force-reinstall pytorch" in found["fix"]
    text = exported.read_text()
    channels = text.split("channels:\n")[1].split("dependencies:")[0]
    assert sorted(channels.split()) == ["-", "-", "conda-forge", "pytorch"], text
    assert "  - pytorch=2.5.1\n" in text and "  - python=3.11.7\n" in text
    assert "  - pip:\n" in text


def freeze(venv: Path) -> list[str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze"],
        check=True, capture_output=True, text=True,
    ).stdout
    return sorted(line for line in out.splitlines() if line.strip())


def test_export_round_trips_through_a_new_venv(tmp_path):
    wheels = tmp_path / "wheels"
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels),
         "six==1.17.0", "idna==3.10"],
        capture_output=True, text=True, timeout=120,
    )
    if got.returncode != 0:
        pytest.skip(f"no package index reachable: {got.stderr.strip()[-200:]}")
    local = ["--no-index", "--find-links", str(wheels)]
    source = make_venv(tmp_path / "source", pip=True)
    subprocess.run([str(source / "bin/python"), "-m", "pip", "install", "-q", *local,
                    "six", "idna"], check=True, capture_output=True)
    exported = tmp_path / "requirements.txt"
    with running_kernel("gpu-magics", env=env_for(source)) as (km, kc):
        r = report(kc, f"%envcheck --json --export {exported}")
    assert r["export"].startswith(f"wrote {exported} (pinned requirements, 2 packages)")
    text = exported.read_text()
    assert "six==1.17.0\n" in text and "idna==3.10\n" in text
    target = make_venv(tmp_path / "target", pip=True)
    subprocess.run([str(target / "bin/python"), "-m", "pip", "install", "-q", *local,
                    "-r", str(exported)], check=True, capture_output=True)
    assert freeze(target) == freeze(source) == ["idna==3.10", "six==1.17.0"]


def test_no_python_at_all_is_said_plainly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["PATH"] = str(tmp_path)  # nothing there
    with running_kernel("gpu-magics", env=env) as (km, kc):
        r = report(kc)
    assert r["checked"] == "no python on PATH (magics-only kernel)"
    assert problems(r)["python"]["summary"] == "no Python to check was found"


def test_export_to_an_unwritable_place_is_an_error(tmp_path):
    venv = torch_venv(tmp_path, "plain")
    with running_kernel("gpu-magics", env=env_for(venv)) as (km, kc):
        reply, outputs = execute(kc, "%envcheck --export /nonexistent/dir/req.txt", timeout=180)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "EnvCheckError"
    assert "/nonexistent/dir/req.txt" in reply["content"]["evalue"]
