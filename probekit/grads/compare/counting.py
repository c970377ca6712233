"""The comparison's tasks over a plan's slab sets (``planner.py``): read, count, sum.

``count_task(plan, pair, slab set, s0, s1)`` reads, a block of steps at a time, the byte ranges
the slab set needs from each run's rank groups (``chunks.read_rows``: exactly those bytes of each
chunk file, into buffers this thread reuses from block to block: fresh memory costs a page fault
per page) and counts its run sets between them (``kernel.count_runs``). It returns the counts of
its steps for every compared parameter, (3, steps, params) int64: differing bits, differing and
significant in both, significant in both. ``add`` sums the slab sets of the same steps.
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


def add(*parts) -> np.ndarray:
    """The sum of the counts of several slab sets over the same steps."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total
