"""Issue 28, point 5: notebook output that reads clean, looked at in chromium.

A small notebook is executed headless with its widget state stored (as ``jupyter nbconvert
--execute`` does), exported with ``probekit.notebook.run.export_html`` and rendered in Debian's
chromium: INFO log lines are plain stdout (not red stderr boxes), a plot returned as the cell's
last expression shows once without a text repr, the panel shows its static view with the device
of this machine (no 'npu'), and the triage report keeps its verdict columns in view with long
(DistilBERT) names. Screenshot: ``test-artifacts/clean_notebook.png``."""
import os
import shutil
import tempfile

import nbformat
import pytest

from probekit.notebook.run import export_html, run_notebook

from conftest import ARTIFACTS, CHROME_ARGS, CHROMIUM

CELLS = [
    """\
import torch, probekit
from probekit.notebook import FreeBenchPanel
torch.manual_seed(0)
def run(dump):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probekit.GradProbe(model, dump_path=dump):
        for _ in range(3):
            opt.zero_grad(); model(torch.randn(16, 4)).square().mean().backward(); opt.step()""",
    "run('runs/a'); run('runs/b')",
    "cmp = probekit.compare_grads('runs/a', 'runs/b')\nprobekit.plot.similarity(cmp)",
    "FreeBenchPanel()",
    """\
import pandas as pd
from probekit.triaging import TriageReport
layer = 'distilbert.transformer.layer.{}.'
names = [layer.format(i) + p for i in range(3)
         for p in ('attention.q_lin.weight', 'attention.k_lin.weight', 'output_layer_norm.weight')]
suspects = pd.DataFrame({'module': [layer.format(i) + 'attention' for i in range(3)],
                         'step': [0, 0, 1], 'similarity': [0.81, 0.9, 0.95],
                         'params': [tuple(names[3 * i:3 * i + 3]) for i in range(3)],
                         'owners': [()] * 3, 'rank': [0] * 3, 'findings': [1, 0, 0],
                         'minor': [0, 2, 0]})
findings = pd.DataFrame([dict(suspect=suspects['module'][0], ratio=16.0, kind='rel_error',
                              pert_modes='add_noise', api_name='Tensor.__sub__.0.forward',
                              module=layer.format(0) + 'attention.softmax_guard.norm',
                              call_site='modeling_distilbert_with_a_long_file_name.py:214',
                              dtype='torch.bfloat16', shape='(8, 12, 128, 128)')])
TriageReport({'rank': 0, 'step': 0, 'param': names[0], 'similarity': 0.81}, suspects,
             findings, [{'pert_mode': 'add_noise'}], None)""",
]

VERDICT_IN_VIEW = """([table, header]) => {
    const th = [...document.querySelectorAll('.probekit-triage table')][table]
        .querySelectorAll('th')[header];
    const area = th.closest('.jp-OutputArea-output');
    return [th.getBoundingClientRect().right, area.getBoundingClientRect().right,
            area.scrollWidth <= area.clientWidth];
}"""


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    path = tmp / "clean.ipynb"
    nbformat.write(nb, str(path))
    nb = run_notebook(path, cwd=tmp, store_widget_state=True)
    return nb, export_html(nb, tmp / "clean.html")


@pytest.mark.browser
def test_outputs_are_clean_in_the_notebook(executed):
    nb, _ = executed
    out = {i: c.outputs for i, c in enumerate(nb.cells)}
    # INFO lines in stdout, not stderr (a red box in every front-end)
    assert {o.name for o in out[1]} == {"stdout"}
    assert "[probekit] grad_probe: monitoring 4 parameters" in out[1][0].text
    # the plot: one PNG, no text repr of an Axes or a Figure
    assert [(o.output_type, sorted(o.get("data", {}))) for o in out[2]] == [
        ("display_data", ["image/png", "text/plain"])]
    assert "<Axes" not in str(out[2]) and "Figure size" not in str(out[2])
    # the panel: a widget view with a static fallback naming this machine's device
    (panel,) = out[3]
    html = panel.data["text/html"]
    assert "application/vnd.jupyter.widget-view+json" in panel.data
    assert "(static view)" in html and "tensors&#x27; own (cpu)" in html and "npu" not in html
    assert "widgets" in nb.metadata  # executed as nbconvert --execute does


@pytest.mark.browser
def test_the_rendered_page_reads_clean_in_chromium(executed):
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make chromium` installs Debian's chromium")
    _, page_path = executed
    ARTIFACTS.mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROME_ARGS,
            viewport={"width": 900, "height": 1000})
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.goto(page_path.as_uri())
            page.screenshot(path=str(ARTIFACTS / "clean_notebook.png"), full_page=True)
            stderr = page.locator("[data-mime-type='application/vnd.jupyter.stderr']")
            assert stderr.count() == 0
            assert page.get_by_text("[probekit] grad_probe: monitoring 4 parameters").count() == 2
            assert page.get_by_text("Free benchmark settings").is_visible()
            assert page.get_by_text("tensors' own (cpu)").is_visible()
            assert page.locator("img").count() == 1
            # "flagged calls" (suspects) and "× threshold" (calls): inside the output area,
            # which does not scroll sideways (long names wrap at their dots)
            for table, header in ((0, 1), (1, 1)):
                right, area_right, fits = page.evaluate(VERDICT_IN_VIEW, [table, header])
                assert right <= area_right and fits, (table, right, area_right)
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)
