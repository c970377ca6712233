"""A recorded run as the comparison reads it: layout segments of rank groups, metadata only.

A run is a list of *segments*, each covering a range of steps with one layout: a set of rank
groups, each with its parameters (names, sizes, where each one's bits lie in the group's rows),
their placements (which box of the whole parameter a group holds: ``assemble.py`` describes the
``placement`` attribute) and its committed steps. Today a store holds one layout, so a run is one
segment; a store whose layout changes across steps (an elastic restart) gives one segment per
layout, and the planner (``planner.py``) compares each pair of overlapping segments.

``open_group`` reads what the planner needs of one rank group, and nothing of its bits: the
group's ``zarr.json`` attributes, ``commit.json``, the ``step`` and ``present`` arrays (straight
from their chunk files) and the layout of its bit arrays (``chunks.RawChunks``: where the
comparison's tasks read them). ``open_batch`` does it for a batch of ranks: one task of the
comparison's graph, so a store of many ranks is opened in parallel. A group whose arrays are not
plain chunk files (another writer's layout) gives ``None``: the comparison then reads the run as
Datasets (``sources.load_runs``).
"""
from __future__ import annotations

import contextlib
import gc
import json

import numpy as np

from .chunks import RawChunks, read_plain
from .planner import boxes

#: rank groups opened per task of the comparison's graph
BATCH = 32


def store_of(source, storage_options=None):
    """(fs, store path, ranks) of a probekit store given by path or URL; None for anything the
    range comparison does not read itself (a Dataset, a dict of them, an msprobe dump)."""
    import os

    from . import msprobe
    from .storage import location
    from .store import find_store, store_ranks

    from ..errors import GradStoreError

    if not isinstance(source, (str, os.PathLike)):
        return None
    fs, path = location(source, storage_options)
    if not fs.remote and (not os.path.isdir(path) or msprobe.is_grad_dump(path)):
        return None
    try:
        store = find_store(path, fs)
    except GradStoreError:  # not a store: the Dataset path says what it is
        return None
    return fs, store, store_ranks(store, fs)


def open_group(fs, store: str, rank: int) -> dict | None:
    """The metadata of one rank group (see the module docstring); None when its arrays are not
    plain chunk files."""
    from .live import flush_live
    from .store import read_commit

    group = fs.join(store, f"rank{int(rank)}")
    flush_live(fs.url(group))  # a recording in this process: its buffered steps first
    n = read_commit(group, fs)["steps"]
    attrs = dict(json.loads(fs.read(fs.join(group, "zarr.json"))).get("attributes", {}))
    if attrs.get("params") is None or attrs.get("numels") is None:
        return None
    step = read_plain(fs.join(group, "step"), n, fs)
    if step is None:
        return None
    present = read_plain(fs.join(group, "present"), n, fs) if fs.isfile(
        fs.join(group, "present", "zarr.json")) else None
    if present is None and fs.isfile(fs.join(group, "present", "zarr.json")):
        return None
    bits = {}
    for name in ("direction", "significant"):
        if fs.isfile(fs.join(group, name, "zarr.json")):
            raw = RawChunks.open(fs.join(group, name), n, fs)
            if raw is None:
                return None
            bits[name] = raw
    placement = attrs.get("placement")
    if isinstance(placement, str):
        placement = json.loads(placement)
    numels = np.asarray(attrs["numels"], np.int64)
    names = [str(x) for x in attrs["params"]]
    shapes = [str(x) for x in attrs.get("shapes") or [f"({int(x)},)" for x in numels]]
    return {
        "rank": int(rank), "steps": np.asarray(step[1], np.int64),
        "present": None if present is None else np.asarray(present[1], bool),
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


def open_batch(fs, store: str, ranks) -> list:
    """``open_group`` of each rank of a batch (one task of the comparison's graph). Python's
    cyclic garbage collector is held off meanwhile: parsing many groups' attributes makes
    thousands of small containers, each batch of which set off a collection of everything
    alive (measured: 2.1 ms per group's ``zarr.json`` with it, 0.6 ms without)."""
    with gc_held():
        return [open_group(fs, store, r) for r in ranks]


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


def segments(groups: list) -> list:
    """The layout segments of a run from its opened rank groups: [{"steps": None, "groups":
    groups}] (one layout over all its steps; ``None``: every step the groups hold)."""
    return [{"steps": None, "groups": groups}]
