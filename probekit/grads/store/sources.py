"""Turn what a user hands over (a path or a Dataset) into {rank: Dataset} for the grad probe.

A path may be a probekit dump folder (holding ``grads.zarr``), the ``grads.zarr`` store itself,
an fsspec URL of either (``storage.py``), or an msprobe grad dump folder
(``rank{r}/grad_summary_{step}.csv`` + ``step{s}/*.npy``).

A probekit store is read segment by segment (``restarts.py``: the step ranges each layout's
rank groups hold after restarts): each segment's groups over its steps, a sharded segment's
shards assembled (``assemble.py``), and the segments of each rank joined along ``step``.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ...log import get_logger
from . import msprobe
from .assemble import assemble_runs
from .chunks import JoinedBits, bit_reader, bits_variable
from .restarts import Segment, segments
from .storage import location
from .store import GradStoreError, open_group

_BITS = ("direction", "significant")

log = get_logger(__name__)


def _is_dataset(obj) -> bool:
    return type(obj).__name__ == "Dataset" and hasattr(obj, "data_vars")


def load_runs(source, *, chunks=None, storage_options=None, shards: bool = False) -> dict:
    """{rank: Dataset} for a path or URL, a Dataset or a dict of Datasets.

    A run recorded shard by shard (FSDP2, tensor parallel: rank groups with a ``placement``)
    comes back assembled: one Dataset of full parameters, under the lowest rank that recorded a
    shard (``assemble.py``); ``shards=True`` gives each rank's shards as recorded instead. A
    store restarted with another layout (an elastic restart at another world size) is read
    segment by segment and joined along ``step`` (``restarts.py``)."""
    if _is_dataset(source):
        return {int(source.attrs.get("rank", 0)): source}
    if isinstance(source, dict):
        return {int(r): ds for r, ds in source.items()}
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"grad run: {type(source).__name__} is not valid; accepted: a path or "
                        "URL of a probekit or msprobe dump, or an xarray Dataset from open_grads")
    fs, path = location(source, storage_options)
    if not fs.remote and not os.path.isdir(path):
        raise GradStoreError(f"grad run: {path!r} is not a folder")
    if not fs.remote and msprobe.is_grad_dump(path):
        runs = {r: msprobe.read_grad_dump(path, r) for r in msprobe.grad_dump_ranks(path)}
    else:
        runs = read_segments(segments(path, fs=fs, shards=shards), fs, chunks=chunks,
                             shards=shards)
    for ds in runs.values():
        _count_no_grad(ds)
    return runs


#: the statistics the verdict of a comparison with a control reads of each run
STAT_MEMBERS = ("present", "norm", "max", "min")


def load_stats(source, *, storage_options=None) -> dict:
    """{rank: table} of the statistics a comparison's verdict reads (``verdict._stats``), a
    table being a plain dict: ``step`` (int64, steps), ``param`` (names as recorded), ``norm``,
    ``max``, ``min`` (float64, step x param), ``present`` (bool, step x param, or None: every
    parameter had a gradient) and ``attrs`` (the run's attributes). For a probekit store of
    one unsharded segment, read straight from their chunk files (a few small reads per rank);
    anything else (an msprobe dump, a sharded or restarted store, arrays stored another way)
    as ``load_runs`` reads it, then taken from its Datasets, as are Datasets handed over.
    ``{rank: table}`` passes through as it is. The same values either way."""
    if isinstance(source, dict) and all(_is_table(t) for t in source.values()):
        return source
    if isinstance(source, (str, os.PathLike)):
        fs, path = location(source, storage_options)
        if fs.remote or (os.path.isdir(path) and not msprobe.is_grad_dump(path)):
            try:
                got = _plain_stats(segments(path, fs=fs), fs)
            except GradStoreError:
                got = None       # not a store: load_runs says what it is
            if got is not None:
                return got
    runs = load_runs(source, storage_options=storage_options)
    return {r: stat_table(ds) for r, ds in runs.items()}


def _is_table(obj) -> bool:
    return isinstance(obj, dict) and "norm" in obj and "param" in obj


def stat_table(ds) -> dict:
    """``load_stats``' table of one Dataset."""
    var = ds.variables

    def values(name, dtype):
        return np.asarray(var[name].transpose("step", "param").values, dtype)

    return {"step": np.asarray(var["step"].values, np.int64),
            "param": [str(p) for p in var["param"].values],
            "norm": values("norm", np.float64), "max": values("max", np.float64),
            "min": values("min", np.float64),
            "present": values("present", bool) if "present" in var else None,
            "attrs": dict(ds.attrs)}


def _plain_stats(segs: list, fs):
    """``load_stats`` of one unsharded segment's groups, or None for any other store."""
    if not plain_segments(segs):
        return None
    seg = segs[0]
    out = {}
    for rank in seg.ranks:
        group = seg.groups[rank]
        got = group_rows(fs, group, seg.first_step, seg.last_step)
        rows = None if got is None else stat_rows(fs, group, *got[:3])
        if rows is None:
            return None
        out[int(rank)] = plain_table(seg, rank, got[3], got[4], rows)
    return out


def group_rows(fs, group: str, first: int, last: int):
    """What a reader takes first of a rank group over a segment's steps ``first..last``: (its
    committed rows ``n``, the segment's rows ``r0``, ``r1``, their steps, their ``present``
    rows, or None where the group stores none: every parameter had a gradient), read straight
    from the chunk files; None where ``step`` or ``present`` is stored another way."""
    from .chunks import read_plain
    from .restarts import read_commit, step_rows

    n = read_commit(group, fs)["steps"]
    step = read_plain(fs.join(group, "step"), n, fs)
    if step is None:
        return None
    steps = np.asarray(step[1], np.int64)
    r0, r1 = step_rows(steps, first, last)
    present = None
    if fs.isfile(fs.join(group, "present", "zarr.json")):
        got = read_plain(fs.join(group, "present"), n, fs)
        if got is None:
            return None
        present = np.asarray(got[1][r0:r1], bool)
    return n, r0, r1, steps[r0:r1], present


def plain_segments(segs: list) -> bool:
    """Are these a store's segments that ``load_stats`` reads straight: one segment of
    unsharded rank groups that name their parameters?"""
    return len(segs) == 1 and not segs[0].sharded and all(
        (segs[0].attrs.get(r) or {}).get("params") is not None
        and (segs[0].attrs.get(r) or {}).get("placement") is None for r in segs[0].ranks)


def stat_rows(fs, group: str, n: int, r0: int, r1: int):
    """{"norm", "max", "min"}: rows ``r0:r1`` of a rank group's statistics (``n`` committed) as
    float64; None where one is stored another way."""
    from .chunks import read_plain

    out = {}
    for name in STAT_MEMBERS[1:]:
        got = read_plain(fs.join(group, name), n, fs)
        if got is None or tuple(got[0]) != ("step", "param"):
            return None
        out[name] = np.asarray(got[1][r0:r1], np.float64)
    return out


def plain_table(seg, rank: int, steps, present, rows: dict) -> dict:
    """``load_stats``' table of rank group ``rank`` of a plain segment (``plain_segments``):
    its steps, ``present`` rows (None: none stored) and statistic rows (``stat_rows``)."""
    attrs = dict(seg.attrs.get(rank) or {})
    attrs["rank"] = int(rank)
    return {"step": np.asarray(steps, np.int64), "param": [str(x) for x in attrs["params"]],
            "present": None if present is None else np.asarray(present, bool), **rows,
            "attrs": attrs}


def without_grad(ds) -> list[str]:
    """The parameters of ``ds`` that have no gradient at any of its steps (none when it has no
    step): frozen ones, ones the backward pass never reached."""
    if "present" not in ds.data_vars or not ds.sizes.get("step", 0):
        return []
    present = ds.variables["present"]   # a Variable: no DataArray built for one reduction
    had = np.asarray(present.values, bool).any(axis=present.dims.index("step"))
    return [str(name) for name, h in zip(ds.variables["param"].values, had) if not h]


def _count_no_grad(ds):
    """Note in ``ds.attrs["no_grad"]`` how many parameters never had a gradient."""
    ds.attrs["no_grad"] = len(without_grad(ds))
    return ds


def read_segments(segs: list, fs, *, chunks=None, shards: bool = False) -> dict:
    """{rank: Dataset} of the segments ``segs`` (``restarts.segments``): each segment's groups
    over its steps (sharded ones assembled unless ``shards``), each rank's segments joined."""
    parts: dict = {}
    for seg in segs:
        runs = {r: open_group(seg.groups[r], chunks=chunks, fs=fs, rank=r,
                              steps=(seg.first_step, seg.last_step)) for r in seg.ranks}
        if not shards:
            runs = assemble_runs(runs)
        for label, ds in runs.items():
            parts.setdefault(label, []).append((seg, ds))
    return {label: join_steps(items) for label, items in sorted(parts.items())}


def join_steps(items: list):
    """One Dataset from the Datasets of consecutive segments ``[(Segment, Dataset)]`` of one
    rank: statistics concatenated along ``step``, sign bits read part by part (``JoinedBits``);
    an error naming the segments when their parameters differ."""
    import xarray as xr

    items = [(s, d) for s, d in items if d.sizes.get("step", 0)] or items[:1]
    if len(items) == 1:
        return items[0][1]
    dss = [d for _, d in items]
    where = "; ".join(f"steps {s.first_step}..{s.last_step}: {len(s.groups)} rank group(s) in "
                      f"{os.path.basename(s.folder.rstrip('/'))}" for s, _ in items)
    first = dss[0]
    for ds in dss[1:]:
        if (ds["param"].values.tolist() != first["param"].values.tolist()
                or ds["numel"].values.tolist() != first["numel"].values.tolist()
                or ds.attrs.get("placement") != first.attrs.get("placement")):
            raise GradStoreError(
                f"the store's segments record different parameters or shards ({where}); they "
                "cannot be read as one run: read one segment at a time "
                "(probekit.grads.segments lists them; open_grads(..., segment=i))")
    common = [v for v in first.data_vars if all(v in d.data_vars for d in dss)]
    dropped = sorted({v for d in dss for v in d.data_vars} - set(common))
    lazy_bits = [v for v in _BITS if v in common and not _is_dask(first[v])]
    rest = [d[[v for v in common if v not in lazy_bits]] for d in dss]
    out = xr.concat(rest, dim="step", data_vars="all", coords="minimal", compat="equals",
                    join="exact", combine_attrs="override")
    for var in lazy_bits:
        joined = JoinedBits([bit_reader(d, var) for d in dss])
        out[var] = bits_variable(("step", "byte"), joined, out["step"].values)
    attrs = dict(dss[-1].attrs)
    attrs["committed_steps"] = int(out.sizes["step"])
    attrs["segments"] = json.dumps([{"first_step": s.first_step, "last_step": s.last_step,
                                     "ranks": s.ranks} for s, _ in items])
    if dropped:
        attrs["dropped_variables"] = dropped  # recorded in some segments only
    out.attrs = attrs
    return out[[v for v in first.data_vars if v in common]]


def _is_dask(da) -> bool:
    return type(da.variable._data).__module__.startswith("dask")


def open_grads(path, rank=None, chunks=None, *, storage_options=None, shards: bool = False,
               segment: int | None = None):
    """One rank of a recorded run as an xarray Dataset (committed steps only).

    ``path``: a dump folder with ``grads.zarr``, the store itself, an msprobe grad dump, or an
    fsspec URL of a store (``s3://bucket/run``, ``gs://...``, ``memory://...``; credentials from
    the usual ``AWS_*`` variables or ``storage_options``). ``rank``: needed when several ranks
    were recorded. ``chunks="auto"``: dask arrays over the Zarr chunks (lazy; for stores larger
    than memory) instead of loading into memory.

    A sharded run (FSDP2, tensor parallel) is assembled: full-parameter statistics and sign
    bits, as a single process would have recorded them, over the steps every rank holding a
    shard committed; ``shards=True`` opens one rank's shards as recorded. A restarted run is
    read over all its segments (``restarts.py``); ``segment=i`` reads only the i-th of
    ``probekit.grads.segments(path)``.

    Variables: ``max``, ``min``, ``norm`` (step, param), ``present`` (step, param), ``hash``
    (L0), ``zeros`` and ``dist`` (step, param, interval) (L2), ``direction`` (step, byte) packed
    sign bits (L1/L2); coordinates ``step``, ``param``, ``numel``, ``shape``, ``offset``,
    ``interval``. The attribute ``no_grad`` counts the parameters that have no gradient at any
    step (a WARNING says so when that is all of them: an empty recording).
    """
    ds = _open(path, rank, chunks, storage_options, shards, segment)
    _count_no_grad(ds)
    n, steps = ds.sizes.get("param", 0), ds.sizes.get("step", 0)
    if steps and n and ds.attrs["no_grad"] == n:
        log.warning("grad run %s: none of its %d parameters has a gradient at any of its %d "
                    "steps: the recording is empty (frozen parameters, or a backward pass that "
                    "did not reach them)", path if isinstance(path, str) else os.fspath(path),
                    n, steps)
    return ds


def _open(path, rank, chunks, storage_options, shards, segment):
    label = path if isinstance(path, str) else os.fspath(path)
    fs, where = location(path, storage_options)
    if not fs.remote and os.path.isdir(where) and msprobe.is_grad_dump(where):
        runs = {r: msprobe.read_grad_dump(where, r) for r in msprobe.grad_dump_ranks(where)}
    else:
        segs = segments(where, fs=fs, shards=shards)
        if segment is not None:
            if not isinstance(segment, int) or not -len(segs) <= segment < len(segs):
                raise GradStoreError(f"segment: {segment!r} is not valid for {label!r}; "
                                     f"accepted: 0..{len(segs) - 1} (segments(path) lists them)")
            segs = [segs[segment]]
        if rank is not None and not shards:
            mine = [s for s in segs if rank in s.groups]
            if mine and not any(s.sharded for s in mine):  # a rank's own record: read it alone
                segs = [_only(s, rank) for s in mine]
        elif rank is not None:
            segs = [_only(s, rank) for s in segs if rank in s.groups] or segs
        runs = read_segments(segs, fs, chunks=chunks, shards=shards)
    ranks = sorted(runs)
    if rank is None:
        if len(ranks) != 1:
            raise GradStoreError(f"{label!r} holds ranks {ranks}; pass rank= one of them")
        rank = ranks[0]
    if rank not in runs:
        raise GradStoreError(f"rank: {rank!r} is not valid for {label!r}; accepted: {ranks}"
                             + ("" if shards else " (shards=True opens each rank's shards)"))
    return runs[rank]


def _only(seg: Segment, rank: int) -> Segment:
    return Segment(seg.first_step, seg.last_step, seg.folder, {rank: seg.groups[rank]},
                   {rank: seg.placements.get(rank)}, {rank: seg.attrs.get(rank)}, seg.sharded,
                   seg.layout_key)
