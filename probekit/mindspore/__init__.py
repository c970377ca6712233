"""probekit for MindSpore: the grad probe (msprobe's ``from msprobe.mindspore import
PrecisionDebugger``) and the comparison of a MindSpore run with a PyTorch run.

``PrecisionDebugger``, ``GradProbe`` and ``GraphModeError`` import MindSpore on first access;
``align_runs`` and ``compare_frameworks`` work on recorded runs and need no MindSpore.
Nothing here is imported by ``import probekit``.
"""
from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "PrecisionDebugger": "probekit.mindspore.debugger",
    "GradProbe": "probekit.mindspore.recorder",
    "GraphModeError": "probekit.mindspore.recorder",
    "align_runs": "probekit.mindspore.align",
    "compare_frameworks": "probekit.mindspore.align",
    "ms_to_torch_name": "probekit.mindspore.align",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
