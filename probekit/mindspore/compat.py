"""MindSpore's wheels and numpy: the install trap, detected before MindSpore is imported.

MindSpore's wheels up to 2.10 are compiled against numpy 1.x (2.10.0's declares numpy>=1.25 and
fails at its first op with numpy 2). probekit's ``mindspore`` extra pins ``numpy<2``; installing
MindSpore after probekit, as MindSpore's guide has users do, leaves numpy 2 beside it.
``numpy_conflict`` reads the installed metadata (no MindSpore import) and says what to install.
"""
from __future__ import annotations

import functools

#: the newest MindSpore release line whose wheels are built against numpy 1.x (2.10.0's CPU
#: wheel declares numpy>=1.25 but fails with numpy 2; 2.7-2.9 declare numpy<2)
NUMPY1_MINDSPORE = (2, 10)


def _release(version: str) -> tuple:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


@functools.lru_cache(maxsize=None)
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
            "numpy 1.x beside it: pip install \"numpy<2\" (probekit's \"mindspore\" extra, "
            "pip install \".[mindspore]\" in a checkout, pins it, and is the tested way to "
            "install probekit with MindSpore)")


def check_numpy(what: str = "probekit.mindspore") -> None:
    """Raise ``ImportError`` saying what to install if numpy and MindSpore conflict (called by
    the modules that import MindSpore, before they import it)."""
    conflict = numpy_conflict()
    if conflict:
        raise ImportError(f"{what}: {conflict}")
