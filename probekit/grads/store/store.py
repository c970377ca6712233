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
    significant(step, byte) uint8                           (L1/L2 with significance)
    commit.json                                             {"steps": n, "runs": [...], ...}

A restarted run continues the store: the rank groups of a later layout (another world size)
live in ``grads.zarr/layout-{key}/``, and ``commit.json`` lists the runs that wrote a group
(``restarts.py``: the format over restarts and the rule for steps a resumed run records again).

Writing (``GradWriter``): the training thread hands each step's statistics over and goes on; one
background thread per process (``live.py``) writes them, a bounded queue between (a step waits
when the queue is full, so memory stays bounded), and the thread's errors are raised on the
training thread at its next step, ``flush()`` or ``stop()``. Each chunk file is written as soon
as it is full (to a temporary file, then renamed); every ``flush_every`` steps, or once the
oldest step waited ``flush_seconds``, the partly filled chunks are written, then the arrays'
shapes, then ``commit.json`` is replaced with the new step count. A reader takes exactly the
committed steps and ignores whatever a killed writer left past them. ``durable=True`` flushes
each file to the disk before its rename, and the folders before ``commit.json`` (which is
flushed too): the committed steps then survive a power loss; without it they survive the death
of the process (the kernel's page cache outlives it), not a crash of the machine.

The sign bits of a model of less than 1 MiB of them per step are stored in shards of several
steps (Zarr v3 ``sharding_indexed``, an uncompressed inner chunk per step): a short run's last
shard holds only its steps. Larger models: one step per chunk, split in near-equal parts.

This module holds the layout, the commit protocol, the writer and the reader together because
the commit protocol is what binds them: what the writer commits is exactly what the reader
takes. The raw chunk-file I/O they share is ``chunks.py``; the background thread and the exit,
signal and timer flushes of open writers are ``live.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections import deque

import numpy as np

from ...errors import GradStoreError
from ...log import get_logger
from .chunks import (
    RawChunks, bits_meta, bits_variable, check_rows, plain_meta, read_plain, set_rows,
    write_bits_chunk, write_plain_chunk)
from .live import LIVE, flush_live
from .restarts import (
    COMMIT, STORE_NAME, find_store, group_attributes, group_ranks, layout_folder,
    layout_folders, read_commit, read_json, remove_aside, runs_of, step_bounds, step_rows)
from ..numerics.stats import HASH_NBYTES, Layout, StepStats, interval_labels
from .storage import LOCAL, location, zarr_store

log = get_logger(__name__)

__all__ = ["STORE_NAME", "COMMIT", "FORMAT", "GradWriter", "GradStoreError", "find_store",
           "read_commit", "open_rank", "open_group", "store_ranks", "layout_key"]

FORMAT = "probekit.grads/1"
HASH_DESCRIPTION = {
    "md5": "md5 of the gradient as C-order float32 bytes (msprobe's MD5 column)",
    "xxh3": "xxh3_128 of the gradient as C-order float32 bytes",
}
_TARGET_CHUNK_BYTES = 1 << 20
_MAX_BUFFER_BYTES = 256 << 20
#: group attributes that define what a rank group records: a group is continued only by a
#: writer whose attributes equal these (``sample``, ``sample_bits``: the sampled sign bits of
#: ``grad_probe.sample``, whose elements and row width depend on it)
_LAYOUT_ATTRS = ("format", "level", "bounds", "hash_algorithm", "params", "numels", "shapes",
                 "offsets", "intervals", "placement", "grad_point", "layout_key", "sample",
                 "sample_bits")
#: the replica check's arrays (``grads/record/replicas.py``) over (step, param): dtype, fill
#: value (what a row of an unchecked step, or of a step recorded before the check, reads as)
REPLICA_ARRAYS = {"replicas": ("uint8", 0), "replica_rank": ("int64", -1),
                  "replica_gap": ("float64", float("nan"))}
#: layout attributes that do not choose the layout folder (a run of another sample is refused,
#: not given a folder of its own: ``restarts.plan_run``)
_UNKEYED = ("format", "layout_key", "sample", "sample_bits")


def direction_chunks(nbytes: int, flush_every: int) -> tuple[int, int, int]:
    """(steps per chunk, bytes per chunk, steps per commit) for ``nbytes`` of signs per step.

    Chunks hold about 1 MiB: several steps of a small model (a shard of one inner chunk per
    step, so an unfilled last shard holds only its steps), or one step split in near-equal
    parts for a large one (so edge chunks waste at most a few bytes). The commit block is a
    multiple of the steps per chunk, at most ``flush_every`` and 256 MiB of signs.
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


def layout_key(description) -> str:
    """The key of a layout: a hash of its description (anything JSON can hold, equal on every
    rank of a run: ``recorder.py`` describes the whole model, not the rank's shards)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def rank_group_path(dump_path: str, rank: int, fs=LOCAL) -> str:
    """The root folder's group of ``rank`` (where a run of the store's first layout records)."""
    return fs.join(dump_path, STORE_NAME, f"rank{int(rank)}")


def store_ranks(store: str, fs=LOCAL) -> list[int]:
    """The ranks of the root folder's groups."""
    return group_ranks(store, fs)


def _ensure_group(path: str, attrs: dict, fs=LOCAL) -> dict:
    """The attributes of the Zarr group at ``path``, created with ``attrs`` if missing. Every
    rank of a distributed run creates it at the same moment: its ``zarr.json`` is written once,
    atomically (temporary file, then an exclusive link; on an object store one PUT of the same
    bytes), so a rank never meets another's half-made group."""
    meta = fs.join(path, "zarr.json")
    body = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs})
    fs.makedirs(path)
    if fs.remote:
        if not fs.isfile(meta):
            fs.write(meta, body)
    elif not os.path.isfile(meta):
        tmp = f"{meta}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(body)
        try:
            os.link(tmp, meta)  # fails if another rank was first: theirs is the same
        except FileExistsError:
            pass
        except OSError:  # no hard links here: a rename (the same bytes if two ranks race)
            os.replace(tmp, meta)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return dict(json.loads(fs.read(meta)).get("attributes", {}))


def _remove_group(path: str, fs=LOCAL) -> None:
    """Delete a rank group: its commit marker first, so a reader never takes a half-deleted
    group for a recording (without a marker it holds no step)."""
    fs.remove(fs.join(path, COMMIT))
    if fs.exists(path):
        fs.rmtree(path)


def _stats_nbytes(stats: StepStats) -> int:
    return sum(int(getattr(v, "nbytes", 0)) for v in vars(stats).values())


class _Array:
    """A growing array of a group as the writer sees it: where, how chunked, and the rows of
    its open chunk (from the chunk's first row) not yet in a full chunk file."""

    def __init__(self, name, path, kind, meta, chunk_rows, tail=(), dtype=None):
        self.name, self.path, self.kind, self.meta = name, path, kind, meta
        self.chunk_rows, self.tail, self.dtype = int(chunk_rows), tuple(tail), dtype
        self.pending: list = []  # rows of the open chunk, from its first row
        self.dirty = False  # the open chunk has rows its file does not


class GradWriter:
    """Writes the statistics of each step to one rank group, off the training thread.

    ``append``/``amend``/``flush``/``close`` are the training thread's side; the rows are
    written by ``live.LIVE``'s thread (``_drain``), or by the caller where that thread cannot
    run. ``begin(run)`` (before the first step) says which run this is (``restarts.py``) and
    creates or opens the rank group: nothing is written before (a job's deciding rank may move
    the store aside first); a writer that is not told records a run of its own, from its first
    step, for its rank. ``close(clean=True)`` marks the run ``closed`` in the group's commit (a
    run that ended cleanly may be replaced by the next one; ``restarts.plan_run``)."""

    def __init__(self, dump_path: str, rank: int, layout: Layout, level: str, bounds,
                 hash_name: str, flush_every: int, flush_seconds: float = 60.0, *,
                 attrs: dict | None = None, significance: bool = False,
                 storage_options: dict | None = None, layout_key: str | None = None,
                 durable: bool = False, overwrite: bool = False,
                 world: int | None = None, replicas: bool = False) -> None:
        # a URL is checked (protocol, package, bucket) before anything is written
        self.fs, root_path = location(dump_path, storage_options, for_writing=True)
        fs = self.fs
        self.rank = int(rank)
        self.store = fs.join(root_path, STORE_NAME)
        self.layout = layout
        self.level = level
        self.bounds = tuple(bounds)
        self.hash_name = hash_name
        self.significance = bool(significance) and level != "L0"
        self.replicas = bool(replicas)  # the replica check's arrays (``REPLICA_ARRAYS``)
        self.durable = bool(durable)
        self.overwrite = bool(overwrite)
        self.world = int(world) if world else None
        self.flush_seconds = float(flush_seconds)
        if level == "L0":
            self.dir_chunks = None
            self.block = max(1, min(flush_every, _MAX_BUFFER_BYTES // (64 * len(layout.names))))
        else:
            step_chunk, byte_chunk, self.block = direction_chunks(layout.nbytes, flush_every)
            self.dir_chunks = (step_chunk, byte_chunk)
        group_attrs = self._attrs(attrs)
        self.layout_key = layout_key or _default_key(group_attrs, self.significance)
        group_attrs["layout_key"] = self.layout_key
        self._group_attrs = group_attrs
        self.store_url = fs.url(self.store)
        # where the group goes is known once the run begins (``_open_group``); until then the
        # root folder's group of this rank, where a run of the store's first layout records
        self.folder = self.store
        self.path = fs.join(self.folder, f"rank{self.rank}")
        self.url = fs.url(self.path)
        self._group_open = False
        self.committed = self._rows = 0
        self._runs: list = []
        self._aside = None  # a store moved aside that this writer removes after its first commit
        # the training thread's side
        self._lock = threading.Lock()
        self._lock_owner = None  # the thread in ``append`` (which may wait for the queue)
        self._newest = None  # (step, stats, nbytes): the newest step, which may be amended
        self._oldest = None  # when the oldest step not yet asked to be committed arrived
        self._handed = 0  # steps handed over since the last commit asked for
        self._run = None
        self._error = None
        # the writing side (LIVE's thread, or a caller draining inline), under _io
        self._io = threading.Lock()
        self._io_owner = None
        self._inbox: deque = deque()  # guarded by LIVE.cond
        self._opened = False
        self._first_commit = True
        if not self._store_holds_steps():
            # nothing for the run to decide about: the group exists from now on (0 steps), so
            # a run that records nothing reads as one (``probekit grads summary`` says why)
            self._open_group()
        LIVE.add(self)

    def _store_holds_steps(self) -> bool:
        """Does the store hold a committed step, or wait aside (``restarts.move_aside``)? Then
        this writer's group is made when its run begins, after the job decided about it."""
        from .restarts import ASIDE, holds_steps, is_store, store_state, valid_aside

        fs = self.fs
        fs.refresh()
        if valid_aside(fs.join(fs.dirname(self.store), ASIDE), fs):
            return True
        return is_store(self.store, fs) and holds_steps(store_state(self.store, fs))

    def _open_group(self) -> None:
        """Create this rank's group, or open the one an earlier run of the same layout wrote
        (the training thread, when the run begins: ``begin`` or the first step)."""
        if self._group_open:
            return
        fs = self.fs
        fs.refresh()
        root = _ensure_group(self.store, {"format": FORMAT, "layout_key": self.layout_key}, fs)
        self.folder = layout_folder(self.store, self.layout_key, root.get("layout_key"), fs)
        if self.folder != self.store:
            _ensure_group(self.folder, {"format": FORMAT, "layout_key": self.layout_key}, fs)
        self.path = fs.join(self.folder, f"rank{self.rank}")
        self.url = fs.url(self.path)
        # a group that never committed (its run died while creating it) holds nothing: anew
        if fs.isfile(fs.join(self.path, "zarr.json")) and fs.isfile(fs.join(self.path, COMMIT)):
            try:
                self._open_existing(self._group_attrs)
            except GradStoreError:
                if not (self.overwrite and (self._run or {}).get("scope") == "rank"):
                    raise
                _remove_group(self.path, fs)  # another layout, replaced as asked
                self._create(self._group_attrs)
        else:
            self._create(self._group_attrs)
        self._group_open = True

    # -- layout ------------------------------------------------------------------------------
    def _attrs(self, extra) -> dict:
        lay, level = self.layout, self.level
        attrs = {
            "format": FORMAT, "level": level, "bounds": list(self.bounds), "rank": self.rank,
            "hash_algorithm": self.hash_name if level == "L0" else None,
            "hash_description": HASH_DESCRIPTION[self.hash_name] if level == "L0" else None,
            "direction": "grad > 0 per element, numpy.packbits order (first element = most "
                         "significant bit), each param padded with 0 bits to 64-bit boundary",
            # the static coordinates once more: one JSON read gives them to readers
            "params": list(lay.names), "numels": [int(x) for x in lay.numels],
            "shapes": [str(tuple(x)) for x in lay.shapes],
            "offsets": [int(x) for x in lay.offsets] if level != "L0" else None,
            "intervals": interval_labels(self.bounds) if level == "L2" else None,
        }
        attrs.update(dict(extra or {}))
        return attrs

    def _create(self, attrs: dict) -> None:
        import zarr

        fs = self.fs
        parent = zarr.open_group(zarr_store(fs, self.folder), mode="r+", zarr_format=3)
        self.group = parent.create_group(f"rank{self.rank}", overwrite=True)
        self.group.attrs.update(attrs)
        self._create_arrays()
        self.committed = self._rows = 0
        self._runs = []
        self._write_commit({"steps": 0, "format": FORMAT, "runs": []})

    def _static(self, name, values, dims, dtype):
        arr = self.group.create_array(name, shape=np.shape(values), dtype=dtype,
                                      dimension_names=dims)
        if np.size(values):
            arr[...] = np.asarray(values) if dtype is str else np.asarray(values, dtype=dtype)
        return arr

    def _growing(self, name, tail, dims, dtype, chunks=None, fill=0, bits=False):
        # Uncompressed: sign bits are random, the statistics barely compress, and plain chunk
        # files are read straight from disk (``read_plain``, ``RawChunks``).
        kwargs = {"compressors": None}
        # statistics: at most 16 steps per chunk, so a run's unfilled last chunk stays small
        chunks = chunks or (min(self.block, 16), *tail)
        if bits and chunks[0] > 1:  # a shard of several steps, an inner chunk per step
            from zarr.codecs import BytesCodec, ShardingCodec

            kwargs = {"serializer": ShardingCodec(chunk_shape=(1, chunks[1]),
                                                  codecs=[BytesCodec()],
                                                  index_codecs=[BytesCodec()]),
                      "compressors": None, "filters": None}
        self.group.create_array(name, shape=(0, *tail), chunks=chunks, dtype=dtype,
                                dimension_names=dims, fill_value=fill, **kwargs)
        path = self.fs.join(self.path, name)
        if bits:
            meta = bits_meta(path, self.fs)
            return _Array(name, path, "bits", meta, meta["chunk"][0])
        return _Array(name, path, "plain", None, chunks[0], tail, np.dtype(dtype))

    def _create_arrays(self) -> None:
        lay, p = self.layout, len(self.layout.names)
        self._static("param", list(lay.names), ("param",), str)
        self._static("numel", list(lay.numels), ("param",), "int64")
        self._static("shape", [str(tuple(s)) for s in lay.shapes], ("param",), str)
        arrays = [
            self._growing("step", (), ("step",), "int64"),
            self._growing("present", (p,), ("step", "param"), "bool"),
            self._growing("max", (p,), ("step", "param"), "float64"),
            self._growing("min", (p,), ("step", "param"), "float64"),
            self._growing("norm", (p,), ("step", "param"), "float64"),
        ]
        if self.level == "L0":
            nb = HASH_NBYTES[self.hash_name]
            arrays.append(self._growing("hash", (p, nb), ("step", "param", "hash_byte"),
                                        "uint8"))
        else:
            self._static("offset", lay.offsets, ("param",), "int64")
            arrays.append(self._growing("direction", (lay.nbytes,), ("step", "byte"), "uint8",
                                        self.dir_chunks, bits=True))
        if self.significance:
            # rows (shards) or chunks that are all ones (the fill value) are not written
            arrays.append(self._growing("significant", (lay.nbytes,), ("step", "byte"),
                                        "uint8", self.dir_chunks, fill=255, bits=True))
        if self.level == "L2":
            labels = interval_labels(self.bounds)
            self._static("interval", labels, ("interval",), str)
            arrays.append(self._growing("zeros", (p,), ("step", "param"), "float64"))
            arrays.append(self._growing("dist", (p, len(labels)),
                                        ("step", "param", "interval"), "float64"))
        if self.replicas:
            arrays += [self._growing(name, (p,), ("step", "param"), dtype, fill=fill)
                       for name, (dtype, fill) in REPLICA_ARRAYS.items()]
        self.arrays = {a.name: a for a in arrays}

    def _open_existing(self, attrs: dict) -> None:
        """Continue a rank group an earlier run of the same layout wrote: its arrays as they
        are chunked, its committed rows and runs."""
        fs = self.fs
        try:
            have = dict(json.loads(fs.read(fs.join(self.path, "zarr.json"))).get("attributes",
                                                                                  {}))
        except (OSError, ValueError) as exc:
            raise GradStoreError(f"{self.url}: unreadable group metadata ({exc}); pass "
                                 "overwrite=True to replace it") from None
        differ = [k for k in _LAYOUT_ATTRS if _norm(have.get(k)) != _norm(attrs.get(k))]
        names = ["step", "present", "max", "min", "norm"]
        names += ["hash"] if self.level == "L0" else ["direction"]
        names += ["significant"] if self.significance else []
        names += ["zeros", "dist"] if self.level == "L2" else []
        if not self.replicas and fs.isfile(fs.join(self.path, "replicas", "zarr.json")):
            self.replicas = True  # the group has them: its rows go on (as not checked)
        elif self.replicas:  # a group recorded before the check had none: made here, empty
            self._add_replica_arrays(attrs)
            names += list(REPLICA_ARRAYS)
        stray = ["significant"] if not self.significance and fs.isfile(
            fs.join(self.path, "significant", "zarr.json")) else []
        if differ or stray:
            what = ", ".join(differ + [f"{k} (recorded: significance on)" for k in stray])
            raise GradStoreError(
                f"{self.url} holds a recording of another layout (differs in: {what}); it "
                "cannot be continued. Pass overwrite=True to replace the store's recording, or "
                "record into another dump_path")
        arrays = {}
        for name in names:
            path = fs.join(self.path, name)
            if name in ("direction", "significant"):
                meta = bits_meta(path, fs)
                if meta is not None:
                    arrays[name] = _Array(name, path, "bits", meta, meta["chunk"][0])
                    continue
            else:
                meta = plain_meta(path, fs)
                if meta is not None:
                    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
                    if list(chunk[1:]) == list(meta["shape"][1:]):
                        arrays[name] = _Array(name, path, "plain", None, chunk[0],
                                              tuple(meta["shape"][1:]),
                                              np.dtype(_dtype_of(meta)))
                        continue
            raise GradStoreError(f"{self.url}/{name}: stored in a way probekit does not append "
                                 "to (compressed, or another chunk layout); pass "
                                 "overwrite=True to replace it, or record into another "
                                 "dump_path")
        self.arrays = arrays
        commit = read_commit(self.path, fs)
        self.committed = self._rows = commit["steps"]
        bounds = None
        if commit.get("runs") is None and self.committed:
            bounds = step_bounds(self.path, self.committed, fs)
        self._runs = [dict(r) for r in runs_of(commit, bounds)]

    def _add_replica_arrays(self, attrs: dict) -> None:
        """The replica check's arrays in a group recorded without them (an older probekit, or
        the check off): created with the group's committed rows, which read as not checked
        (the fill value), and the group's ``replica_check`` attribute set."""
        import zarr

        fs = self.fs
        if all(fs.isfile(fs.join(self.path, n, "zarr.json")) for n in REPLICA_ARRAYS):
            return
        group = zarr.open_group(zarr_store(fs, self.path), mode="r+", zarr_format=3)
        rows = read_commit(self.path, fs)["steps"]
        p = len(self.layout.names)
        for name, (dtype, fill) in REPLICA_ARRAYS.items():
            if name not in group:
                group.create_array(name, shape=(rows, p), chunks=(min(self.block, 16), p),
                                   dtype=dtype, dimension_names=("step", "param"),
                                   fill_value=fill, compressors=None)
        if "replica_check" in attrs:
            group.attrs["replica_check"] = attrs["replica_check"]

    # -- the training thread's side -----------------------------------------------------------
    def begin(self, run: dict) -> None:
        """Which run this writer records (before its first step): ``{"run": id, "time": t,
        "start": first step, "from": supersede from (None: everything), "scope": "job" or
        "rank"}`` (``restarts.py``)."""
        with self._lock:
            if self._run:  # {}: a run that never began (an empty group, ``finish``)
                raise RuntimeError("GradWriter.begin: the run is already set")
            self._run = dict(run)
            if run.get("aside") and run.get("by") == self.rank:
                self._aside = run["aside"]
            self._group_open = False  # an empty group made before (``finish``) may be gone
            try:
                self._open_group()
            except BaseException:  # refused (another layout...): no run, no longer live
                self._run = {}
                LIVE.remove(self)
                raise

    def append(self, step: int, stats: StepStats) -> None:
        """Hand one step over. The newest step stays here until the next one arrives (so
        ``amend`` can replace it), or until a commit is due (``flush_every`` steps handed, or
        the oldest waited ``flush_seconds``). Waits while the process's write queue is full."""
        self.raise_error()
        with self._lock:
            self._lock_owner = threading.get_ident()  # a signal handler on this thread knows
            try:
                self._append_locked(int(step), stats)
            finally:
                self._lock_owner = None

    def _append_locked(self, step: int, stats: StepStats) -> None:
        now = time.monotonic()
        if not self._run:
            self._run = {"run": uuid.uuid4().hex, "time": time.time_ns() // 1000,
                         "start": step,
                         "from": None if self.overwrite else step, "scope": "rank"}
            self._open_group()
        prev, self._newest = self._newest, (step, stats, _stats_nbytes(stats))
        if self._oldest is None:
            self._oldest = now
        due = now - self._oldest >= self.flush_seconds
        if prev is not None:
            LIVE.put(self, ("row", prev), prev[2])
            self._handed += 1
        if due:
            self._hand_all()
        elif self._handed >= self.block:
            LIVE.put(self, ("commit", None), 0)
            self._handed = 0
            self._oldest = now
        elif prev is None:
            LIVE.wake()  # the timer: a step now waits

    def _hand_all(self, event=None) -> None:
        """Hand over the newest step too, and ask for a commit (under ``_lock``)."""
        if self._newest is not None:
            LIVE.put(self, ("row", self._newest), self._newest[2], force=True)
            self._newest = None
        LIVE.put(self, ("commit", event), 0, force=True)
        self._handed = 0
        self._oldest = None

    def amend(self, step: int, stats: StepStats) -> bool:
        """Replace the newest step if it is ``step``; False once it was handed over."""
        with self._lock:
            if self._newest is not None and self._newest[0] == int(step):
                self._newest = (int(step), stats, _stats_nbytes(stats))
                return True
            return False

    def pending(self) -> bool:
        """Steps not yet asked to be committed (the timer's question)."""
        return self._oldest is not None

    def flush(self, wait: bool = True) -> None:
        """Write every step handed so far and the newest, then commit them; ``wait``: return
        once committed (raising what the writing failed with)."""
        event = threading.Event() if wait else None
        with self._lock:
            if self._oldest is None and self._newest is None and not self._handed:
                event = None  # nothing since the last commit asked for
            else:
                self._hand_all(event)
        if event is not None:
            LIVE.wait(self, event)
        if wait:
            LIVE.wait(self, None)  # and what was asked before
            self.raise_error()

    def flush_from_signal(self) -> bool:
        """Write every step from a signal handler (``live.py``); False when the signal
        interrupted this writer's own writing on this thread (that finishes, then the process
        dies)."""
        me = threading.get_ident()
        if self._io_owner == me:
            return False
        event = threading.Event()
        # the signal may have interrupted this thread in ``append`` (waiting for room in the
        # queue): then only what was handed over is committed (that step and the newest are
        # lost); another thread holds the lock only for a moment
        if self._lock_owner != me and self._lock.acquire(timeout=1):
            try:
                self._hand_all(event)
            finally:
                self._lock.release()
        else:
            LIVE.put(self, ("commit", event), 0, force=True)
        LIVE.wait(self, event)
        return True

    def raise_error(self) -> None:
        """Raise what the writing failed with (on the training thread: at its next step)."""
        if self._error is not None:
            raise GradStoreError(f"grad_probe: writing {self.url} failed: "
                                 f"{type(self._error).__name__}: {self._error}") from self._error

    def nbytes(self) -> int:
        """Bytes the rank group holds on its storage now (every array, attribute and marker)."""
        return self.fs.du(self.path) if self._group_open else 0

    def close(self, clean: bool = True) -> None:
        """Write every step; ``clean``: the run ended as planned (not on an exception), which
        its commit then says (``closed``)."""
        try:
            self.finish(clean)
        finally:
            LIVE.remove(self)

    def finish(self, clean: bool = True) -> None:
        """``flush``, then, when ``clean``, mark the run closed in the group's commit."""
        self.flush()
        if clean and self._error is None:
            event = threading.Event()
            with self._lock:
                LIVE.put(self, ("close", event), 0, force=True)
            LIVE.wait(self, event)
            self.raise_error()

    def reopen(self) -> None:
        """Record again after ``close()`` (a probe started again): the same run goes on, not
        closed any more."""
        LIVE.add(self)
        with self._lock:
            LIVE.put(self, ("reopen", None), 0, force=True)

    # -- the writing side (under _io) ------------------------------------------------------
    def _drain(self) -> None:
        """Write what was handed over, in order (``LIVE``'s thread, or inline)."""
        with self._io:
            self._io_owner = threading.get_ident()
            try:
                items = LIVE.take(self)
                freed = 0
                for kind, payload in items:
                    if kind == "row":
                        freed += payload[2]
                        if self._error is None:
                            try:
                                self._write_row(payload[0], payload[1])
                            except Exception as exc:
                                self._fail(exc)
                    elif kind in ("close", "reopen"):
                        if self._error is None and self._opened:
                            try:
                                self._mark_closed(kind == "close")
                            except Exception as exc:
                                self._fail(exc)
                        if payload is not None:
                            payload.set()
                    else:
                        if self._error is None:
                            try:
                                self._commit()
                            except Exception as exc:
                                self._fail(exc)
                        if payload is not None:
                            payload.set()
                LIVE.done(freed)
            finally:
                self._io_owner = None
        if LIVE.pending_sigterm and threading.current_thread() is threading.main_thread():
            LIVE.terminate()  # SIGTERM arrived while this thread wrote: die of it now

    def _fail(self, exc) -> None:
        self._error = exc
        log.warning("grad_probe: writing %s failed (%s: %s); the steps from here on are not "
                    "recorded", self.url, type(exc).__name__, exc)

    def _open_run(self) -> None:
        """Begin this writer's run in the group: cut it to the rows before the run's ``from``
        step (the rule of ``restarts.py``), commit that with the run listed, and read back the
        rows of the chunks the run goes on filling."""
        fs, run = self.fs, self._run
        n = self.committed
        steps = read_plain(fs.join(self.path, "step"), n, fs)[1] if n else np.zeros(0, np.int64)
        k = 0 if run.get("from") is None else int(
            np.searchsorted(steps, min(run["from"], run["start"]), side="left"))
        runs = []
        for r in self._runs:
            r = dict(r)
            a, b = r.get("rows") or [0, 0]
            a, b = min(a, k), min(b, k)
            r["rows"] = [a, b]
            r["steps"] = [int(steps[a]), int(steps[b - 1])] if b > a else None
            runs.append(r)
        entry = {k2: run.get(k2) for k2 in ("run", "time", "start", "from", "scope")}
        entry.update(rows=[k, k], steps=None, closed=False)
        runs.append(entry)
        self._runs = runs
        self.committed = self._rows = k
        self._write_commit(self._commit_body())
        for arr in self.arrays.values():  # the chunk the run goes on filling, from its start
            c0 = k // arr.chunk_rows * arr.chunk_rows
            arr.pending, arr.dirty = [], False
            if c0 == k:
                continue
            if arr.kind == "bits":
                raw = RawChunks.open(arr.path, k, fs)
                block = raw.read(c0, k)
                arr.pending = [block[i] for i in range(k - c0)]
            else:
                data = read_plain(arr.path, k, fs)[1]
                arr.pending = [data[i] for i in range(c0, k)]
        self._opened = True

    def _mark_closed(self, closed: bool) -> None:
        """The run ended cleanly (``close``) or goes on (``reopen``): its commit says so."""
        self._runs[-1]["closed"] = bool(closed)
        self._write_commit(self._commit_body())

    def _committed_first(self) -> None:
        """After the run's first commit of a step: the store it replaced, moved aside, is
        deleted (by the rank that decided the run), and a process recording alone that replaced
        its own steps (``from`` None, scope "rank") deletes its groups in other layout folders."""
        self._first_commit = False
        if self._aside is not None:
            try:
                remove_aside(self._aside, self.fs)
            except OSError as exc:  # superseded anyway: only space is lost until the next run
                log.warning("grad_probe: removing the replaced store %s failed: %s",
                            self.fs.url(self._aside), exc)
            self._aside = None
        if self._run.get("from") is None and self._run.get("scope") == "rank":
            self._reclaim()

    def _reclaim(self) -> None:
        """A replacing run of a process recording alone: the groups of this rank in the store's
        other layout folders (and those of ranks past the world size, this rank's share) are
        superseded: delete them."""
        fs = self.fs
        for folder in layout_folders(self.store, fs):
            for r in group_ranks(folder, fs):
                mine = r == self.rank or (self.world and r >= self.world
                                          and r % self.world == self.rank)
                path = fs.join(folder, f"rank{r}")
                if mine and path != self.path:
                    try:
                        _remove_group(path, fs)
                    except OSError as exc:  # superseded anyway: only space is lost
                        log.warning("grad_probe: removing %s failed: %s", fs.url(path), exc)

    def _row_value(self, name: str, step: int, stats: StepStats):
        if name == "step":
            return np.int64(step)
        value = getattr(stats, name)
        if value is None and name in REPLICA_ARRAYS:  # not checked at this step
            dtype, fill = REPLICA_ARRAYS[name]
            return np.full(len(self.layout.names), fill, dtype)
        if value is None and name in ("direction", "significant"):
            # statistics without significance bits (another writer): every element counts
            value = np.full(self.layout.nbytes, 255, np.uint8)
        return value

    def _write_row(self, step: int, stats: StepStats) -> None:
        if not self._opened:
            self._open_run()
        row = self._rows
        for arr in self.arrays.values():
            arr.pending.append(self._row_value(arr.name, step, stats))
            arr.dirty = True
            if (row + 1) % arr.chunk_rows == 0:  # the chunk is full: write it now
                self._write_chunk(arr, row // arr.chunk_rows)
                arr.pending, arr.dirty = [], False
        self._rows = row + 1
        self._last_step = int(step)
        cur = self._runs[-1]
        if cur["steps"] is None:
            cur["steps"] = [int(step), int(step)]
        cur["steps"][1] = int(step)
        cur["rows"][1] = self._rows

    def _write_chunk(self, arr: _Array, i: int) -> set:
        fs, fsync = self.fs, self.durable
        # a chunk past the committed rows is read by no reader: written in place (a writer
        # killed meanwhile leaves rows no commit names); one holding committed rows is replaced
        fresh = i * arr.chunk_rows >= self.committed
        if arr.kind == "bits":
            return write_bits_chunk(arr.path, arr.meta, i, arr.pending, fs, fsync, fresh)
        block = np.zeros((arr.chunk_rows, *arr.tail), arr.dtype)
        block[:len(arr.pending)] = np.asarray(arr.pending, arr.dtype).reshape(
            len(arr.pending), *arr.tail)
        return {write_plain_chunk(arr.path, i, block, fs, fsync, fresh)}

    def _commit(self) -> None:
        """The open chunks, then the arrays' shapes, then ``commit.json``."""
        if not self._opened or self._rows == self.committed:
            return
        fs, durable = self.fs, self.durable
        folders = set()
        for arr in self.arrays.values():
            if arr.dirty and arr.pending:
                folders |= self._write_chunk(arr, (self._rows - 1) // arr.chunk_rows)
                arr.dirty = False
        if durable:
            fs.sync_dirs(folders)
        for arr in self.arrays.values():
            set_rows(arr.path, self._rows, fs, fsync=durable)
        if durable:
            fs.sync_dirs([a.path for a in self.arrays.values()])
        # ``committed`` moves once commit.json is in place: a reader (or a test waiting to kill
        # the process) that sees it can count on the store holding those steps
        self._write_commit(self._commit_body(self._rows))
        self.committed = self._rows
        if self._first_commit:
            self._committed_first()

    def _commit_body(self, steps: int | None = None) -> dict:
        body = {"steps": self.committed if steps is None else steps, "format": FORMAT,
                "runs": self._runs}
        last = next((r["steps"][1] for r in reversed(self._runs) if r.get("steps")), None)
        if last is not None:
            body["last_step"] = int(last)
        return body

    def _write_commit(self, info: dict) -> None:
        self.fs.write(self.fs.join(self.path, COMMIT), json.dumps(info), fsync=self.durable)
        if self.durable:
            self.fs.sync_dirs([self.path])


def _norm(value):
    """An attribute as JSON gives it back (tuples as lists)."""
    return json.loads(json.dumps(value, default=str)) if value is not None else None


def _dtype_of(meta: dict) -> str:
    return {"bool": "bool", "uint8": "uint8", "int64": "int64", "float64": "float64"}[
        meta["data_type"]]


def _default_key(attrs: dict, significance: bool) -> str:
    """The layout key of a writer not given one: its group's description, which is the same on
    every rank when each records the whole model. A shard group's parameters differ from rank
    to rank: its key is what they share (level, bounds, the mesh), and a group is continued
    only when its attributes equal the writer's anyway (``recorder.py`` passes the key of the
    whole model's layout)."""
    keys = [k for k in _LAYOUT_ATTRS if k not in _UNKEYED]
    desc = {k: attrs.get(k) for k in keys}
    places = attrs.get("placement")
    if places:
        desc = {k: attrs.get(k) for k in ("level", "bounds", "hash_algorithm", "grad_point")}
        desc["mesh"] = sorted({json.dumps(p.get("mesh_shape")) for p in places if p})
    desc["significance"] = bool(significance)
    return layout_key(desc)


# -- reading ---------------------------------------------------------------------------------
#: arrays every rank group holds, whatever its level
_REQUIRED = ("step", "param", "max", "min", "norm")
_BITS = ("direction", "significant")  # packed bits per element, read through RawChunks


#: members of a rank group, in the order a Dataset lists them
_MEMBERS = ("step", "param", "numel", "shape", "offset", "interval", "present", "max", "min",
            "norm", "zeros", "dist", "direction", "significant", "hash", *REPLICA_ARRAYS)
_COORDS = ("param", "numel", "shape", "offset", "interval")
#: coordinate -> the group attribute holding it too (one JSON read gives them all)
_STATIC_ATTRS = {"param": "params", "numel": "numels", "shape": "shapes", "offset": "offsets",
                 "interval": "intervals"}


def open_rank(store: str, rank: int, chunks=None, fs=LOCAL):
    """The committed steps of one rank group of the store's root folder as an xarray Dataset
    (``open_group``)."""
    group_path = fs.join(store, f"rank{int(rank)}")
    if not fs.isdir(group_path):
        flush_live(fs.url(group_path))
        if not fs.isdir(group_path):
            raise GradStoreError(f"{fs.url(store) if fs.remote else store!r} has no group for "
                                 f"rank {rank}; ranks stored: {store_ranks(store, fs)}")
    return open_group(group_path, chunks=chunks, fs=fs, rank=rank)


def open_group(group_path: str, chunks=None, fs=LOCAL, *, rank=None, steps=None):
    """The committed steps of one rank group as an xarray Dataset; ``steps=(first, last)``:
    only those from ``first`` to ``last`` (a segment of a restarted store, ``restarts.py``).
    A group whose files cannot be read as probekit writes them (metadata that is not JSON or
    not Zarr's, a member missing, a file cut short) is a ``GradStoreError`` naming the group
    and what failed (the reader's own error chained to it).

    ``chunks=None`` loads the arrays into memory; ``chunks="auto"`` (or a dict of dim -> size)
    wraps them in dask arrays over the Zarr chunks, so stores larger than memory work.

    Where each array comes from: the static coordinates from the group's attributes; the
    statistics straight from their chunk files (``chunks.read_plain``) or, stored another way,
    through Zarr in one round trip; the sign (and significance) bits through a lazy reader of
    their chunk files (``chunks.RawChunks``); with ``chunks``, dask arrays instead.
    """
    try:
        return _open_group(group_path, chunks, fs, rank, steps)
    except GradStoreError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        where = fs.url(group_path) if fs.remote else group_path
        raise GradStoreError(f"{where}: cannot be read ({type(exc).__name__}: {exc}); the store "
                             "is damaged, or was not written by probekit") from exc


def _open_group(group_path: str, chunks, fs, rank, steps):
    import xarray as xr

    flush_live(fs.url(group_path))  # a recording in this process: its buffered steps first
    n = read_commit(group_path, fs)["steps"]
    # members looked up by path, not by listing the group (the listing would meet commit.json)
    if fs.remote:
        got = fs.read_many([fs.join(group_path, m, "zarr.json") for m in _MEMBERS])
        names = [m for m in _MEMBERS if got[fs.join(group_path, m, "zarr.json")] is not None]
    else:
        names = [m for m in _MEMBERS if os.path.isfile(os.path.join(group_path, m, "zarr.json"))]
    lost = [m for m in _REQUIRED if m not in names]
    if lost:
        raise GradStoreError(f"{fs.url(group_path) if fs.remote else group_path}: no "
                             f"{', '.join(lost)} array (every rank group has {', '.join(_REQUIRED)}"
                             "): the store is damaged (a folder lost or removed, or a partial "
                             "copy)")
    attrs = _group_attrs(group_path, fs)
    arrays = _static_arrays(attrs, names)
    lazy = chunks is not None
    eager = [k for k in names if k not in arrays and k not in _BITS
             and not (lazy and k not in ("step", "hash"))]
    arrays.update(_eager_arrays(group_path, eager, n, fs))
    r0, r1 = 0, n
    if steps is not None:
        r0, r1 = step_rows(arrays["step"][1], *steps)
        for k in eager:
            dims, data = arrays[k]
            arrays[k] = (dims, data[r0:r1])
    if lazy:
        arrays.update(_dask_arrays(group_path, [k for k in names if k not in arrays], n, chunks,
                                   fs, (r0, r1)))
    step_values = arrays["step"][1]
    for name in _BITS:
        if name in names and name not in arrays:
            arrays[name] = _bits(group_path, name, n, step_values, fs, (r0, r1))
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
    if isinstance(attrs.get("replica_check"), dict):  # the replica check's (replicas.py)
        attrs["replica_check"] = json.dumps(attrs["replica_check"])
    if rank is not None:
        attrs["rank"] = int(rank)
    attrs["committed_steps"] = int(r1 - r0)
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
        plain = read_plain(fs.join(group_path, name), n, fs,
                           missing_ok=name in REPLICA_ARRAYS)  # added after earlier rows
        if plain is not None:
            out[name] = plain
    rest = [k for k in names if k not in out]
    if rest:
        _, dims, data = _fetch(group_path, rest, n, fs)
        out.update({k: (dims[k], data[k]) for k in rest})
    return out


def _dask_arrays(group_path: str, names, n: int, chunks, fs=LOCAL, rows=None) -> dict:
    """{name: (dims, a dask array over the Zarr chunks)} for a store larger than memory;
    ``rows``: (r0, r1) of the committed rows, else all ``n``."""
    import dask.array as dsa
    import zarr

    r0, r1 = rows if rows is not None else (0, n)
    group = zarr.open_group(zarr_store(fs, group_path), mode="r", zarr_format=3)
    out = {}
    for name in names:
        arr = group[name]
        dims = tuple(arr.metadata.dimension_names)
        raw = RawChunks.open(fs.join(group_path, name), n, fs) if name in _BITS else None
        if raw is not None:
            raw = raw.window(r0, r1)
            out[name] = (dims, dsa.from_array(raw, chunks=_dask_chunks(arr, dims, chunks),
                                              asarray=False))
        elif dims and dims[0] == "step":
            check_rows(arr.shape[0], n, group_path, name)
            out[name] = (dims, dsa.from_array(arr, chunks=_dask_chunks(arr, dims, chunks))[r0:r1])
        else:
            out[name] = (dims, arr[...])
    return out


def _bits(group_path: str, name: str, n: int, steps, fs=LOCAL, rows=None):
    """A packed bit array (step, byte): read lazily from its chunk files, remembering them for
    the comparison (``chunks.raw_bits``); stored another way, through Zarr. ``rows``: (r0, r1)
    of the committed rows, else all ``n``."""
    r0, r1 = rows if rows is not None else (0, n)
    raw = RawChunks.open(fs.join(group_path, name), n, fs)
    if raw is not None:
        return bits_variable(("step", "byte"), raw.window(r0, r1), steps)
    import zarr

    group = zarr.open_group(zarr_store(fs, group_path), mode="r", zarr_format=3)
    return ("step", "byte"), group[name][r0:r1]


def _group_attrs(group_path: str, fs=LOCAL) -> dict:
    path = fs.join(group_path, "zarr.json")
    return group_attributes(read_json(path, fs), path)


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
    stored = getattr(arr, "shards", None) or arr.chunks  # a shard file, not its inner chunks
    if chunks == "auto" or chunks == {}:
        return stored
    return tuple(chunks.get(d, c) for d, c in zip(dims, stored))


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
