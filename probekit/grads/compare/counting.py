"""The comparison's tasks over a plan's slab sets (``planner.py``): read, count, sum.

``count_task(plan, pair, slab set, s0, s1)`` reads, a block of steps at a time, the byte ranges
the slab set needs from each run's rank groups (``chunks.read_rows``: exactly those bytes of each
chunk file, into buffers this thread reuses from block to block: fresh memory costs a page fault
per page) and counts its run sets between them (``kernel.count_runs``). It returns the counts of
its steps for every compared parameter, (3, steps, params) int64: differing bits, differing and
significant in both, significant in both. ``add`` sums the slab sets of the same steps.

A reference compared with its test and its controls (``compare.count_stages``): where their
plans agree on the reference's side (``twins``: the same reference rows, slab sets, run sets and
steps, as when the test and the controls were recorded in the same layout), ``count_many`` reads
each block of the reference's bits once and counts it against every other run
(``kernel.count_runs_many``): the same counts as ``count_task`` of each plan.
"""
from __future__ import annotations

import threading

import numpy as np

from ..numerics import kernel
from ..store.chunks import map_rows, read_rows

_TLS = threading.local()


def _buffer(key, nbytes: int) -> np.ndarray:
    bufs = getattr(_TLS, "bufs", None)
    if bufs is None:
        bufs = _TLS.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.size < nbytes:
        buf = bufs[key] = np.empty(max(nbytes, 1), np.uint8)
    return buf


def _read_side(groups: list, reads: np.ndarray, b0: int, b1: int, use_sig: bool,
               side: int) -> list:
    """[(sign rows, significance rows or None)] of each read range of one side, steps b0:b1."""
    n = b1 - b0
    widths = (reads[:, 2] - reads[:, 1]).astype(np.int64)
    offs = np.concatenate([[0], np.cumsum(widths * n)]).astype(np.int64)
    out = []
    kinds = ("direction", "significant") if use_sig else ("direction",)
    bufs = {k: _buffer((side, k), int(offs[-1])) for k in kinds}
    for k, (g, c0, c1) in enumerate(reads):
        group = groups[int(g)]
        rows = group["rows"][b0:b1]
        views = []
        for kind in kinds:
            raw = group[kind]
            view = map_rows(raw, rows, int(c0), int(c1))  # the page cache itself where it can
            if view is None:
                view = bufs[kind][offs[k]:offs[k + 1]].reshape(n, int(widths[k]))
                read_rows(raw, rows, int(c0), int(c1), view)
            views.append(view)
        out.append((views[0], views[1] if use_sig else None))
    return out


def count_task(plan: dict, p: int, s: int, s0: int, s1: int) -> np.ndarray:
    """(3, s1 - s0, params) int64 counts of slab set ``s`` of pair ``p`` over the compared
    steps ``s0:s1``."""
    pair = plan["pairs"][p]
    st = pair["sets"][s]
    ncols = len(pair["common"])
    out = np.zeros((3, s1 - s0, ncols), np.int64)
    use_sig = pair["use_sig"]
    for b0 in range(s0, s1, st["block"]):
        b1 = min(b0 + st["block"], s1)
        side_a = _read_side(pair["sides"][0], st["reads"][0], b0, b1, use_sig, 0)
        side_b = _read_side(pair["sides"][1], st["reads"][1], b0, b1, use_sig, 1)
        part = np.zeros((3, b1 - b0, ncols), np.int64)
        kernel.count_runs(side_a, side_b, st["runs"], b1 - b0, part)
        out[:, b0 - s0:b1 - s0] += part
    return out


def _same_side(ga: list, gb: list) -> bool:
    """Do two plans' lists of one side's rank groups read the same rows of the same arrays?"""
    if len(ga) != len(gb):
        return False
    for x, y in zip(ga, gb):
        if x["rank"] != y["rank"] or not np.array_equal(x["rows"], y["rows"]):
            return False
        for kind in ("direction", "significant"):
            u, v = x[kind], y[kind]
            if (u is None) != (v is None):
                return False
            if u is not None and (u.path != v.path or u.row0 != v.row0 or u.kind != v.kind
                                  or u.shape != v.shape or u.chunk_shape != v.chunk_shape):
                return False
    return True


def twins(first: dict, other: dict) -> list:
    """Per pair of the plan ``first``: can pair ``p`` of ``other`` be counted with it, reading
    their first side's bits once (``count_many``)? Yes where both read the same rows of the
    same arrays on that side, with the same slab sets (read ranges there, run sets, blocks of
    steps), steps, step chunks and compared parameters."""
    out = []
    for p, a in enumerate(first["pairs"]):
        b = other["pairs"][p] if p < len(other["pairs"]) else None
        ok = (b is not None and a["label"] == b["label"] and a["use_sig"] == b["use_sig"]
              and a["common"] == b["common"] and np.array_equal(a["steps"], b["steps"])
              and a["chunks"] == b["chunks"] and len(a["sets"]) == len(b["sets"])
              and _same_side(a["sides"][0], b["sides"][0]))
        if ok:
            ok = all(x["block"] == y["block"] and np.array_equal(x["reads"][0], y["reads"][0])
                     and np.array_equal(x["runs"], y["runs"])
                     for x, y in zip(a["sets"], b["sets"]))
        out.append(bool(ok))
    return out


def count_many(p: int, s: int, s0: int, s1: int, *plans) -> np.ndarray:
    """(len(plans), 3, s1 - s0, params) int64: ``count_task(plan, p, s, s0, s1)`` of each of
    ``plans`` (``twins`` of the first), the first side's bits read once for all of them."""
    pairs = [plan["pairs"][p] for plan in plans]
    st = pairs[0]["sets"][s]
    ncols = len(pairs[0]["common"])
    out = np.zeros((len(plans), 3, s1 - s0, ncols), np.int64)
    use_sig = pairs[0]["use_sig"]
    for b0 in range(s0, s1, st["block"]):
        b1 = min(b0 + st["block"], s1)
        side_a = _read_side(pairs[0]["sides"][0], st["reads"][0], b0, b1, use_sig, 0)
        others = [_read_side(pair["sides"][1], pair["sets"][s]["reads"][1], b0, b1, use_sig,
                             1 + i) for i, pair in enumerate(pairs)]
        part = np.zeros((len(plans), 3, b1 - b0, ncols), np.int64)
        kernel.count_runs_many(side_a, others, st["runs"], b1 - b0, part)
        out[:, :, b0 - s0:b1 - s0] += part
    return out


def add(*parts) -> np.ndarray:
    """The sum of the counts of several slab sets over the same steps."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total
