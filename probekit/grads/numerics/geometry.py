"""Where the elements two runs recorded meet: boxes of a parameter's index space and the runs of
bits they share (the comparison's planner, ``planner.py``).

A recorded piece of a parameter is a box of its global index space (an FSDP2 dim-0 shard, a
tensor-parallel column or row block, an HSDP shard, or the whole parameter), its bits stored in
the box's own C order. Two pieces from two runs share the box where they intersect; in each
piece's bits that box is a set of equal-length *runs*: the intersection's trailing dimensions that
are whole in both pieces are contiguous in both, the leading ones step through them with each
piece's strides. ``runsets`` gives, vectorised over many piece pairs, each intersection as one
row: where its first run starts in each piece (an element offset), the run length and, per
leading dimension, the count and the two strides (``PREFIX`` slots; a dimension of count 1 is a
no-op). The kernel (``kernel.count_runs``) steps through them.

``flat_boxes`` cuts a flat C-order range of a box (a slab of a piece, cut where the planner wants
a task to end or a chunk file to change) into at most ``2 * ndim - 1`` boxes, each itself a
contiguous range of that order, so a slab is handled as pieces of its own.
"""
from __future__ import annotations

import numpy as np

#: leading dimensions a run set steps through (parameters of more dimensions are split first)
PREFIX = 3
#: columns of a run set row: param, a start, b start, run length, then (count, a stride,
#: b stride) per prefix slot
FIELDS = 4 + 3 * PREFIX


def strides(shape) -> np.ndarray:
    """C-order element strides of ``shape`` (int64)."""
    shape = np.asarray(shape, np.int64)
    if shape.size == 0:
        return shape
    return np.concatenate([np.cumprod(shape[::-1])[::-1][1:], [1]]).astype(np.int64)


def flat_boxes(shape, x0: int, x1: int) -> list:
    """[(offset, extent)] boxes covering the flat C-order range ``[x0, x1)`` of an array of
    ``shape``, in order; each box is a contiguous range of that order (fixed leading indices,
    one partial dimension, whole trailing ones)."""
    shape = tuple(int(s) for s in shape)
    if x1 <= x0:
        return []
    if len(shape) <= 1:
        return [((x0,), (x1 - x0,))]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    q0, r0 = divmod(x0, inner)
    q1, r1 = divmod(x1, inner)
    out = []

    def sub(q, a, b):
        for off, ext in flat_boxes(shape[1:], a, b):
            out.append(((q, *off), (1, *ext)))

    if q0 == q1:
        sub(q0, r0, r1)
        return out
    full0 = q0
    if r0:
        sub(q0, r0, inner)
        full0 = q0 + 1
    if q1 > full0:
        out.append(((full0,) + (0,) * (len(shape) - 1), (q1 - full0, *shape[1:])))
    if r1:
        sub(q1, 0, r1)
    return out


def candidate_pairs(oa, la, ob, lb) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j) of boxes ``a[i]``, ``b[j]`` that intersect ((n, ndim) offset and extent
    arrays): candidates by the first dimension through sorted intervals, then every dimension
    checked. Empty boxes meet nothing."""
    na, nb = len(oa), len(ob)
    if na == 0 or nb == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    sa, ea = oa[:, 0], oa[:, 0] + la[:, 0]
    sb, eb = ob[:, 0], ob[:, 0] + lb[:, 0]
    order = np.argsort(sb, kind="stable")
    s_sorted, e_sorted = sb[order], eb[order]
    if np.all(np.diff(e_sorted) >= 0):  # tiled along dim 0 (the usual case): a window each
        lo = np.searchsorted(e_sorted, sa, side="right")
        hi = np.searchsorted(s_sorted, ea, side="left")
        cnt = np.maximum(hi - lo, 0)
        i = np.repeat(np.arange(na), cnt)
        start = np.repeat(lo - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
        j = order[np.arange(i.size) + start]
    else:
        i, j = np.divmod(np.arange(na * nb, dtype=np.int64), nb)
    hit = np.all((np.maximum(oa[i], ob[j]) < np.minimum(oa[i] + la[i], ob[j] + lb[j])), axis=1)
    return i[hit].astype(np.int64), j[hit].astype(np.int64)


def runsets(oa, la, ob, lb, param: np.ndarray) -> np.ndarray:
    """Run sets of intersecting box pairs ((n, ndim) arrays, every pair intersecting, ndim <=
    PREFIX + 1): an (n, FIELDS) int64 array, starts as element offsets into each box's C order."""
    n, nd = oa.shape
    out = np.zeros((n, FIELDS), np.int64)
    if n == 0:
        return out
    lo = np.maximum(oa, ob)
    ext = np.minimum(oa + la, ob + lb) - lo
    sta = np.concatenate([np.cumprod(la[:, ::-1], axis=1)[:, ::-1][:, 1:],
                          np.ones((n, 1), np.int64)], axis=1)
    stb = np.concatenate([np.cumprod(lb[:, ::-1], axis=1)[:, ::-1][:, 1:],
                          np.ones((n, 1), np.int64)], axis=1)
    full = (ext == la) & (ext == lb)
    # m: first dimension of the contiguous suffix (the trailing dims after it are whole in both)
    trail = np.zeros(n, np.int64)
    alive = np.ones(n, bool)
    for d in range(nd - 1, 0, -1):
        alive &= full[:, d]
        trail += alive
    m = nd - 1 - trail
    dims = np.arange(nd)
    in_run = dims[None, :] >= m[:, None]
    out[:, 0] = param
    out[:, 1] = ((lo - oa) * sta).sum(axis=1)
    out[:, 2] = ((lo - ob) * stb).sum(axis=1)
    out[:, 3] = np.where(in_run, ext, 1).prod(axis=1)
    # prefix slots: the dims before m, the innermost last (slot PREFIX-1), unused slots count 1
    for k in range(PREFIX):
        d = m - PREFIX + k  # slot k holds dim d (aligned so the last slot is dim m-1)
        ok = d >= 0
        dd = np.clip(d, 0, nd - 1)
        rows = np.arange(n)
        out[:, 4 + 3 * k] = np.where(ok, ext[rows, dd], 1)
        out[:, 5 + 3 * k] = np.where(ok, sta[rows, dd], 0)
        out[:, 6 + 3 * k] = np.where(ok, stb[rows, dd], 0)
    return out


def runset_span(rs: np.ndarray, side: int) -> np.ndarray:
    """(n, 2) element ranges [first, end) each run set touches in side ``side``'s box (0 = a,
    1 = b): from its start to the end of its last run."""
    start = rs[:, 1 + side]
    last = start.copy()
    for k in range(PREFIX):
        last += (rs[:, 4 + 3 * k] - 1) * rs[:, 5 + 3 * k + side]
    return np.stack([start, last + rs[:, 3]], axis=1)


def expand(rs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every run of the run sets ``rs``: (param, a start, b start, length) arrays (tests and the
    numpy twin)."""
    params, sa, sb, lengths = [], [], [], []
    for row in rs:
        a = np.array([row[1]], np.int64)
        b = np.array([row[2]], np.int64)
        for k in range(PREFIX):
            cnt, da, db = row[4 + 3 * k], row[5 + 3 * k], row[6 + 3 * k]
            step = np.arange(cnt, dtype=np.int64)
            a = (a[:, None] + step[None, :] * da).reshape(-1)
            b = (b[:, None] + step[None, :] * db).reshape(-1)
        params.append(np.full(a.size, row[0], np.int64))
        sa.append(a)
        sb.append(b)
        lengths.append(np.full(a.size, row[3], np.int64))
    if not params:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    return (np.concatenate(params), np.concatenate(sa), np.concatenate(sb),
            np.concatenate(lengths))
