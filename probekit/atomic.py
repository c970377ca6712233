"""The one way probekit replaces a file: whole or not at all.

``atomic_write(path, data)`` writes ``data`` to a temporary file beside ``path``, flushes and
fsyncs it, then renames it over ``path``: a reader (or a run killed at any moment, or a machine
that loses power after the call returned) sees the old file or the new one, never a part. Used for
the grad store's chunk files, array metadata and commit marker, and for ``Config.to_json``.
"""
from __future__ import annotations

import os


def atomic_write(path: str | os.PathLike, data: bytes | str | memoryview, *, pad: int = 0) -> None:
    """Replace ``path`` by ``data`` (``str`` is written as UTF-8) followed by ``pad`` zero bytes."""
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = f"{path}.{os.getpid()}.partial"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if pad:
                fh.write(bytes(pad))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
