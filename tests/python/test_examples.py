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


def test_gpu_python_notebook_runs():
    nb = run("gpu-python.ipynb")
    code = [c for c in nb.cells if c.cell_type == "code"]
    help_out, before, torch_out, after, mixed, freed, emptied, _, sized = (c.outputs for c in code)
    assert "%gpumem" in help_out[0]["data"]["text/plain"]
    assert "torch not imported" in before[0]["data"]["text/plain"]
    # (torch may warn on stderr that numpy is missing; only stdout matters here)
    assert "256 MiB on" in "".join(o.get("text", "") for o in torch_out if o.get("name") == "stdout")
    assert "torch 2.11" in after[0]["data"]["text/plain"]
    assert [o["output_type"] for o in mixed] == ["stream", "execute_result", "stream"]
    assert mixed[0]["text"] == "before the magic\n" and mixed[2]["text"] == "after the magic\n"
    assert mixed[1]["data"]["application/json"]["python_kernel"]["torch"]["imported"] is True
    assert freed[0]["text"] == "freed\n"
    assert "Python kernel" in emptied[0]["data"]["text/plain"]
    sized_text = "".join(o.get("text", "") for o in sized if o.get("name") == "stdout")
    assert "Checked the step instead: one step of batch 2 ran" in sized_text, sized_text
    assert [c.execution_count for c in code] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
