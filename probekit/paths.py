"""File names built from model data (parameter and API names) that cannot escape the dump folder."""
from __future__ import annotations

import os
import re

from .errors import UnsafePathError

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_EXT = re.compile(r"\.[A-Za-z0-9]{1,8}$")
MAX_NAME = 200


def safe_name(name: str) -> str:
    """``name`` as a single path component: characters outside ``[A-Za-z0-9_.-]`` become ``_``.

    Separators, ``..`` and leading dots are neutralised and the result is never empty; long
    names are cut and suffixed with a short digest so two long names stay distinct (their
    extension, up to 8 letters or digits after the last dot, kept at the end).
    """
    cleaned = _clean(name)
    return _digested(name, cleaned) if len(cleaned) > MAX_NAME else cleaned


def _clean(name) -> str:
    return _UNSAFE.sub("_", str(name)).lstrip(".") or "_"


def _digested(name: str, cleaned: str) -> str:
    """``cleaned`` cut to fit ``MAX_NAME`` with a digest of ``name`` before its extension."""
    import hashlib

    digest = hashlib.sha1(str(name).encode()).hexdigest()[:10]
    m = _EXT.search(cleaned)
    ext = m.group(0) if m else ""
    stem = cleaned[:len(cleaned) - len(ext)]
    return f"{stem[:MAX_NAME - 11 - len(ext)]}-{digest}{ext}"


def unique_names(names, suffix: str = "", taken=()) -> list[str]:
    """One file name per name in ``names`` (``safe_name`` of it plus ``suffix``) for one folder,
    no two alike: a name whose file name is in ``taken``, and every name that cleaning changed
    whose file name another name shares, gets the digest form (a name cleaning left as it is
    keeps its file name otherwise). It depends only on the set of names, not their order, so a
    reader that knows the names finds the files a writer gave them."""
    from collections import Counter

    wanted = [f"{n}{suffix}" for n in names]
    plain = [safe_name(w) for w in wanted]
    count, taken = Counter(plain), set(taken)
    return [_digested(w, _clean(w)) if (f != w and count[f] > 1) or f in taken else f
            for w, f in zip(wanted, plain)]


def safe_join(root: str | os.PathLike, *names: str) -> str:
    """Join sanitised ``names`` under ``root`` and prove the result stays inside it."""
    root_abs = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root_abs, *(safe_name(n) for n in names)))
    if os.path.commonpath([root_abs, path]) != root_abs:
        raise UnsafePathError(f"refusing path {path!r}: it is outside {root_abs!r}")
    return path
