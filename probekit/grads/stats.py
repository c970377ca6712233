"""Per-parameter gradient statistics and packed sign bits for one optimizer step.

What is computed, per parameter (the grad probe's levels):

* ``max``, ``min`` (NaN if the gradient holds a NaN), ``norm`` = L2 norm, squares accumulated in
  float64 across chunks (each chunk's dot product in float32 unless its magnitude could overflow
  or underflow float32 squares; then in float64);
* L0: a digest of the gradient as C-order float32 bytes (msprobe's MD5 definition, so digests
  match msprobe's for the same gradient);
* L1/L2: the direction, ``grad > 0`` per element, packed 8 per byte most significant bit first
  (``numpy.packbits`` order), each parameter padded with zero bits to a 64-bit boundary;
* L2: the share of elements in each interval of ``bounds`` — ``(-inf, b0], (b0, b1], ..., (bn, inf)``
  — and the share of exact zeros. NaN elements fall in no interval.

CPU gradients are processed in chunks that fit in cache, so every statistic of a chunk is computed
while it is hot: the cost stays a small multiple of one read of the gradient bytes. Gradients on
an accelerator are reduced on their device with whole-tensor ops and transferred once per step
(statistics stacked, sign bits packed on the device), without per-statistic ``.item()`` syncs.

Over 400 lines because both paths fill the same ``StepStats`` from the same layout (offsets, the
padded sign bits, intervals); split, each would restate that layout.
"""
from __future__ import annotations

import copy

import hashlib
import math
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

CHUNK = 1 << 18  # elements per cache-resident chunk (1 MiB of float32); a multiple of 64
_F32_SAFE_HI = 2.0 ** 60  # |x| above this: x*x may overflow float32 across a chunk sum
_F32_SAFE_LO = 2.0 ** -50  # |x| below this: x*x underflows float32's normal range


def interval_labels(bounds) -> list[str]:
    """msprobe's labels of the intervals of ``bounds``: ``(-inf, b0]``, ``(b0, b1]``, ``(bn, inf)``."""
    b = [_fmt(x) for x in bounds]
    return [f"(-inf, {b[0]}]", *[f"({lo}, {hi}]" for lo, hi in zip(b, b[1:])], f"({b[-1]}, inf)"]


def _fmt(x) -> str:
    return str(x)


def padded_nbytes(numel: int) -> int:
    """Bytes of a parameter's packed sign bits, padded to a 64-bit boundary."""
    return -(-numel // 64) * 8


@dataclass(frozen=True)
class Layout:
    """Fixed order and byte layout of the monitored parameters."""

    names: tuple
    numels: tuple
    shapes: tuple

    @property
    def offsets(self) -> np.ndarray:
        sizes = np.array([padded_nbytes(n) for n in self.numels], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else sizes

    @property
    def nbytes(self) -> int:
        return int(sum(padded_nbytes(n) for n in self.numels))


def hasher(name: str):
    """A new digest object: ``md5`` (hashlib) or ``xxh3`` (xxh3_128 of the xxhash package)."""
    if name == "md5":
        return hashlib.md5()
    if name == "xxh3":
        try:
            import xxhash
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError("grad_probe hash 'xxh3' needs the xxhash package: "
                              "pip install 'probekit[fast]'") from None
        return xxhash.xxh3_128()
    raise ValueError(f"hash: {name!r} is not valid; accepted: md5, xxh3")


HASH_NBYTES = {"md5": 16, "xxh3": 16}


@dataclass
class StepStats:
    """Statistics of every monitored parameter at one step (arrays indexed by parameter)."""

    present: np.ndarray  # (P,) bool: the parameter had a gradient
    max: np.ndarray  # (P,) float64
    min: np.ndarray
    norm: np.ndarray
    hash: np.ndarray | None = None  # (P, 16) uint8 digest bytes (L0)
    zeros: np.ndarray | None = None  # (P,) float64 share of exact zeros (L2)
    dist: np.ndarray | None = None  # (P, I) float64 share per interval (L2)
    direction: np.ndarray | None = None  # (nbytes,) uint8 packed sign bits (L1/L2)
    #: (nbytes,) uint8 packed bits, same layout: |grad| > SIGNIFICANCE * eps(dtype) * max|grad|
    #: (max over the element's chunk of 2**18): its sign is above the tensor's rounding level
    significant: np.ndarray | None = None


def merge(parts, layout: Layout) -> StepStats:
    """One step's statistics from several partial ones (each parameter from the last part in
    which it is present): the gradients of one training iteration taken at the ``step()`` of
    each optimizer that owns some of the parameters."""
    out = copy.deepcopy(parts[0])
    offsets, numels = layout.offsets, layout.numels
    for part in parts[1:]:
        for i in np.flatnonzero(part.present):
            for name in ("present", "max", "min", "norm", "hash", "zeros", "dist"):
                arr = getattr(out, name)
                if arr is not None:
                    arr[i] = getattr(part, name)[i]
            if out.direction is not None:
                sl = slice(offsets[i], offsets[i] + padded_nbytes(numels[i]))
                out.direction[sl] = part.direction[sl]
                if out.significant is not None and part.significant is not None:
                    out.significant[sl] = part.significant[sl]
    return out


class Workspace:
    """What a probe's statistics reuse from step to step, owned by the probe and closed with it:
    chunk buffers (so chunks allocate nothing), the thread pool a large step is split over
    (created on first need), and per-device constants of the device path."""

    def __init__(self) -> None:
        self.f32 = torch.empty(CHUNK, dtype=torch.float32)
        self.f32_np = self.f32.numpy()
        self.mask = np.empty(CHUNK, dtype=bool)  # sign bits of the chunk
        self.mask2 = np.empty(CHUNK, dtype=bool)  # comparisons for the interval counts
        self.mask3 = np.empty(CHUNK, dtype=bool)  # the significance bits
        self.pool = None
        self.bit_weights: dict = {}  # device -> the packbits weights on it

    def executor(self):
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="probekit-grads")
        return self.pool

    def close(self) -> None:
        """Shut the pool down (its threads end) and drop the device constants."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.bit_weights.clear()



def compute(grads, layout: Layout, level: str, bounds, hash_name: str = "md5",
            scratch: Workspace | None = None, significance: bool = True) -> StepStats:
    """Statistics of ``grads`` (one tensor or None per parameter of ``layout``) at ``level``."""
    p = len(layout.names)
    want_dir = level in ("L1", "L2")
    want_dist = level == "L2"
    out = StepStats(present=np.zeros(p, bool), max=np.full(p, np.nan), min=np.full(p, np.nan),
                    norm=np.full(p, np.nan))
    if level == "L0":
        out.hash = np.zeros((p, HASH_NBYTES[hash_name]), np.uint8)
    if want_dir:
        out.direction = np.zeros(layout.nbytes, np.uint8)
        if significance:
            out.significant = np.full(layout.nbytes, 255, np.uint8)  # padding bits are ones
    if want_dist:
        out.zeros = np.full(p, np.nan)
        out.dist = np.full((p, len(bounds) + 1), np.nan)
    offsets = layout.offsets
    bounds_arr = np.asarray(bounds, dtype=np.float64)
    device_jobs, cpu_jobs = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if g.numel() != layout.numels[i]:
            raise ValueError(f"gradient of {layout.names[i]!r} has {g.numel()} elements; the "
                             f"recording started with {layout.numels[i]}")
        out.present[i] = True
        if g.numel() == 0:
            continue
        span = slice(offsets[i], offsets[i] + padded_nbytes(layout.numels[i]))
        dir_view = ((out.direction[span], out.significant[span] if significance else None)
                    if want_dir else None)
        if g.device.type == "cpu":
            if not g.dtype.is_floating_point:
                raise TypeError(f"gradient of {layout.names[i]!r} has dtype {g.dtype}, not a "
                                "floating-point type")
            cpu_jobs.append((i, g.detach().reshape(-1), dir_view))
        else:
            device_jobs.append((i, g, dir_view))
    if cpu_jobs:
        _cpu_params(cpu_jobs, out, bounds_arr, level, hash_name, scratch)
    if device_jobs:
        _device_params(device_jobs, out, bounds_arr, level, hash_name, scratch)
    if want_dir and significance:
        pad_significance(out, layout)
    return out


def pad_significance(out: StepStats, layout: Layout) -> None:
    """Set the padding bits of the significance to ones (so a store's chunks are mostly 0xFF,
    the fill value, and are not written)."""
    offsets = layout.offsets
    for i in np.flatnonzero(out.present):
        n = layout.numels[i]
        out.significant[offsets[i] + -(-n // 8):offsets[i] + padded_nbytes(n)] = 255
        if n % 8:
            out.significant[offsets[i] + n // 8] |= 0xFF >> (n % 8)


_ROW = 4096
#: an element is significant when |grad| > SIGNIFICANCE * eps(dtype) * max|grad| (max over its
#: chunk): below that its sign is rounding noise of the sums that made it
SIGNIFICANCE = 1.0


def _chunk_sumsq(a: np.ndarray, mx: float, mn: float) -> float:
    """Sum of squares of a chunk: float32 products summed per 4096-element row (a batched
    matmul, about the cost of one dot product) and the rows summed in float64; float64 throughout
    when float32 squares could overflow or underflow."""
    amax = max(abs(mx), abs(mn))
    if a.dtype == np.float32 and (amax > _F32_SAFE_HI or 0 < amax < _F32_SAFE_LO):
        a = a.astype(np.float64)
    k = a.size - a.size % _ROW
    total = 0.0
    if k:
        rows = a[:k].reshape(-1, _ROW)
        total = float((rows[:, None, :] @ rows[:, :, None]).sum(dtype=np.float64))
    if k < a.size:
        rest = a[k:]
        total += float(np.dot(rest, rest))
    return total


def _chunk(part, start, native, level, bounds, dir_view, s: Workspace, digest=None) -> tuple:
    """Statistics of one chunk of a flat gradient: (max, min, sum of squares, ``<= bound``
    counts, zeros, NaNs); its sign and significance bits are packed into ``dir_view`` (a pair
    of views) and ``digest`` updated."""
    m = part.numel()
    eps = torch.finfo(part.dtype).eps
    if native:
        a = part.numpy()
    else:  # float16/bfloat16: widen into the scratch buffer (exact)
        part = s.f32[:m].copy_(part)
        a = s.f32_np[:m]
    lo, hi = torch.aminmax(part)
    mx, mn = float(hi), float(lo)
    sumsq = _chunk_sumsq(a, mx, mn)
    if digest is not None:
        digest.update((a if a.dtype == np.float32 else a.astype(np.float32)).tobytes())
    if dir_view is not None:
        signs, sig = dir_view
        packed = np.packbits(np.greater(a, 0, out=s.mask[:m]))
        signs[start // 8:start // 8 + packed.size] = packed
        if sig is not None:
            thr = SIGNIFICANCE * eps * max(abs(mx), abs(mn))
            big = np.greater(a, thr, out=s.mask2[:m])
            big |= np.less(a, -thr, out=s.mask3[:m])
            sig[start // 8:start // 8 + packed.size] = np.packbits(big)
    counts, zeros, nans = None, 0, 0
    if level == "L2":
        # A bound outside [min, max) of a NaN-free chunk needs no pass over the data, and
        # ``x <= 0`` is the complement of the sign mask just built. Only bounds inside the
        # chunk's range (and the zero count, when 0 is in range) cost a pass.
        counts = np.zeros(len(bounds), np.int64)
        clean = not (math.isnan(mx) or math.isnan(mn))
        if not clean:
            nans = int(np.count_nonzero(np.isnan(a)))
        npos = None
        for k, b in enumerate(bounds):
            if clean and b >= mx:
                counts[k] = m
            elif clean and b < mn:
                continue
            elif clean and b == 0:
                npos = np.count_nonzero(s.mask[:m]) if npos is None else npos
                counts[k] = m - npos
            else:
                counts[k] = np.count_nonzero(np.less_equal(a, b, out=s.mask2[:m]))
        if not (clean and (mn > 0 or mx < 0)):
            zeros = int(np.count_nonzero(np.equal(a, 0, out=s.mask2[:m])))
    return mx, mn, sumsq, counts, zeros, nans


def _run_units(units, jobs, level, bounds, hash_name, s: Workspace | None) -> list:
    """Partial statistics of work units: ``(job, start)`` is one chunk; ``(job, None)`` a whole
    parameter (L0: its digest needs the chunks in order)."""
    s = s or _thread_scratch()
    results = []
    for j, start in units:
        _, flat, dir_view = jobs[j]
        native = flat.dtype in (torch.float32, torch.float64)
        if start is not None:
            results.append((j, _chunk(flat[start:start + CHUNK], start, native, level, bounds,
                                      dir_view, s), None))
            continue
        digest = hasher(hash_name) if level == "L0" else None
        for st in range(0, flat.numel(), CHUNK):
            results.append((j, _chunk(flat[st:st + CHUNK], st, native, level, bounds, dir_view,
                                      s, digest), None))
        results.append((j, None, digest.digest() if digest is not None else None))
    return results


_TLS = threading.local()
_PARALLEL_MIN = 4 * CHUNK  # below this many elements a step is not worth splitting


def _thread_scratch() -> Workspace:
    s = getattr(_TLS, "scratch", None)
    if s is None:
        s = _TLS.scratch = Workspace()
    return s


def _workers(total: int) -> int:
    """Threads for a step: as many as torch may use (the user's setting), at most 4."""
    if total < _PARALLEL_MIN:
        return 1
    return max(1, min(4, torch.get_num_threads(), os.cpu_count() or 1))


def _split(units, sizes, k):
    """``k`` contiguous groups of ``units`` with about equal numbers of elements."""
    target = sum(sizes) / k
    groups, cur, acc = [], [], 0.0
    for u, n in zip(units, sizes):
        cur.append(u)
        acc += n
        if acc >= target * (len(groups) + 1) and len(groups) < k - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    return [g for g in groups if g]


def _cpu_params(jobs, out: StepStats, bounds, level, hash_name, scratch) -> None:
    """Statistics of CPU gradients ``jobs`` = [(param index, flat tensor, sign-bit view)].

    Chunks are independent (each writes its own bytes of the sign bits), so a step is split
    between up to ``torch.get_num_threads()`` threads; numpy and torch release the GIL in the
    loops that matter. L0 keeps each parameter in one thread (its digest reads chunks in order).
    """
    units, sizes = [], []
    for j, (_, flat, _) in enumerate(jobs):
        n = flat.numel()
        if level == "L0":
            units.append((j, None))
            sizes.append(n)
        else:
            for st in range(0, n, CHUNK):
                units.append((j, st))
                sizes.append(min(CHUNK, n - st))
    k = _workers(sum(sizes))
    if k > 1 and len(units) > 1 and scratch is not None:  # the probe's own pool
        futures = [scratch.executor().submit(_run_units, g, jobs, level, bounds, hash_name, None)
                   for g in _split(units, sizes, k)]
        partials = [r for f in futures for r in f.result()]
    else:
        partials = _run_units(units, jobs, level, bounds, hash_name, scratch)
    by_job: dict = {}
    digests = {}
    for j, part, digest in partials:
        if part is None:
            digests[j] = digest
        else:
            by_job.setdefault(j, []).append(part)
    for j, parts in by_job.items():
        i, flat, _ = jobs[j]
        n = flat.numel()
        out.max[i] = np.max([p[0] for p in parts])
        out.min[i] = np.min([p[1] for p in parts])
        out.norm[i] = np.sqrt(sum(p[2] for p in parts))
        if level == "L2":
            counts = np.sum([p[3] for p in parts], axis=0)
            out.zeros[i] = sum(p[4] for p in parts) / n
            out.dist[i] = _interval_shares(counts, sum(p[5] for p in parts), n)
        if j in digests and digests[j] is not None:
            out.hash[i] = np.frombuffer(digests[j], np.uint8)


def _interval_shares(le_counts: np.ndarray, nans: int, n: int) -> np.ndarray:
    """Shares per interval from counts of ``x <= b_k`` (NaN elements are in no interval)."""
    if not n:
        return np.full(len(le_counts) + 1, np.nan)
    inner = np.diff(le_counts, prepend=0)
    return np.concatenate([inner, [n - nans - le_counts[-1]]]).astype(np.float64) / n


def _device_params(jobs, out: StepStats, bounds, level, hash_name, scratch=None) -> None:
    """Whole-tensor reductions on the gradients' device; one transfer for all statistics."""
    rows, packed = [], []
    weights = scratch.bit_weights if scratch is not None else {}
    for i, g, dir_view in jobs:
        flat = g.detach().reshape(-1)
        n = flat.numel()
        wide = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
        mn, mx = torch.aminmax(wide)
        vals = [mx.double(), mn.double(), torch.linalg.vector_norm(wide, dtype=torch.float64)]
        if level == "L2":
            vals += [(wide <= float(b)).sum().double() for b in bounds]
            vals.append((wide == 0).sum().double())
            vals.append(torch.isnan(wide).sum().double())
        rows.append(torch.stack(vals))
        if dir_view is not None:
            key = flat.device
            if key not in weights:
                weights[key] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8,
                                            device=flat.device)
            masks = [flat > 0]
            if dir_view[1] is not None:
                thr = SIGNIFICANCE * torch.finfo(flat.dtype).eps * torch.maximum(mx.abs(),
                                                                                  mn.abs())
                masks.append(wide.abs() > thr)
            for mask in masks:
                bits = torch.zeros(dir_view[0].size * 8, dtype=torch.uint8, device=flat.device)
                bits[:n] = mask
                packed.append((bits.view(-1, 8) * weights[key]).sum(1, dtype=torch.uint8))
        if level == "L0":  # the digest needs the bytes on the host, as msprobe's does
            digest = hasher(hash_name)
            digest.update(wide.float().cpu().numpy().tobytes())
            out.hash[i] = np.frombuffer(digest.digest(), np.uint8)
    host = torch.stack(rows).cpu().numpy()
    host_bits = torch.cat(packed).cpu().numpy() if packed else None
    pos = 0
    for r, (i, g, dir_view) in enumerate(jobs):
        n = g.numel()
        out.max[i], out.min[i], out.norm[i] = host[r, 0], host[r, 1], host[r, 2]
        if level == "L2":
            counts = host[r, 3:3 + len(bounds)].astype(np.int64)
            out.dist[i] = _interval_shares(counts, int(host[r, -1]), n)
            out.zeros[i] = host[r, -2] / n if n else np.nan
        if dir_view is not None:
            for view in (v for v in dir_view if v is not None):
                view[:] = host_bits[pos:pos + view.size]
                pos += view.size
