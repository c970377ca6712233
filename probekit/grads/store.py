"""The grad probe's Zarr v3 store: ``{dump_path}/grads.zarr/rank{r}/``, one group per rank.

Layout of a rank group (every array carries Zarr v3 ``dimension_names``)::

    param(param) str, numel(param) int64, shape(param) str, offset(param) int64
    interval(interval) str                                  (L2)
    step(step) int64                                        optimizer step numbers
    present(step, param) bool                               the parameter had a gradient
    max, min, norm(step, param) float64
    hash(step, param, hash_byte) uint8                      (L0) digest bytes
    zeros(step, param), dist(step, param, interval) float64 (L2)
    direction(step, byte) uint8                             (L1/L2) packed sign bits, uncompressed
    commit.json                                             {"steps": n, ...}

Crash safety: steps are buffered and written in blocks; only after a block's arrays are written is
``commit.json`` replaced atomically (temporary file, fsync, rename) with the new step count. A
reader takes exactly the committed steps and ignores whatever a killed writer left past them.
Array chunks along ``step`` match the flush block, so a flush writes new chunks and never rewrites
committed ones (except the last, partial block written by ``close``).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from ..log import get_logger
from .stats import HASH_NBYTES, Layout, StepStats, interval_labels

log = get_logger(__name__)

STORE_NAME = "grads.zarr"
COMMIT = "commit.json"
FORMAT = "probekit.grads/1"
HASH_DESCRIPTION = {
    "md5": "md5 of the gradient as C-order float32 bytes (msprobe's MD5 column)",
    "xxh3": "xxh3_128 of the gradient as C-order float32 bytes",
}
_TARGET_CHUNK_BYTES = 4 << 20
_MAX_BUFFER_BYTES = 256 << 20


def direction_chunks(nbytes: int, flush_every: int) -> tuple[int, int, int]:
    """(steps per chunk, bytes per chunk, steps per flush) for ``nbytes`` of signs per step.

    Chunks hold about 4 MiB: several steps of a small model, or one step split in near-equal
    parts for a large one (so edge chunks waste at most a few bytes). An unfilled last chunk
    wastes at most one chunk per run, since the direction array is stored uncompressed. The
    flush block is a multiple of the steps per chunk, and its buffer stays under 256 MiB.
    """
    nbytes = max(8, nbytes)
    if nbytes <= _TARGET_CHUNK_BYTES:
        step_chunk, byte_chunk = max(1, min(flush_every, _TARGET_CHUNK_BYTES // nbytes)), nbytes
    else:
        parts = -(-nbytes // _TARGET_CHUNK_BYTES)
        step_chunk, byte_chunk = 1, -(-(-(-nbytes // parts)) // 8) * 8
    block = min(flush_every, max(1, _MAX_BUFFER_BYTES // nbytes))
    block = max(step_chunk, block // step_chunk * step_chunk)
    return step_chunk, byte_chunk, block


class GradStoreError(ValueError):
    """A grad store is missing, empty, or not readable as one."""


def rank_group_path(dump_path: str, rank: int) -> str:
    return os.path.join(dump_path, STORE_NAME, f"rank{int(rank)}")


def _write_commit(group_path: str, info: dict) -> None:
    path = os.path.join(group_path, COMMIT)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(info, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_commit(group_path: str) -> dict:
    path = os.path.join(group_path, COMMIT)
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
    except FileNotFoundError:
        raise GradStoreError(f"{group_path}: no {COMMIT}; the recording died before its first "
                             "commit, or this is not a probekit grad store") from None
    if not isinstance(info, dict) or not isinstance(info.get("steps"), int):
        raise GradStoreError(f"{path}: unreadable commit marker {info!r}")
    return info


class GradWriter:
    """Buffers the statistics of each step and writes them to one rank group in blocks."""

    def __init__(self, dump_path: str, rank: int, layout: Layout, level: str, bounds,
                 hash_name: str, flush_every: int) -> None:
        import zarr

        self.path = rank_group_path(dump_path, rank)
        self.layout = layout
        self.level = level
        self.bounds = tuple(bounds)
        self.hash_name = hash_name
        if level == "L0":
            self.dir_chunks = None
            self.block = max(1, min(flush_every, _MAX_BUFFER_BYTES // (64 * len(layout.names))))
        else:
            step_chunk, byte_chunk, self.block = direction_chunks(layout.nbytes, flush_every)
            self.dir_chunks = (step_chunk, byte_chunk)
        self.committed = 0
        self._buffer: list[tuple[int, StepStats]] = []
        if os.path.exists(self.path):
            log.warning("%s exists and will be replaced by this recording", self.path)
            shutil.rmtree(self.path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        root = zarr.open_group(os.path.dirname(self.path), mode="a", zarr_format=3)
        root.attrs.update({"format": FORMAT})
        self.group = root.create_group(f"rank{int(rank)}", overwrite=True)
        self.group.attrs.update({
            "format": FORMAT, "level": level, "bounds": list(self.bounds), "rank": int(rank),
            "hash_algorithm": hash_name if level == "L0" else None,
            "hash_description": HASH_DESCRIPTION[hash_name] if level == "L0" else None,
            "direction": "grad > 0 per element, numpy.packbits order (first element = most "
                         "significant bit), each param padded with 0 bits to 64-bit boundary",
        })
        self._create_arrays()
        _write_commit(self.path, {"steps": 0, "format": FORMAT})

    # -- layout ------------------------------------------------------------------------------
    def _static(self, name, values, dims, dtype):
        arr = self.group.create_array(name, shape=np.shape(values), dtype=dtype,
                                      dimension_names=dims)
        if np.size(values):
            arr[...] = np.asarray(values) if dtype is str else np.asarray(values, dtype=dtype)
        return arr

    def _growing(self, name, tail, dims, dtype, chunks=None, compress=True):
        kwargs = {} if compress else {"compressors": None}
        return self.group.create_array(
            name, shape=(0, *tail), chunks=chunks or (self.block, *tail), dtype=dtype,
            dimension_names=dims, fill_value=0, **kwargs)

    def _create_arrays(self) -> None:
        lay, p = self.layout, len(self.layout.names)
        self._static("param", list(lay.names), ("param",), str)
        self._static("numel", list(lay.numels), ("param",), "int64")
        self._static("shape", [str(tuple(s)) for s in lay.shapes], ("param",), str)
        self.arrays = {
            "step": self._growing("step", (), ("step",), "int64"),
            "present": self._growing("present", (p,), ("step", "param"), "bool"),
            "max": self._growing("max", (p,), ("step", "param"), "float64"),
            "min": self._growing("min", (p,), ("step", "param"), "float64"),
            "norm": self._growing("norm", (p,), ("step", "param"), "float64"),
        }
        if self.level == "L0":
            nb = HASH_NBYTES[self.hash_name]
            self.arrays["hash"] = self._growing("hash", (p, nb), ("step", "param", "hash_byte"),
                                                "uint8")
        else:
            self._static("offset", lay.offsets, ("param",), "int64")
            self.arrays["direction"] = self._growing("direction", (lay.nbytes,), ("step", "byte"),
                                                     "uint8", self.dir_chunks, compress=False)
        if self.level == "L2":
            labels = interval_labels(self.bounds)
            self._static("interval", labels, ("interval",), str)
            self.arrays["zeros"] = self._growing("zeros", (p,), ("step", "param"), "float64")
            self.arrays["dist"] = self._growing("dist", (p, len(labels)),
                                                ("step", "param", "interval"), "float64")

    # -- writing -----------------------------------------------------------------------------
    def append(self, step: int, stats: StepStats) -> None:
        self._buffer.append((int(step), stats))
        if len(self._buffer) >= self.block:
            self.flush()

    def flush(self) -> None:
        """Write the buffered steps, then commit them (atomically)."""
        if not self._buffer:
            return
        rows = self._buffer
        n0, k = self.committed, len(rows)
        columns = {"step": np.array([s for s, _ in rows], np.int64)}
        for name in self.arrays:
            if name != "step":
                columns[name] = np.stack([getattr(st, name) for _, st in rows])
        for name, arr in self.arrays.items():
            arr.resize((n0 + k, *arr.shape[1:]))
            arr[n0:n0 + k] = columns[name]
        self.committed = n0 + k
        _write_commit(self.path, {"steps": self.committed, "format": FORMAT,
                                  "last_step": int(columns["step"][-1])})
        self._buffer = []

    def close(self) -> None:
        self.flush()


# -- reading ---------------------------------------------------------------------------------
def find_store(path: str) -> str:
    """The ``grads.zarr`` folder for ``path`` (a dump_path or the store itself)."""
    path = os.fspath(path)
    for candidate in (path, os.path.join(path, STORE_NAME)):
        if os.path.isfile(os.path.join(candidate, "zarr.json")) and any(
                d.startswith("rank") for d in os.listdir(candidate)):
            return candidate
    raise GradStoreError(f"{path!r} holds no probekit grad store ({STORE_NAME} with rank groups)")


def store_ranks(store: str) -> list[int]:
    ranks = []
    for d in os.listdir(store):
        if d.startswith("rank") and d[4:].isdigit() and os.path.isdir(os.path.join(store, d)):
            ranks.append(int(d[4:]))
    return sorted(ranks)


def open_rank(store: str, rank: int, chunks=None):
    """The committed steps of one rank group as an xarray Dataset.

    ``chunks=None`` loads the arrays into memory; ``chunks="auto"`` (or a dict of dim -> size)
    wraps them in dask arrays over the Zarr chunks, so stores larger than memory work.
    """
    import xarray as xr
    import zarr

    group_path = os.path.join(store, f"rank{int(rank)}")
    if not os.path.isdir(group_path):
        raise GradStoreError(f"{store!r} has no group for rank {rank}; ranks stored: "
                             f"{store_ranks(store)}")
    n = read_commit(group_path)["steps"]
    group = zarr.open_group(group_path, mode="r", zarr_format=3)
    attrs = dict(group.attrs)
    # Look members up by path rather than listing the group (the listing would meet commit.json)
    names = {name for name in ("step", "param", "numel", "shape", "offset", "interval",
                               "present", "max", "min", "norm", "zeros", "dist", "direction",
                               "hash") if os.path.isfile(os.path.join(group_path, name,
                                                                     "zarr.json"))}

    def load(name, lazy_ok=True):
        arr = group[name]
        dims = tuple(arr.metadata.dimension_names)
        if name == "direction":
            raw = RawChunks.open(os.path.join(group_path, name), n)
            if raw is not None:
                if chunks is not None and lazy_ok:
                    import dask.array as dsa

                    return dims, dsa.from_array(raw, chunks=_dask_chunks(arr, dims, chunks),
                                                asarray=False)
                return dims, _lazy(raw)
        if dims and dims[0] == "step":
            if arr.shape[0] < n:
                raise GradStoreError(f"{group_path}/{name}: {arr.shape[0]} steps stored but "
                                     f"{n} committed; the store is damaged")
            if chunks is not None and lazy_ok:
                import dask.array as dsa

                data = dsa.from_array(arr, chunks=_dask_chunks(arr, dims, chunks))[:n]
            else:
                data = arr[:n]
        else:
            data = arr[...]
        return dims, data

    coords = {"step": load("step", lazy_ok=False)}
    for name in ("param", "numel", "shape", "offset", "interval"):
        if name in names:
            dims, data = load(name)
            if data.dtype.kind in "UTO":
                data = np.array(data.tolist(), dtype=str).reshape(data.shape)
            coords[name] = (dims, data)
    data_vars = {}
    for name in ("present", "max", "min", "norm", "zeros", "dist", "direction"):
        if name in names:
            data_vars[name] = load(name)
    if "hash" in names:
        dims, raw = load("hash", lazy_ok=False)
        data_vars["hash"] = (("step", "param"), _hex(raw))
    attrs["rank"] = int(rank)
    attrs["committed_steps"] = n
    return xr.Dataset(data_vars, coords=coords, attrs=_clean_attrs(attrs))


class RawChunks:
    """Read-only array over an uncompressed Zarr v3 array, reading its chunk files directly.

    The sign bits are stored without compression (they are random bits), so a chunk file is
    the chunk's C-order bytes (Zarr v3, ``bytes`` codec, default chunk key encoding
    ``c/<i>/<j>``; a missing file is all fill value). Reading them with ``readinto`` straight
    into the result avoids the copies of the generic codec pipeline, which matters for the
    comparison's throughput. ``open`` returns None for an array stored any other way.
    """

    ndim = 2

    def __init__(self, path, shape, chunk_shape, dtype, fill, n_rows):
        self.path, self.chunk_shape = path, tuple(chunk_shape)
        self.dtype = np.dtype(dtype)
        self.fill = fill
        self.shape = (int(n_rows), int(shape[1]))

    @classmethod
    def open(cls, path: str, n_rows: int):
        with open(os.path.join(path, "zarr.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        codecs = meta.get("codecs", [])
        key_enc = meta.get("chunk_key_encoding", {})
        if (len(meta.get("shape", [])) != 2 or meta.get("data_type") != "uint8"
                or [c.get("name") for c in codecs] != ["bytes"]
                or key_enc.get("name") != "default"
                or key_enc.get("configuration", {}).get("separator", "/") != "/"
                or meta.get("chunk_grid", {}).get("name") != "regular"):
            return None
        chunk_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        return cls(path, meta["shape"], chunk_shape, "uint8", meta.get("fill_value", 0),
                   min(n_rows, meta["shape"][0]))

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
        out = np.empty((max(0, r1 - r0), max(0, c1 - c0)), self.dtype)
        cr, cc = self.chunk_shape
        buf = np.empty(cr * cc, self.dtype)
        for i in range(r0 // cr, -(-r1 // cr) if r1 > r0 else r0 // cr):
            for j in range(c0 // cc, -(-c1 // cc) if c1 > c0 else c0 // cc):
                rows = slice(max(r0, i * cr), min(r1, (i + 1) * cr))
                cols = slice(max(c0, j * cc), min(c1, (j + 1) * cc))
                dest = out[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
                path = os.path.join(self.path, "c", str(i), str(j))
                whole = dest.shape == (cr, cc) and dest.flags.c_contiguous
                try:
                    with open(path, "rb", buffering=0) as fh:
                        got = fh.readinto(dest if whole else buf)
                except FileNotFoundError:
                    dest[...] = self.fill
                    continue
                if got != buf.size:
                    raise GradStoreError(f"{path}: {got} bytes, expected {buf.size}")
                if whole:
                    continue
                chunk = buf.reshape(cr, cc)
                dest[...] = chunk[rows.start - i * cr:rows.stop - i * cr,
                                  cols.start - j * cc:cols.stop - j * cc]
        return out


def _lazy(raw: "RawChunks"):
    """Wrap ``raw`` for xarray: nothing is read until values are asked for, and then only the
    selected rows (no dask involved)."""
    from xarray.backends import BackendArray
    from xarray.core import indexing

    class _Backend(BackendArray):
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

    return indexing.LazilyIndexedArray(_Backend(raw))


def _dask_chunks(arr, dims, chunks):
    if chunks == "auto" or chunks == {}:
        return arr.chunks
    return tuple(chunks.get(d, c) for d, c in zip(dims, arr.chunks))


_HEX_DIGITS = np.array(list("0123456789abcdef"))


def _hex(raw: np.ndarray) -> np.ndarray:
    """(step, param, nbytes) uint8 -> (step, param) hex strings, vectorised."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    nb = raw.shape[-1]
    chars = np.stack([_HEX_DIGITS[raw >> 4], _HEX_DIGITS[raw & 15]], axis=-1)
    chars = np.ascontiguousarray(chars.reshape(*raw.shape[:-1], 2 * nb))
    return chars.view(f"<U{2 * nb}").reshape(raw.shape[:-1])


def _clean_attrs(attrs: dict) -> dict:
    """netCDF-friendly attrs (no None), so Datasets can be saved anywhere."""
    return {k: v for k, v in attrs.items() if v is not None}
