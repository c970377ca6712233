"""How far a re-run's output ``p`` is from the original ``o``, relative to the call's own scale.

With ``d = p - o`` and the scale ``S`` of the call (``scales.py``):

* ``tensor`` scale: ``max_rel = max|d| / max|o|`` (the output tensor's scale; an all-zero ``o``
  gives 0 when ``d`` is 0 too, else infinity);
* per-element scale (``magnitude``, ``element``): ``max_rel = max_i |d_i| / S_i``, ``S`` a tensor
  shaped like ``o`` (``sum |a||b|``, or ``|p| + offset``);
* ``max_abs = max|d|``; ``nan_inf`` = elements where one side is NaN/Inf and the other is not, or
  both are non-finite but different (+Inf vs -Inf, NaN vs Inf); the maxima are taken over the
  finite pairs, so a NaN does not hide the rest of the tensor. Two edges of the range are no
  mismatch (issue 34): a re-run's +-Inf against an original at the same-signed +-max (class O,
  ``_at_the_edge``), and an element-wise call's original +-Inf whose own operand at that element
  is the same-signed +-max of its dtype, a stand-in for +-infinity (class O2, ``_stood_in``).

The comparison stays on the device (``device_stats``: 0-dim tensors, nothing read back) and is
read back at the step's gather point (``deferred.py``). Its fast form is three kernels for the
tensor scale -- ``p - o`` and two ``aminmax`` (of ``d`` and of ``o``) -- and three for a
per-element scale (``p - o``, ``/ S``, ``aminmax``); it is conclusive when every value read back
is finite (a NaN/Inf difference, or ``0 / 0`` where ``S`` is zero, makes it inconclusive: the call
site is then compared in the exact form, which counts NaN/Inf mismatches and ignores non-finite
pairs). Large tensors are compared in chunks of ``CHUNK`` elements (a few chunk-sized
temporaries instead of copies of the whole output).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..perturb.host import host_value
from .scales import TENSOR

CHUNK = 1 << 18  # 2 MiB of float64 per temporary
#: values of an exact comparison (``_exact``); the fast forms have 4 (tensor scale) or 2
EXACT = 6
#: error-model families (``scales.family``) whose every output element reads only the same
#: (broadcast) element of each input: an original +-Inf there can be read against its own
#: operands (``_stood_in``)
STAND_IN_FAMILIES = frozenset({"arithmetic", "additive", "elementwise", "saturating", "gelu"})
#: the largest finite value of each floating dtype: a Python number equal to one is a stand-in
_MAXES = frozenset(torch.finfo(d).max for d in (torch.float16, torch.bfloat16, torch.float32,
                                                 torch.float64))


class Stats(NamedTuple):
    """One comparison's statistics (a named tuple: one is built per finding)."""

    max_rel: float   # worst |d_i| / S_i (the call's scale), over the finite pairs
    max_abs: float   # worst |d_i| over the finite pairs (NaN when the fast form did not keep it)
    nan_inf: int     # NaN/Inf mismatches
    scale: float     # tensor scale: max|o|; per-element: the result's max|p| (exact form), NaN


def _chunks(t: torch.Tensor, size: int):
    """Pieces of ``t`` with at most ``size`` elements each, by slicing (no copies)."""
    if t.numel() <= size or t.dim() == 0:
        yield t
        return
    row = t.numel() // t.shape[0]
    if row > size:
        for i in range(t.shape[0]):
            yield from _chunks(t[i], size)
        return
    step = max(1, size // row)
    for s in range(0, t.shape[0], step):
        yield t.narrow(0, s, min(step, t.shape[0] - s))


def _fast(o, p, scale) -> tuple:
    """Fast values of one piece: tensor scale (dlo, dhi, olo, ohi), else (rlo, rhi)."""
    d = torch.sub(p, o)
    if scale is None:
        return (*torch.aminmax(d), *torch.aminmax(o))
    # in place when the quotient keeps d's dtype (the usual case: S from the upcast inputs)
    return tuple(torch.aminmax(d.div_(scale) if d.dtype == scale.dtype else torch.div(d, scale)))


def _exact(o, p, scale, operands=None) -> tuple:
    """Exact values of one piece: tensor scale (dlo, dhi, olo, ohi, mismatches, pmax), else
    (rlo, rhi, dlo, dhi, mismatches, pmax); maxima over the finite pairs (``nan_to_num`` zeroes
    the others: arithmetic kernels instead of boolean masks, which cost several times an add on
    the CPU); a NaN/Inf mismatch is a pair whose class (finite, NaN, +Inf, -Inf) differs;
    ``pmax = max|p|`` over the finite values, the result's scale (the bits it lost relative to
    itself: issue 34, ``Judging.record``). ``operands``: an element-wise call's inputs
    (``stand_in_operands``, broadcastable to ``o``): an original +-Inf that a same-signed
    +-max operand of the element stands for is no mismatch (``_stood_in``), looked at only when
    a mismatch was seen (the CPU: its count read on the host by its bits, no ATen operator; an
    accelerator, where reading it would be a sync, looks at once)."""
    cdt = torch.promote_types(torch.promote_types(o.dtype, p.dtype), torch.float32)
    oc, pc = o.to(cdt), p.to(cdt)
    if o.is_floating_point():
        pc = _at_the_edge(oc, pc, torch.finfo(o.dtype).max)
    if operands and not oc.is_cpu:
        pc = _stood_in(oc, pc, operands)
        operands = None
    vals = _exact_values(oc, pc, scale, cdt)
    if operands and host_value(vals[4]):   # a mismatch: the stand-ins looked at
        vals = _exact_values(oc, _stood_in(oc, pc, operands), scale, cdt)
    return vals


def _exact_values(oc, pc, scale, cdt) -> tuple:
    of = torch.nan_to_num(oc, nan=0.0, posinf=0.0, neginf=0.0)
    pf = torch.nan_to_num(pc, nan=0.0, posinf=0.0, neginf=0.0)
    d0 = torch.nan_to_num_(pc - oc, nan=0.0, posinf=0.0, neginf=0.0)
    code_o = torch.nan_to_num(oc, nan=1.0, posinf=2.0, neginf=4.0).sub_(of)
    code_p = torch.nan_to_num(pc, nan=1.0, posinf=2.0, neginf=4.0).sub_(pf)
    mis = code_o.sub_(code_p).abs_().sign_().sum().to(cdt)
    dlo, dhi = torch.aminmax(d0)
    pmax = torch.linalg.vector_norm(pf, math.inf)
    if scale is None:
        olo, ohi = torch.aminmax(of)
        return dlo, dhi, olo, ohi, mis, pmax
    r = torch.nan_to_num_(d0.div(scale.to(cdt)), nan=0.0, posinf=math.inf, neginf=-math.inf)
    rlo, rhi = torch.aminmax(r)
    return rlo, rhi, dlo, dhi, mis, pmax


def _at_the_edge(oc, pc, big: float):
    """``pc`` with its +-Inf put back to ``oc`` where ``oc`` is the same-signed +-max of the
    original's dtype (``big``): a one-ulp nudge of an input moved a result that sits at the
    range's edge one ulp outwards, and the dtype holds nothing between max and Inf (issue 34,
    class O: Longformer's mask, ``ones @ finfo.min``, nudged to ``(1 + 2u) finfo.min``). The
    move is at most that ulp, far below any threshold; counting it as none keeps the Inf that
    IEEE arithmetic made of it from being a NaN/Inf mismatch. The exact form only (the fast
    form is inconclusive on an Inf): six kernels (``oc * inf`` is the Inf of ``oc``'s sign)."""
    edge = (pc == oc * math.inf).logical_and_(oc.abs() == big)
    return torch.where(edge, oc, pc)


def _stood_in(oc, pc, operands):
    """``pc`` with ``oc``'s +-Inf put back where an operand of that element is the same-signed
    +-max of its own dtype (issue 34, class O2). Masks write ``finfo.min`` as a stand-in for
    -infinity (a dtype's -Inf would make ``0 * mask`` and ``-inf - -inf`` NaN), so a +-Inf the
    original made of it -- GPT-Neo's ``where(causal, scores, finfo.min) + mask``, ``finfo.min +
    finfo.min`` = -Inf in fp32 -- is the value the stand-in means, while the upcast re-run, whose
    range holds -6.8e38, keeps a finite value that means the same. The move is not measured
    (there is no finite difference to measure), it is counted as none. An Inf from ordinary
    finite operands (fp32 ``3e38 + 3e38``, a variance of values near 1e20) has no stand-in and
    stays a mismatch. Per operand two kernels and a comparison with the Inf of its sign
    (``x * inf`` is the Inf of ``x``'s sign); a Python number stands in when it is some floating
    dtype's +-max (``torch.finfo(torch.float32).min`` passed as a number)."""
    meant = None
    for x in operands:
        if isinstance(x, torch.Tensor):
            hit = (x * math.inf == oc).logical_and_(x.abs() == torch.finfo(x.dtype).max)
        elif abs(x) in _MAXES:
            hit = oc == math.copysign(math.inf, x)
        else:
            continue
        meant = hit if meant is None else meant.logical_or_(hit)
    return pc if meant is None else torch.where(meant, oc, pc)


def stand_in_operands(family: str, leaves, out: torch.Tensor):
    """The operands ``_stood_in`` reads for a call of error-model ``family`` with output
    ``out``: its floating tensor inputs on ``out``'s device whose shape broadcasts to ``out``'s,
    and its finite Python floats, when each output element reads only the same (broadcast)
    element of each input (``STAND_IN_FAMILIES``); None otherwise (a reduction, a matmul:
    compared as before). Shapes only: no ATen operator on the healthy path."""
    if family not in STAND_IN_FAMILIES:
        return None
    shape, ops = tuple(out.shape), []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.device == out.device and _broadcasts(x.shape, shape):
                ops.append(x)
        elif isinstance(x, float) and math.isfinite(x):
            ops.append(x)
    return ops or None


def _broadcasts(shape, to: tuple) -> bool:
    """Does ``shape`` broadcast to ``to`` (without growing it)?"""
    if len(shape) > len(to):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(tuple(shape)), reversed(to)))


def combine(parts: list) -> tuple:
    """One comparison's values from those of its pieces (blocks, chunks), on the device: minima
    and maxima alternate, a fifth value (mismatches) is summed, a sixth (``max|p|``) is a
    maximum."""
    if len(parts) == 1:
        return tuple(parts[0])
    s = torch.stack([torch.stack(list(p)).to(torch.float64) for p in parts])
    out = []
    for j in range(s.shape[1]):
        col = s[:, j]
        out.append(col.sum() if j == 4 else (col.amin() if j % 2 == 0 else col.amax()))
    return tuple(out)


def device_stats(o: torch.Tensor, p: torch.Tensor, scale=None, exact: bool = False,
                 lam: float = 0.0, operands=None) -> tuple:
    """The comparison of one pair as 0-dim tensors on ``p``'s device; nothing is read back.

    ``scale``: None for the tensor scale, else a tensor shaped like ``o`` (per-element scale).
    ``exact``: the exact form (NaN/Inf mismatches counted). ``lam``: the per-element scale is
    ``|p| + lam * scale`` (``scales.py``'s two terms), made chunk by chunk (no tensor of ``o``'s
    size). ``operands``: ``stand_in_operands`` of the call (the exact form reads them after a
    mismatch). See the module doc."""
    if not exact:
        operands = None
    if lam and scale is not None:
        fn = _exact if exact else _fast

        def two(a, b, s, ops=None):
            s = torch.add(b.abs(), s, alpha=lam)
            return fn(a, b, s, ops) if ops else fn(a, b, s)

        return _compare_pieces(o, p, scale, exact, two, operands)
    return _compare_pieces(o, p, scale, exact, None, operands)


def _compare_pieces(o, p, scale, exact, fn, operands=None) -> tuple:
    if o.shape != p.shape:
        raise ValueError(f"output shapes differ: {tuple(o.shape)} vs {tuple(p.shape)}")
    if o.device != p.device:
        o = o.to(p.device)
        if scale is not None:
            scale = scale.to(p.device)
        operands = None   # (a to_cpu re-run: the original's operands are on another device)
    if o.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64, device=p.device)
        return (zero,) * (EXACT if exact else (4 if scale is None else 2))
    if fn is None:
        fn = _exact if exact else _fast
    if o.numel() <= CHUNK:
        return fn(o, p, scale, operands) if operands else fn(o, p, scale)
    scales = _chunks(scale, CHUNK) if scale is not None else iter(lambda: None, 0)
    if not operands:
        return combine([fn(a, b, s) for a, b, s in zip(_chunks(o, CHUNK), _chunks(p, CHUNK),
                                                       scales)])
    # the operands, expanded to o's shape (a view), are cut as o is (numbers are kept whole)
    cuts = [_chunks(x.expand(o.shape), CHUNK) if isinstance(x, torch.Tensor)
            else iter(lambda x=x: x, object()) for x in operands]
    return combine([fn(a, b, s, list(ops)) for a, b, s, *ops in
                    zip(_chunks(o, CHUNK), _chunks(p, CHUNK), scales, *cuts)])


def stats_from(values, kind: str = TENSOR) -> Stats | None:
    """``Stats`` from the values ``device_stats`` returned (read back as floats); None when the
    fast form is inconclusive (a value is not finite: compare exactly). An exact per-element
    comparison's ``scale`` is the result's ``max|p|``."""
    if len(values) >= EXACT:
        a_lo, a_hi, b_lo, b_hi, mis, pmax = values[:EXACT]
        if kind == TENSOR:
            dmax, omax = max(0.0, -a_lo, a_hi), max(0.0, -b_lo, b_hi)
            return Stats(_ratio(dmax, omax), dmax, int(mis), omax)
        return Stats(max(0.0, -a_lo, a_hi), max(0.0, -b_lo, b_hi), int(mis), pmax)
    if not all(math.isfinite(v) for v in values):
        return None
    if len(values) == 4:
        dlo, dhi, olo, ohi = values
        dmax, omax = max(0.0, -dlo, dhi), max(0.0, -olo, ohi)
        return Stats(_ratio(dmax, omax), dmax, 0, omax)
    rlo, rhi = values
    return Stats(max(0.0, -rlo, rhi), math.nan, 0, math.nan)


def fast_error(values) -> float | None:
    """``max_rel`` of fast values read back (None when inconclusive): the gather's test, without
    building ``Stats``."""
    if len(values) == 4:
        dlo, dhi, olo, ohi = values
        if not (-math.inf < dlo and dhi < math.inf and -math.inf < olo and ohi < math.inf):
            return None   # NaN fails every comparison
        return _ratio(dhi if dhi > -dlo else -dlo, ohi if ohi > -olo else -olo)
    rlo, rhi = values
    if not (-math.inf < rlo and rhi < math.inf):
        return None
    return rhi if rhi > -rlo else -rlo


def _ratio(dmax: float, omax: float) -> float:
    if omax > 0:
        return dmax / omax
    return 0.0 if dmax == 0 else math.inf


def compare(o: torch.Tensor, p: torch.Tensor, scale=None) -> Stats:
    """Exact ``Stats`` of one pair (one read-back)."""
    return compare_many([(o, p, scale)])[0]


def compare_many(triples) -> list[Stats]:
    """Exact ``Stats`` of each ``(original, perturbed, scale or None)``, one read-back for all."""
    triples = list(triples)
    if not triples:
        return []
    values = [device_stats(o, p, s, exact=True) for o, p, s in triples]
    device = values[0][0].device
    flat = torch.stack([v.to(device=device, dtype=torch.float64) for vals in values
                        for v in vals]).tolist()
    return [stats_from(flat[EXACT * i:EXACT * (i + 1)], TENSOR if s is None else "scaled")
            for i, (_, _, s) in enumerate(triples)]
