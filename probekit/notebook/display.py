"""The findings view in a notebook: the core view (``probekit.freebench.view.Findings``) with
call sites shown as the notebook cells they are in (``In [5] line 20``); the ``%%freebench``
magic displays one after the cell ran.
"""
from __future__ import annotations

import os

from ..freebench import view


def cell_sites(shell=None) -> dict:
    """``{"3156476363.py": "In [5]"}`` for the cells this IPython session compiled, so call
    sites like ``3156476363.py:20`` can be shown as ``In [5] line 20`` (empty outside IPython)."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    names = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    return {os.path.basename(f): f"In [{n}]" for f, n in names.items()}


def readable_site(site, cells: dict) -> str:
    """``"3156476363.py:20"`` -> ``"In [5] line 20"`` when the file is a notebook cell."""
    site = "" if site is None else str(site)
    name, sep, line = site.rpartition(":")
    if sep and name in cells:
        return f"{cells[name]} line {line}"
    return site


class Findings(view.Findings):
    """Free-benchmark results as a table by severity plus a summary line, call sites named by
    notebook cell (``cells``: cell file name -> ``"In [n]"``; default: this IPython session's)."""

    def __init__(self, results, summary: dict | None = None, *, cells: dict | None = None,
                 **kwargs):
        super().__init__(results, summary, **kwargs)
        self.cells = cell_sites() if cells is None else cells

    def site(self, value) -> str:
        return readable_site(value, self.cells)
