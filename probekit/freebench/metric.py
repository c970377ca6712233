"""How far a perturbed output is from the original one, element by element.

For an original output ``o`` and a perturbed output ``p`` (compared in the wider of their dtypes,
at least float32), with the floor ``f`` of ``o``'s dtype (``FLOORS``):

* ``err_i = |p_i - o_i| / max(|o_i|, f)``: relative error where ``|o_i| >= f``, absolute error
  measured against the floor below it (so near-zero outputs do not dominate);
* ``max_rel = max_i err_i`` over the elements where both values are finite; ``rel_part`` says
  whether that maximum came from an element above the floor (relative) or below it (absolute);
* ``max_abs = max_i |p_i - o_i|`` over the same elements;
* ``nan_inf``: elements where one side is NaN/Inf and the other is not, or both are non-finite but
  different (+Inf vs -Inf, NaN vs Inf). They do not hide the other elements: ``max_rel`` is still
  taken over the finite ones (msprobe's chunked max turned a whole chunk into "consistent");
* ``sign_flip``: elements where both ``|o_i|`` and ``|p_i|`` are at least ``f`` and their signs
  differ.

The formula is symmetric in sign: ``(-1e4 - 0.01) + 1e4`` scores like ``(1e4 + 0.01) - 1e4``
(msprobe clamped signed values to a positive floor, so negative outputs were never flagged).
Large tensors are compared in chunks of ``CHUNK`` elements, so the extra memory is a few
chunk-sized temporaries rather than copies of the whole output; all statistics of one call come
back in a single device sync (a second, exact pass runs only for pairs holding NaN/Inf or an
error of 1 or more).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: small-value floor per output dtype (msprobe's forward floors, the square roots of its tolerances)
FLOORS = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-8}
DEFAULT_FLOOR = 1e-4
CHUNK = 1 << 18  # 2 MiB of float64 per temporary
_WIDE = (torch.float32, torch.float64)


def floor_for(dtype: torch.dtype) -> float:
    return FLOORS.get(dtype, DEFAULT_FLOOR)


class Stats(NamedTuple):
    """One comparison's statistics (a named tuple: one is built per finding)."""

    max_rel: float
    max_abs: float
    nan_inf: int
    sign_flip: int
    rel_part: bool  # True: max_rel came from an element above the floor (relative error)


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


def _fast_chunk(o, p, floor: float, cdt, device) -> torch.Tensor:
    """[max err, max |p-o|, |o| at the max-err element]: cheap arithmetic only (no masks).

    Non-finite values make the second entry NaN/Inf; the caller then takes the exact path."""
    oc = o.to(device=device, dtype=cdt)   # may be ``o`` itself: never modified in place
    d = (p.to(device=device, dtype=cdt) - oc).abs_()
    dmax = d.amax()
    ao = oc.abs().reshape(-1)
    r = torch.nan_to_num_(d.reshape(-1).div_(ao.clamp_min(floor)), nan=0.0, posinf=0.0,
                          neginf=0.0)
    rmax, idx = r.max(0)
    return torch.stack([rmax, dmax, ao[idx]])


def _exact_chunk(o, p, floor: float, cdt, device) -> torch.Tensor:
    """[max rel above floor, max abs/floor below it, max |p-o|, NaN/Inf mismatches, sign flips]
    over the finite pairs.

    Arithmetic kernels only where it can (boolean masks such as ``isfinite``, ``where`` and
    ``isclose`` cost 5-15 times an add on the CPU): non-finite values are zeroed with
    ``nan_to_num``; the relative and below-floor errors come out of one ``aminmax`` of the error
    carrying the sign of ``|o| - floor`` (as in the fast path); a NaN/Inf mismatch is a pair
    whose class (finite, NaN, +Inf, -Inf) differs, read from ``nan_to_num`` with a code per
    class; a sign flip is ``o * p < 0`` with ``min(|o|, |p|) >= floor``, both finite."""
    oc = o.to(device=device, dtype=cdt)
    pc = p.to(device=device, dtype=cdt)
    of = torch.nan_to_num(oc, nan=0.0, posinf=0.0, neginf=0.0)
    pf = torch.nan_to_num(pc, nan=0.0, posinf=0.0, neginf=0.0)
    # the difference of a finite pair; 0 where it is not finite (either side NaN/Inf)
    d0 = torch.nan_to_num_(pc - oc, nan=0.0, posinf=0.0, neginf=0.0)
    dlo, dhi = torch.aminmax(d0)
    ao = of.abs()
    lo, hi = torch.aminmax(d0.div(ao.clamp_min(floor)).copysign_(ao.sub(floor)))
    # class codes: 0 finite, 1 NaN, 2 +Inf, 4 -Inf
    code_o = torch.nan_to_num(oc, nan=1.0, posinf=2.0, neginf=4.0).sub_(of)
    code_p = torch.nan_to_num(pc, nan=1.0, posinf=2.0, neginf=4.0).sub_(pf)
    mis = code_o.sub_(code_p).abs_().sign_().sum()
    flips = (((of * pf) < 0) & (torch.minimum(ao, pf.abs()) >= floor)).sum()
    zero = torch.zeros((), dtype=cdt, device=device)
    return torch.stack([torch.maximum(hi, zero), torch.maximum(-lo, zero),
                        torch.maximum(dhi, -dlo), mis, flips.to(cdt)])


def _plan(o: torch.Tensor, p: torch.Tensor):
    if o.shape != p.shape:
        raise ValueError(f"output shapes differ: {tuple(o.shape)} vs {tuple(p.shape)}")
    cdt = torch.promote_types(torch.promote_types(o.dtype, p.dtype), torch.float32)
    return cdt, p.device, list(zip(_chunks(o, CHUNK), _chunks(p, CHUNK)))


def fast_stats(o: torch.Tensor, p: torch.Tensor, floor: float) -> torch.Tensor:
    """float64 [max err, max |p-o|, |o| at the max-err element] on ``p``'s device (no sync)."""
    cdt, device, parts = _plan(o, p)
    if o.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=device)
    s = torch.stack([_fast_chunk(a, b, floor, cdt, device) for a, b in parts]).to(torch.float64)
    if len(parts) == 1:
        return s[0]
    i = s[:, 0].argmax()
    return torch.stack([s[i, 0], s[:, 1].amax(), s[i, 2]])


def exact_stats(o: torch.Tensor, p: torch.Tensor, floor: float) -> Stats:
    """``Stats`` with NaN/Inf mismatches and sign flips counted (one more sync)."""
    cdt, device, parts = _plan(o, p)
    if o.numel() == 0:
        return Stats(0.0, 0.0, 0, 0, True)
    s = torch.stack([_exact_chunk(a, b, floor, cdt, device) for a, b in parts]).to(torch.float64)
    r_hi, r_lo, a_max, mis, flips = torch.cat([s[:, :3].amax(0), s[:, 3:].sum(0)]).tolist()
    return Stats(max(r_hi, r_lo), a_max, int(mis), int(flips), r_hi >= r_lo)


def compare_many(pairs) -> list[Stats]:
    """``Stats`` for each ``(original, perturbed, floor)``.

    One host sync for all pairs in the common case. A pair whose differences are not all finite,
    or whose error reaches 1 (where a sign flip is possible), is recomputed exactly."""
    pairs = list(pairs)
    if not pairs:
        return []
    rows = [fast_stats(o, p, f) for o, p, f in pairs]
    device = rows[0].device
    values = torch.stack([r.to(device) for r in rows]).tolist()
    out = []
    for (o, p, f), (rmax, dmax, a_at) in zip(pairs, values):
        if not math.isfinite(dmax) or rmax >= 1.0:
            out.append(exact_stats(o, p, f))
        else:
            out.append(Stats(rmax, dmax, 0, 0, a_at >= f))
    return out


# -- deferred comparison: device-resident values, read back once per step ----------------------
#: number of values ``device_stats`` returns per pair, by kind
FAST_LEN, EXACT_LEN = 4, 5


def device_stats(o: torch.Tensor, p: torch.Tensor, floor: float, exact: bool = False) -> tuple:
    """The comparison of one pair as 0-dim tensors on ``p``'s device; nothing is read back.

    fast (``exact=False``, 4 values): the min and max of ``err_i`` carrying the sign of
    ``|o_i| - floor`` (so ``max`` is the worst error above the floor and ``-min`` the worst below
    it; NaN when any difference is NaN), then the min and max of ``p_i - o_i`` (``max |p-o|`` is
    the larger of ``-min`` and ``max``; NaN/Inf when a difference is). ``stats_from`` turns them
    into ``Stats`` when they are conclusive: every difference finite and ``max err < 1`` (a sign
    flip needs an error above 1, a NaN/Inf mismatch a non-finite difference); otherwise it answers
    None and the pair must be compared exactly (``exact=True``: the 5 values of ``exact_stats``).

    Small tensors take one pass of eight kernels (one more to widen a narrow original): no
    chunking, no stack, no ``abs`` of the difference (``copysign`` sets the sign anyway)."""
    n = o.numel()
    if not exact and 0 < n <= CHUNK and o.shape == p.shape and o.device == p.device:
        cdt = o.dtype if o.dtype == p.dtype else torch.promote_types(o.dtype, p.dtype)
        if cdt not in _WIDE:
            cdt = torch.promote_types(cdt, torch.float32)
        return _fast_values(o if o.dtype == cdt else o.to(cdt), p, floor)
    cdt, device, parts = _plan(o, p)
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return (zero,) * (EXACT_LEN if exact else FAST_LEN)
    if exact:
        s = torch.stack([_exact_chunk(a, b, floor, cdt, device) for a, b in parts])
        if len(parts) > 1:
            s = torch.cat([s[:, :3].amax(0), s[:, 3:].sum(0)])
        else:
            s = s[0]
        return tuple(s.unbind())
    s = torch.stack([torch.stack(_fast_values(a.to(device=device, dtype=cdt), b.to(device), floor))
                     for a, b in parts])
    return combine_fast(s)


def _fast_values(oc: torch.Tensor, p: torch.Tensor, floor: float) -> tuple:
    """(min signed err, max signed err, min p-o, max p-o) of ``oc`` (already in the compute
    dtype, never written) and ``p`` (promoted by the subtraction); NaN propagating."""
    d = p - oc
    dlo, dhi = torch.aminmax(d)
    ao = oc.abs()
    lo, hi = torch.aminmax(d.div_(ao.clamp_min(floor)).copysign_(ao.sub_(floor)))
    return lo, hi, dlo, dhi


def combine_fast(s: torch.Tensor) -> tuple:
    """The fast values of a whole tensor from a (parts x 4) stack of its parts' values."""
    return s[:, 0].amin(), s[:, 1].amax(), s[:, 2].amin(), s[:, 3].amax()


def fast_verdict(values, thr: float):
    """From fast values read back: None when inconclusive, else whether ``max_rel > thr`` (the
    only way a conclusive fast comparison can be a finding)."""
    lo, hi, dlo, dhi = values
    rmax = hi if hi > -lo else -lo
    if not (rmax < 1.0 and -math.inf < dlo and dhi < math.inf):  # NaN fails every comparison
        return None
    return rmax > thr


def stats_from(values, floor: float) -> Stats | None:
    """``Stats`` from the values ``device_stats`` returned (read back as floats); None when fast
    values are inconclusive (the pair must be compared exactly)."""
    if len(values) == EXACT_LEN:
        r_hi, r_lo, a_max, mis, flips = values
        return Stats(max(r_hi, r_lo), a_max, int(mis), int(flips), r_hi >= r_lo)
    lo, hi, dlo, dhi = values
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(dlo)
            and math.isfinite(dhi)):
        return None
    r_hi, r_lo = max(hi, 0.0), max(-lo, 0.0)
    rmax = max(r_hi, r_lo)
    if rmax >= 1.0:
        return None
    return Stats(rmax, max(dhi, -dlo, 0.0), 0, 0, r_hi >= r_lo)


def compare(o: torch.Tensor, p: torch.Tensor, floor: float | None = None) -> Stats:
    """``Stats`` of one pair; ``floor`` defaults to that of ``o``'s dtype."""
    return compare_many([(o, p, floor_for(o.dtype) if floor is None else floor)])[0]
