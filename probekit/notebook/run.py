"""Execute notebooks headless (nbclient) with this project's Python, and export them as HTML.

``run_notebook(path)`` runs every cell in a fresh kernel whose Python is ``sys.executable`` (or
``python=``) and whose ``PYTHONPATH`` starts with the folder this ``probekit`` was imported from,
so the kernel uses the same probekit as the caller. ``demo(out)`` is what ``make demo`` runs:
``01_quickstart.ipynb`` -> ``{out}/quickstart.html`` (plots inline) and a short text summary,
then ``04_triage.ipynb`` -> ``{out}/triage.html`` and ``triage_summary.txt``.

    python -m probekit.notebook.run notebooks/01_quickstart.ipynb --html out.html
    python -m probekit.notebook.run --no-execute executed.ipynb --html out.html
    python -m probekit.notebook.run --demo demo_out

The HTML shows every widget by its static fallback (probekit's panels and explorer give one),
whether or not the notebook was executed with its widget state stored: a page rendering the
live widgets would need the widget manager's script from the network, and shows them blank
without it (what ``jupyter nbconvert --execute --to html`` gives offline).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

KERNEL_NAME = "python3"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = PROJECT_ROOT / "notebooks"


def write_kernelspec(directory, *, python: str | None = None, pythonpath: str | None = None,
                     name: str = KERNEL_NAME) -> Path:
    """Write ``{directory}/kernels/{name}/kernel.json`` running ``python -m ipykernel_launcher``.

    Put ``directory`` on ``JUPYTER_PATH`` (it then shadows the default ``python3`` kernel) or pass
    ``{directory}/kernels`` to a ``KernelSpecManager``. Returns the kernels folder.
    """
    kernels = Path(directory) / "kernels"
    spec_dir = kernels / name
    spec_dir.mkdir(parents=True, exist_ok=True)
    pythonpath = pythonpath or str(PROJECT_ROOT)
    spec = {
        "argv": [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (probekit)",
        "language": "python",
        "env": {"PYTHONPATH": pythonpath},
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return kernels


def kernel_env() -> dict:
    """The kernel's environment: ours, without ``MPLBACKEND`` (it would disable inline PNGs)."""
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)
    return env


def run_notebook(path, *, cwd=None, timeout: int = 300, python: str | None = None,
                 pythonpath: str | None = None, allow_errors: bool = False,
                 store_widget_state: bool = False):
    """Execute the notebook at ``path`` in a fresh kernel; returns the executed notebook.

    ``cwd`` is the kernel's working folder (default: a new temporary folder, so outputs the
    notebook writes do not land next to it). Errors raise ``nbclient``'s
    ``CellExecutionError`` unless ``allow_errors``. ``store_widget_state``: keep the widgets'
    state in the notebook's metadata, as ``jupyter nbconvert --execute`` does.
    """
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    cwd = str(cwd) if cwd is not None else tempfile.mkdtemp(prefix="probekit-nb-")
    with tempfile.TemporaryDirectory(prefix="probekit-kernel-") as spec_root:
        kernels = write_kernelspec(spec_root, python=python, pythonpath=pythonpath)
        km = AsyncKernelManager(kernel_name=KERNEL_NAME,
                                kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
        client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=allow_errors,
                                record_timing=True, store_widget_state=store_widget_state,
                                resources={"metadata": {"path": cwd}})
        client.execute(env=kernel_env())
    return nb


def outputs(nb):
    """Every output of every code cell, in order."""
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]


def errors(nb) -> list:
    return [f"{o.get('ename')}: {o.get('evalue')}" for o in outputs(nb) if o.output_type == "error"]


def count_outputs(nb) -> dict:
    """Counts of tables (HTML with <table>), PNG images and widgets in the outputs."""
    counts = {"tables": 0, "images": 0, "widgets": 0, "errors": len(errors(nb))}
    for out in outputs(nb):
        data = out.get("data", {})
        counts["tables"] += "<table" in data.get("text/html", "")
        counts["images"] += "image/png" in data or "data:image/png" in data.get("text/html", "")
        counts["widgets"] += "application/vnd.jupyter.widget-view+json" in data
    return counts


def duration(nb) -> float:
    """Seconds from the first cell's start to the last cell's end (nbclient timing)."""
    from datetime import datetime

    stamps = [c.metadata.get("execution", {}) for c in nb.cells if c.cell_type == "code"]
    starts = [s["iopub.execute_input"] for s in stamps if "iopub.execute_input" in s]
    ends = [s["shell.execute_reply"] for s in stamps if "shell.execute_reply" in s]
    if not starts or not ends:
        return float("nan")
    parse = lambda t: datetime.fromisoformat(t.replace("Z", "+00:00"))  # noqa: E731
    return (parse(max(ends)) - parse(min(starts))).total_seconds()


def headlines(nb) -> list:
    """Lines of text outputs that report findings (``Free benchmark ...``, ``Grad probe ...``)."""
    lines = []
    for out in outputs(nb):
        text = out.get("data", {}).get("text/plain", "") if "data" in out else out.get("text", "")
        for line in (text if isinstance(text, str) else "".join(text)).splitlines():
            if line.startswith(("Free benchmark", "Grad probe")):
                lines.append(line.strip())
    return lines


def summary(nb, name: str = "notebook") -> str:
    counts = count_outputs(nb)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    head = (f"{name}: {n_code} code cells in {duration(nb):.1f} s; {counts['errors']} errors, "
            f"{counts['tables']} tables, {counts['images']} images, {counts['widgets']} widgets")
    return "\n".join([head, *(f"  {line}" for line in headlines(nb)), *errors(nb)])


def export_html(nb, path) -> Path:
    """Write ``nb`` as a standalone HTML page (nbconvert's lab template, images inline).

    Widgets are shown through their static HTML fallback (the page needs no network): without
    the widgets' state in the notebook's metadata nbconvert skips the widget views, so a state
    stored by the execution (``jupyter nbconvert --execute``, JupyterLab's "save widget state")
    is left out of the page.
    """
    import copy

    from nbconvert import HTMLExporter

    if "widgets" in nb.metadata:
        nb = copy.deepcopy(nb)
        del nb.metadata["widgets"]
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return path


#: what ``make demo`` exports after the quickstart: (notebook, output stem)
EXTRA_DEMOS = (("04_triage.ipynb", "triage"),)


def demo(out="demo_out", notebook=None, timeout: int = 300) -> str:
    """``make demo``: run the quickstart headless; write ``quickstart.html`` and
    ``quickstart_summary.txt`` under ``out`` (its dumps go to ``{out}/quickstart_run``); then the
    same for ``EXTRA_DEMOS`` (``triage.html``, ...). With ``notebook``, only that notebook is run
    (as the quickstart)."""
    out = Path(out)
    text = _demo_one(out, Path(notebook) if notebook else NOTEBOOKS / "01_quickstart.ipynb",
                     "quickstart", timeout)
    if notebook is None:
        for name, stem in EXTRA_DEMOS:
            text += "\n" + _demo_one(out, NOTEBOOKS / name, stem, timeout)
    return text


def _demo_one(out: Path, notebook: Path, stem: str, timeout: int) -> str:
    workdir = out / f"{stem}_run"
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    nb = run_notebook(notebook, cwd=workdir, timeout=timeout, allow_errors=True)
    wall = time.perf_counter() - t0
    html_path = export_html(nb, out / f"{stem}.html")
    text = summary(nb, notebook.name) + f"\n  wall time incl. kernel start: {wall:.1f} s" + (
        f"\n  HTML: {html_path}")
    (out / f"{stem}_summary.txt").write_text(text + "\n", encoding="utf-8")
    if errors(nb):
        raise RuntimeError(f"{notebook.name} raised errors:\n" + "\n".join(errors(nb)))
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probekit.notebook.run",
                                     description="Execute notebooks headless with this Python.")
    parser.add_argument("notebooks", nargs="*", help="notebooks to run")
    parser.add_argument("--html", help="write the (single) executed notebook as HTML here")
    parser.add_argument("--demo", metavar="OUT", help="run the quickstart as `make demo` does")
    parser.add_argument("--no-execute", action="store_true",
                        help="export notebooks already executed (with --html), do not run them")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args(argv)
    if args.demo:
        print(demo(args.demo, timeout=args.timeout))
        return 0
    if not args.notebooks:
        parser.error("give notebooks to run, or --demo OUT")
    status = 0
    for path in args.notebooks:
        if args.no_execute:
            import nbformat

            nb = nbformat.read(str(path), as_version=4)
        else:
            nb = run_notebook(path, timeout=args.timeout, allow_errors=True)
        print(summary(nb, Path(path).name))
        if args.html:
            export_html(nb, args.html)
        status |= bool(errors(nb))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
