"""The notebooks in examples/ run headless through nbclient, as a user would run them."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name=nb.metadata["kernelspec"]["name"]).execute()
    return nb


def test_gpu_magics_notebook_runs():
    nb = run("gpu-magics.ipynb")
    code = [c for c in nb.cells if c.cell_type == "code"]
    help_out, mem_out, json_out, watch_out, echo_out = (c.outputs for c in code)
    assert "%gpumem" in help_out[0]["data"]["text/plain"]
    assert "text/html" in mem_out[0]["data"]
    assert json_out[0]["output_type"] == "execute_result"
    assert "available" in json_out[0]["data"]["application/json"]
    # nbclient applies update_display_data to the one display: a single output remains.
    assert [o["output_type"] for o in watch_out] == ["display_data"]
    assert echo_out[0]["text"].startswith("done")
    assert [c.execution_count for c in code] == [1, 2, 3, 4, 5]
