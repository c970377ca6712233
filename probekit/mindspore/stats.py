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


#: elements (with padding) per group of parameters reduced together on the device: bounds the
#: float64 copy of the device path to 128 MiB (a larger parameter makes a group of its own)
GROUP_ELEMS = 1 << 24


class Group:
    """Consecutive parameters reduced together: their indices, segment ids and pads."""

    def __init__(self, index, numels) -> None:
        self.index = list(index)
        self.pads = [padded_nbytes(numels[i]) * 8 - numels[i] for i in self.index]
        k = len(self.index)
        ids = []
        for j, i in enumerate(self.index):
            ids.append(np.full(numels[i], j, np.int32))
            ids.append(np.full(self.pads[j], k, np.int32))  # the pads' own, discarded segment
        self.ids = ms.Tensor(np.concatenate(ids) if ids else np.zeros(0, np.int32))
        self.nbytes = sum(padded_nbytes(numels[i]) for i in self.index)


class Plan:
    """Per-layout constants kept between steps: device groups (built on first device use) and the
    host path's scratch buffers."""

    def __init__(self, layout: Layout, group_elems: int = GROUP_ELEMS) -> None:
        self.layout = layout
        self.p = len(layout.names)
        self.numels = np.asarray(layout.numels, np.int64)
        self.group_elems = group_elems
        self.scratch = None  # the host path's reusable buffers
        self._groups = None
        self._zero_pads = {}
        self._weights = None

    @property
    def groups(self) -> list:
        if self._groups is None:
            groups, cur, size = [], [], 0
            for i, n in enumerate(self.layout.numels):
                padded = padded_nbytes(n) * 8
                if cur and size + padded > self.group_elems:
                    groups.append(cur)
                    cur, size = [], 0
                cur.append(i)
                size += padded
            if cur:
                groups.append(cur)
            self._groups = [Group(g, self.layout.numels) for g in groups]
        return self._groups

    @property
    def weights(self):
        if self._weights is None:
            self._weights = ms.Tensor(np.array([[128], [64], [32], [16], [8], [4], [2], [1]],
                                               np.float32))
        return self._weights

    def pad(self, k: int, dtype):
        if (k, dtype) not in self._zero_pads:
            self._zero_pads[k, dtype] = ops.zeros(k, dtype)
        return self._zero_pads[k, dtype]


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
        plan.scratch = host_stats.Workspace()
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
    for i, g in enumerate(grads):
        if g is None:
            continue
        if g.size != layout.numels[i]:
            raise ValueError(f"gradient of {layout.names[i]!r} has {g.size} elements; the "
                             f"recording started with {layout.numels[i]}")
        if not _is_float(g.dtype):
            raise TypeError(f"gradient of {layout.names[i]!r} has dtype {g.dtype}, not a "
                            "floating-point type")
        out.present[i] = True
    parts, done = [], []
    for grp in plan.groups:
        if not out.present[grp.index].any():
            continue
        parts += _group_parts([grads[i] for i in grp.index], grp, plan, level, bounds)
        done.append(grp)
    if not done:
        return out
    host = ops.cat(parts).asnumpy() if len(parts) > 1 else parts[0].asnumpy()  # one transfer
    pos = 0
    offsets = layout.offsets
    for grp in done:
        pos = _unpack_group(host, pos, grp, plan, out, level, bounds, hash_name, offsets)
    return out


def _group_parts(grads, grp: Group, plan: Plan, level: str, bounds) -> list:
    """Device tensors (uint8) holding one group's statistics, sign bits and (L0) float32 bytes."""
    # float64 gradients keep float64 (then the whole group is float64); the rest become float32
    wide_t = ms.float64 if any(g is not None and g.dtype == ms.float64 for g in grads) \
        else ms.float32
    pieces = []
    for j, g in enumerate(grads):
        if g is None:  # zeros: no sign bit; its statistics are discarded
            pieces.append(plan.pad(padded_nbytes(plan.numels[grp.index[j]]) * 8, wide_t))
            continue
        flat = g.reshape(-1)
        if flat.dtype != wide_t:
            flat = flat.astype(wide_t)  # fp16/bf16 -> float32/float64: exact
        pieces.append(flat)
        if grp.pads[j]:
            pieces.append(plan.pad(grp.pads[j], wide_t))
    flat = ops.cat(pieces) if len(pieces) > 1 else pieces[0]
    segs = len(grp.index) + 1
    wide = flat.astype(ms.float64)
    rows = [ops.unsorted_segment_max(wide, grp.ids, segs),
            ops.unsorted_segment_min(wide, grp.ids, segs),
            ops.unsorted_segment_sum(wide * wide, grp.ids, segs),
            ops.unsorted_segment_sum(ops.isnan(flat).astype(ms.float64), grp.ids, segs)]
    del wide
    if level == "L2":
        rows += [ops.unsorted_segment_sum((flat <= float(b)).astype(ms.float64), grp.ids, segs)
                 for b in bounds]
        rows.append(ops.unsorted_segment_sum((flat == 0).astype(ms.float64), grp.ids, segs))
    parts = [ops.stack(rows).view(ms.uint8).reshape(-1)]
    if level in ("L1", "L2"):
        bits = (flat > 0).astype(ms.float32).reshape(-1, 8)
        parts.append(ops.matmul(bits, plan.weights).astype(ms.uint8).reshape(-1))
    if level == "L0":
        f32 = flat if flat.dtype == ms.float32 else flat.astype(ms.float32)
        parts.append(f32.view(ms.uint8).reshape(-1))
    return parts


def _unpack_group(host, pos, grp: Group, plan: Plan, out: StepStats, level, bounds, hash_name,
                  offsets) -> int:
    """Fill ``out`` from one group's bytes of the transfer at ``pos``; returns the next ``pos``."""
    idx = np.asarray(grp.index)
    segs = idx.size + 1
    k = 4 + (len(bounds) + 1 if level == "L2" else 0)
    stat = host[pos:pos + k * segs * 8].view(np.float64).reshape(k, segs)[:, :-1]
    pos += k * segs * 8
    have = out.present[idx]
    sel = idx[have]
    numels = plan.numels[idx]
    nan = stat[3] > 0
    out.max[sel] = np.where(nan, np.nan, stat[0])[have]
    out.min[sel] = np.where(nan, np.nan, stat[1])[have]
    out.norm[sel] = np.sqrt(stat[2])[have]
    empty = sel[plan.numels[sel] == 0]  # a zero-element gradient: present, no values
    out.max[empty] = out.min[empty] = out.norm[empty] = np.nan
    if level == "L2":
        nb = len(bounds)
        le = stat[4:4 + nb].T  # (params, bounds): count of x <= b
        n = np.maximum(numels, 1).astype(np.float64)
        inner = np.diff(le, axis=1, prepend=0)
        last = numels - stat[3] - le[:, -1]
        dist = np.concatenate([inner, last[:, None]], axis=1) / n[:, None]
        out.dist[sel] = dist[have]
        out.zeros[sel] = (stat[4 + nb] / n)[have]
        out.dist[empty], out.zeros[empty] = np.nan, np.nan
    if level in ("L1", "L2"):
        lo = offsets[idx[0]]
        out.direction[lo:lo + grp.nbytes] = host[pos:pos + grp.nbytes]
        pos += grp.nbytes
    if level == "L0":
        nf = grp.nbytes * 8
        f32 = host[pos:pos + nf * 4].view(np.float32)
        start = 0
        for j, i in enumerate(grp.index):
            if out.present[i]:
                d = hasher(hash_name)
                d.update(f32[start:start + plan.numels[i]].tobytes())
                out.hash[i] = np.frombuffer(d.digest(), np.uint8)
            start += padded_nbytes(plan.numels[i]) * 8
        pos += nf * 4
    return pos
