"""trials.py (%maxbatch's python engine) loaded into a plain process, and called as gpukernel
calls it (JSON in, JSON out), for the bench scripts that check its parts without a kernel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TRIALS = Path(__file__).resolve().parents[2] / "crates/gpukernel/src/magics/maxbatch/trials.py"


def load_trials():
    spec = importlib.util.spec_from_file_location("_gpukernel_maxbatch_bench", TRIALS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(trials, ns, name, **args):
    return json.loads(trials.call(ns, name, json.dumps(args)))
