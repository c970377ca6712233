"""The findings view in a notebook: the core view (``probekit.freebench.report.view.Findings``)
with call sites shown as the notebook cells they are in (``In [5] line 20``) and, for each finding
whose call was recorded, the command that writes its standalone repro (``fb.repro("...")``);
the ``%%freebench`` magic displays one after the cell ran.
"""
from __future__ import annotations

import os

from ..freebench.report import view


def cell_sites(shell=None) -> dict:
    """``{"3156476363.py": "In [5]"}`` for the cells this IPython session compiled, so call
    sites like ``3156476363.py:20`` can be shown as ``In [5] line 20`` (empty outside IPython)."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    names = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    return {os.path.basename(f): f"In [{n}]" for f, n in names.items()}


def show_png(data: bytes) -> None:
    """Display PNG bytes in the running IPython front-end (the core's figures call this from
    their ``_ipython_display_``, so only the notebook layer imports IPython)."""
    from IPython.display import Image, display

    display(Image(data=data, format="png"))


def readable_site(site, cells: dict) -> str:
    """``"3156476363.py:20"`` -> ``"In [5] line 20"`` when the file is a notebook cell."""
    site = "" if site is None else str(site)
    name, sep, line = site.rpartition(":")
    if sep and name in cells:
        return f"{cells[name]} line {line}"
    return site


def repro_command(dump_path: str | None, row, name: str = "") -> str:
    """``fb.repro("Functional.layer_norm.0.backward")`` for a finding whose call the session
    recorded in ``dump_path`` (``repro/record.py``), else ``""``; ``name``: the FreeBench's
    variable (default ``fb``)."""
    if not dump_path:
        return ""
    from ..freebench.repro.record import record_path

    try:
        rank = int(row.get("rank", 0) or 0)
        path = record_path(dump_path, row["api_name"], rank)
    except (KeyError, TypeError, ValueError):
        return ""
    if not os.path.isfile(path):
        return ""
    return f'{name or "fb"}.repro({row["api_name"]!r})'


class Findings(view.Findings):
    """Free-benchmark results as a table by severity plus a summary line, call sites named by
    notebook cell (``cells``: cell file name -> ``"In [n]"``; default: this IPython session's),
    and a ``repro`` column: the command writing a finding's standalone repro folder (a script
    needing only torch), for the findings whose call was recorded in ``dump_path``."""

    def __init__(self, results, summary: dict | None = None, *, cells: dict | None = None,
                 dump_path: str | None = None, **kwargs):
        super().__init__(results, summary, **kwargs)
        self.cells = cell_sites() if cells is None else cells
        self.dump_path = dump_path

    @classmethod
    def of(cls, bench, hotspots: bool = False, **kwargs) -> "Findings":
        kwargs.setdefault("dump_path", bench.config.dump_path)
        return super().of(bench, hotspots=hotspots, **kwargs)

    @property
    def calls(self):
        calls = super().calls
        if self.dump_path and len(calls):
            calls = calls.assign(repro=[repro_command(self.dump_path, row, self.name)
                                        for _, row in calls.iterrows()])
        return calls

    def _columns(self, calls) -> list:
        cols = super()._columns(calls)
        if "repro" in calls and (calls["repro"] != "").any():
            cols.append(("repro", "repro"))
        return cols

    def site(self, value) -> str:
        return readable_site(value, self.cells)

    def __repr__(self) -> str:
        text = super().__repr__()
        calls = self.calls
        if "repro" in calls and (calls["repro"] != "").any():
            cmds = [c for c in calls["repro"].head(self.top) if c]
            text += "\nrepro (a script needing only torch): " + "; ".join(cmds)
        return text
