"""Where a grad store lives: a local folder (plain file calls) or an fsspec URL.

``location(path, storage_options)`` -> ``(fs, path)``. A local folder, or a ``file://`` URL,
gets ``LOCAL``: plain ``open``/``os`` calls with no thread pool and no event loop, so a flush works
at interpreter exit and from a signal handler, as fast as before. Any other URL (``s3://``,
``gs://``, ``memory://``, every protocol fsspec knows) gets a ``Remote`` wrapping the fsspec
filesystem, with credentials and endpoint the fsspec way: the standard variables (``AWS_*`` for
S3, ``GOOGLE_APPLICATION_CREDENTIALS`` for GCS) or ``storage_options``.

Atomic writes: locally a temporary file renamed over the old one (``probekit.atomic``; flushed
to the disk first, and the folder after the rename, only where the store asks for durability);
on an object store one PUT per object, which readers see whole or not at all. The store's commit
protocol (chunks, then array shapes, then ``commit.json``) rests on nothing else, so a writer
that dies leaves the last committed step readable on either.

A URL is checked before anything is written: an unknown protocol, a missing filesystem package
(``s3fs``, ``gcsfs``) or a missing bucket raise ``GradStoreError`` naming it; a URL never falls
back to a local path (it once made folders such as ``./s3:/bucket/...``).
"""
from __future__ import annotations

import os
import shutil

from ...atomic import atomic_write, fsync_dir, write_in_place
from ...errors import GradStoreError

#: packages providing the common object-store protocols (fsspec names them in its registry too)
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
             "abfs": "adlfs"}
_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs")


def is_url(path) -> bool:
    return isinstance(path, str) and "://" in path


class Local:
    """Plain file calls (the fast path): what the store always did."""

    remote = False
    sep = os.sep

    @staticmethod
    def join(*parts) -> str:
        return os.path.join(*parts)

    @staticmethod
    def dirname(path) -> str:
        return os.path.dirname(path)

    @staticmethod
    def read(path) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    @staticmethod
    def read_many(paths) -> dict:
        out = {}
        for p in paths:
            try:
                with open(p, "rb") as fh:
                    out[p] = fh.read()
            except FileNotFoundError:
                out[p] = None
        return out

    @staticmethod
    def write(path, data, pad: int = 0, fsync: bool = True, atomic: bool = True) -> None:
        """``data`` (then ``pad`` zero bytes) as the file ``path``: replaced whole
        (``atomic_write``), or, ``atomic=False`` for a file no reader reads yet (a chunk of
        uncommitted rows), written in place."""
        (atomic_write if atomic else write_in_place)(path, data, pad=pad, fsync=fsync)

    @staticmethod
    def sync_dirs(paths) -> None:
        """Make the files renamed into these folders durable (``durable=True``)."""
        for p in paths:
            fsync_dir(p)

    @staticmethod
    def makedirs(path) -> None:
        os.makedirs(path, exist_ok=True)

    @staticmethod
    def isfile(path) -> bool:
        return os.path.isfile(path)

    @staticmethod
    def isdir(path) -> bool:
        return os.path.isdir(path)

    @staticmethod
    def exists(path) -> bool:
        return os.path.exists(path)

    @staticmethod
    def listdir(path) -> list:
        return os.listdir(path)

    @staticmethod
    def remove(path) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    @staticmethod
    def rmtree(path) -> None:
        shutil.rmtree(path)

    @staticmethod
    def move(src, dst) -> None:
        """``src`` (a folder) becomes ``dst``, at once (one rename)."""
        os.rename(src, dst)

    @staticmethod
    def du(path) -> int:
        """Bytes of the files under ``path`` (a file a writer renames meanwhile counts once)."""
        total = 0
        for folder, _, files in os.walk(path):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(folder, f))
                except FileNotFoundError:
                    pass
        return total

    @staticmethod
    def url(path) -> str:
        return os.path.abspath(path)

    @staticmethod
    def refresh() -> None:
        pass

    def __reduce__(self):
        return (_local, ())


def _local():
    return LOCAL


LOCAL = Local()


class Remote:
    """An fsspec filesystem; paths are the filesystem's own (``bucket/key``, no protocol)."""

    remote = True
    sep = "/"

    def __init__(self, fs, protocol: str, options: dict | None = None) -> None:
        self.fs, self.protocol, self.options = fs, protocol, dict(options or {})

    def join(self, *parts) -> str:
        return "/".join(p.rstrip("/") for p in parts if p != "")

    @staticmethod
    def dirname(path) -> str:
        return path.rstrip("/").rpartition("/")[0]

    def read(self, path) -> bytes:
        return self.fs.cat_file(path)

    def read_many(self, paths) -> dict:
        """Many objects at once (concurrent requests on async filesystems); None where missing."""
        paths = list(paths)
        if not paths:
            return {}
        got = self.fs.cat(paths, on_error="return")
        if not isinstance(got, dict):  # one path: fsspec returns its bytes
            got = {paths[0]: got}
        out = {}
        for p in paths:
            v = got.get(p, got.get(self.fs._strip_protocol(p)))
            if isinstance(v, FileNotFoundError) or v is None:
                out[p] = None
            elif isinstance(v, BaseException):
                raise v
            else:
                out[p] = v
        return out

    def write(self, path, data, pad: int = 0, fsync: bool = True, atomic: bool = True) -> None:
        # a PUT is durable once it returned and replaces the object whole: ``fsync`` and
        # ``atomic`` have nothing to add
        if isinstance(data, str):
            data = data.encode("utf-8")
        data = bytes(data)
        if pad:
            data += bytes(pad)
        self.fs.pipe_file(path, data)  # one PUT: the object is replaced whole

    @staticmethod
    def sync_dirs(paths) -> None:
        pass  # an object store has no folder entries to flush

    def makedirs(self, path) -> None:
        if self.protocol not in _BUCKETED:  # object stores have no folders
            self.fs.makedirs(path, exist_ok=True)

    def isfile(self, path) -> bool:
        return self.fs.isfile(path)

    def isdir(self, path) -> bool:
        return self.fs.isdir(path)

    def exists(self, path) -> bool:
        return self.fs.exists(path)

    def listdir(self, path) -> list:
        try:
            return [p.rstrip("/").rpartition("/")[2] for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def remove(self, path) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def rmtree(self, path) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def copy(self, src, dst) -> None:
        """Every object under ``src`` copied under ``dst`` (an object store renames nothing)."""
        self.fs.copy(src, dst, recursive=True)

    def du(self, path) -> int:
        """Bytes of the objects under ``path``."""
        return int(self.fs.du(path, total=True))

    def url(self, path) -> str:
        return f"{self.protocol}://{path}"

    def refresh(self) -> None:
        """Forget cached listings (another process may have written since)."""
        self.fs.invalidate_cache()


def _local_path(path: str, for_writing: bool) -> str:
    """A local dump path; ``for_writing``: the folder made now, or a ``GradStoreError`` naming it
    where it cannot be (a file in the way, no permission, a read-only file system)."""
    if "\0" in path:
        raise GradStoreError(f"dump_path {path!r}: holds a NUL character; accepted: a folder "
                             "path")
    if for_writing:
        try:
            os.makedirs(path or ".", exist_ok=True)
        except OSError as exc:
            raise GradStoreError(f"grad_probe: dump_path {path!r} cannot be created "
                                 f"({exc.strerror or exc}); accepted: a folder that exists or "
                                 "can be created") from None
    return path


def location(path, storage_options: dict | None = None, *, for_writing: bool = False):
    """``(fs, path)`` for a local path or an fsspec URL; raises ``GradStoreError`` naming a bad
    URL (unknown protocol, missing package, missing bucket) before anything is written."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not is_url(path):
        if storage_options:
            raise GradStoreError(f"storage_options: given for the local path {path!r}; "
                                 "accepted: only with an fsspec URL (s3://, gs://, memory://...)")
        return LOCAL, _local_path(path, for_writing)
    protocol = path.split("://", 1)[0].lower()
    if protocol in ("file", "local"):
        return LOCAL, _local_path(path.split("://", 1)[1], for_writing)
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with dask
        raise GradStoreError(f"{path!r}: URLs need fsspec: pip install fsspec") from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        known = ", ".join(sorted(p for p in fsspec.available_protocols()
                                 if p in ("file", "memory", "s3", "gs", "gcs", "az", "abfs",
                                          "http", "https", "hdfs", "sftp")))
        raise GradStoreError(f"{path!r}: unknown storage protocol {protocol!r}; accepted: a "
                             f"local folder or an fsspec URL ({known}, ...)") from None
    except ImportError as exc:
        pkg = _PACKAGES.get(protocol, "the package fsspec names")
        extra = "gcs" if pkg == "gcsfs" else "s3"
        raise GradStoreError(f"{path!r}: the {protocol}:// protocol needs {pkg}: pip install "
                             f"{pkg} (probekit's {extra!r} extra) ({exc})") from None
    try:
        fs = cls(**dict(storage_options or {}))
    except TypeError as exc:
        raise GradStoreError(f"storage_options: {sorted(storage_options or {})} not accepted "
                             f"by {cls.__name__} for {path!r}: {exc}") from None
    inner = cls._strip_protocol(path).rstrip("/")
    remote = Remote(fs, protocol, storage_options)
    if protocol in _BUCKETED:
        bucket = inner.split("/", 1)[0]
        if not bucket:
            raise GradStoreError(f"{path!r}: no bucket in the URL; accepted: "
                                 f"{protocol}://BUCKET/PATH")
        if for_writing:
            try:
                ok = fs.exists(bucket)
            except (PermissionError, OSError) as exc:
                raise GradStoreError(f"{path!r}: bucket {bucket!r} cannot be reached: "
                                     f"{exc}") from None
            except Exception as exc:  # credentials/endpoint errors of the client library
                raise GradStoreError(f"{path!r}: bucket {bucket!r} cannot be reached: "
                                     f"{type(exc).__name__}: {exc}") from None
            if not ok:
                raise GradStoreError(f"{path!r}: bucket {bucket!r} does not exist (or these "
                                     "credentials cannot see it); create it first")
    return remote, inner


def zarr_store(fs, path):
    """What ``zarr.open_group`` takes for ``(fs, path)``: the path itself locally, else a
    ``FsspecStore`` over the same filesystem object."""
    if not fs.remote:
        return path
    from zarr.storage import FsspecStore

    return FsspecStore.from_url(fs.url(path), storage_options=fs.options or None,
                                read_only=False)
