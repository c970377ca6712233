"""Free benchmark: re-run PyTorch API calls on perturbed inputs and report inconsistent outputs.

``FreeBench`` is the public entry point; ``PrecisionDebugger(task="free_benchmark")`` uses it too.
Modules: ``modes`` (what each pert_mode means; torch-free), ``names`` (API naming/classification),
``intercept`` (the TorchFunctionMode), ``perturb`` (perturbations), ``metric`` (error metric),
``handlers`` (thresholds, check/fix), ``preheat`` (sampling rule), ``backward`` (gradient
checks), ``guards`` (modes off, autocast off), ``results`` (CSV, DataFrame), ``view`` (the
findings view), ``bench`` (``FreeBench``), ``state`` (calls that write state), ``compiled``
(torch.compile refused), ``coverage`` (zero coverage reported), ``autocast`` (autocast-aware
noise and fix), ``cause`` (why a finding: inaccurate / ill-conditioned).

The public names load on first access, so ``probekit.freebench.modes`` can be read without
importing torch (``probekit.config`` does).
"""
from __future__ import annotations

import importlib

_LAZY = {"FreeBench": "bench", "open_session": "bench", "COLUMNS": "results",
         "CompiledModelError": "compiled"}
__all__ = ["FreeBench", "open_session", "COLUMNS", "CompiledModelError"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'probekit.freebench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
