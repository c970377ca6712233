"""File names built from model data (parameter and API names) that cannot escape the dump folder."""
from __future__ import annotations

import os
import re

from .errors import UnsafePathError

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
MAX_NAME = 200


def safe_name(name: str) -> str:
    """``name`` as a single path component: characters outside ``[A-Za-z0-9_.-]`` become ``_``.

    Separators, ``..`` and leading dots are neutralised and the result is never empty; long
    names are cut and suffixed with a short digest so two long names stay distinct.
    """
    cleaned = _UNSAFE.sub("_", str(name)).lstrip(".") or "_"
    if len(cleaned) > MAX_NAME:
        import hashlib

        digest = hashlib.sha1(str(name).encode()).hexdigest()[:10]
        cleaned = f"{cleaned[:MAX_NAME - 11]}-{digest}"
    return cleaned


def safe_join(root: str | os.PathLike, *names: str) -> str:
    """Join sanitised ``names`` under ``root`` and prove the result stays inside it."""
    root_abs = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root_abs, *(safe_name(n) for n in names)))
    if os.path.commonpath([root_abs, path]) != root_abs:
        raise UnsafePathError(f"refusing path {path!r}: it is outside {root_abs!r}")
    return path
