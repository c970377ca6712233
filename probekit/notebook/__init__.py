"""The notebook layer: the only package of probekit that imports IPython and ipywidgets."""
from __future__ import annotations


def load_ipython_extension(ipython) -> None:
    from .magics import register

    register(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magics import unregister

    unregister(ipython)
