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

This module holds the layout, the commit protocol, the writer and the reader together (about 500
lines) because the commit protocol is what binds them: what the writer commits is exactly what
the reader takes. The raw chunk-file I/O they share is ``chunks.py``; the exit, signal and timer
flushes of open writers are ``live.py``.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from ..errors import GradStoreError
from ..log import get_logger
from .live import LIVE, flush_live
from .chunks import (RawChunks, bits_variable, check_rows, read_plain, set_rows, write_raw_rows,
                     write_step_rows)
from .stats import HASH_NBYTES, Layout, StepStats, interval_labels
from .storage import LOCAL, location, zarr_store

log = get_logger(__name__)

STORE_NAME = "grads.zarr"
COMMIT = "commit.json"
FORMAT = "probekit.grads/1"
HASH_DESCRIPTION = {
    "md5": "md5 of the gradient as C-order float32 bytes (msprobe's MD5 column)",
    "xxh3": "xxh3_128 of the gradient as C-order float32 bytes",
}
_TARGET_CHUNK_BYTES = 1 << 20
_MAX_BUFFER_BYTES = 256 << 20


def direction_chunks(nbytes: int, flush_every: int) -> tuple[int, int, int]:
    """(steps per chunk, bytes per chunk, steps per flush) for ``nbytes`` of signs per step.

    Chunks hold about 1 MiB: several steps of a small model, or one step split in near-equal
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


def rank_group_path(dump_path: str, rank: int, fs=LOCAL) -> str:
    return fs.join(dump_path, STORE_NAME, f"rank{int(rank)}")


def _write_commit(group_path: str, info: dict, fs=LOCAL) -> None:
    fs.write(fs.join(group_path, COMMIT), json.dumps(info))


def read_commit(group_path: str, fs=LOCAL) -> dict:
    path = fs.join(group_path, COMMIT)
    try:
        info = json.loads(fs.read(path))
    except FileNotFoundError:
        raise GradStoreError(f"{fs.url(group_path)}: no {COMMIT}; the recording died before its "
                             "first commit, or this is not a probekit grad store") from None
    if not isinstance(info, dict) or not isinstance(info.get("steps"), int):
        raise GradStoreError(f"{path}: unreadable commit marker {info!r}")
    return info


def _open_root(store_path: str, fs=LOCAL):
    """The store's root group, created if missing. Every rank of a distributed run opens it at
    the same moment: the root's ``zarr.json`` is written once, atomically (temporary file, then
    an exclusive link; on an object store one PUT of the same bytes), so a rank never meets
    another's half-made root."""
    import zarr

    if fs.remote:
        meta = fs.join(store_path, "zarr.json")
        if not fs.isfile(meta):
            fs.write(meta, json.dumps({"zarr_format": 3, "node_type": "group",
                                       "attributes": {"format": FORMAT}}))
        return zarr.open_group(zarr_store(fs, store_path), mode="r+", zarr_format=3)
    meta = os.path.join(store_path, "zarr.json")
    if not os.path.isfile(meta):
        tmp = f"{meta}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"zarr_format": 3, "node_type": "group",
                       "attributes": {"format": FORMAT}}, fh)
        try:
            os.link(tmp, meta)  # fails if another rank was first: theirs is the same
        except FileExistsError:
            pass
        except OSError:  # no hard links here: a rename (the same bytes if two ranks race)
            os.replace(tmp, meta)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return zarr.open_group(store_path, mode="r+", zarr_format=3)


class GradWriter:
    """Buffers the statistics of each step and writes them to one rank group in blocks."""

    def __init__(self, dump_path: str, rank: int, layout: Layout, level: str, bounds,
                 hash_name: str, flush_every: int, flush_seconds: float = 60.0, *,
                 attrs: dict | None = None, significance: bool = False,
                 storage_options: dict | None = None) -> None:
        # a URL is checked (protocol, package, bucket) before anything is written
        self.fs, root_path = location(dump_path, storage_options, for_writing=True)
        fs = self.fs
        self.path = rank_group_path(root_path, rank, fs)
        self.url = fs.url(self.path)
        self.layout = layout
        self.level = level
        self.bounds = tuple(bounds)
        self.hash_name = hash_name
        self.significance = bool(significance) and level != "L0"
        if level == "L0":
            self.dir_chunks = None
            self.block = max(1, min(flush_every, _MAX_BUFFER_BYTES // (64 * len(layout.names))))
        else:
            step_chunk, byte_chunk, self.block = direction_chunks(layout.nbytes, flush_every)
            self.dir_chunks = (step_chunk, byte_chunk)
        self.committed = 0
        self.flush_seconds = float(flush_seconds)
        self._buffer: list[tuple[int, StepStats]] = []
        self._oldest = 0.0
        self._lock = threading.Lock()
        self._flushing = None  # thread id while a flush runs (a signal handler must not nest)
        fs.refresh()
        if fs.exists(self.path):
            log.warning("%s exists and will be replaced by this recording", self.url)
            fs.rmtree(self.path)
        fs.makedirs(fs.dirname(self.path))
        root = _open_root(fs.dirname(self.path), fs)
        self.group = root.create_group(f"rank{int(rank)}", overwrite=True)
        self.group.attrs.update({
            "format": FORMAT, "level": level, "bounds": list(self.bounds), "rank": int(rank),
            "hash_algorithm": hash_name if level == "L0" else None,
            "hash_description": HASH_DESCRIPTION[hash_name] if level == "L0" else None,
            "direction": "grad > 0 per element, numpy.packbits order (first element = most "
                         "significant bit), each param padded with 0 bits to 64-bit boundary",
        })
        # the static coordinates once more as attributes: one JSON read gives them to readers
        self.group.attrs.update({
            "params": list(layout.names), "numels": [int(x) for x in layout.numels],
            "shapes": [str(tuple(x)) for x in layout.shapes],
            "offsets": [int(x) for x in layout.offsets] if level != "L0" else None,
            "intervals": interval_labels(self.bounds) if level == "L2" else None,
        })
        if attrs:
            self.group.attrs.update(dict(attrs))
        self._create_arrays()
        _write_commit(self.path, {"steps": 0, "format": FORMAT}, fs)
        LIVE.add(self)

    # -- layout ------------------------------------------------------------------------------
    def _static(self, name, values, dims, dtype):
        arr = self.group.create_array(name, shape=np.shape(values), dtype=dtype,
                                      dimension_names=dims)
        if np.size(values):
            arr[...] = np.asarray(values) if dtype is str else np.asarray(values, dtype=dtype)
        return arr

    def _growing(self, name, tail, dims, dtype, chunks=None, fill=0):
        # Uncompressed: sign bits are random, the statistics barely compress, and plain chunk
        # files are read straight from disk (``read_plain``, ``RawChunks``).
        kwargs = {"compressors": None}
        # statistics: at most 16 steps per chunk, so a run's unfilled last chunk stays small
        chunks = chunks or (min(self.block, 16), *tail)
        self.group.create_array(name, shape=(0, *tail), chunks=chunks, dtype=dtype,
                                dimension_names=dims, fill_value=fill, **kwargs)
        return self.fs.join(self.path, name), chunks[0]  # written directly from here on

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
                                                     "uint8", self.dir_chunks)
        if self.significance:
            # chunks that are all ones (the fill value) are not written
            self.arrays["significant"] = self._growing("significant", (lay.nbytes,),
                                                       ("step", "byte"), "uint8", self.dir_chunks,
                                                       fill=255)
        if self.level == "L2":
            labels = interval_labels(self.bounds)
            self._static("interval", labels, ("interval",), str)
            self.arrays["zeros"] = self._growing("zeros", (p,), ("step", "param"), "float64")
            self.arrays["dist"] = self._growing("dist", (p, len(labels)),
                                                ("step", "param", "interval"), "float64")

    # -- writing -----------------------------------------------------------------------------
    def append(self, step: int, stats: StepStats) -> None:
        """Buffer one step. A block is written once a step beyond it arrives (so the newest
        step can still be ``amend``-ed), or once the oldest buffered step waited
        ``flush_seconds``."""
        with self._lock:
            if not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.append((int(step), stats))
            if len(self._buffer) > self.block:
                keep = self._buffer[self.block:]
                self._buffer = self._buffer[:self.block]
                self._flush_locked()
                self._buffer = keep
                self._oldest = time.monotonic()
            due = time.monotonic() - self._oldest >= self.flush_seconds
        if due:
            self.flush()
        elif len(self._buffer) == 1:
            LIVE.wake()

    def amend(self, step: int, stats: StepStats) -> bool:
        """Replace the newest buffered step if it is ``step``; False once it was written."""
        with self._lock:
            if self._buffer and self._buffer[-1][0] == int(step):
                self._buffer[-1] = (int(step), stats)
                return True
            return False

    def flush(self) -> None:
        """Write the buffered steps, then commit them (atomically).

        Plain file writes only (no thread pool, no event loop), so this also works from an
        ``atexit`` handler after the interpreter has begun shutting down, and from a signal
        handler."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._buffer:
            return
        self._flushing = threading.get_ident()
        try:
            self._write_buffer()
        finally:
            self._flushing = None
        if LIVE.pending_sigterm:  # SIGTERM arrived during this flush: die of it now
            LIVE.terminate()

    def _write_buffer(self) -> None:
        rows = self._buffer
        n0, k = self.committed, len(rows)
        columns = {"step": np.array([s for s, _ in rows], np.int64)}
        for name in self.arrays:
            if name not in ("step", "direction", "significant"):
                columns[name] = np.stack([getattr(st, name) for _, st in rows])
        for name, (path, chunk_rows) in self.arrays.items():
            if name in ("direction", "significant"):  # the bulk, chunked along bytes too
                # statistics without significance bits (another writer): every element counts
                bits = [getattr(st, name) if getattr(st, name) is not None else
                        np.full(self.layout.nbytes, 255, np.uint8) for _, st in rows]
                write_raw_rows(path, self.dir_chunks, n0, bits, self.layout.nbytes,
                               fill=255 if name == "significant" else 0, fs=self.fs)
            else:
                write_step_rows(path, chunk_rows, n0, columns[name], fs=self.fs)
        for path, _ in self.arrays.values():
            set_rows(path, n0 + k, self.fs)
        self.committed = n0 + k
        _write_commit(self.path, {"steps": self.committed, "format": FORMAT,
                                  "last_step": int(columns["step"][-1])}, self.fs)
        self._buffer = []

    def flush_from_signal(self) -> bool:
        """Write the buffer from a signal handler (``live.py``); False when the signal interrupted
        this writer's own flush on this thread (that flush completes, then the process dies)."""
        if self._flushing == threading.get_ident():
            return False
        if self._lock.acquire(timeout=10):
            try:
                if self._buffer:
                    self._write_buffer()
            finally:
                self._lock.release()
        return True

    def nbytes(self) -> int:
        """Bytes the rank group holds on its storage now (every array, attribute and marker)."""
        return self.fs.du(self.path)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            LIVE.remove(self)


# -- reading ---------------------------------------------------------------------------------
_BITS = ("direction", "significant")  # packed bits per element, read through RawChunks


def find_store(path: str, fs=LOCAL) -> str:
    """The ``grads.zarr`` folder for ``path`` (a dump_path or the store itself)."""
    path = os.fspath(path)
    fs.refresh()
    for candidate in (path, fs.join(path, STORE_NAME)):
        if fs.isfile(fs.join(candidate, "zarr.json")) and any(
                d.startswith("rank") for d in fs.listdir(candidate)):
            return candidate
    raise GradStoreError(f"{fs.url(path) if fs.remote else path!r} holds no probekit grad "
                         f"store ({STORE_NAME} with rank groups)")


def store_ranks(store: str, fs=LOCAL) -> list[int]:
    ranks = []
    for d in fs.listdir(store):
        if d.startswith("rank") and d[4:].isdigit() and fs.isdir(fs.join(store, d)):
            ranks.append(int(d[4:]))
    return sorted(ranks)


#: members of a rank group, in the order a Dataset lists them
_MEMBERS = ("step", "param", "numel", "shape", "offset", "interval", "present", "max", "min",
            "norm", "zeros", "dist", "direction", "significant", "hash")
_COORDS = ("param", "numel", "shape", "offset", "interval")
#: coordinate -> the group attribute holding it too (one JSON read gives them all)
_STATIC_ATTRS = {"param": "params", "numel": "numels", "shape": "shapes", "offset": "offsets",
                 "interval": "intervals"}


def open_rank(store: str, rank: int, chunks=None, fs=LOCAL):
    """The committed steps of one rank group as an xarray Dataset.

    ``chunks=None`` loads the arrays into memory; ``chunks="auto"`` (or a dict of dim -> size)
    wraps them in dask arrays over the Zarr chunks, so stores larger than memory work.

    Where each array comes from: the static coordinates from the group's attributes; the
    statistics straight from their chunk files (``chunks.read_plain``) or, stored another way,
    through Zarr in one round trip; the sign (and significance) bits through a lazy reader of
    their chunk files (``chunks.RawChunks``); with ``chunks``, dask arrays instead.
    """
    import xarray as xr

    group_path = fs.join(store, f"rank{int(rank)}")
    flush_live(fs.url(group_path))  # a recording in this process: its buffered steps first
    if not fs.isdir(group_path):
        raise GradStoreError(f"{fs.url(store) if fs.remote else store!r} has no group for rank "
                             f"{rank}; ranks stored: {store_ranks(store, fs)}")
    n = read_commit(group_path, fs)["steps"]
    # members looked up by path, not by listing the group (the listing would meet commit.json)
    if fs.remote:
        got = fs.read_many([fs.join(group_path, m, "zarr.json") for m in _MEMBERS])
        names = [m for m in _MEMBERS if got[fs.join(group_path, m, "zarr.json")] is not None]
    else:
        names = [m for m in _MEMBERS if os.path.isfile(os.path.join(group_path, m, "zarr.json"))]
    attrs = _group_attrs(group_path, fs)
    arrays = _static_arrays(attrs, names)
    lazy = chunks is not None
    eager = [k for k in names if k not in arrays and k not in _BITS
             and not (lazy and k not in ("step", "hash"))]
    arrays.update(_eager_arrays(group_path, eager, n, fs))
    if lazy:
        arrays.update(_dask_arrays(group_path, [k for k in names if k not in arrays], n, chunks,
                                   fs))
    steps = arrays["step"][1]
    for name in _BITS:
        if name in names and name not in arrays:
            arrays[name] = _bits(group_path, name, n, steps, fs)
    coords = {"step": arrays["step"]}
    for name in _COORDS:
        if name in arrays:
            dims, data = arrays[name]
            if data.dtype.kind in "UTO":
                data = np.array(data.tolist(), dtype=str).reshape(data.shape)
            coords[name] = (dims, data)
    if attrs.get("sample_bits") is not None:  # sampled sign bits: the bits per parameter
        coords["nbits"] = ("param", np.asarray(attrs.pop("sample_bits"), np.int64))
    data_vars = {k: arrays[k] for k in names if k not in coords and k != "hash"}
    if "hash" in arrays:
        data_vars["hash"] = (("step", "param"), _hex(arrays["hash"][1]))
    for k in _STATIC_ATTRS.values():
        attrs.pop(k, None)
    if isinstance(attrs.get("placement"), list):  # a shard group (assemble.py reads it)
        attrs["placement"] = json.dumps(attrs["placement"])
    attrs["rank"] = int(rank)
    attrs["committed_steps"] = n
    return xr.Dataset(data_vars, coords=coords, attrs=_clean_attrs(attrs))


def _static_arrays(attrs: dict, names) -> dict:
    """The coordinates the writer also stored as group attributes: {name: (dims, values)}."""
    out = {}
    for name, key in _STATIC_ATTRS.items():
        if name in names and attrs.get(key) is not None:
            out[name] = (("interval",) if name == "interval" else ("param",),
                         np.asarray(attrs[key]))
    return out


def _eager_arrays(group_path: str, names, n: int, fs=LOCAL) -> dict:
    """{name: (dims, the committed rows)}: plain arrays from their chunk files, the others (a
    compressed array, another writer's) through Zarr in one round trip."""
    out = {}
    for name in names:
        plain = read_plain(fs.join(group_path, name), n, fs)
        if plain is not None:
            out[name] = plain
    rest = [k for k in names if k not in out]
    if rest:
        _, dims, data = _fetch(group_path, rest, n, fs)
        out.update({k: (dims[k], data[k]) for k in rest})
    return out


def _dask_arrays(group_path: str, names, n: int, chunks, fs=LOCAL) -> dict:
    """{name: (dims, a dask array over the Zarr chunks)} for a store larger than memory."""
    import dask.array as dsa
    import zarr

    group = zarr.open_group(zarr_store(fs, group_path), mode="r", zarr_format=3)
    out = {}
    for name in names:
        arr = group[name]
        dims = tuple(arr.metadata.dimension_names)
        raw = RawChunks.open(fs.join(group_path, name), n, fs) if name in _BITS else None
        if raw is not None:
            out[name] = (dims, dsa.from_array(raw, chunks=_dask_chunks(arr, dims, chunks),
                                              asarray=False))
        elif dims and dims[0] == "step":
            check_rows(arr.shape[0], n, group_path, name)
            out[name] = (dims, dsa.from_array(arr, chunks=_dask_chunks(arr, dims, chunks))[:n])
        else:
            out[name] = (dims, arr[...])
    return out


def _bits(group_path: str, name: str, n: int, steps, fs=LOCAL):
    """A packed bit array (step, byte): read lazily from its chunk files, remembering them for
    the comparison (``chunks.raw_bits``); stored another way, through Zarr."""
    raw = RawChunks.open(fs.join(group_path, name), n, fs)
    if raw is not None:
        return bits_variable(("step", "byte"), raw, steps)
    import zarr

    group = zarr.open_group(zarr_store(fs, group_path), mode="r", zarr_format=3)
    return ("step", "byte"), group[name][:n]


def _group_attrs(group_path: str, fs=LOCAL) -> dict:
    return dict(json.loads(fs.read(fs.join(group_path, "zarr.json"))).get("attributes", {}))


def _fetch(group_path: str, names, n: int, fs=LOCAL):
    """Group attributes, dimension names and the committed data of ``names``, read in one
    round trip through Zarr's event loop (metadata of all arrays together, then all data)."""
    import asyncio

    import zarr

    try:
        from zarr.api.asynchronous import open_group
        from zarr.core.sync import sync
    except ImportError:  # pragma: no cover - another zarr layout: one array at a time
        group = zarr.open_group(zarr_store(fs, group_path), mode="r", zarr_format=3)
        meta = {k: tuple(group[k].metadata.dimension_names) for k in names}
        data = {}
        for k in names:
            arr = group[k]
            step_dim = meta[k] and meta[k][0] == "step"
            if step_dim:
                check_rows(arr.shape[0], n, group_path, k)
            data[k] = arr[:n] if step_dim else arr[...]
        return dict(group.attrs), meta, data

    async def run():
        group = await open_group(zarr_store(fs, group_path), mode="r", zarr_format=3)
        arrays = await asyncio.gather(*(group.getitem(k) for k in names))
        meta = {k: tuple(a.metadata.dimension_names) for k, a in zip(names, arrays)}
        for k, a in zip(names, arrays):
            if meta[k] and meta[k][0] == "step":
                check_rows(a.shape[0], n, group_path, k)
        values = await asyncio.gather(*(
            a.getitem(slice(0, n) if meta[k] and meta[k][0] == "step" else ...)
            for k, a in zip(names, arrays)))
        return dict(group.attrs), meta, {k: np.asarray(v) for k, v in zip(names, values)}

    return sync(run())


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
