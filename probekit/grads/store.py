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

import atexit
import json
import os
import shutil
import signal
import threading
import time

import numpy as np

from ..errors import GradStoreError
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


def _open_root(store_path: str):
    """The store's root group, created if missing. Every rank of a distributed run opens it at
    the same moment: the root's ``zarr.json`` is written once, atomically (temporary file, then
    an exclusive link), so a rank never meets another's half-made root."""
    import zarr

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
                 attrs: dict | None = None, significance: bool = False) -> None:
        import zarr

        self.path = rank_group_path(dump_path, rank)
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
        if os.path.exists(self.path):
            log.warning("%s exists and will be replaced by this recording", self.path)
            shutil.rmtree(self.path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        root = _open_root(os.path.dirname(self.path))
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
        _write_commit(self.path, {"steps": 0, "format": FORMAT})
        _live.add(self)

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
        return os.path.join(self.path, name), chunks[0]  # written directly from here on

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
            _live.wake()

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
        if _live.pending_sigterm:  # SIGTERM arrived during this flush: die of it now
            _live.terminate()

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
                               fill=255 if name == "significant" else 0)
            else:
                write_step_rows(path, chunk_rows, n0, columns[name])
        for path, _ in self.arrays.values():
            _set_rows(path, n0 + k)
        self.committed = n0 + k
        _write_commit(self.path, {"steps": self.committed, "format": FORMAT,
                                  "last_step": int(columns["step"][-1])})
        self._buffer = []

    def close(self) -> None:
        try:
            self.flush()
        finally:
            _live.remove(self)


class _LiveWriters:
    """Every open writer of this process, so that nothing buffered is lost: written at exit
    (``atexit``: normal end, uncaught exception, ``sys.exit``, Ctrl-C), on SIGTERM (the handler
    writes, then the process dies of SIGTERM as it would have), by a timer once a step has waited
    ``flush_seconds``, and before a reader in this process opens the store."""

    def __init__(self) -> None:
        self.writers: dict[int, GradWriter] = {}
        self.cond = threading.Condition()
        self.thread = None
        self.sigterm_installed = False
        self.pending_sigterm = False
        atexit.register(self.flush_all)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.cond = threading.Condition()
        self.thread = None

    def add(self, writer) -> None:
        with self.cond:
            self.writers[id(writer)] = writer
            if self.thread is None:
                self.thread = threading.Thread(target=self._timer, name="probekit-grad-flush",
                                               daemon=True)
                self.thread.start()
        self._install_sigterm()

    def remove(self, writer) -> None:
        with self.cond:
            self.writers.pop(id(writer), None)
            last = not self.writers
            self.cond.notify_all()  # the timer thread ends when no writer is left
        if last and self.sigterm_installed and \
                threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self.sigterm_installed = False
            except (ValueError, OSError):  # pragma: no cover
                pass

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def flush_all(self, path=None) -> None:
        for writer in list(self.writers.values()):
            if path is None or os.path.abspath(writer.path) == os.path.abspath(path):
                try:
                    writer.flush()
                except Exception as exc:  # never raise at exit; say what was lost
                    log.warning("grad_probe: writing the buffered steps of %s failed: %s",
                                writer.path, exc)

    def _timer(self) -> None:
        while True:
            with self.cond:
                if not self.writers:
                    self.thread = None
                    return
                now = time.monotonic()
                pending = [w for w in self.writers.values() if w._buffer]
                due = [w for w in pending if now - w._oldest >= w.flush_seconds]
                if not due:
                    waits = [w._oldest + w.flush_seconds - now for w in pending]
                    self.cond.wait(timeout=min(waits, default=None))
                    continue
            for w in due:
                try:
                    w.flush()
                except Exception as exc:
                    log.warning("grad_probe: timed write of %s failed: %s", w.path, exc)

    def _install_sigterm(self) -> None:
        if self.sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the program handles SIGTERM itself (and then exits through atexit)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self.sigterm_installed = True
        except (ValueError, OSError):  # pragma: no cover - no signals here
            pass

    def _on_sigterm(self, signum, frame) -> None:
        me = threading.get_ident()
        for writer in list(self.writers.values()):
            if writer._flushing == me:  # interrupted inside its own flush: it finishes, then dies
                self.pending_sigterm = True
                continue
            if writer._lock.acquire(timeout=10):
                try:
                    writer._write_buffer() if writer._buffer else None
                except Exception as exc:
                    log.warning("grad_probe: writing %s on SIGTERM failed: %s", writer.path, exc)
                finally:
                    writer._lock.release()
        if not self.pending_sigterm:
            self.terminate()

    @staticmethod
    def terminate() -> None:
        """Die of SIGTERM, as the process would have without probekit's handler."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


_live = _LiveWriters()


def flush_live(path=None) -> None:
    """Write the buffered steps of this process's open writers (of the rank group ``path``, or
    all), so a reader in this process (a notebook) sees every recorded step."""
    _live.flush_all(path)


def _set_rows(array_path: str, n: int) -> None:
    """Set the first dimension of a Zarr v3 array's metadata to ``n`` (atomic rewrite)."""
    meta_path = os.path.join(array_path, "zarr.json")
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    meta["shape"][0] = int(n)
    _atomic_write(meta_path, json.dumps(meta, indent=2).encode())


def write_step_rows(array_path: str, chunk_rows: int, n0: int, data: np.ndarray) -> None:
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
        folder = os.path.join(array_path, "c", str(i))
        name = os.path.join(folder, key) if tail else folder
        os.makedirs(os.path.dirname(name) if tail else os.path.dirname(folder), exist_ok=True)
        block = np.zeros((chunk_rows, *tail), dtype)
        if r0 < n0:
            with open(name, "rb") as fh:
                old = np.frombuffer(fh.read(), dtype).reshape(chunk_rows, *tail)
            block[:n0 - r0] = old[:n0 - r0]
        lo, hi = max(r0, n0), min(r1, n0 + len(data))
        block[lo - r0:hi - r0] = data[lo - n0:hi - n0]
        _atomic_write(name, block.tobytes())


# -- reading ---------------------------------------------------------------------------------
_BITS = ("direction", "significant")  # packed bits per element, read through RawChunks


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
    flush_live(group_path)  # a recording in this process: its buffered steps first
    if not os.path.isdir(group_path):
        raise GradStoreError(f"{store!r} has no group for rank {rank}; ranks stored: "
                             f"{store_ranks(store)}")
    n = read_commit(group_path)["steps"]
    # Look members up by path rather than listing the group (the listing would meet commit.json)
    names = [name for name in ("step", "param", "numel", "shape", "offset", "interval",
                               "present", "max", "min", "norm", "zeros", "dist", "direction",
                               "significant", "hash") if os.path.isfile(os.path.join(group_path, name,
                                                                     "zarr.json"))]
    lazy = set() if chunks is None else {k for k in names if k not in ("step", "hash")}
    attrs = _group_attrs(group_path)
    eager, meta = {}, {}
    static = {"param": "params", "numel": "numels", "shape": "shapes", "offset": "offsets",
              "interval": "intervals"}
    for name in names:
        if name in static and attrs.get(static[name]) is not None:
            eager[name] = np.asarray(attrs[static[name]])
            meta[name] = ("interval",) if name == "interval" else ("param",)
        elif name not in lazy and name not in _BITS:
            plain = read_plain(os.path.join(group_path, name), n)
            if plain is not None:
                meta[name], eager[name] = plain
    rest = [k for k in names if k not in eager and k not in lazy and k not in _BITS]
    if rest:  # arrays stored another way (compressed, other writer): through Zarr
        _, m2, e2 = _fetch(group_path, rest, n)
        meta.update(m2)
        eager.update(e2)
    for k in static.values():
        attrs.pop(k, None)
    group = zarr.open_group(group_path, mode="r", zarr_format=3) if lazy else None

    def load(name, lazy_ok=True):
        if name in _BITS:
            dims = ("step", "byte")
            raw = RawChunks.open(os.path.join(group_path, name), n)
            if raw is not None:
                if chunks is not None and lazy_ok:
                    import dask.array as dsa

                    return dims, dsa.from_array(raw, chunks=_dask_chunks(
                        group[name], dims, chunks), asarray=False)
                return dims, _lazy(raw)
            data = zarr.open_array(os.path.join(group_path, name), mode="r")[:n]
            return dims, data
        if name in eager:
            return meta[name], eager[name]
        arr = group[name]
        dims = tuple(arr.metadata.dimension_names)
        if dims and dims[0] == "step":
            _check_rows(arr.shape[0], n, group_path, name)
            import dask.array as dsa

            return dims, dsa.from_array(arr, chunks=_dask_chunks(arr, dims, chunks))[:n]
        return dims, arr[...]

    coords = {"step": load("step", lazy_ok=False)}
    for name in ("param", "numel", "shape", "offset", "interval"):
        if name in names:
            dims, data = load(name)
            if data.dtype.kind in "UTO":
                data = np.array(data.tolist(), dtype=str).reshape(data.shape)
            coords[name] = (dims, data)
    data_vars = {}
    for name in ("present", "max", "min", "norm", "zeros", "dist", "direction", "significant"):
        if name in names:
            data_vars[name] = load(name)
    if "hash" in names:
        dims, raw = load("hash", lazy_ok=False)
        data_vars["hash"] = (("step", "param"), _hex(raw))
    attrs["rank"] = int(rank)
    attrs["committed_steps"] = n
    return xr.Dataset(data_vars, coords=coords, attrs=_clean_attrs(attrs))


def _atomic_write(path: str, data, pad: int = 0) -> None:
    tmp = f"{path}.{os.getpid()}.partial"
    with open(tmp, "wb") as fh:
        fh.write(data)
        if pad:
            fh.write(bytes(pad))
    os.replace(tmp, path)


def write_raw_rows(array_path: str, chunks, n0: int, rows: list, ncols: int,
                   fill: int = 0) -> None:
    """Write ``rows`` (1-D uint8 arrays of ``ncols`` bytes) as rows ``n0...`` of an
    uncompressed Zarr v3 array whose chunks are ``chunks`` = (rows, cols), chunk file by chunk
    file: the C-order bytes of the whole chunk (unfilled rows/cols = 0, the fill value), each
    written to a temporary file and renamed, as Zarr's own LocalStore does. A chunk that already
    holds rows below ``n0`` is read back first, so those rows are kept. A chunk holding only
    ``fill`` bytes (the array's fill value) is not written (any earlier file of it removed)."""

    def put(path, data, pad=0):
        if fill and np.all(np.asarray(data) == fill) and (not pad or fill == 0):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            return
        _atomic_write(path, data, pad=pad)

    cr, cc = chunks
    ncol_chunks = -(-ncols // cc)
    k = len(rows)
    for i in range(n0 // cr, (n0 + k - 1) // cr + 1):
        folder = os.path.join(array_path, "c", str(i))
        os.makedirs(folder, exist_ok=True)
        r0, r1 = i * cr, (i + 1) * cr
        if cr == 1:  # one step per chunk (large models): write the row's pieces as they are
            row = rows[r0 - n0]
            for j in range(ncol_chunks):
                piece = row[j * cc:(j + 1) * cc]
                if fill and piece.size < cc:
                    piece = np.concatenate([piece, np.full(cc - piece.size, fill, np.uint8)])
                put(os.path.join(folder, str(j)), piece, pad=cc - piece.size)
            continue
        block = np.full((cr, ncol_chunks * cc), fill, np.uint8)
        if r0 < n0:  # a chunk begun by an earlier flush
            block[:, :ncols] = RawChunks(array_path, (r1, ncols), chunks, "uint8", fill, r1)[
                r0:r1, 0:ncols]
        for r in range(max(r0, n0), min(r1, n0 + k)):
            block[r - r0, :ncols] = rows[r - n0]
        for j in range(ncol_chunks):
            put(os.path.join(folder, str(j)), np.ascontiguousarray(block[:, j * cc:(j + 1) * cc]))


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


def raw_direction(ds):
    """The ``RawChunks`` behind ``ds["direction"]`` when it is exactly as ``open_grads``
    returned it (no selection applied since), else None: lets the comparison read rows
    straight into reusable buffers."""
    from xarray.core import indexing

    data = getattr(ds["direction"].variable, "_data", None)
    if not isinstance(data, indexing.LazilyIndexedArray):
        return None
    backend = getattr(data, "array", None)
    raw = getattr(backend, "arr", None)
    full = tuple(data.key.tuple) == (slice(None), slice(None))
    return raw if isinstance(raw, RawChunks) and full and raw.shape == ds["direction"].shape \
        else None


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


def _group_attrs(group_path: str) -> dict:
    with open(os.path.join(group_path, "zarr.json"), encoding="utf-8") as fh:
        return dict(json.load(fh).get("attributes", {}))


_PLAIN_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int64": np.int64, "float64": np.float64}


def read_plain(array_path: str, n: int):
    """(dimension names, the first ``n`` rows) of an uncompressed Zarr v3 array chunked along its
    first dimension only, read straight from its chunk files; None for any other layout."""
    try:
        with open(os.path.join(array_path, "zarr.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
    except OSError:
        return None
    codecs = meta.get("codecs", [])
    dtype = _PLAIN_DTYPES.get(meta.get("data_type"))
    shape = meta.get("shape", [])
    grid = meta.get("chunk_grid", {})
    key_enc = meta.get("chunk_key_encoding", {})
    if (dtype is None or [c.get("name") for c in codecs] != ["bytes"]
            or codecs[0].get("configuration", {}).get("endian", "little") != "little"
            or grid.get("name") != "regular" or key_enc.get("name") != "default"
            or key_enc.get("configuration", {}).get("separator", "/") != "/"
            or not shape):
        return None
    chunk = grid["configuration"]["chunk_shape"]
    if list(chunk[1:]) != list(shape[1:]):
        return None
    _check_rows(shape[0], n, os.path.dirname(array_path), os.path.basename(array_path))
    cr, tail = chunk[0], tuple(shape[1:])
    out = np.empty((n, *tail), dtype=np.dtype(dtype).newbyteorder("<"))
    per_chunk = cr * int(np.prod(tail, dtype=np.int64)) * out.dtype.itemsize
    zero_idx = "/".join("0" for _ in tail)
    for i in range(-(-n // cr)):
        rows = out[i * cr:min(n, (i + 1) * cr)]
        name = f"c/{i}/{zero_idx}" if tail else f"c/{i}"
        try:
            with open(os.path.join(array_path, name), "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            rows[...] = meta.get("fill_value", 0)
            continue
        if len(raw) != per_chunk:
            raise GradStoreError(f"{array_path}/{name}: {len(raw)} bytes, expected {per_chunk}")
        rows[...] = np.frombuffer(raw, out.dtype).reshape(cr, *tail)[:rows.shape[0]]
    return tuple(meta.get("dimension_names") or ()), out.astype(dtype, copy=False)


def _check_rows(stored: int, n: int, group_path: str, name: str) -> None:
    if stored < n:
        raise GradStoreError(f"{group_path}/{name}: {stored} steps stored but {n} committed; "
                             "the store is damaged")


def _fetch(group_path: str, names, n: int):
    """Group attributes, dimension names and the committed data of ``names``, read in one
    round trip through Zarr's event loop (metadata of all arrays together, then all data)."""
    import asyncio

    import zarr

    try:
        from zarr.api.asynchronous import open_group
        from zarr.core.sync import sync
    except ImportError:  # pragma: no cover - another zarr layout: one array at a time
        group = zarr.open_group(group_path, mode="r", zarr_format=3)
        meta = {k: tuple(group[k].metadata.dimension_names) for k in names}
        data = {}
        for k in names:
            arr = group[k]
            step_dim = meta[k] and meta[k][0] == "step"
            if step_dim:
                _check_rows(arr.shape[0], n, group_path, k)
            data[k] = arr[:n] if step_dim else arr[...]
        return dict(group.attrs), meta, data

    async def run():
        group = await open_group(group_path, mode="r", zarr_format=3)
        arrays = await asyncio.gather(*(group.getitem(k) for k in names))
        meta = {k: tuple(a.metadata.dimension_names) for k, a in zip(names, arrays)}
        for k, a in zip(names, arrays):
            if meta[k] and meta[k][0] == "step":
                _check_rows(a.shape[0], n, group_path, k)
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
