"""The notebook layer: the only package of probekit that imports IPython and ipywidgets.

* ``%load_ext probekit``: the ``%%freebench`` cell magic and ``%freebench_config`` (``magics``)
* ``FreeBenchPanel``, ``GradProbePanel``: config panels (``widgets``)
* ``GradExplorer``: per-parameter view of grad-probe runs (``explorer``)
* ``Findings``: the findings table the magic displays (``display``)
* ``run_notebook``: execute a notebook headless and export HTML (``run``)
"""
from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "FreeBenchPanel": ".widgets", "GradProbePanel": ".widgets", "GradExplorer": ".explorer",
    "Findings": ".display", "set_defaults": ".magics", "get_defaults": ".magics",
    "run_notebook": ".run",
}
__all__ = ["load_ipython_extension", "unload_ipython_extension", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


def load_ipython_extension(ipython) -> None:
    from .magics import register

    register(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magics import unregister

    unregister(ipython)
