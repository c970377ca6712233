"""Per-parameter gradient statistics and packed sign bits for one optimizer step.

What is computed, per parameter (the grad probe's levels):

* ``max``, ``min`` (NaN if the gradient holds a NaN), ``norm`` = L2 norm, squares accumulated in
  float64;
* L0: a digest of the gradient as C-order float32 bytes (msprobe's MD5 definition, so digests
  match msprobe's for the same gradient);
* L1/L2: the direction, ``grad > 0`` per element, packed 8 per byte most significant bit first
  (``numpy.packbits`` order), each parameter padded with zero bits to a 64-bit boundary; and
  (``significance``, on by default) the significance bits in the same layout: ``|grad| >
  significance_unit(dtype) * M``, ``M`` the largest finite ``|grad|`` over the gradients of the
  parameter's module (``Layout.modules``);
* L2: the share of elements in each interval of ``bounds`` — ``(-inf, b0], (b0, b1], ..., (bn, inf)``
  — and the share of exact zeros. NaN elements fall in no interval.

CPU gradients go through the fused kernel (``kernel.py``) a chunk of ``CHUNK`` elements at a
time, each chunk read once from memory (``_CpuParams``); gradients on an accelerator are reduced
on their device with whole-tensor ops and transferred in two pieces per step (the maxima, then
the rest), without per-statistic ``.item()`` syncs (``_DeviceParams``).

Over 400 lines because both paths fill the same ``StepStats`` from the same layout (offsets, the
padded bits, intervals, the significance rule); split, each would restate that layout.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import kernel

CHUNK = 1 << 18  # elements per cache-resident chunk (1 MiB of float32); a multiple of 64


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
    """Fixed order and byte layout of the monitored parameters. ``nbits``: the bits recorded
    per parameter when they are not one per element (``sampling.py``: a sample of each)."""

    names: tuple
    numels: tuple
    shapes: tuple
    nbits: tuple | None = None

    @property
    def bits(self) -> tuple:
        """Sign bits recorded per parameter (its elements, or its sample)."""
        return self.numels if self.nbits is None else self.nbits

    @property
    def offsets(self) -> np.ndarray:
        sizes = np.array([padded_nbytes(n) for n in self.bits], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else sizes

    @property
    def nbytes(self) -> int:
        return int(sum(padded_nbytes(n) for n in self.bits))

    @functools.cached_property
    def modules(self) -> np.ndarray:
        """Per parameter, the index of its module (the name without its last component:
        ``enc.key.weight`` and ``enc.key.bias`` share one; a parameter of the root module,
        ``cls_token``, is alone), the significance rule's scale."""
        index: dict = {}
        keys = [n.rpartition(".")[0] if "." in n else ("root", n) for n in self.names]
        return np.array([index.setdefault(k, len(index)) for k in keys], np.int64)


def hasher(name: str):
    """A new digest object: ``md5`` (hashlib) or ``xxh3`` (xxh3_128 of the xxhash package)."""
    if name == "md5":
        return hashlib.md5()
    if name == "xxh3":
        try:
            import xxhash
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError("grad_probe hash 'xxh3' needs the xxhash package: "
                              "pip install xxhash (probekit's 'fast' extra)") from None
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
    #: (nbytes,) uint8 packed bits, same layout: |grad| > significance_unit * its module's
    #: largest |grad| (``compute``): its sign is above the rounding level of the gradients
    significant: np.ndarray | None = None
    #: the replica check (``grads/record/replicas.py``), where the run checks it: (P,) uint8
    #: code (0 not checked, 1 agree, | 2 the gradients differ, | 4 the parameters differ), the
    #: lowest rank whose digest differs (-1: none), the relative max/min gap (NaN: none)
    replicas: np.ndarray | None = None
    replica_rank: np.ndarray | None = None
    replica_gap: np.ndarray | None = None


def merge(parts, layout: Layout) -> StepStats:
    """One step's statistics from several partial ones (each parameter from the last part in
    which it is present): the gradients of one training iteration taken at the ``step()`` of
    each optimizer that owns some of the parameters."""
    out = copy.deepcopy(parts[0])
    offsets, numels = layout.offsets, layout.bits
    for part in parts[1:]:
        if part.replicas is not None:  # checked where its optimizer stepped
            if out.replicas is None:
                out.replicas, out.replica_rank, out.replica_gap = (
                    part.replicas.copy(), part.replica_rank.copy(), part.replica_gap.copy())
            else:
                on = part.replicas > 0
                out.replicas[on] = part.replicas[on]
                out.replica_rank[on] = part.replica_rank[on]
                out.replica_gap[on] = part.replica_gap[on]
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
        self.cand = np.empty(_CpuParams.CAND, np.int32)  # a chunk's listed elements
        self.pool = None
        self.bit_weights: dict = {}  # device -> the packbits weights on it
        self.hints: dict = {}  # layout -> the last step's significance scales (provisional)
        self.sample_index: dict = {}  # (sample positions, device) -> them as a device tensor

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
        self.hints.clear()
        self.sample_index.clear()



def compute(grads, layout: Layout, level: str, bounds, hash_name: str = "md5",
            scratch: Workspace | None = None, significance: bool = True,
            reduce_amax=None, compute_dtype=None, _device_path: bool = False,
            sample=None) -> StepStats:
    """Statistics of ``grads`` (one tensor or None per parameter of ``layout``) at ``level``.

    ``sample`` (L1/L2): per parameter None (a bit per element) or the sorted positions (int64,
    in the gradient's C order) of the elements whose bits are recorded (``sampling.py``;
    ``layout.nbits`` gives their number): max, min, norm and the counts stay over every element;
    the sampled elements' values are gathered and their bits taken against the same threshold.

    Significance (``significance``, L1/L2): an element is significant when ``|g| >
    significance_unit(dtype) * M``, ``M`` the largest finite ``|g|`` over the gradients of its
    module (``Layout.modules``) at this step; ``compute_dtype``: the dtype the gradients were
    computed in when it is less precise than theirs (autocast). ``reduce_amax``, for shards of
    gradients (DTensor): a function from a float64 tensor of this rank's maxima, one per
    parameter of ``layout`` (0 where it has none), to the whole gradients' maxima; called
    exactly once (a collective: every rank holding shards calls it at the same step)."""
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
    offsets, nbits = layout.offsets, layout.bits
    bounds_arr = np.asarray(bounds, dtype=np.float64)
    device_jobs, cpu_jobs, sampled = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if g.numel() != layout.numels[i]:
            raise ValueError(f"gradient of {layout.names[i]!r} has {g.numel()} elements; the "
                             f"recording started with {layout.numels[i]}")
        if not g.dtype.is_floating_point:
            raise TypeError(f"gradient of {layout.names[i]!r} has dtype {g.dtype}, not a "
                            "floating-point type")
        out.present[i] = True
        if g.numel() == 0:
            continue
        span = slice(offsets[i], offsets[i] + padded_nbytes(nbits[i]))
        dir_view = ((out.direction[span], out.significant[span] if significance else None)
                    if want_dir else None)
        idx = sample[i] if sample is not None and want_dir else None
        if idx is not None:  # the bits of the sampled elements only, once the thresholds are
            sampled.append((i, g, idx, dir_view))  # known; the statistics over every element
            dir_view = None
        if g.device.type == "cpu" and not _device_path:  # (_device_path: the tests' switch)
            cpu_jobs.append((i, g.detach().reshape(-1), dir_view))
        else:
            device_jobs.append((i, g, dir_view))
    job = _Job(out, bounds_arr, level, hash_name, layout.modules, significance and want_dir)
    if want_dir:
        job.bases = (kernel._ptr(out.direction), kernel._ptr(out.significant) or 0)
        job.offsets = offsets.tolist()
    if job.significance:
        job.unit = np.array([significance_unit(g.dtype, compute_dtype) if g is not None else 0.0
                             for g in grads])
    hints = scratch.hints.get(layout) if scratch is not None else None
    cpu = _CpuParams(cpu_jobs, job, scratch, hints) if cpu_jobs else None
    dev = _DeviceParams(device_jobs, job, scratch) if device_jobs else None
    local = np.zeros(p)  # every gradient's largest finite |x|
    if cpu is not None:
        cpu.run()
        local[[i for i, _, _ in cpu_jobs]] = cpu.amax
    if dev is not None:
        local[[i for i, _, _ in device_jobs]] = dev.first_pass()
    if job.significance:  # the thresholds need every module's scale (the shards': reduced)
        if reduce_amax is not None:
            anchor = device_jobs[0][1].device if device_jobs else "cpu"
            local = reduce_amax(torch.from_numpy(local).to(anchor)).cpu().numpy()
        scale = job.scales(local, out.present)
        thresholds = job.unit * scale
        if cpu is not None:
            cpu.mend(thresholds)
        if scratch is not None:
            scratch.hints[layout] = scale  # the next step's provisional scale
    else:
        thresholds = np.zeros(p)
    if cpu is not None:
        cpu.finish()
    if dev is not None:
        dev.second_pass(thresholds)
    for i, g, idx, views in sampled:
        _sampled_bits(g, idx, thresholds[i], views, scratch)
    if want_dir and significance:
        pad_significance(out, layout)
    return out


def _sampled_bits(g, idx: np.ndarray, thr: float, views, scratch) -> None:
    """Sign and significance bits of the elements ``idx`` of gradient ``g`` (gathered on its
    device; compared as the chunk kernel compares: 16-bit values widened to float32)."""
    if not idx.size:
        return
    flat = g.detach().reshape(-1)
    key = (id(idx), str(flat.device))
    cache = scratch.sample_index if scratch is not None else {}
    pos = cache.get(key)
    if pos is None or pos[0] is not idx:
        pos = cache[key] = (idx, torch.from_numpy(idx).to(flat.device))
    v = flat.index_select(0, pos[1])
    if v.dtype not in (torch.float32, torch.float64):
        v = v.float()
    a = v.cpu().numpy()
    k = -(-idx.size // 8)
    views[0][:k] = np.packbits(a > 0)
    if views[1] is not None:
        t = a.dtype.type(thr)
        views[1][:k] = np.packbits((a > t) | (a < -t))


def pad_significance(out: StepStats, layout: Layout) -> None:
    """Set the padding bits of the significance to ones (so a store's chunks are mostly 0xFF,
    the fill value, and are not written)."""
    offsets = layout.offsets
    for i in np.flatnonzero(out.present):
        n = layout.bits[i]
        out.significant[offsets[i] + -(-n // 8):offsets[i] + padded_nbytes(n)] = 255
        if n % 8:
            out.significant[offsets[i] + n // 8] |= 0xFF >> (n % 8)


#: The significance rule's factor by the bits of the dtype a gradient was computed in: an
#: element is significant when |g| > SIGNIFICANCE[bits] * eps(dtype) * M, M the largest finite
#: |g| over its module's gradients. A mathematically zero gradient (the key bias of an
#: attention layer: softmax ignores it) is left with rounding noise of the sums that made it:
#: measured on BERT and ViT (docs/DESIGN.md) up to 3.2 eps * M in fp32/fp64, summed in their
#: own precision, and up to 0.7 eps * M in bf16 (autocast: 0.54 bf16 eps), where the kernels
#: accumulate in fp32 and the noise is the 16-bit rounding of the terms; real gradients'
#: maxima were >= 0.11 M. So 8 eps for 32/64-bit sums, and a 16-bit dtype's own eps (its
#: rounding level: a larger factor would hide the sign changes bf16 really causes).
SIGNIFICANCE = {16: 1.0, 32: 8.0, 64: 8.0}


def significance_unit(dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> float:
    """``SIGNIFICANCE[bits] * eps`` of the less precise of ``dtype`` and ``compute_dtype``."""
    if compute_dtype is not None and (torch.finfo(compute_dtype).eps
                                      > torch.finfo(dtype).eps):
        dtype = compute_dtype
    return SIGNIFICANCE[torch.finfo(dtype).bits] * float(torch.finfo(dtype).eps)


def finite_amax(g: torch.Tensor) -> float:
    """The largest finite |x| of a CPU gradient (the first pass of ``compute``, on its own)."""
    flat = g.detach().reshape(-1)
    top = 0.0
    for st in range(0, flat.numel(), CHUNK):
        part = flat[st:st + CHUNK]
        if part.dtype not in (torch.float32, torch.float64):
            part = part.float()
        top = max(top, kernel.minmax(part.numpy())[2])
    return top


@dataclass
class _Job:
    """What one ``compute`` call asks for, shared by its CPU and device parts."""

    out: StepStats
    bounds: np.ndarray
    level: str
    hash_name: str
    modules: np.ndarray  # per parameter of the layout: its module's index
    significance: bool
    unit: np.ndarray | None = None  # per parameter: significance_unit of its gradient
    #: the addresses of ``out.direction`` and ``out.significant`` (0: none) and the layout's
    #: byte offsets: a parameter's bit views (``compute``) start at base + its offset
    bases: tuple | None = None
    offsets: list | None = None

    def scales(self, amax: np.ndarray, known: np.ndarray) -> np.ndarray:
        """Per parameter its module's largest finite |g| over the parameters ``known`` (a
        module's gradients not among them do not count): the significance scale."""
        top = np.zeros(int(self.modules.max()) + 1 if self.modules.size else 0)
        np.maximum.at(top, self.modules[known], amax[known])
        return top[self.modules]


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


class _CpuParams:
    """Statistics of CPU gradients ``jobs`` = [(param index, flat tensor, bit views)] in chunks
    of ``CHUNK`` elements (``kernel.py``), each read once from memory: the kernel finds the
    chunk's max, min and largest finite |x|, then, with the chunk in cache, the sum of squares,
    the sign bits, the L2 counts and the significance bits against a provisional threshold
    (``unit * max(the chunk's largest |x|, the module's scale at the previous step)``), and
    lists the elements within a factor ``kernel.BAND`` of it. Once every module's scale is
    known (``mend``), a chunk whose real threshold differs has those listed bits set again;
    only a chunk whose threshold moved by more than the band, or with more listed elements than
    ``CAND`` (a 16-bit gradient, whose threshold sits among its values), is read again for its
    significance bits. Chunks are independent (each writes its own bytes of the bits), so a
    step is split between up to ``torch.get_num_threads()`` threads (the kernel releases the
    GIL); at L0 a parameter's chunks stay in one thread (its digest reads them in order)."""

    CAND = 256  # listed elements kept per chunk

    def __init__(self, jobs, job: _Job, scratch, hints=None) -> None:
        self.jobs, self.job, self.scratch = jobs, job, scratch
        n = len(jobs)
        self.mx = np.full(n, -np.inf)
        self.mn = np.full(n, np.inf)
        self.amax = np.zeros(n)
        self.nans = np.zeros(n, np.int64)
        self.sumsq = np.zeros(n)
        self.counts = np.zeros((n, len(job.bounds) + 2), np.int64)
        self.digests: dict = {}
        self.marks: list = []  # per significance chunk: (job, start, provisional t, listed)
        # the same, batched (``_run_many``): per kernel call (its first unit, arrays of its
        # significance chunks' job, start, provisional t, listed count, list complete, list
        # address; the lists)
        self._mark_parts: list = []
        idx = [i for i, _, _ in jobs]
        self.unit = job.unit[idx] if job.significance else np.zeros(n)
        self.hint = (hints[idx] if hints is not None and len(hints) == job.modules.size
                     else np.zeros(n))
        self.workers = _workers(sum(int(f.numel()) for _, f, _ in jobs))
        # float32/float64 gradients on the compiled kernel: each thread's chunks in one call,
        # given by address (``_run_many``); else a call per chunk (16-bit gradients are widened
        # chunk by chunk, L0's digest reads them in order, the numpy twin takes arrays)
        self.batch = (kernel.path != "numpy" and job.level != "L0" and all(
            f.dtype in (torch.float32, torch.float64) and f.is_contiguous() for _, f, _ in jobs))
        if not self.batch:
            self.addr = []
        elif job.bases is not None:  # the views' addresses from the bases (no numpy call each)
            (bd, bs), off = job.bases, job.offsets
            self.addr = [(f.data_ptr(), f.element_size(), f.numel(),
                          bd + off[i] if v is not None else 0,
                          bs + off[i] if v is not None and v[1] is not None else 0)
                         for i, f, v in jobs]
        else:
            self.addr = [(f.data_ptr(), f.element_size(), f.numel(),
                          (kernel._ptr(v[0]) or 0) if v is not None else 0,
                          (kernel._ptr(v[1]) or 0) if v is not None and v[1] is not None else 0)
                         for _, f, v in jobs]

    def _units(self, whole: bool):
        units, sizes = [], []
        for j, (_, flat, _) in enumerate(self.jobs):
            n = flat.numel()
            if whole:
                units.append((j, None))
                sizes.append(n)
            else:
                for st in range(0, n, CHUNK):
                    units.append((j, st))
                    sizes.append(min(CHUNK, n - st))
        return units, sizes

    def _map(self, fn, units, sizes) -> list:
        k = self.workers
        if k > 1 and len(units) > 1 and self.scratch is not None:  # the probe's own pool
            futures = [self.scratch.executor().submit(fn, g, None)
                       for g in _split(units, sizes, k)]
            return [r for f in futures for r in f.result()]
        return fn(units, self.scratch)

    def _array(self, flat, start, s: Workspace) -> np.ndarray:
        part = flat[start:start + CHUNK]
        if flat.dtype in (torch.float32, torch.float64):
            return part.numpy()
        m = part.numel()  # float16/bfloat16: widened into the scratch buffer (exact)
        s.f32[:m].copy_(part)
        return s.f32_np[:m]

    def _views(self, j, st, size):
        views = self.jobs[j][2]
        if views is None:
            return None, None
        lo, hi = st // 8, st // 8 + -(-size // 8)
        return views[0][lo:hi], (views[1][lo:hi] if views[1] is not None else None)

    def run(self) -> None:
        job = self.job
        level = job.level

        def chunk(j, st, s, digest=None):
            a = self._array(self.jobs[j][1], st, s)
            if digest is not None:
                digest.update((a if a.dtype == np.float32 else a.astype(np.float32)).tobytes())
            signs, sig = self._views(j, st, a.size)
            res = kernel.chunk(a, self.unit[j], self.hint[j], signs, sig, job.bounds,
                               level == "L2", s.cand if sig is not None else None)
            listed = s.cand[:res[7]].copy() if sig is not None and res[7] <= s.cand.size \
                else None
            return j, st, res, listed

        def work(units, s):
            s = s or _thread_scratch()
            out = []
            for j, st in units:
                if st is not None:
                    out.append(chunk(j, st, s))
                    continue
                digest = hasher(job.hash_name)
                for c0 in range(0, self.jobs[j][1].numel(), CHUNK):
                    out.append(chunk(j, c0, s, digest))
                self.digests[j] = digest.digest()
            return out

        for j, st, (mx, mn, am, sumsq, t, nans, counts, _), listed in self._map(
                self._run_many if self.batch else work, *self._units(level == "L0")):
            self.mx[j] = max(self.mx[j], mx)
            self.mn[j] = min(self.mn[j], mn)
            self.amax[j] = max(self.amax[j], am)
            self.nans[j] += nans
            self.sumsq[j] += sumsq
            if counts is not None:
                self.counts[j] += counts
            if (not self.batch and self.jobs[j][2] is not None
                    and self.jobs[j][2][1] is not None):
                self.marks.append((j, st, t, listed))

    def _run_many(self, units, s=None) -> list:
        """``run``'s chunks ``units`` (float32/float64, the compiled kernel) in one kernel call:
        the same results as a call per chunk, without the Python work of each."""
        cap_n, wc = self.CAND, self.job.level == "L2"
        m = len(units)
        cand = np.empty((m, cap_n), np.int32)
        cbase = kernel._ptr(cand)
        rows, lens, is64, unit, hint, cap = [], [], [], [], [], []
        for c, (j, st) in enumerate(units):
            xp, isz, n, sp, gp = self.addr[j]
            rows.append((xp + st * isz, sp and sp + st // 8, gp and gp + st // 8,
                         gp and cbase + 4 * cap_n * c))
            lens.append(min(CHUNK, n - st))
            is64.append(isz == 8)
            unit.append(self.unit[j])
            hint.append(self.hint[j])
            cap.append(cap_n if gp else 0)
        out = np.empty((m, 5))
        ints = np.empty((m, 2), np.int64)
        counts = np.empty((m, len(self.job.bounds) + 2), np.int64) if wc else None
        kernel.chunk_many(np.array(rows, np.int64), np.array(lens, np.int64),
                          np.array(is64, np.int32), np.array(unit, np.float64),
                          np.array(hint, np.float64), self.job.bounds, wc,
                          np.array(cap, np.int32), out, ints, counts)
        sig = np.flatnonzero(np.array(cap, np.int32))
        if sig.size:  # ``mend``'s marks, as arrays (no Python per chunk there)
            found = ints[sig, 1]
            ok = found <= cap_n  # else the list is incomplete (``listed`` None)
            self._mark_parts.append((units[0], np.array([units[c][0] for c in sig.tolist()]),
                                     np.array([units[c][1] for c in sig.tolist()], np.int64),
                                     out[sig, 4], found, ok, cbase + 4 * cap_n * sig,
                                     cand))  # (the lists live as long as the marks)
        res = []
        for c, (o, (nans, found)) in enumerate(zip(out.tolist(), ints.tolist())):
            j, st = units[c]
            listed = cand[c, :found] if cap[c] and found <= cap_n else None
            res.append((j, st, (*o, nans, counts[c] if wc else None, found), listed))
        return res

    def mend(self, thresholds: np.ndarray) -> None:
        """The significance bits against the real thresholds (one per parameter of the
        layout): listed elements set again, a chunk read again where the list cannot tell."""
        if self.batch:
            return self._mend_many(thresholds)
        again = []
        here = self.scratch or _thread_scratch()
        for j, st, t, listed in self.marks:
            real = thresholds[self.jobs[j][0]]
            f = np.float64 if self.jobs[j][1].dtype == torch.float64 else np.float32
            if f(real) == f(t):
                continue
            if listed is not None and f(t / kernel.BAND) <= f(real) <= f(t * kernel.BAND):
                a = self._array(self.jobs[j][1], st, here)  # few bits: done here
                kernel.fix(a, listed, real, self._views(j, st, a.size)[1])
            else:
                again.append((j, st, real))
        self._again(again)

    def _mend_many(self, thresholds: np.ndarray) -> None:
        """``mend`` of the batched chunks (``_run_many``'s marks): the same decisions, taken
        on arrays, in each chunk's dtype as a chunk at a time took them."""
        if not self._mark_parts:
            return
        parts = sorted(self._mark_parts, key=lambda x: x[0])  # the order of the units
        j, st, t, found, ok, lptr = (np.concatenate([p[k] for p in parts]) for k in range(1, 7))
        addr = np.array(self.addr, np.int64)[j]  # data, item size, numel, signs, significance
        is64 = addr[:, 1] == 8
        real = thresholds[np.array([i for i, _, _ in self.jobs])[j]]
        lo, hi = t / kernel.BAND, t * kernel.BAND
        with np.errstate(over="ignore", invalid="ignore"):  # (a float32 cast of a float64 chunk's)
            r32, t32 = real.astype(np.float32), t.astype(np.float32)
            moved = np.where(is64, real != t, r32 != t32)
            inband = ok & np.where(is64, (lo <= real) & (real <= hi),
                                   (lo.astype(np.float32) <= r32) & (r32 <= hi.astype(np.float32)))
        fix = np.flatnonzero(moved & inband & (found > 0))
        if fix.size:  # few bits: every chunk's in one call
            kernel.fix_many(
                np.stack([addr[fix, 0] + st[fix] * addr[fix, 1], lptr[fix],
                          addr[fix, 4] + st[fix] // 8], axis=1),
                np.ascontiguousarray(found[fix]), np.ascontiguousarray(real[fix]),
                is64[fix].astype(np.int32))
        again = np.flatnonzero(moved & ~inband)
        self._again([(int(j[c]), int(st[c]), real[c]) for c in again.tolist()])

    def _again(self, again) -> None:
        """The significance bits of chunks ``again`` = [(job, start, threshold)] read again."""
        if not again:
            return

        def work(items, s):
            s = s or _thread_scratch()
            for j, st, real in items:
                a = self._array(self.jobs[j][1], st, s)
                kernel.chunk_stats(a, real, None, self._views(j, st, a.size)[1],
                                   self.job.bounds[:0], False)
            return []

        self._map(work, again, [CHUNK] * len(again))

    def finish(self) -> None:
        out, job = self.job.out, self.job
        for j, (i, flat, _) in enumerate(self.jobs):
            n = flat.numel()
            nan = self.nans[j] > 0
            out.max[i] = np.nan if nan else self.mx[j]
            out.min[i] = np.nan if nan else self.mn[j]
            out.norm[i] = np.sqrt(self.sumsq[j])
            if job.level == "L2":
                out.zeros[i] = self.counts[j, -2] / n
                out.dist[i] = _interval_shares(self.counts[j, :-2], int(self.nans[j]), n)
            if j in self.digests:
                out.hash[i] = np.frombuffer(self.digests[j], np.uint8)


def _interval_shares(le_counts: np.ndarray, nans: int, n: int) -> np.ndarray:
    """Shares per interval from counts of ``x <= b_k`` (NaN elements are in no interval)."""
    if not n:
        return np.full(len(le_counts) + 1, np.nan)
    inner = np.diff(le_counts, prepend=0)
    return np.concatenate([inner, [n - nans - le_counts[-1]]]).astype(np.float64) / n


class _DeviceParams:
    """Gradients on an accelerator: whole-tensor reductions on their device, one transfer for
    every statistic of the step, no per-statistic sync."""

    def __init__(self, jobs, job: _Job, scratch) -> None:
        self.jobs, self.job = jobs, job
        self.weights = scratch.bit_weights if scratch is not None else {}
        self.wide = [self._wide(g) for _, g, _ in jobs]
        self.minmax = None

    @staticmethod
    def _wide(g):
        flat = g.detach().reshape(-1)
        return flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat

    def first_pass(self) -> np.ndarray:
        """Each gradient's min and max (kept on the device) and largest finite |x| (returned to
        the host: the thresholds need every module's)."""
        self.minmax = [torch.aminmax(w) for w in self.wide]
        amax = [torch.where(torch.isfinite(w), w.abs(), 0).amax() for w in self.wide]
        return torch.stack(amax).double().cpu().numpy()

    def second_pass(self, thresholds: np.ndarray) -> None:
        """``thresholds``: the significance threshold of every parameter of the layout."""
        job, out = self.job, self.job.out
        bounds, level = job.bounds, job.level
        rows, packed = [], []
        for k, ((i, g, dir_view), wide) in enumerate(zip(self.jobs, self.wide)):
            mn, mx = self.minmax[k]
            vals = [mx.double(), mn.double(),
                    torch.linalg.vector_norm(wide, dtype=torch.float64)]
            if level == "L2":
                vals += [(wide <= float(b)).sum().double() for b in bounds]
                vals.append((wide == 0).sum().double())
                vals.append(torch.isnan(wide).sum().double())
            rows.append(torch.stack(vals))
            if dir_view is not None:
                dev = wide.device
                if dev not in self.weights:
                    self.weights[dev] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1],
                                                     dtype=torch.uint8, device=dev)
                masks = [wide > 0]
                if dir_view[1] is not None:
                    masks.append(wide.abs() > wide.new_tensor(thresholds[i]))
                for mask in masks:
                    bits = torch.zeros(dir_view[0].size * 8, dtype=torch.uint8, device=dev)
                    bits[:wide.numel()] = mask
                    packed.append((bits.view(-1, 8) * self.weights[dev]).sum(1, dtype=torch.uint8))
            if level == "L0":  # the digest needs the bytes on the host, as msprobe's does
                digest = hasher(job.hash_name)
                digest.update(wide.float().cpu().numpy().tobytes())
                out.hash[i] = np.frombuffer(digest.digest(), np.uint8)
        host = torch.stack(rows).cpu().numpy()
        host_bits = torch.cat(packed).cpu().numpy() if packed else None
        pos = 0
        for r, (i, g, dir_view) in enumerate(self.jobs):
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
