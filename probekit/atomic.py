"""The one way probekit replaces a file: whole or not at all.

``atomic_write(path, data)`` writes ``data`` to a temporary file beside ``path`` and renames it
over ``path``: a reader, or a process killed at any moment, sees the old file or the new one,
never a part (the kernel's page cache holds what was written; it outlives the process). With
``fsync=True`` (the default) the file is also flushed to the disk before the rename, so it
survives a power loss or a kernel crash once the rename is itself durable: ``fsync_dir`` of the
folder. Used for ``Config.to_json`` (fsync'd) and for the grad store's chunk files, array
metadata and commit marker (fsync'd only with ``durable=True``: ``grads/store.py``);
``write_in_place`` for the store's chunks no reader reads yet (issue 38).
"""
from __future__ import annotations

import os
import threading


def atomic_write(path: str | os.PathLike, data: bytes | str | memoryview, *, pad: int = 0,
                 fsync: bool = True) -> None:
    """Replace ``path`` by ``data`` (``str`` is written as UTF-8) followed by ``pad`` zero bytes;
    ``fsync``: flush the file to the disk before the rename."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        write_in_place(tmp, data, pad=pad, fsync=fsync)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_in_place(path: str | os.PathLike, data: bytes | str | memoryview, *, pad: int = 0,
                   fsync: bool = True) -> None:
    """Write ``data`` (then ``pad`` zero bytes) as the file ``path`` directly: for a file no
    reader reads yet (the grad store's chunks of uncommitted rows); a reader, or a process
    killed meanwhile, may see it partly written."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.fspath(path), "wb") as fh:
        fh.write(data)
        if pad:
            fh.write(bytes(pad))
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder ``path`` (files renamed or created in it) durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
