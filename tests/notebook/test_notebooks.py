"""Every notebook in notebooks/ executes cleanly with nbclient (one pytest process, a kernel whose
Python is this interpreter) and shows what it promises: tables, plots, the finding it is about.
The quickstart's HTML export (what `make demo` writes) carries its plots inline."""
import json
import re
from pathlib import Path

import nbformat
import pytest

from probekit.notebook.run import (count_outputs, demo, errors, export_html, headlines, outputs,
                                   run_notebook, summary)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

#: per notebook: (min tables, min PNG images, patterns that must appear in the outputs)
EXPECT = {
    "01_quickstart.ipynb": (3, 2, [
        # a healthy model stays silent, the planted E[x^2] - E[x]^2 is caught (issue 19)
        r"Free benchmark \(bit_noise, check, forward\): no findings",
        r"Free benchmark \(bit_noise, check, forward\): 1 finding in 1 API call",
        r"Tensor\.__sub__\.0\.forward[^\n]{0,60}rel_error \(ill-conditioned\)",
        r"Free benchmark \(improve_precision, check, forward\): no findings",
        r"Grad probe: runs diverge first at step 4, parameter '1\.weight'"]),
    "02_free_benchmark.ipynb": (6, 2, [
        # the healthy twin is silent in every mode (asserted in the notebook), the planted one not
        r"healthy: flagged",
        r"Free benchmark \(bit_noise, check, forward\): [1-9]\d* findings in 1 API call.* 3 steps",
        # backward severities are relative to the gradient's scale: healthy fp32 layers, none
        r"Free benchmark \(bit_noise, check, backward\): no findings.*no_grad",
        r"out_of_scope", r"skipped \(.*preheat [1-9]",  # the summary line's skip reasons
        r"Free benchmark \(improve_precision, check, forward\): 1 finding in 1 API call",
        r"Functional\.mse_loss\.0\.forward.{0,1000}nan_inf"]),
    "03_grad_probe.ipynb": (3, 3, [
        r"Grad probe: runs diverge first at step 4, parameter '3\.weight'"]),
    "04_triage.ipynb": (3, 2, [
        r"Grad probe: runs diverge first at step 0, parameter 'blocks\.2\.fc1\.weight'",
        r"1\. blocks\.2 \(flagged at step 0, similarity 0\.\d+; [^)]*\): [1-9]\d* flagged call",
        r"     Tensor\.__sub__\.0\.forward \[add_noise\] rel_error [\d,.]+× threshold, "
        r"blocks\.2\.norm, In \[1\] line 16\n",
        r"2\. blocks\.0 \(flagged at step 0[^\n]*: no flagged call",
        r"3\. blocks\.1 \(flagged at step 0[^\n]*: no flagged call",
        r"Free benchmark \(add_noise, check, forward\): 2 findings in 2 API calls"]),
}
_executed = {}
_folder = []
#: an image embedded in the page (the template's own icons are CSS, not <img>)
IMG = re.compile(r"<img[^>]*src=[\"']data:image/png;base64,")


def _shared(tmp_path_factory):
    """One folder for every notebook of the session, as Jupyter runs them side by side."""
    if not _folder:
        _folder.append(tmp_path_factory.mktemp("notebooks"))
    return _folder[0]


@pytest.fixture
def executed(tmp_path_factory):
    """Run a notebook once per session and reuse the result; all of them in one folder, in the
    order asked (the tests ask 01 -> 04), as a user runs them one after the other."""
    def get(path):
        if path.name not in _executed:
            _executed[path.name] = run_notebook(path, cwd=_shared(tmp_path_factory),
                                                timeout=240, allow_errors=True)
        return _executed[path.name]
    return get


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
def test_notebook_runs_clean(path, executed):
    nb = executed(path)
    assert errors(nb) == []
    counts = count_outputs(nb)
    min_tables, min_images, patterns = EXPECT[path.name]
    assert counts["tables"] >= min_tables, counts
    assert counts["images"] >= min_images, counts
    text = "\n".join(json.dumps(o.get("data", {})) + o.get("text", "") for o in outputs(nb))
    for pattern in patterns:
        assert re.search(pattern, text), (pattern, headlines(nb))


@pytest.mark.slow
def test_the_notebooks_run_again_in_the_same_folder(executed, tmp_path_factory):
    """All four in order in one folder, then all four again there (issue 36): each run into a
    store or dump folder that an earlier notebook wrote replaces it (none is a restart), so
    every notebook runs clean both times and shows what it promised, the same lines again."""
    first = [executed(path) for path in NOTEBOOKS]          # 01 -> 04, in one folder
    for path, nb in zip(NOTEBOOKS, first):
        again = run_notebook(path, cwd=_shared(tmp_path_factory), timeout=240,
                             allow_errors=True)
        assert errors(nb) == [] and errors(again) == [], path.name
        text = "\n".join(json.dumps(o.get("data", {})) + o.get("text", "")
                         for o in outputs(again))
        for pattern in EXPECT[path.name][2]:
            assert re.search(pattern, text), (path.name, pattern, headlines(again))
        assert headlines(again) == headlines(nb), path.name


@pytest.mark.slow
def test_quickstart_exports_html_with_inline_plots(executed, tmp_path):
    nb = executed(NOTEBOOKS[0])
    page = export_html(nb, tmp_path / "quickstart.html").read_text()
    assert len(IMG.findall(page)) == 2          # the similarity figure + the explorer's static view
    assert "Free benchmark (bit_noise, check, forward)" in page
    assert "Free benchmark settings</b> (static view)" in page    # panels without widget JS
    assert "application/vnd.jupyter.widget-state+json" not in page
    text = summary(nb, "01_quickstart.ipynb")
    assert re.match(r"01_quickstart\.ipynb: 8 code cells in [\d.]+ s; 0 errors, \d+ tables, "
                    r"\d+ images, 2 widgets\n", text)
    assert "  Grad probe: runs diverge first at step 4, parameter '1.weight'" in text


def test_demo_writes_html_and_summary(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);"),
        nbformat.v4.new_code_cell("print('Grad probe: demo line')")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}})
    source = tmp_path / "tiny.ipynb"
    nbformat.write(nb, str(source))
    text = demo(tmp_path / "out", notebook=source)
    page = (tmp_path / "out" / "quickstart.html").read_text()
    assert len(IMG.findall(page)) == 1          # an inline PNG: the kernel used the inline backend
    saved = (tmp_path / "out" / "quickstart_summary.txt").read_text()
    assert saved == text + "\n"
    assert text.startswith("tiny.ipynb: 2 code cells in ")
    assert "  Grad probe: demo line" in text
    assert (tmp_path / "out" / "quickstart_run").is_dir()


def test_demo_reports_errors(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    source = tmp_path / "bad.ipynb"
    nbformat.write(nb, str(source))
    with pytest.raises(RuntimeError, match="bad.ipynb raised errors:\nZeroDivisionError"):
        demo(tmp_path / "out", notebook=source)
    assert "ZeroDivisionError: division by zero" in (
        tmp_path / "out" / "quickstart_summary.txt").read_text()


@pytest.mark.slow
def test_triage_notebook_exports_html_with_report_and_plots(executed, tmp_path):
    nb = executed(NOTEBOOKS[3])
    page = export_html(nb, tmp_path / "triage.html").read_text()
    assert len(IMG.findall(page)) == 2          # the similarity figures + the triage plot
    assert "<b>probekit triage</b>: runs diverge first at step <b>0</b>" in page
    # the row of the planted call: ratio, kind, perturbations, API call, module, call site
    # (names wrap at their dots: <wbr> after each)
    assert re.search(r"<td[^>]*>[\d.,]+×</td><td[^>]*>rel_error</td><td[^>]*>add_noise</td>"
                     r"<td[^>]*>Tensor\.__sub__\.0\.forward</td><td[^>]*>blocks\.2\.norm</td>"
                     r"<td[^>]*>In \[1\] line 16</td>", re.sub(r"<wbr\s*/?>", "", page))
