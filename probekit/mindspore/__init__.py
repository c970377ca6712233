"""probekit for MindSpore: the grad probe (msprobe's ``from msprobe.mindspore import
PrecisionDebugger``) and the comparison of a MindSpore run with a PyTorch run.

``PrecisionDebugger``, ``GradProbe`` and ``GraphModeError`` import MindSpore on first access;
``align_runs`` and ``compare_frameworks`` work on recorded runs and need no MindSpore.
Nothing here is imported by ``import probekit``.

Install with ``pip install "probekit[mindspore]"``: MindSpore's wheels up to 2.10 are compiled
against numpy 1.x, and that extra pins ``numpy<2``. Importing this package with numpy >= 2
beside such a wheel warns, and the MindSpore-backed names then raise ``ImportError``, both
saying what to install (``numpy_conflict``), before MindSpore fails at its first op.
"""
from __future__ import annotations

import warnings

from ..lazy import lazy_exports

_LAZY = {
    "PrecisionDebugger": "probekit.mindspore.debugger",
    "GradProbe": "probekit.mindspore.recorder",
    "GraphModeError": "probekit.mindspore.recorder",
    "align_runs": "probekit.mindspore.align",
    "compare_frameworks": "probekit.mindspore.align",
    "ms_to_torch_name": "probekit.mindspore.align",
}
_NEEDS_MINDSPORE = ("PrecisionDebugger", "GradProbe", "GraphModeError")

#: the newest MindSpore release line whose wheels are built against numpy 1.x (2.10.0's CPU
#: wheel declares numpy>=1.25 but fails with numpy 2; 2.7-2.9 declare numpy<2)
NUMPY1_MINDSPORE = (2, 10)

__all__ = [*_LAZY, "numpy_conflict"]


def _release(version: str) -> tuple:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def numpy_conflict() -> str | None:
    """What to install when numpy >= 2 sits beside a MindSpore wheel built for numpy 1.x (read
    from the installed metadata, without importing MindSpore); None when there is no conflict."""
    from importlib import metadata

    try:
        ms_version = metadata.version("mindspore")
    except metadata.PackageNotFoundError:
        return None
    import numpy

    if _release(numpy.__version__)[0] < 2 or _release(ms_version) > NUMPY1_MINDSPORE:
        return None
    return (f"MindSpore {ms_version} is compiled against numpy 1.x, but numpy "
            f"{numpy.__version__} is installed: MindSpore imports, then fails at its first op "
            "('A module that was compiled using NumPy 1.x cannot be run in NumPy 2'). Install "
            "numpy 1.x beside it: pip install \"numpy<2\" (pip install \"probekit[mindspore]\" "
            "pins it, and is the tested way to install probekit with MindSpore)")


_CONFLICT = numpy_conflict()
if _CONFLICT:
    warnings.warn(_CONFLICT, RuntimeWarning, stacklevel=2)



def check_numpy(what: str = "probekit.mindspore") -> None:
    """Raise ``ImportError`` saying what to install if numpy and MindSpore conflict (called by
    the modules that import MindSpore, before they import it)."""
    if _CONFLICT:
        raise ImportError(f"{what}: {_CONFLICT}")


_lazy_getattr, __dir__ = lazy_exports(__name__, _LAZY)


def __getattr__(name: str):
    if name in _NEEDS_MINDSPORE:
        check_numpy(f"probekit.mindspore.{name}")
    return _lazy_getattr(name)
