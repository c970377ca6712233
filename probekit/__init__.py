"""probekit: find numerical-precision problems in PyTorch training.

Two features, usable from scripts, ``torchrun`` and notebooks:

* the free benchmark (``FreeBench``), re-running API calls on perturbed inputs, and
* the grad probe (``GradProbe``, ``open_grads``, ``compare_grads``), recording gradient statistics
  and sign bits per optimizer step and comparing two runs.

``PrecisionDebugger`` offers msprobe's interface over both. This module imports no IPython,
ipywidgets, matplotlib or zarr: the heavy parts load on first use.
"""
from __future__ import annotations

from ._version import __version__
from .config import (Config, FreeBenchmarkConfig, GradProbeConfig, config_for, load_config,
                     make_config)
from .debugger import PrecisionDebugger
from .errors import (ConfigError, GradCompareError, GradStoreError, MsprobeDumpError,
                     ProbekitError, UnsafePathError)
from .lazy import lazy_exports

#: public name -> module that defines it (imported on first access)
_LAZY = {
    "FreeBench": "probekit.freebench",
    "GradProbe": "probekit.grads",
    "open_grads": "probekit.grads",
    "compare_grads": "probekit.grads",
    "perturb": "probekit.grads",         # a control run's rounding, without a probe
    "GradComparator": "probekit.grads",
    "suspects": "probekit.grads",
    "Verdict": "probekit.grads",         # cmp.probekit.verdict, TriageReport.verdict
    "triage": "probekit.triaging",       # a module named probekit.triage would shadow the function
    "TriageReport": "probekit.triaging",
    "impact": "probekit.impacting",      # does a finding matter? (fb.impact)
    "Impact": "probekit.impacting",
}

__all__ = ["__version__", "Config", "FreeBenchmarkConfig", "GradProbeConfig", "PrecisionDebugger",
           "config_for", "load_config", "make_config", "ProbekitError", "ConfigError",
           "GradStoreError", "GradCompareError", "MsprobeDumpError", "UnsafePathError", "plot",
           *_LAZY]

_lazy_getattr, _lazy_dir = lazy_exports(__name__, _LAZY)


def __getattr__(name: str):
    if name == "plot":  # the submodule, importable as probekit.plot without its own import line
        import importlib

        return importlib.import_module(".plot", __name__)
    return _lazy_getattr(name)


def __dir__():
    return sorted({*_lazy_dir(), "plot"})


def load_ipython_extension(ipython) -> None:
    """``%load_ext probekit``: register the notebook magics."""
    from .notebook import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .notebook import unload_ipython_extension as unload

    unload(ipython)
