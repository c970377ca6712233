"""Gradient statistics of one optimizer step of a MindSpore model.

Two paths give the same ``StepStats`` (the statistics and byte layout of
``probekit.grads.numerics.stats``, which the store's ``GradWriter`` takes as it is):

* **host** (MindSpore on the CPU, chosen automatically there): the gradients already are host
  memory, so they are viewed without a copy (``asnumpy`` -> ``torch.from_numpy``) and go through
  probekit's chunked CPU path (``probekit.grads.numerics.stats.compute``), the very code that
  records PyTorch's CPU gradients. MindSpore's CPU kernels are several times slower than that path.
* **device** (Ascend, GPU): ``DeviceStats``, a ``Cell`` of MindSpore ops, computes every
  statistic where the gradients are, and hands back three tensors (statistics, packed bits,
  and at L0 the float32 bytes the MD5 digest is computed from on the host, as msprobe's is).
  The same cell runs compiled inside a training graph (``probekit.mindspore.graph``) and,
  jit-compiled on its own, for gradients handed over in PyNative mode.

Per parameter the device path computes, in the gradient's own precision widened exactly to
float32 (fp16/bf16) or kept float64: max, min (NaN when the gradient holds a NaN: MindSpore's
reductions skip NaN; a NaN is found from the NaN sum of squares, or counted at L2), the sum of
squares as float32 squares summed per row of 4096 elements and the rows summed in float64 (the
host path's accumulation; float64 gradients in float64), the signs ``x > 0`` packed 8 per byte
(most significant bit first, zero-padded to a 64-bit boundary per parameter), with
``significance`` the significance bits by the host path's rule (``|x| > SIGNIFICANCE[bits] *
eps(dtype) * M``, M the largest finite |x| over the gradients of the parameter's module, the
name without its last component; a NaN is never significant; padding bits are ones), and at L2 one ``x <= b`` count per bound plus the zero count (exact int32 counts).
"""
from __future__ import annotations

import numpy as np

from .compat import check_numpy

check_numpy()  # before MindSpore is imported: numpy 2 beside its numpy-1 wheel

import mindspore as ms  # noqa: E402
from mindspore import nn, ops

from ..grads.numerics.stats import HASH_NBYTES, Layout, StepStats, hasher, padded_nbytes

_FLOAT_TYPES = None
ROW = 4096  # elements per float32 row sum of squares (then summed in float64)


def _is_float(dtype) -> bool:
    global _FLOAT_TYPES
    if _FLOAT_TYPES is None:
        _FLOAT_TYPES = {ms.float16, ms.float32, ms.float64, ms.bfloat16}
    return dtype in _FLOAT_TYPES


_BITS = {ms.float16: 16, ms.bfloat16: 16, ms.float32: 32, ms.float64: 64}


def eps(dtype) -> float:
    """Machine epsilon of a MindSpore floating-point dtype (the significance rule's unit)."""
    return {ms.float16: 2.0 ** -10, ms.bfloat16: 2.0 ** -7, ms.float32: 2.0 ** -23,
            ms.float64: 2.0 ** -52}[dtype]


def stat_rows(level: str, bounds) -> int:
    """Statistics per parameter in ``DeviceStats``' first output: max, min, sum of squares,
    NaN count, then at L2 one ``x <= b`` count per bound and the zero count."""
    return 4 + (len(bounds) + 1 if level == "L2" else 0)


class Plan:
    """Per-layout state kept between steps: the host path's scratch buffers and the device
    path's compiled statistics cells (one per gradient dtypes, level and options)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.p = len(layout.names)
        self.scratch = None  # the host path's reusable buffers
        self.cells: dict = {}

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.close()  # the pool's threads end with the probe


def on_cpu() -> bool:
    """True when MindSpore runs on the CPU (its tensors live in host memory)."""
    return ms.get_context("device_target") == "CPU"


def resolve_where(where: str) -> str:
    if where == "auto":
        return "host" if on_cpu() else "device"
    if where not in ("host", "device"):
        raise ValueError(f"where: {where!r} is not valid; accepted: auto, host, device")
    return where


def compute(grads, plan: Plan, level: str, bounds, hash_name: str = "md5",
            where: str = "auto", significance: bool = False, sample=None) -> StepStats:
    """Statistics of ``grads`` (one MindSpore Tensor or None per parameter of the plan's layout).

    ``where``: ``"device"`` = ``DeviceStats`` on the gradients' device; ``"host"`` = the
    gradients' host memory read by probekit's chunked CPU path; ``"auto"`` = host when MindSpore
    runs on the CPU (the gradients are already in host memory, and the cache-resident chunked
    pass is several times faster there than MindSpore's CPU kernels), else device.
    ``sample``: per parameter the positions of the elements whose bits are recorded, or None
    for all (``probekit.grads.numerics.sampling``: the elements PyTorch's probe records too).
    """
    where = resolve_where(where)
    _check(grads, plan.layout)
    if where == "host":
        return compute_host(grads, plan, level, bounds, hash_name, significance, sample)
    return compute_device(grads, plan, level, bounds, hash_name, significance, sample)


def _check(grads, layout: Layout) -> None:
    for name, numel, g in zip(layout.names, layout.numels, grads):
        if g is None:
            continue
        if g.size != numel:
            raise ValueError(f"gradient of {name!r} has {g.size} elements; the recording "
                             f"started with {numel}")
        if not _is_float(g.dtype):
            raise TypeError(f"gradient of {name!r} has dtype {g.dtype}, not a floating-point "
                            "type")


def host_view(array: np.ndarray, dtype):
    """A torch view of a gradient's host array (bf16 arrives widened to float32 and is narrowed
    back, exactly, so the significance rule sees the gradient's own dtype)."""
    import torch

    t = torch.from_numpy(array)
    return t.to(torch.bfloat16) if dtype == ms.bfloat16 else t


def compute_host(grads, plan: Plan, level: str, bounds, hash_name: str = "md5",
                 significance: bool = False, sample=None) -> StepStats:
    """The gradients as host arrays (no copy for CPU tensors), through probekit's CPU path."""
    from ..grads.numerics import stats as host_stats

    if plan.scratch is None:
        plan.scratch = host_stats.Workspace()
    views = []
    for g in grads:
        if g is None:
            views.append(None)
            continue
        dtype = g.dtype
        if dtype == ms.bfloat16:  # numpy has no bfloat16: widen on the device (exact)
            g = g.astype(ms.float32)
        views.append(host_view(g.asnumpy(), dtype))
    return host_stats.compute(views, plan.layout, level, bounds, hash_name, plan.scratch,
                              significance, sample=sample)


def compute_device(grads, plan: Plan, level: str, bounds, hash_name: str = "md5",
                   significance: bool = False, sample=None) -> StepStats:
    """Every statistic with MindSpore's ops on the gradients' device (``DeviceStats``, compiled
    once per dtypes and options); the results come back in at most three transfers."""
    layout = plan.layout
    present = np.array([g is not None for g in grads], bool)
    dtypes = tuple(g.dtype if g is not None else ms.float32 for g in grads)
    key = (dtypes, level, tuple(bounds), bool(significance), id(sample))
    cell = plan.cells.get(key)
    if cell is None:
        cell = plan.cells[key] = DeviceStats(layout.numels, dtypes, level, bounds, significance,
                                             modules=layout.modules, compiled=True,
                                             sample=sample)
    filled = tuple(g if g is not None else ops.zeros(int(n), ms.float32)
                   for g, n in zip(grads, layout.numels))
    outs = cell(filled)
    host = [o.asnumpy() for o in outs]
    return unpack(host, layout, present, level, bounds, hash_name, significance)


class DeviceStats(nn.Cell):
    """Every statistic of one step's gradients with MindSpore ops, compilable into a graph.

    ``DeviceStats(numels, dtypes, level, bounds, significance)(grads)`` -> a tuple: the
    statistics ``(P, stat_rows)`` float64; at L1/L2 the packed sign bits (``layout.nbytes``
    uint8), then with ``significance`` the packed significance bits (as many); at L0 the
    gradients as float32, concatenated unpadded. ``unpack`` turns them into ``StepStats``.
    Parameters are processed one by one (no concatenated or float64 copy of the step).
    """

    def __init__(self, numels, dtypes, level: str, bounds, significance: bool = False, *,
                 modules=None, compiled: bool = False, sample=None) -> None:
        super().__init__()
        from ..grads.numerics.stats import SIGNIFICANCE

        # the significance scale: the largest finite |g| over each module's gradients
        modules = tuple(range(len(numels))) if modules is None else tuple(int(m) for m in modules)
        self.mod = modules
        self.members = tuple(tuple(j for j, m in enumerate(modules) if m == mod)
                             for mod in modules)
        numels = tuple(int(n) for n in numels)
        self.idx = tuple(range(len(numels)))
        self.n = numels
        self.empty = tuple(n == 0 for n in numels)
        self.f64 = tuple(dt == ms.float64 for dt in dtypes)
        self.widen = tuple(dt in (ms.float16, ms.bfloat16) for dt in dtypes)  # to float32
        self.unit = tuple(SIGNIFICANCE[_BITS[dt]] * eps(dt) for dt in dtypes)  # threshold unit
        self.nrow = tuple(n // ROW * ROW for n in numels)  # elements summed in float32 rows
        # sampled bits (probekit.grads.numerics.sampling): the sampled elements gathered first
        sample = sample if sample is not None else (None,) * len(numels)
        self.sampled = tuple(p is not None for p in sample)
        self.sidx = tuple(ms.Tensor(np.asarray(p, np.int32)) if p is not None
                          else ms.Tensor(np.zeros(1, np.int32)) for p in sample)
        bits = tuple(len(p) if p is not None else n for p, n in zip(sample, numels))
        self.pad = tuple(padded_nbytes(b) * 8 - b for b in bits)
        self.level = level
        self.bounds = tuple(float(b) for b in bounds)
        self.want_bits = level in ("L1", "L2")
        self.want_sig = bool(significance) and self.want_bits
        self.want_l2 = level == "L2"
        self.want_raw = level == "L0"
        self.weights = ms.Tensor(np.array([[128], [64], [32], [16], [8], [4], [2], [1]],
                                          np.float32))
        if compiled:  # PyNative callers: one compiled graph instead of op-by-op launches
            self.construct = ms.jit(self.construct)

    def construct(self, grads):
        rows = []
        signs = []
        sigs = []
        raws = []
        wide = []
        mags = []
        amax = []
        for j in self.idx:
            w = grads[j].reshape(-1)
            if self.widen[j]:
                w = w.astype(ms.float32)  # exact
            wide.append(w)
            if self.want_sig:
                a = ops.abs(w)
                mags.append(a)
                amax.append(self._amax(a, j))
        for j in self.idx:
            if self.empty[j]:
                rows.append(self._empty_row())
                continue
            w = wide[j]
            sumsq = self._sumsq(w, j)
            if self.want_l2:
                nans = ops.isnan(w).astype(ms.int32).sum().astype(ms.float64)
            else:  # only whether there is one: a NaN, and only a NaN, makes the squares' sum NaN
                nans = ops.isnan(sumsq).astype(ms.float64)
            vals = [w.max().astype(ms.float64), w.min().astype(ms.float64), sumsq, nans]
            if self.want_l2:
                for b in self.bounds:
                    vals.append((w <= b).astype(ms.int32).sum().astype(ms.float64))
                vals.append((w == 0).astype(ms.int32).sum().astype(ms.float64))
            rows.append(ops.stack(vals))
            if self.want_bits:
                ws = ops.gather(w, self.sidx[j], 0) if self.sampled[j] else w
                signs.append(self._pack(ws > 0, self.pad[j], False))
                if self.want_sig:
                    top = amax[j]
                    for k in self.members[j]:
                        top = ops.maximum(top, amax[k])
                    mag = ops.abs(ws) if self.sampled[j] else mags[j]
                    sigs.append(self._pack(mag > top * self.unit[j], self.pad[j], True))
            if self.want_raw:
                raws.append(w.astype(ms.float32))
        out = [ops.stack(rows)]
        if self.want_bits:
            out.append(ops.cat(signs))
            if self.want_sig:
                out.append(ops.cat(sigs))
        if self.want_raw:
            out.append(ops.cat(raws))
        return tuple(out)

    def _empty_row(self):
        k = 4
        if self.want_l2:
            k = k + len(self.bounds) + 1
        return ops.zeros(k, ms.float64)

    def _sumsq(self, w, j):
        if self.f64[j]:
            return (w * w).sum()
        m = self.nrow[j]
        total = ops.zeros((), ms.float64)
        if m > 0:
            head = w[:m] if m < self.n[j] else w
            total = total + (head * head).reshape(-1, 4096).sum(1).astype(ms.float64).sum()
        if m < self.n[j]:
            tail = w[m:]
            total = total + (tail * tail).sum().astype(ms.float64)
        return total

    def _amax(self, a, j):
        """The largest finite ``a`` (|x| of gradient ``j``; 0 for an empty one)."""
        if self.empty[j]:
            return ops.zeros((), a.dtype)
        return ops.select(a < float("inf"), a, ops.zeros_like(a)).max()

    def _pack(self, mask, pad, fill):
        """Bits packed 8 per byte, most significant first, padded with ``fill`` bits."""
        bits = mask.astype(ms.float32)
        if pad > 0:
            if fill:
                bits = ops.cat([bits, ops.ones(pad, ms.float32)])
            else:
                bits = ops.cat([bits, ops.zeros(pad, ms.float32)])
        return ops.matmul(bits.reshape(-1, 8), self.weights).astype(ms.uint8).reshape(-1)


def unpack(host, layout: Layout, present, level: str, bounds, hash_name: str = "md5",
           significance: bool = False) -> StepStats:
    """``StepStats`` from ``DeviceStats``' outputs as host arrays (``present``: the parameters
    that had a gradient; the others' values are discarded)."""
    p = len(layout.names)
    present = np.asarray(present, bool)
    stat = np.asarray(host[0], np.float64).reshape(p, stat_rows(level, bounds))
    numels = np.asarray(layout.numels, np.int64)
    out = StepStats(present=present.copy(), max=np.full(p, np.nan), min=np.full(p, np.nan),
                    norm=np.full(p, np.nan))
    have = present & (numels > 0)
    nan = stat[:, 3] > 0
    out.max[have] = np.where(nan, np.nan, stat[:, 0])[have]
    out.min[have] = np.where(nan, np.nan, stat[:, 1])[have]
    out.norm[have] = np.sqrt(stat[:, 2])[have]
    if level == "L2":
        nb = len(bounds)
        le = stat[:, 4:4 + nb]
        n = np.maximum(numels, 1).astype(np.float64)
        inner = np.diff(le, axis=1, prepend=0)
        last = numels - stat[:, 3] - le[:, -1]
        dist = np.concatenate([inner, last[:, None]], axis=1) / n[:, None]
        out.zeros = np.full(p, np.nan)
        out.dist = np.full((p, nb + 1), np.nan)
        out.dist[have] = dist[have]
        out.zeros[have] = (stat[:, 4 + nb] / n)[have]
    if level in ("L1", "L2"):
        absent = _absent_bytes(layout, present)
        out.direction = np.asarray(host[1], np.uint8).reshape(-1).copy()
        out.direction[absent] = 0
        if significance:
            out.significant = np.asarray(host[2], np.uint8).reshape(-1).copy()
            out.significant[absent] = 255
    if level == "L0":
        out.hash = np.zeros((p, HASH_NBYTES[hash_name]), np.uint8)
        f32 = np.asarray(host[1]).reshape(-1).view(np.float32)
        start = 0
        for i in range(p):
            if present[i] and numels[i]:
                d = hasher(hash_name)
                d.update(f32[start:start + numels[i]].tobytes())
                out.hash[i] = np.frombuffer(d.digest(), np.uint8)
            start += numels[i]
    return out


def _absent_bytes(layout: Layout, present) -> np.ndarray:
    """Byte positions of the parameters without a gradient (their bits are not recorded)."""
    mask = np.zeros(layout.nbytes, bool)
    for i, off in enumerate(layout.offsets):
        if not present[i]:
            mask[off:off + padded_nbytes(layout.bits[i])] = True
    return mask
