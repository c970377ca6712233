"""Raw Zarr v3 chunk I/O: the chunk files of the grad store's arrays, read and written directly.

The store keeps every array uncompressed (sign bits are random; the statistics barely compress),
so a chunk file is the chunk's little-endian C-order bytes (``bytes`` codec, default ``c/<i>/<j>``
keys). Reading and writing those files without Zarr's codec pipeline or event loop is what makes
the comparison fast and lets a flush run anywhere (an ``atexit`` handler, a signal handler).
``plain_meta`` is the one check that an array has that layout; anything else goes through Zarr.
Every file is replaced with ``probekit.atomic.atomic_write``.
"""
from __future__ import annotations

import json
import mmap
import os

import numpy as np

from ..errors import GradStoreError
from .storage import LOCAL

_PLAIN_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int64": np.int64, "float64": np.float64}


def plain_meta(array_path: str, fs=LOCAL) -> dict | None:
    """The ``zarr.json`` of an array whose chunk files can be read and written directly: Zarr
    v3, uncompressed (the ``bytes`` codec alone, little-endian), a regular chunk grid, the
    default ``c/<i>/<j>`` chunk keys, a data type of ``_PLAIN_DTYPES``; None for anything else
    (another writer's layout: read through Zarr instead)."""
    try:
        meta = json.loads(fs.read(fs.join(array_path, "zarr.json")))
    except (OSError, ValueError):
        return None
    codecs = meta.get("codecs", [])
    key_enc = meta.get("chunk_key_encoding", {})
    if (meta.get("data_type") not in _PLAIN_DTYPES or not meta.get("shape")
            or [c.get("name") for c in codecs] != ["bytes"]
            or codecs[0].get("configuration", {}).get("endian", "little") != "little"
            or meta.get("chunk_grid", {}).get("name") != "regular"
            or key_enc.get("name") != "default"
            or key_enc.get("configuration", {}).get("separator", "/") != "/"):
        return None
    return meta


def check_rows(stored: int, n: int, group_path: str, name: str) -> None:
    if stored < n:
        raise GradStoreError(f"{group_path}/{name}: {stored} steps stored but {n} committed; "
                             "the store is damaged")


def set_rows(array_path: str, n: int, fs=LOCAL) -> None:
    """Set the first dimension of a Zarr v3 array's metadata to ``n`` (atomic rewrite)."""
    meta_path = fs.join(array_path, "zarr.json")
    meta = json.loads(fs.read(meta_path))
    meta["shape"][0] = int(n)
    fs.write(meta_path, json.dumps(meta, indent=2).encode())


def write_step_rows(array_path: str, chunk_rows: int, n0: int, data: np.ndarray,
                    fs=LOCAL) -> None:
    """Write ``data`` as rows ``n0...`` of an uncompressed Zarr v3 array chunked along its first
    dimension only (``chunk_rows`` rows, whole trailing dimensions): each chunk file is the
    chunk's little-endian C-order bytes, written to a temporary file and renamed. A chunk that
    already holds rows below ``n0`` is read back first."""
    data = np.asarray(data)
    tail = data.shape[1:]
    key = "/".join(["0"] * len(tail))
    dtype = data.dtype.newbyteorder("<")
    for i in range(n0 // chunk_rows, (n0 + len(data) - 1) // chunk_rows + 1):
        r0, r1 = i * chunk_rows, (i + 1) * chunk_rows
        folder = fs.join(array_path, "c", str(i))
        name = fs.join(folder, key) if tail else folder
        fs.makedirs(fs.dirname(name))
        block = np.zeros((chunk_rows, *tail), dtype)
        if r0 < n0:
            old = np.frombuffer(fs.read(name), dtype).reshape(chunk_rows, *tail)
            block[:n0 - r0] = old[:n0 - r0]
        lo, hi = max(r0, n0), min(r1, n0 + len(data))
        block[lo - r0:hi - r0] = data[lo - n0:hi - n0]
        fs.write(name, block.tobytes())


def write_raw_rows(array_path: str, chunks, n0: int, rows: list, ncols: int,
                   fill: int = 0, fs=LOCAL) -> None:
    """Write ``rows`` (1-D uint8 arrays of ``ncols`` bytes) as rows ``n0...`` of an
    uncompressed Zarr v3 array whose chunks are ``chunks`` = (rows, cols), chunk file by chunk
    file: the C-order bytes of the whole chunk (unfilled rows/cols = 0, the fill value), each
    written to a temporary file and renamed, as Zarr's own LocalStore does. A chunk that already
    holds rows below ``n0`` is read back first, so those rows are kept. A chunk holding only
    ``fill`` bytes (the array's fill value) is not written (any earlier file of it removed)."""

    def put(path, data, pad=0):
        if fill and np.all(np.asarray(data) == fill) and (not pad or fill == 0):
            fs.remove(path)
            return
        fs.write(path, data, pad=pad)

    cr, cc = chunks
    ncol_chunks = -(-ncols // cc)
    k = len(rows)
    for i in range(n0 // cr, (n0 + k - 1) // cr + 1):
        folder = fs.join(array_path, "c", str(i))
        fs.makedirs(folder)
        r0, r1 = i * cr, (i + 1) * cr
        if cr == 1:  # one step per chunk (large models): write the row's pieces as they are
            row = rows[r0 - n0]
            for j in range(ncol_chunks):
                piece = row[j * cc:(j + 1) * cc]
                if fill and piece.size < cc:
                    piece = np.concatenate([piece, np.full(cc - piece.size, fill, np.uint8)])
                put(fs.join(folder, str(j)), piece, pad=cc - piece.size)
            continue
        block = np.full((cr, ncol_chunks * cc), fill, np.uint8)
        if r0 < n0:  # a chunk begun by an earlier flush
            block[:, :ncols] = RawChunks(array_path, (r1, ncols), chunks, "uint8", fill, r1,
                                         fs)[r0:r1, 0:ncols]
        for r in range(max(r0, n0), min(r1, n0 + k)):
            block[r - r0, :ncols] = rows[r - n0]
        for j in range(ncol_chunks):
            put(fs.join(folder, str(j)), np.ascontiguousarray(block[:, j * cc:(j + 1) * cc]))


class RawChunks:
    """Read-only array over an uncompressed Zarr v3 array, reading its chunk files directly.

    The sign bits are stored without compression (they are random bits), so a chunk file is
    the chunk's C-order bytes (Zarr v3, ``bytes`` codec, default chunk key encoding
    ``c/<i>/<j>``; a missing file is all fill value). Reading them with ``readinto`` straight
    into the result avoids the copies of the generic codec pipeline, which matters for the
    comparison's throughput. ``open`` returns None for an array stored any other way.
    """

    ndim = 2

    def __init__(self, path, shape, chunk_shape, dtype, fill, n_rows, fs=LOCAL):
        self.path, self.chunk_shape, self.fs = path, tuple(chunk_shape), fs
        self.dtype = np.dtype(dtype)
        self.fill = fill
        self.shape = (int(n_rows), int(shape[1]))

    @classmethod
    def open(cls, path: str, n_rows: int, fs=LOCAL):
        meta = plain_meta(path, fs)
        if meta is None or len(meta["shape"]) != 2 or meta["data_type"] != "uint8":
            return None
        chunk_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        return cls(path, meta["shape"], chunk_shape, "uint8", meta.get("fill_value", 0),
                   min(n_rows, meta["shape"][0]), fs)

    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        key = key + (slice(None),) * (2 - len(key))
        r0, r1, rs = key[0].indices(self.shape[0]) if isinstance(key[0], slice) else (
            None, None, None)
        c0, c1, cs = key[1].indices(self.shape[1]) if isinstance(key[1], slice) else (
            None, None, None)
        if r0 is None or c0 is None or rs != 1 or cs != 1:
            raise IndexError(f"RawChunks supports unit-step slices only, got {key!r}")
        return self.read(r0, r1, c0, c1)

    def read(self, r0: int, r1: int, c0: int = 0, c1: int | None = None, out=None):
        """Rows ``r0:r1``, columns ``c0:c1``; into ``out`` when given (a buffer reused across
        calls reads faster: fresh memory costs a page fault per page)."""
        c1 = self.shape[1] if c1 is None else c1
        shape = (max(0, r1 - r0), max(0, c1 - c0))
        out = np.empty(shape, self.dtype) if out is None else out
        if out.shape != shape:
            raise ValueError(f"out has shape {out.shape}, expected {shape}")
        cr, cc = self.chunk_shape
        if self.fs.remote:
            return self._read_remote(r0, r1, c0, c1, out)
        buf = None
        for i in range(r0 // cr, -(-r1 // cr) if r1 > r0 else r0 // cr):
            for j in range(c0 // cc, -(-c1 // cc) if c1 > c0 else c0 // cc):
                rows = slice(max(r0, i * cr), min(r1, (i + 1) * cr))
                cols = slice(max(c0, j * cc), min(c1, (j + 1) * cc))
                dest = out[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
                path = os.path.join(self.path, "c", str(i), str(j))
                whole = dest.shape == (cr, cc) and dest.flags.c_contiguous
                if not whole and buf is None:
                    buf = np.empty(cr * cc, self.dtype)
                try:
                    with open(path, "rb", buffering=0) as fh:
                        got = fh.readinto(dest if whole else buf)
                except FileNotFoundError:
                    dest[...] = self.fill
                    continue
                if got != cr * cc:
                    raise GradStoreError(f"{path}: {got} bytes, expected {cr * cc}")
                if whole:
                    continue
                chunk = buf.reshape(cr, cc)
                dest[...] = chunk[rows.start - i * cr:rows.stop - i * cr,
                                  cols.start - j * cc:cols.stop - j * cc]
        return out

    def _read_remote(self, r0, r1, c0, c1, out):
        """The same rows and columns from an object store: every chunk object needed is
        fetched in one concurrent request."""
        cr, cc = self.chunk_shape
        keys = [(i, j) for i in range(r0 // cr, -(-r1 // cr) if r1 > r0 else r0 // cr)
                for j in range(c0 // cc, -(-c1 // cc) if c1 > c0 else c0 // cc)]
        paths = {k: self.fs.join(self.path, "c", str(k[0]), str(k[1])) for k in keys}
        got = self.fs.read_many(paths.values())
        for (i, j), path in paths.items():
            rows = slice(max(r0, i * cr), min(r1, (i + 1) * cr))
            cols = slice(max(c0, j * cc), min(c1, (j + 1) * cc))
            dest = out[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
            raw = got[path]
            if raw is None:
                dest[...] = self.fill
                continue
            if len(raw) != cr * cc:
                raise GradStoreError(f"{self.fs.url(path)}: {len(raw)} bytes, expected "
                                     f"{cr * cc}")
            dest[...] = np.frombuffer(raw, self.dtype).reshape(cr, cc)[
                rows.start - i * cr:rows.stop - i * cr, cols.start - j * cc:cols.stop - j * cc]
        return out


def read_rows(raw: RawChunks, rows: np.ndarray, c0: int, c1: int, out: np.ndarray) -> None:
    """Rows ``rows`` (sorted indices) and columns ``c0:c1`` of ``raw`` into ``out`` ((len(rows),
    c1 - c0) uint8, C-contiguous): exactly those bytes of each chunk file, read into place with
    ``os.preadv`` (whole rows of a chunk at once where they are contiguous in the file and in
    ``out``); a missing chunk file is its fill value. From an object store: the chunk objects
    (``RawChunks.read``)."""
    if not len(rows) or c1 <= c0:
        return
    rows = np.asarray(rows, np.int64)
    if raw.fs.remote:
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        block = raw.read(lo, hi, c0, c1)
        out[...] = block if hi - lo == rows.size else block[rows - lo]
        return
    cr, cc = raw.chunk_shape
    which = rows // cr
    starts = np.flatnonzero(np.concatenate([[True], which[1:] != which[:-1]]))
    stops = np.append(starts[1:], rows.size)
    for a, z in zip(starts, stops):
        i = int(which[a])
        local = rows[a:z] - i * cr
        together = z - a == 1 or bool(np.all(np.diff(local) == 1))
        for j in range(c0 // cc, (c1 - 1) // cc + 1):
            lo, hi = max(c0, j * cc), min(c1, (j + 1) * cc)
            path = os.path.join(raw.path, "c", str(i), str(j))
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                out[a:z, lo - c0:hi - c0] = raw.fill
                continue
            try:
                if together and hi - lo == cc and out.shape[1] == cc:  # whole rows, one read
                    want = (z - a) * cc
                    got = _pread(fd, out[a:z].reshape(-1), int(local[0]) * cc)
                else:
                    want = (z - a) * (hi - lo)
                    got = 0
                    for k in range(a, z):
                        got += _pread(fd, out[k, lo - c0:hi - c0],
                                      int(local[k - a]) * cc + lo - j * cc)
            finally:
                os.close(fd)
            if got != want:
                raise GradStoreError(f"{path}: {got} bytes where {want} were expected; the "
                                     "chunk file is shorter than its chunk")


def _pread(fd: int, dest: np.ndarray, offset: int) -> int:
    """Bytes of file ``fd`` from ``offset`` read into ``dest`` (contiguous); how many."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [dest], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # no preadv here (Windows): seek, then read into place
    with os.fdopen(os.dup(fd), "rb", buffering=0) as fh:
        return fh.readinto(dest) or 0


_PAGE = mmap.ALLOCATIONGRANULARITY


def map_rows(raw: RawChunks, rows: np.ndarray, c0: int, c1: int):
    """Rows ``rows`` and columns ``c0:c1`` of ``raw`` as a read-only (len(rows), c1 - c0) view
    of the page cache (``mmap`` of the one chunk file holding them all: no copy; rows keep the
    file's row stride), a row of the fill value repeated (a chunk never written), or None when
    they span several chunk files, lie in an object store, or are not consecutive (then
    ``read_rows`` copies them)."""
    n = len(rows)
    if raw.fs.remote or not n or c1 <= c0 or not hasattr(mmap, "PROT_READ"):
        return None
    cr, cc = raw.chunk_shape
    r0 = int(rows[0])
    i, j = r0 // cr, c0 // cc
    if (int(rows[-1]) // cr != i or (c1 - 1) // cc != j
            or (n > 1 and int(rows[-1]) - r0 != n - 1)):
        return None
    path = os.path.join(raw.path, "c", str(i), str(j))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return np.broadcast_to(np.full(c1 - c0, raw.fill, np.uint8), (n, c1 - c0))
    try:
        size = os.fstat(fd).st_size
        if size != cr * cc:
            raise GradStoreError(f"{path}: {size} bytes, expected {cr * cc}")
        first = (r0 - i * cr) * cc + (c0 - j * cc)
        last = (r0 + n - 1 - i * cr) * cc + (c1 - j * cc)
        start = first - first % _PAGE
        m = mmap.mmap(fd, last - start, flags=mmap.MAP_SHARED | _POPULATE,
                      prot=mmap.PROT_READ, offset=start)
    finally:
        os.close(fd)
    buf = np.frombuffer(m, np.uint8)
    return np.lib.stride_tricks.as_strided(buf[first - start:], (n, c1 - c0), (cc, 1),
                                           writeable=False)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def read_plain(array_path: str, n: int, fs=LOCAL):
    """(dimension names, the first ``n`` rows) of an uncompressed Zarr v3 array chunked along its
    first dimension only, read straight from its chunk files; None for any other layout."""
    meta = plain_meta(array_path, fs)
    if meta is None:
        return None
    dtype = _PLAIN_DTYPES[meta["data_type"]]
    shape = meta["shape"]
    grid = meta["chunk_grid"]
    chunk = grid["configuration"]["chunk_shape"]
    if list(chunk[1:]) != list(shape[1:]):
        return None
    check_rows(shape[0], n, fs.dirname(array_path), os.path.basename(array_path.rstrip("/")))
    cr, tail = chunk[0], tuple(shape[1:])
    out = np.empty((n, *tail), dtype=np.dtype(dtype).newbyteorder("<"))
    per_chunk = cr * int(np.prod(tail, dtype=np.int64)) * out.dtype.itemsize
    zero_idx = "/".join("0" for _ in tail)
    names = [fs.join(array_path, f"c/{i}/{zero_idx}" if tail else f"c/{i}")
             for i in range(-(-n // cr))]
    got = fs.read_many(names)
    for i, name in enumerate(names):
        rows = out[i * cr:min(n, (i + 1) * cr)]
        raw = got[name]
        if raw is None:
            rows[...] = meta.get("fill_value", 0)
            continue
        if len(raw) != per_chunk:
            raise GradStoreError(f"{array_path}/{name}: {len(raw)} bytes, expected {per_chunk}")
        rows[...] = np.frombuffer(raw, out.dtype).reshape(cr, *tail)[:rows.shape[0]]
    return tuple(meta.get("dimension_names") or ()), out.astype(dtype, copy=False)


def _backend_class():
    """xarray backend array over a ``RawChunks`` (or anything with its ``shape``, ``dtype`` and
    ``[rows, cols]`` slicing), made on first use (xarray is imported then) and reachable as the
    module attribute ``_BitsBackend`` (module ``__getattr__``), so a lazily read Dataset
    pickles: a dask worker reads the chunk files itself."""
    cls = globals().get("_BitsBackendClass")
    if cls is not None:
        return cls
    from xarray.backends import BackendArray
    from xarray.core import indexing

    class _BitsBackend(BackendArray):
        def __init__(self, arr):
            self.arr, self.shape, self.dtype = arr, arr.shape, arr.dtype

        def __getitem__(self, key):
            return indexing.explicit_indexing_adapter(
                key, self.shape, indexing.IndexingSupport.OUTER_1VECTOR, self._get)

        def _get(self, key):
            rows, cols = key
            if isinstance(rows, (int, np.integer)):
                return self._get((slice(int(rows), int(rows) + 1), cols))[0]
            if isinstance(cols, (int, np.integer)):
                return self._get((rows, slice(int(cols), int(cols) + 1)))[:, 0]
            if isinstance(cols, np.ndarray):
                return self._get((rows, slice(None)))[:, cols]
            if isinstance(rows, np.ndarray):  # outer indexing on steps: read the covering range
                lo, hi = int(rows.min()), int(rows.max()) + 1
                return self.arr[lo:hi, cols][rows - lo]
            return self.arr[rows, cols]

    _BitsBackend.__module__, _BitsBackend.__qualname__ = __name__, "_BitsBackend"
    globals()["_BitsBackendClass"] = _BitsBackend
    return _BitsBackend


def __getattr__(name):
    if name == "_BitsBackend":
        return _backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lazy_bits(raw: "RawChunks"):
    """Wrap ``raw`` for xarray: nothing is read until values are asked for, and then only the
    selected rows (no dask involved)."""
    from xarray.core import indexing

    return indexing.LazilyIndexedArray(_backend_class()(raw))


#: ``Variable.encoding`` key under which ``open_grads`` leaves the chunk reader of a bit array
#: and the steps it was opened with (xarray copies a variable's encoding through selections)
RAW_KEY = "probekit_raw_chunks"


def bits_variable(dims: tuple, raw: RawChunks, steps):
    """A lazily read bit array for a Dataset that remembers its ``RawChunks`` (``raw_bits``)."""
    import xarray as xr

    return xr.Variable(dims, lazy_bits(raw), encoding={RAW_KEY: (raw, np.asarray(steps))})


def raw_bits(ds, name: str = "direction"):
    """The ``RawChunks`` behind ``ds[name]`` while it still holds exactly the rows ``open_grads``
    read — the same steps in the same order and every byte — else None. Lets the comparison
    read rows straight into reused buffers; any selection falls back to ``ds[name]`` itself."""
    var = ds[name].variable
    got = var.encoding.get(RAW_KEY)
    if got is None:
        return None
    raw, steps = got
    if var.shape != raw.shape or not np.array_equal(np.asarray(ds["step"].values), steps):
        return None
    return raw


class Rows:
    """Rows of a (step, byte) DataArray read like ``RawChunks`` (``read(r0, r1, out=)``): bits
    held any other way (in memory, an msprobe dump, dask arrays with ``chunks="auto"``)."""

    def __init__(self, da) -> None:
        self.da, self.shape = da, tuple(da.shape)

    def read(self, r0: int, r1: int, c0: int = 0, c1: int | None = None, out=None):
        sel = self.da.isel(step=slice(r0, r1), byte=slice(c0, c1))
        rows = np.ascontiguousarray(sel.values, dtype=np.uint8)
        if out is not None:
            out[...] = rows
            return out
        return rows


def bit_reader(ds, name: str = "direction"):
    """What the rows of ``ds[name]`` are read from: its chunk files straight (``raw_bits``:
    ``RawChunks``, or an assembled run's ``AssembledBits``) while the Dataset holds exactly what
    ``open_grads`` read, else ``Rows`` over the variable."""
    raw = raw_bits(ds, name)
    return raw if raw is not None else Rows(ds[name])
