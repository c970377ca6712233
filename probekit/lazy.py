"""Public names that load on first access (PEP 562), the one way probekit's packages do it.

    __getattr__, __dir__ = lazy_exports(__name__, {"FreeBench": ".bench", ...})

``names`` maps a public name to the module defining it (absolute, or relative to the package
with a leading dot). The first access imports that module and caches the value in the package,
so ``import probekit`` stays light (no torch, zarr, IPython or MindSpore until they are used).
"""
from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, names: dict):
    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
