"""Gradient statistics of one optimizer step of a MindSpore model.

Two paths give the same ``StepStats``. On an accelerator (Ascend, GPU) the statistics are
computed with MindSpore's own ops on the device (``compute_device``, below). When MindSpore runs
on the CPU the gradients already are host memory: ``compute_host`` hands them (without a copy) to
probekit's chunked CPU path, which MindSpore's CPU kernels are several times slower than.

Both give the statistics and byte layout of ``probekit.grads.stats`` (a ``StepStats`` the
store's ``GradWriter`` takes as it is). The device path works on the whole step at once:

* every gradient is flattened (fp16/bf16 widened to float32, exactly; a step holding a float64
  gradient is processed in float64) and all are concatenated,
  each followed by zero padding up to a 64-bit boundary — the padded order *is* the sign-bit
  layout of the store;
* one segment id per element (the pads belong to an extra, discarded segment) turns every
  per-parameter statistic into one segment reduction for all parameters: ``max``, ``min``,
  the sum of squares in float64 (so the norm is the float64 norm of the float32 values), the
  NaN count, and at L2 one ``x <= b`` count per bound plus the zero count;
* the sign bits ``x > 0`` are packed 8 per byte (most significant bit first) on the device;
* everything is viewed as bytes and concatenated: **one** transfer to the host per step (at L0
  the float32 gradient bytes travel too: the MD5 digest is computed on the host, as msprobe's is).

A NaN makes ``max``/``min``/``norm`` NaN (MindSpore's segment max/min skip NaN; the NaN count
restores numpy's propagation) and falls in no interval.
"""
from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import ops

from ..grads.stats import HASH_NBYTES, Layout, StepStats, hasher, padded_nbytes

_FLOAT_TYPES = None


def _is_float(dtype) -> bool:
    global _FLOAT_TYPES
    if _FLOAT_TYPES is None:
        _FLOAT_TYPES = {ms.float16, ms.float32, ms.float64, ms.bfloat16}
    return dtype in _FLOAT_TYPES


class Plan:
    """Per-layout constants kept on the device between steps (segment ids, pads, bit weights)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        p = len(layout.names)
        pads, ids = [], []
        for i, n in enumerate(layout.numels):
            pad = padded_nbytes(n) * 8 - n
            pads.append(pad)
            ids.append(np.full(n, i, np.int32))
            ids.append(np.full(pad, p, np.int32))
        self.pads = pads
        self.p = p
        self.nbits = layout.nbytes * 8
        self.ids = ms.Tensor(np.concatenate(ids) if ids else np.zeros(0, np.int32))
        self.zero_pads = {}
        self.weights = ms.Tensor(np.array([128, 64, 32, 16, 8, 4, 2, 1], np.float32))
        self.numels = np.asarray(layout.numels, np.int64)
        self.scratch = None  # the host path's reusable buffers

    def pad(self, k: int, dtype):
        if (k, dtype) not in self.zero_pads:
            self.zero_pads[k, dtype] = ops.zeros(k, dtype)
        return self.zero_pads[k, dtype]


def on_cpu() -> bool:
    """True when MindSpore runs on the CPU (its tensors live in host memory)."""
    return ms.get_context("device_target") == "CPU"


def compute(grads, plan: Plan, level: str, bounds, hash_name: str = "md5",
            where: str = "auto") -> StepStats:
    """Statistics of ``grads`` (one MindSpore Tensor or None per parameter of the plan's layout).

    ``where``: ``"device"`` = MindSpore's ops on the device, one transfer (``compute_device``);
    ``"host"`` = the gradients' host memory read by probekit's chunked CPU path
    (``probekit.grads.stats.compute``); ``"auto"`` = host when MindSpore runs on the CPU (the
    gradients are already in host memory, and the cache-resident chunked pass is several times
    faster there than MindSpore's CPU kernels), else device.
    """
    if where == "auto":
        where = "host" if on_cpu() else "device"
    if where == "host":
        return compute_host(grads, plan, level, bounds, hash_name)
    if where != "device":
        raise ValueError(f"where: {where!r} is not valid; accepted: auto, host, device")
    return compute_device(grads, plan, level, bounds, hash_name)


def compute_host(grads, plan: Plan, level: str, bounds, hash_name: str = "md5") -> StepStats:
    """The gradients as host arrays (no copy for CPU tensors), through probekit's CPU path."""
    import torch

    from ..grads import stats as host_stats

    if plan.scratch is None:
        plan.scratch = host_stats._Scratch()
    views = []
    for name, g in zip(plan.layout.names, grads):
        if g is None:
            views.append(None)
            continue
        if not _is_float(g.dtype):
            raise TypeError(f"gradient of {name!r} has dtype {g.dtype}, not a floating-point "
                            "type")
        if g.dtype == ms.bfloat16:  # numpy has no bfloat16: widen on the device (exact)
            g = g.astype(ms.float32)
        views.append(torch.from_numpy(g.asnumpy()))
    return host_stats.compute(views, plan.layout, level, bounds, hash_name, plan.scratch)


def compute_device(grads, plan: Plan, level: str, bounds, hash_name: str = "md5") -> StepStats:
    """Every statistic with MindSpore's ops on the gradients' device; one transfer per step."""
    layout = plan.layout
    p = plan.p
    out = StepStats(present=np.zeros(p, bool), max=np.full(p, np.nan), min=np.full(p, np.nan),
                    norm=np.full(p, np.nan))
    if level == "L0":
        out.hash = np.zeros((p, HASH_NBYTES[hash_name]), np.uint8)
    if level in ("L1", "L2"):
        out.direction = np.zeros(layout.nbytes, np.uint8)
    if level == "L2":
        out.zeros = np.full(p, np.nan)
        out.dist = np.full((p, len(bounds) + 1), np.nan)
    pieces = []
    # float64 gradients keep float64 (then the whole step is float64); the rest become float32
    wide_t = ms.float64 if any(g is not None and g.dtype == ms.float64 for g in grads) \
        else ms.float32
    for i, g in enumerate(grads):
        n = layout.numels[i]
        if g is None:
            pieces.append(plan.pad(padded_nbytes(n) * 8, wide_t))  # zeros: no sign bit, ignored below
            continue
        if g.size != n:
            raise ValueError(f"gradient of {layout.names[i]!r} has {g.size} elements; the "
                             f"recording started with {n}")
        if not _is_float(g.dtype):
            raise TypeError(f"gradient of {layout.names[i]!r} has dtype {g.dtype}, not a "
                            "floating-point type")
        out.present[i] = True
        flat = g.reshape(-1)
        if flat.dtype != wide_t:
            flat = flat.astype(wide_t)  # fp16/bf16 -> float32/float64: exact
        pieces.append(flat)
        if plan.pads[i]:
            pieces.append(plan.pad(plan.pads[i], wide_t))
    if not out.present.any():
        return out
    flat = ops.cat(pieces) if len(pieces) > 1 else pieces[0]
    segs = p + 1
    wide = flat.astype(ms.float64)
    rows = [ops.unsorted_segment_max(wide, plan.ids, segs),
            ops.unsorted_segment_min(wide, plan.ids, segs),
            ops.unsorted_segment_sum(wide * wide, plan.ids, segs),
            ops.unsorted_segment_sum(ops.isnan(flat).astype(ms.float64), plan.ids, segs)]
    if level == "L2":
        rows += [ops.unsorted_segment_sum((flat <= float(b)).astype(ms.float64), plan.ids, segs)
                 for b in bounds]
        rows.append(ops.unsorted_segment_sum((flat == 0).astype(ms.float64), plan.ids, segs))
    parts = [ops.stack(rows).view(ms.uint8).reshape(-1)]
    if level in ("L1", "L2"):
        bits = (flat > 0).astype(ms.float32).reshape(-1, 8)
        parts.append(ops.matmul(bits, plan.weights.reshape(8, 1)).astype(ms.uint8).reshape(-1))
    if level == "L0":
        f32 = flat if flat.dtype == ms.float32 else flat.astype(ms.float32)
        parts.append(f32.view(ms.uint8).reshape(-1))
    host = ops.cat(parts).asnumpy() if len(parts) > 1 else parts[0].asnumpy()  # one transfer
    k = len(rows)
    stat = host[:k * segs * 8].view(np.float64).reshape(k, segs)[:, :p]
    pos = k * segs * 8
    have = out.present
    nan = stat[3] > 0
    out.max[have] = np.where(nan, np.nan, stat[0])[have]
    out.min[have] = np.where(nan, np.nan, stat[1])[have]
    out.norm[have] = np.sqrt(stat[2])[have]
    empty = plan.numels == 0
    if empty.any():  # a zero-element gradient: present, no values
        for name in ("max", "min", "norm"):
            getattr(out, name)[empty] = np.nan
    if level == "L2":
        nb = len(bounds)
        le = stat[4:4 + nb].T  # (p, bounds): count of x <= b
        n = np.maximum(plan.numels, 1).astype(np.float64)
        inner = np.diff(le, axis=1, prepend=0)
        last = plan.numels - stat[3] - le[:, -1]
        dist = np.concatenate([inner, last[:, None]], axis=1) / n[:, None]
        out.dist[have] = dist[have]
        out.zeros[have] = (stat[4 + nb] / n)[have]
        out.dist[empty], out.zeros[empty] = np.nan, np.nan
    if level in ("L1", "L2"):
        out.direction[:] = host[pos:pos + layout.nbytes]
    if level == "L0":
        f32 = host[pos:].view(np.float32)
        offsets = np.concatenate([[0], np.cumsum([padded_nbytes(n) * 8
                                                  for n in layout.numels])[:-1]]).astype(np.int64)
        for i in np.flatnonzero(have):
            d = hasher(hash_name)
            d.update(f32[offsets[i]:offsets[i] + layout.numels[i]].tobytes())
            out.hash[i] = np.frombuffer(d.digest(), np.uint8)
    return out
