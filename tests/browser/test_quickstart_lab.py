"""01_quickstart.ipynb in a real JupyterLab, driven through Debian's chromium: run all cells,
change the settings panel, apply, re-run the magic cell; the findings table and plots render."""
import re

import pytest
from playwright.sync_api import expect

TIMEOUT = 120_000
KERNEL_IDLE = """() => {
    const name = document.querySelector('.jp-NotebookPanel .jp-KernelName, .jp-NotebookPanel .jp-Toolbar-kernelName');
    const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
    return name && !/No Kernel/.test(name.textContent) && ind && ind.getAttribute('data-status') === 'idle';
}"""
ALL_RUN = """() => {
    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
    const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
    return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent))
        && ind && ind.getAttribute('data-status') === 'idle';
}"""


def shot(locator, path):
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str(path))


@pytest.mark.browser
@pytest.mark.slow
def test_quickstart_in_jupyterlab(lab, page, artifacts):
    try:
        run_quickstart(page, lab, artifacts)
    except BaseException:
        page.screenshot(path=str(artifacts / "lab_quickstart_failure.png"))
        (artifacts / "lab_quickstart_failure.html").write_text(page.content())
        raise


def run_quickstart(page, lab, artifacts):
    page.goto(f"{lab['base']}/lab/tree/01_quickstart.ipynb?reset&token={lab['token']}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=TIMEOUT)
    # "idle" shows before a kernel exists; Run All then would ask for a kernel: wait for its name
    page.wait_for_function(KERNEL_IDLE, timeout=TIMEOUT)
    assert page.locator(".jp-Dialog").count() == 0

    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    page.wait_for_function(ALL_RUN, timeout=TIMEOUT)

    outputs = page.locator(".jp-OutputArea-output")
    assert outputs.filter(has_text="Traceback").count() == 0
    # the healthy model: silent; the planted one: the subtraction flagged
    healthy, planted = page.locator(".probekit-findings").nth(0), page.locator(
        ".probekit-findings").nth(1)
    expect(healthy).to_contain_text("Free benchmark (bit_noise, check, forward) ✓ no findings")
    expect(healthy.locator("table")).to_have_count(0)
    expect(planted).to_contain_text("Free benchmark (bit_noise, check, forward)")
    expect(planted.locator("table")).to_be_visible()
    expect(planted.locator("tr", has_text="Tensor.__sub__")).not_to_have_count(0)
    plots = page.locator(".jp-OutputArea-output img")
    expect(plots.first).to_be_visible(timeout=TIMEOUT)
    assert plots.first.evaluate("img => img.naturalWidth") > 300

    # the panel: choose add_noise, apply -> the defaults of %%freebench
    panel = page.locator(".probekit-panel")
    expect(panel).to_be_visible()
    mode = panel.locator(".widget-dropdown").filter(
        has=page.locator("label", has_text=re.compile(r"^perturbation$"))).locator("select")
    status = panel.locator(".probekit-status")
    apply = panel.locator("button", has_text="Apply")
    mode.select_option("to_cpu")                 # needs device cpu: shown, Apply disabled
    expect(status).to_contain_text("✗ free_benchmark.fuzz_device: 'npu' is not valid with "
                                   "pert_mode 'to_cpu'; accepted: 'cpu'", timeout=30_000)
    expect(apply).to_be_disabled()
    shot(panel, artifacts / "lab_quickstart_panel_invalid.png")
    mode.select_option("add_noise")
    expect(apply).to_be_enabled()
    apply.click()
    expect(status).to_contain_text("Applied (now the %%freebench defaults): pert_mode='add_noise'",
                                   timeout=30_000)
    shot(panel, artifacts / "lab_quickstart_panel.png")

    # re-run the magic cell without options: it now uses the panel's settings
    cell = page.locator(".jp-Notebook .jp-CodeCell").filter(has_text="re-run me after Apply")
    expect(cell.locator(".probekit-findings")).to_contain_text("improve_precision")
    cell.locator(".cm-content").click()
    page.keyboard.press("Shift+Enter")
    findings = cell.locator(".probekit-findings")
    expect(findings).to_contain_text("Free benchmark (add_noise, check, forward)", timeout=60_000)
    expect(findings.locator("table")).to_be_visible()
    expect(findings.locator("tr", has_text="Tensor.__sub__")).not_to_have_count(0)
    chart = cell.locator(".jp-OutputArea-output img")
    expect(chart).to_be_visible(timeout=30_000)
    assert chart.evaluate("img => img.naturalWidth") > 300
    shot(cell, artifacts / "lab_quickstart_findings.png")

    explorer = page.locator(".probekit-explorer")
    expect(explorer.locator("img")).to_be_visible()
    expect(explorer).to_contain_text("first flag at step 4")
    shot(explorer, artifacts / "lab_quickstart_explorer.png")
    page.screenshot(path=str(artifacts / "lab_quickstart_page.png"))
