"""Every notebook in notebooks/ executes cleanly with nbclient (one pytest process, a kernel whose
Python is this interpreter) and shows what it promises: tables, plots, the finding it is about."""
import json
import re
from pathlib import Path

import nbformat
import pytest

from probekit.notebook.run import count_outputs, errors, headlines, outputs, run_notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

#: per notebook: (min tables, min PNG images, text that must appear in the outputs)
EXPECT = {
    "01_quickstart.ipynb": (2, 2, [
        r"Free benchmark \(bit_noise, check, forward\): [1-9]\d* findings? in \d+ API calls?",
        r"Tensor\.__sub__\.0\.forward", r"Tensor\.__sub__\.1\.forward",
        r"Free benchmark \(improve_precision, check, forward\): no findings",
        r"Grad probe: runs diverge first at step 4, parameter '1\.weight'"]),
    "02_free_benchmark.ipynb": (6, 2, [
        r"Free benchmark \(bit_noise, check, forward\): [1-9]\d* findings in \d+ API calls.* 3 steps",
        r"Free benchmark \(add_noise, check, backward\): [1-9]",
        r"out_of_scope", r"'preheat': [1-9]",
        r"Free benchmark \(improve_precision, check, forward\): 1 finding in 1 API call",
        r"Functional\.mse_loss\.0\.forward.{0,400}nan_inf"]),
    "03_grad_probe.ipynb": (3, 3, [
        r"Grad probe: runs diverge first at step 4, parameter '3\.weight'"]),
}


def test_every_notebook_has_expectations():
    assert NOTEBOOKS, "no notebooks found"
    assert sorted(EXPECT) == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_clean(path, tmp_path):
    nb = run_notebook(path, cwd=tmp_path, timeout=240, allow_errors=True)
    assert errors(nb) == []
    counts = count_outputs(nb)
    min_tables, min_images, patterns = EXPECT[path.name]
    assert counts["tables"] >= min_tables, counts
    assert counts["images"] >= min_images, counts
    text = "\n".join(json.dumps(o.get("data", {})) + o.get("text", "") for o in outputs(nb))
    for pattern in patterns:
        assert re.search(pattern, text), (pattern, headlines(nb))
