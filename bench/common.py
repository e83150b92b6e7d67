"""Shared bits of the benchmarks: machine description and result files."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "mean": statistics.fmean(values),
    }


def write_result(name: str, command: str, body: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    today = dt.date.today().isoformat()
    path = RESULTS / f"{name}-{today}.md"
    header = (
        f"# {name}\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}\n"
        f"- machine: {machine()}\n"
        f"- commit: {git_rev()}\n"
        f"- command: `{command}`\n\n"
    )
    path.write_text(header + body)
    return path
