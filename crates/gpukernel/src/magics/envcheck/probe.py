"""%envcheck's probe: run by gpukernel as ``PYTHON probe.py [ARGS_JSON]`` in a fresh process of
the Python being checked (the notebook's own interpreter in the gpu-python kernel, the env's
python on PATH in the magics-only kernel), so importing torch here costs the notebook nothing.

ARGS_JSON: ``{"sys_path": [...]}`` (the notebook's sys.path: torch is looked for and imported
from there, as the notebook would) and ``{"freeze": true}`` (also list the packages for
``--export``). Prints one JSON object on stdout; never raises.
"""

import json
import os
import sys


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _metadata_field(text, field):
    for line in (text or "").splitlines():
        if not line.strip():
            break  # headers end at the first blank line
        key, _, value = line.partition(":")
        if key.strip().lower() == field.lower():
            return value.strip()
    return None


def _canonical(name):
    return name.lower().replace("_", "-").replace(".", "-")


def distributions(paths):
    """Every installed distribution on ``paths``, each with its location (duplicates kept)."""
    found = []
    for entry in paths:
        if not entry or not os.path.isdir(entry):
            continue
        try:
            names = sorted(os.listdir(entry))
        except OSError:
            continue
        for name in names:
            full = os.path.join(entry, name)
            if name.endswith(".dist-info"):
                meta = _read(os.path.join(full, "METADATA"))
            elif name.endswith(".egg-info"):
                meta = _read(os.path.join(full, "PKG-INFO")) if os.path.isdir(full) else _read(full)
            else:
                continue
            dist_name = _metadata_field(meta, "Name")
            version = _metadata_field(meta, "Version")
            if not dist_name:
                continue
            installer = (_read(os.path.join(full, "INSTALLER")) or "").strip() or None
            found.append({"name": dist_name, "canonical": _canonical(dist_name),
                          "version": version, "location": entry, "metadata_dir": name,
                          "installer": installer})
    return found


def _env():
    prefix = sys.prefix
    conda_meta = os.path.isdir(os.path.join(prefix, "conda-meta"))
    if conda_meta:
        kind = "conda"
        name = os.environ.get("CONDA_DEFAULT_ENV") if os.environ.get("CONDA_PREFIX") == prefix \
            else None
        name = name or os.path.basename(prefix.rstrip("/"))
    elif prefix != getattr(sys, "base_prefix", prefix):
        kind = "venv"
        name = os.path.basename(prefix.rstrip("/"))
    else:
        kind = "system"
        name = None
    return {"kind": kind, "name": name, "prefix": prefix}


def conda_packages(prefix):
    """conda's own record of what it installed in ``prefix`` (conda-meta/*.json)."""
    meta = os.path.join(prefix, "conda-meta")
    packages = []
    try:
        names = sorted(os.listdir(meta))
    except OSError:
        return packages
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            record = json.loads(_read(os.path.join(meta, name)) or "{}")
        except ValueError:
            continue
        if record.get("name"):
            packages.append({"name": record["name"], "version": record.get("version"),
                             "build": record.get("build"), "channel": record.get("channel")})
    return packages


def _torch_facts():
    out = {"importable": False, "import_error": None}
    try:
        import torch  # noqa: PLC0415 - this process exists to do this
    except BaseException as e:  # a broken install raises anything (OSError, ImportError...)
        out["import_error"] = f"{type(e).__name__}: {e}"
        return out
    out["importable"] = True
    out["version"] = getattr(torch, "__version__", None)
    out["file"] = getattr(torch, "__file__", None)
    version = getattr(torch, "version", None)
    out["cuda"] = getattr(version, "cuda", None)
    out["hip"] = getattr(version, "hip", None)
    try:
        flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
        out["arch_list"] = (flags or "").split()
    except Exception:
        out["arch_list"] = []
    try:
        out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() \
            else None
    except Exception:
        out["cudnn"] = None
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        out["nccl"] = None
    devices = []
    try:
        available = torch.cuda.is_available()
        out["cuda_available"] = bool(available)
        for i in range(torch.cuda.device_count() if available else 0):
            props = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": props.name, "capability": [props.major, props.minor],
                            "uuid": str(getattr(props, "uuid", "")) or None})
    except Exception as e:
        out["cuda_available"] = False
        out["cuda_error"] = f"{type(e).__name__}: {e}"
    out["devices"] = devices
    return out


def freeze(python_paths):
    """``pip freeze`` of this interpreter, or (no pip) the distributions as name==version."""
    import subprocess  # noqa: PLC0415

    try:
        done = subprocess.run([sys.executable, "-m", "pip", "freeze"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            lines = [l for l in done.stdout.splitlines() if l.strip() and not l.startswith("#")]
            return {"tool": "pip freeze", "lines": lines}
    except (OSError, subprocess.SubprocessError):
        pass
    seen = set()
    lines = []
    for d in distributions(python_paths):
        if d["canonical"] not in seen:
            seen.add(d["canonical"])
            lines.append(f"{d['name']}=={d['version']}")
    return {"tool": "metadata", "lines": sorted(lines, key=str.lower)}


def main():
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    paths = args.get("sys_path") or list(sys.path)
    # Import torch as the notebook does: from its sys.path, in its order.
    sys.path[:] = [p for p in paths if p] + [p for p in sys.path if p not in paths]
    dists = distributions(paths)
    out = {
        "python": {"executable": sys.executable, "version": sys.version.split()[0],
                   "prefix": sys.prefix, "base_prefix": getattr(sys, "base_prefix", sys.prefix)},
        "env": _env(),
        "torch_dists": [d for d in dists if d["canonical"] == "torch"],
        "nvidia_wheels": [d for d in dists if d["canonical"].startswith("nvidia-")],
        "conda_torch": [p for p in conda_packages(sys.prefix)
                        if p["name"] in ("pytorch", "torch", "pytorch-gpu", "pytorch-cuda")],
        "torch": None,
    }
    if out["torch_dists"] or any(os.path.isdir(os.path.join(p, "torch")) for p in paths if p):
        out["torch"] = _torch_facts()
    if args.get("freeze"):
        out["freeze"] = freeze(paths)
        if out["env"]["kind"] == "conda":
            out["conda_packages"] = conda_packages(sys.prefix)
    return out


if __name__ == "__main__":
    try:
        result = main()
    except BaseException as e:  # report, never a traceback on stdout
        result = {"failed": f"{type(e).__name__}: {e}"}
    sys.stdout.write("\n@@GPUKERNEL_ENVCHECK@@" + json.dumps(result) + "\n")
