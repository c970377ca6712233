"""Sampled sign bits: a fixed pseudo-random sample of each parameter's elements, chosen by
global index, and the confidence interval of a similarity measured on it.

``grad_probe.sample = k`` records the sign (and significance) bits of at most ``k`` elements per
parameter instead of all of them (max, min, norm and the L2 counts stay exact, over every
element). The sample is stratified: the parameter's ``N`` elements in C order are cut into ``k``
strata ``[floor(i N / k), floor((i + 1) N / k))`` and stratum ``i`` contributes the element at
``h(shape, i) mod (its size)``, ``h`` a 64-bit integer hash (splitmix64's finaliser) of the
parameter's global shape and ``i``. A deterministic function of (global shape, global index):
no random stream, so every layout (a single process, DDP, FSDP2 shards over any number of
ranks, tensor-parallel blocks), every framework (PyTorch and MindSpore) and every run of the
same model records the same elements, in the order of their global index. A parameter of at
most ``k`` elements is recorded whole. The shape, not the name, seeds the hash, so two runs
whose names differ (a MindSpore run against a PyTorch one) still sample the same elements of
each pair; parameters of one shape share their sample positions.

Where a shard lies in the sample: the strata its box covers, ``samples_in_box`` (the sample
numbers and their positions in the shard's C order: a contiguous run of sample numbers for a
box that is a flat range of the parameter, such as an FSDP2 dim-0 shard; a scattered set for a
tensor-parallel column block). Cost: O(samples in the box's flat span), once per layout.

The interval (``wilson``): the share of equal signs over all ``N`` elements, estimated from the
``n`` sampled ones, with a Wilson score interval (95 %, ``Z``) whose sample size carries the
finite-population correction, ``n_eff = n (N - 1) / (N - n)``: zero width when ``n = N``. The
stratified sample (one element per stratum of equal size) has a variance no larger than a
simple random sample's of the same size, so the interval is conservative.
"""
from __future__ import annotations

import math

import numpy as np

#: two-sided 95 % normal quantile
Z = 1.959963984540054
CONFIDENCE = 0.95

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = np.asarray(x, np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def shape_seed(shape) -> np.uint64:
    """The hash seed of a parameter's global shape."""
    h = _mix(np.array([len(tuple(shape))], np.uint64) + _GOLDEN)[0]
    for d in tuple(shape):
        with np.errstate(over="ignore"):
            h = _mix(np.array([h ^ np.uint64(int(d))], np.uint64) + _GOLDEN)[0]
    return h


def sample_size(numel: int, k: int) -> int:
    """Elements sampled of a parameter of ``numel`` (every one when ``k`` is 0 or larger)."""
    return int(numel) if not k or k >= numel else int(k)


def chosen(shape, k: int, i: np.ndarray) -> np.ndarray:
    """Global flat index of sample ``i`` (int64 array) of a parameter of ``shape``."""
    n = math.prod(tuple(shape))
    i = np.asarray(i, np.int64)
    if not k or k >= n:
        return i
    lo = (i * n) // k
    size = ((i + 1) * n) // k - lo
    off = (_mix(np.uint64(shape_seed(shape)) ^ (i.astype(np.uint64) * _GOLDEN))
           % size.astype(np.uint64)).astype(np.int64)
    return lo + off


def _stratum(g: np.ndarray | int, n: int, k: int):
    """The stratum holding global flat index ``g``."""
    return ((np.asarray(g, np.int64) + 1) * k - 1) // n


def _flat_range(shape, off, ext):
    """(first, last) global flat index of a box, and whether the box is that whole range."""
    shape, off, ext = tuple(shape), tuple(off), tuple(ext)
    if not shape:
        return 0, 0, True
    st = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(o * s for o, s in zip(off, st))
    last = sum((o + e - 1) * s for o, e, s in zip(off, ext, st))
    d0 = next((d for d, e in enumerate(ext) if e > 1), len(shape) - 1)
    flat = all(off[d] == 0 and ext[d] == shape[d] for d in range(d0 + 1, len(shape)))
    return first, last, flat


def samples_in_box(shape, k: int, off, ext) -> tuple[np.ndarray, np.ndarray]:
    """(sample numbers, positions in the box's C order) of the samples of a parameter of
    global ``shape`` that lie in the box ``off``/``ext``, in increasing order of both. Every
    element of the box when the parameter has at most ``k`` elements."""
    shape, off, ext = tuple(int(x) for x in shape), tuple(int(x) for x in off), tuple(
        int(x) for x in ext)
    n = math.prod(shape)
    size = math.prod(ext)
    if size == 0:
        z = np.zeros(0, np.int64)
        return z, z
    if not k or k >= n:
        local = np.arange(size, dtype=np.int64)
        if not shape:
            return local, local
        glob = np.ravel_multi_index(np.unravel_index(local, ext), shape) + np.ravel_multi_index(
            off, shape) if shape else local
        return np.asarray(glob, np.int64), local
    first, last, flat = _flat_range(shape, off, ext)
    i = np.arange(int(_stratum(first, n, k)), int(_stratum(last, n, k)) + 1, dtype=np.int64)
    g = chosen(shape, k, i)
    if flat:
        keep = (g >= first) & (g <= last)
        return i[keep], g[keep] - first
    idx = np.unravel_index(g, shape)
    keep = np.ones(g.size, bool)
    for d in range(len(shape)):
        keep &= (idx[d] >= off[d]) & (idx[d] < off[d] + ext[d])
    local = np.ravel_multi_index(tuple(idx[d][keep] - off[d] for d in range(len(shape))), ext)
    return i[keep], np.asarray(local, np.int64)


def sample_run(shape, k: int, off, ext):
    """(first sample number, count) when the samples of the box are consecutive sample numbers
    (a box that is a flat range of the parameter, or a parameter recorded whole: then the
    numbers are its elements'), else None."""
    shape, off, ext = tuple(shape), tuple(off), tuple(ext)
    n = math.prod(shape)
    if not k or k >= n:
        return None
    first, last, flat = _flat_range(shape, off, ext)
    if not flat:
        return None
    if math.prod(ext) == 0:
        return 0, 0
    lo, hi = int(_stratum(first, n, k)), int(_stratum(last, n, k))
    g = chosen(shape, k, np.array([lo, hi], np.int64))
    start = lo + int(g[0] < first)
    stop = hi + 1 - int(g[1] > last)
    return start, max(0, stop - start)


def wilson(successes, n, population, z: float = Z) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the Wilson score interval of the share ``successes / n`` of a sample of
    ``n`` out of ``population`` (arrays broadcast), with the finite-population correction:
    the sample counts as ``n (N - 1) / (N - n)`` draws (infinitely many when ``n = N``: the
    share itself). NaN where ``n`` is 0."""
    x = np.asarray(successes, np.float64)
    n = np.asarray(n, np.float64)
    big = np.asarray(population, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = x / n
        whole = n >= big
        n_eff = np.where(whole, np.inf, n * (big - 1) / np.maximum(big - n, 1e-300))
        z2 = z * z
        denom = 1 + z2 / n_eff
        centre = (p + z2 / (2 * n_eff)) / denom
        half = z * np.sqrt(p * (1 - p) / n_eff + z2 / (4 * n_eff * n_eff)) / denom
        low = np.where(whole, p, np.clip(centre - half, 0.0, 1.0))
        high = np.where(whole, p, np.clip(centre + half, 0.0, 1.0))
    bad = ~(n > 0)
    return np.where(bad, np.nan, low), np.where(bad, np.nan, high)


def stratified_interval(shares, weights, n, population, z: float = Z):
    """(low, high) of a weighted mean of per-parameter shares (``shares`` (steps, params), each
    from a sample of ``n`` of ``population`` elements, ``weights`` the parameters' sizes,
    0 where a parameter does not count): a Wilson interval whose sample size is the design's
    effective one, ``1 / sum(w_p^2 (1 - f_p) / n_p)`` with ``w_p`` the normalised weights and
    ``f_p = n_p / N_p`` (infinite when every parameter is whole)."""
    w = np.asarray(weights, np.float64)
    tot = w.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        wn = w / tot
        n = np.asarray(n, np.float64)
        big = np.asarray(population, np.float64)
        frac = np.where(n > 0, wn * wn * np.clip(1 - n / big, 0, 1) / n, 0.0)
        var_unit = frac.sum(axis=-1)
        p = np.nansum(np.where(w > 0, wn * shares, 0.0), axis=-1)
        n_eff = np.where(var_unit > 0, 1 / var_unit, np.inf)
        whole = ~(var_unit > 0)
        z2 = z * z
        denom = 1 + z2 / n_eff
        centre = (p + z2 / (2 * n_eff)) / denom
        half = z * np.sqrt(p * (1 - p) / n_eff + z2 / (4 * n_eff * n_eff)) / denom
        low = np.where(whole, p, np.clip(centre - half, 0, 1))
        high = np.where(whole, p, np.clip(centre + half, 0, 1))
    empty = ~(tot[..., 0] > 0)
    return np.where(empty, np.nan, low), np.where(empty, np.nan, high)


def subsample(ds, k: int):
    """A Dataset of a run that recorded every element's bits (``open_grads``), turned into the
    one a run with ``grad_probe.sample = k`` records: each parameter's bits at its sampled
    elements (chosen by its global shape, the ``shape`` coordinate), the ``nbits`` coordinate,
    the ``sample`` attribute. Reads the bits into memory."""
    import ast

    from .stats import padded_nbytes

    numel = np.asarray(ds["numel"].values, np.int64)
    shapes = []
    for text, n in zip(ds["shape"].values, numel):
        value = ast.literal_eval(str(text))
        shape = tuple(int(x) for x in (value if isinstance(value, (tuple, list)) else (value,)))
        shapes.append(shape if math.prod(shape) == n else (int(n),))
    nbits = np.array([sample_size(n, k) for n in numel], np.int64)
    offsets = np.concatenate([[0], np.cumsum([padded_nbytes(int(b)) for b in nbits])[:-1]]
                             ).astype(np.int64) if len(nbits) else np.zeros(0, np.int64)
    width = int(offsets[-1] + padded_nbytes(int(nbits[-1]))) if len(nbits) else 0
    old = np.asarray(ds["offset"].values, np.int64)
    out = ds.drop_vars([v for v in ("direction", "significant") if v in ds])
    for var, fill in (("direction", 0), ("significant", 255)):
        if var not in ds:
            continue
        bits = np.asarray(ds[var].values, np.uint8)
        new = np.full((bits.shape[0], width), fill, np.uint8)
        for j, (shape, n, nb) in enumerate(zip(shapes, numel, nbits)):
            if nb == n:
                size = padded_nbytes(int(n))
                new[:, offsets[j]:offsets[j] + size] = bits[:, old[j]:old[j] + size]
                continue
            pos = chosen(shape, k, np.arange(nb, dtype=np.int64))
            picked = (bits[:, old[j] + (pos >> 3)] >> (7 - (pos & 7)).astype(np.uint8)) & 1
            packed = np.packbits(picked.astype(bool), axis=1)
            new[:, offsets[j]:offsets[j] + packed.shape[1]] = packed
            if fill and nb % 8:  # padding bits of the significance are ones
                new[:, offsets[j] + nb // 8] |= np.uint8(0xFF >> (nb % 8))
        out[var] = (("step", "byte"), new)
    out = out.assign_coords(offset=("param", offsets), nbits=("param", nbits))
    out.attrs = {**ds.attrs, "sample": int(k)}
    return out


def whole_sample(shapes, k: int) -> tuple:
    """(positions of the sampled elements of each whole parameter of ``shapes`` or None where
    every element is recorded, bits recorded per parameter) for ``grad_probe.sample = k``;
    (None, None) when no parameter is sampled (a probe recording whole parameters: MindSpore's,
    and PyTorch's without sharding)."""
    if not k:
        return None, None
    pos, nbits = [], []
    for shape in shapes:
        shape = tuple(int(x) for x in shape)
        n = math.prod(shape)
        if k >= n:
            pos.append(None)
            nbits.append(n)
            continue
        p = chosen(shape, k, np.arange(k, dtype=np.int64))
        pos.append(p)
        nbits.append(int(p.size))
    if all(p is None for p in pos):
        return None, None
    return pos, tuple(nbits)
