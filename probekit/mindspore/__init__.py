"""probekit for MindSpore: the grad probe (msprobe's ``from msprobe.mindspore import
PrecisionDebugger``) and the comparison of a MindSpore run with a PyTorch run.

``PrecisionDebugger``, ``GradProbe`` and ``GraphModeError`` import MindSpore on first access;
``align_runs`` and ``compare_frameworks`` work on recorded runs and need no MindSpore.
Nothing here is imported by ``import probekit``.

Install with the ``mindspore`` extra (``pip install ".[mindspore]"`` in a checkout): MindSpore's
wheels up to 2.10 are compiled against numpy 1.x, and that extra pins ``numpy<2``. Importing this package with numpy >= 2
beside such a wheel warns, and the MindSpore-backed names then raise ``ImportError``, both
saying what to install (``numpy_conflict``), before MindSpore fails at its first op.
"""
from __future__ import annotations

import warnings

from ..lazy import lazy_exports
from .compat import check_numpy, numpy_conflict

_LAZY = {
    "PrecisionDebugger": "probekit.mindspore.debugger",
    "GradProbe": "probekit.mindspore.recorder",
    "GraphModeError": "probekit.mindspore.recorder",
    "align_runs": "probekit.mindspore.align",
    "compare_frameworks": "probekit.mindspore.align",
    "ms_to_torch_name": "probekit.mindspore.align",
}
_NEEDS_MINDSPORE = ("PrecisionDebugger", "GradProbe", "GraphModeError")

__all__ = [*_LAZY, "numpy_conflict"]

if numpy_conflict():
    warnings.warn(numpy_conflict(), RuntimeWarning, stacklevel=2)

_lazy_getattr, __dir__ = lazy_exports(__name__, _LAZY)


def __getattr__(name: str):
    if name in _NEEDS_MINDSPORE:
        check_numpy(f"probekit.mindspore.{name}")
    return _lazy_getattr(name)
