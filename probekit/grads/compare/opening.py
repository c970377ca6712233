"""A recorded run as the comparison reads it: its layout segments and rank groups, metadata only.

A run is its store's segments (``restarts.segments``: the step ranges each layout folder's rank
groups hold after restarts and the supersede rule; a store never restarted with another layout
is one segment), each with its rank groups. ``open_group`` reads what the planner
(``planner.py``) needs of one rank group over one segment, and nothing of its bits: its
attributes (the segment already parsed them: names, sizes, placements, where each parameter's
bits lie in a row), the committed rows of its ``step`` and ``present`` arrays that belong to the
segment's steps (a *window* of the group's rows: a group that a later run superseded from some
step on keeps rows the comparison must not read), and the layout of its bit arrays
(``chunks.RawChunks`` over the same window, plain chunk files or shards of steps: where the
count tasks read them). ``open_batch`` does it for a batch of a segment's ranks: one task of the
comparison's graph, so a store of many ranks is opened in parallel. A group whose arrays are
neither plain chunk files nor shards of steps (another writer's layout) gives ``None``: the
comparison then reads the run as Datasets (``sources.load_runs``).
"""
from __future__ import annotations

import contextlib
import gc
import json

import numpy as np

from ..store.chunks import RawChunks
from .planner import boxes

#: rank groups opened per task of the comparison's graph
BATCH = 32


def store_of(source, storage_options=None):
    """(fs, store path) of a probekit store given by path or URL; None for anything the range
    comparison does not read itself (a Dataset, a dict of them, an msprobe dump)."""
    import os

    from ..store import msprobe
    from ..store.restarts import find_store
    from ..store.storage import location

    from ...errors import GradStoreError

    if not isinstance(source, (str, os.PathLike)):
        return None
    fs, path = location(source, storage_options)
    if not fs.remote and (not os.path.isdir(path) or msprobe.is_grad_dump(path)):
        return None
    try:
        store = find_store(path, fs)
    except GradStoreError:  # not a store: the Dataset path says what it is
        return None
    return fs, store


def store_segments(fs, store: str) -> list:
    """``restarts.segments`` of a store (a task of the comparison's graph), the cyclic garbage
    collector held off while every rank group's attributes are parsed."""
    from ..store.restarts import segments

    with gc_held():
        return segments(store, fs=fs)


def shape(segs: list) -> list:
    """[(first step, last step, ranks)] of each segment (what the caller needs to build the
    opening tasks: small, where the segments themselves may stay on a cluster)."""
    return [(s.first_step, s.last_step, s.ranks) for s in segs]


def open_group(fs, seg, rank: int, stats: bool = False) -> dict | None:
    """The metadata of rank group ``rank`` of segment ``seg`` (``restarts.Segment``) over the
    segment's steps (see the module docstring); None when its arrays are stored in a way the
    comparison does not read straight. ``stats``: also its norms, maxima and minima over those
    steps (``"stats"``: ``sources.stat_rows``, what a verdict with a control reads)."""
    from ..store.sources import group_rows, stat_rows

    group = seg.groups[rank]
    attrs = seg.attrs.get(rank) or {}
    if attrs.get("params") is None or attrs.get("numels") is None:
        return None
    got = group_rows(fs, group, seg.first_step, seg.last_step)  # the segment's rows only
    if got is None:
        return None
    n, r0, r1, steps, present = got
    bits = {}
    for name in ("direction", "significant"):
        if fs.isfile(fs.join(group, name, "zarr.json")):
            raw = RawChunks.open(fs.join(group, name), n, fs)
            if raw is None:
                return None
            bits[name] = raw.window(r0, r1)
    placement = attrs.get("placement")
    if isinstance(placement, str):
        placement = json.loads(placement)
    numels = np.asarray(attrs["numels"], np.int64)
    names = [str(x) for x in attrs["params"]]
    shapes = [str(x) for x in attrs.get("shapes") or [f"({int(x)},)" for x in numels]]
    return {
        "rank": int(rank), "steps": steps,
        "stats": stat_rows(fs, group, n, r0, r1) if stats else None, "present": present,
        "names": names, "numels": numels, "shapes": shapes,
        "boxes": boxes(names, numels, shapes, placement, int(attrs.get("sample") or 0),
                       attrs.get("sample_bits")),
        "offsets": (np.asarray(attrs["offsets"], np.int64) if attrs.get("offsets") is not None
                    else None),
        "placement": placement, "level": attrs.get("level"),
        "sample": attrs.get("sample"),
        "nbits": (np.asarray(attrs["sample_bits"], np.int64)
                  if attrs.get("sample_bits") is not None else numels),
        "direction": bits.get("direction"), "significant": bits.get("significant"),
    }


def open_batch(fs, segs: list, index: int, ranks, stats: bool = False) -> list:
    """``open_group`` of each rank of a batch of segment ``segs[index]``'s ranks (one task of
    the comparison's graph). Python's cyclic garbage collector is held off meanwhile: the many
    small containers of the groups' metadata would set off collections of everything alive."""
    seg = segs[index]
    with gc_held():
        return [open_group(fs, seg, r, stats) for r in ranks]


def stat_tables(segs: list, *batches) -> dict | None:
    """``sources.load_stats`` of a store from its opened groups (``open_batch(..., stats=True)``
    of each segment's ranks in order): the same tables, none of its files read again; None
    where ``load_stats`` would not read the store straight (it reads it then)."""
    from ..store.sources import plain_segments, plain_table

    groups = [g for batch in batches for g in batch]
    if not plain_segments(segs) or any(g is None or g["stats"] is None for g in groups):
        return None
    return {g["rank"]: plain_table(segs[0], g["rank"], g["steps"], g["present"], g["stats"])
            for g in groups}


@contextlib.contextmanager
def gc_held():
    """Python's cyclic garbage collector off for the block (on again after, if it was on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def batches(ranks, size: int = BATCH) -> list:
    ranks = list(ranks)
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]
