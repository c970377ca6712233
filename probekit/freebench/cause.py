"""Why a call was flagged: inaccurate, ill-conditioned or unconfirmed (run only for flagged calls,
once per call site).

Float64 re-runs of the call, on its inputs as the op computed with them (autocast's casts
included) upcast to float64:

* ``r``: the reference (every floating input in float64);
* ``s``: the same with the floating inputs first moved by one ulp of their *own* dtype, then
  upcast (``NUDGES``): every element towards +inf (``perturb.add_noise``: the condition number of
  a sum) and every element's last bit flipped (``perturb.flip_last_bit``: up or down by the
  element's own bits, which a shift-invariant op such as softmax does not ignore, while equal
  values stay equal), in every input and in the first alone. How far the mathematical result
  moves under a one-ulp input change, whatever the kernel; the largest move counts.

Both are measured with the row's own metric (``metric.py``, the call's scale of ``scales.py``:
``sum |a||b|`` recomputed on the float64 inputs for the accumulating APIs in the accuracy modes,
the output tensor's scale otherwise):

* ``accuracy`` = error of the original output against ``r`` (a NaN/Inf where float64 is finite,
  e.g. fp32 overflow of ``var`` at 1e20, counts as infinite);
* ``sensitivity`` = error of ``s`` against ``r``.

With ``t = 16 u`` of the compute dtype (what a correct kernel may lose, ``scales.py``):
``inaccurate`` when ``accuracy > t`` and ``accuracy > 2 * sensitivity`` (the kernel lost more than
the input's own last bit explains, with a factor 2 for the rounding of the nudged inputs);
else ``ill-conditioned`` when ``sensitivity > t`` (the exact result itself moves that far under a
one-ulp change); else ``unconfirmed`` (a float64 recomputation explains neither: e.g. the
rounding jitter of two runs of the kernel); ``nondeterministic`` for no_change rows.
``analyse_backward`` does the same for input gradients (same upstream gradient).
"""
from __future__ import annotations

import math

import torch

from . import handlers, perturb, scales
from .metric import compare_many
from .scales import ELEMENT, MAGNITUDE

INACCURATE = "inaccurate"
ILL_CONDITIONED = "ill-conditioned"
UNCONFIRMED = "unconfirmed"
NONDETERMINISTIC = "nondeterministic"
#: how much more than the sensitivity the error must be to blame the kernel
BLAME_FACTOR = 2.0


def _to64(x):
    if perturb.is_float(x) and x.dtype != torch.float64:
        return x.detach().to(torch.float64)
    return x.detach() if perturb.is_float(x) else x


def _nudge(noise):
    def fn(x):
        if not perturb.is_float(x):
            return x
        try:
            return noise(x.detach())
        except perturb.Cancel:  # a dtype without a bit-level ulp: left as is
            return x
    return fn


#: the one-ulp nudges of the sensitivity: (noise, every floating input or the first only).
#: Nudging every input alike misses a difference of two inputs that move together (both
#: values one ulp up: (a + ulp) - (b + ulp)); the noise modes move the first alone. The flips
#: follow each element's own bits, so equal values stay equal (a constant batch-norm channel
#: stays constant: its exact output, 0, does not move)
NUDGES = ((perturb.add_noise, False), (perturb.flip_last_bit, False),
          (perturb.add_noise, True), (perturb.flip_last_bit, True))


def nudged(leaves: list, noise, first_only: bool) -> list:
    """The leaves with ``noise`` applied to every floating tensor, or to the first only."""
    fn = _nudge(noise)
    if not first_only:
        return [fn(x) for x in leaves]
    out, done = list(leaves), False
    for i, x in enumerate(leaves):
        if not done and perturb.is_float(x):
            out[i], done = fn(x), True
    return out


def _run(func, leaves, spec, kwargs_fix=None) -> list:
    args, kwargs = perturb.unflatten(leaves, spec)
    if kwargs_fix is not None:
        kwargs = kwargs_fix(kwargs)
    return handlers.float_outputs(func(*args, **kwargs))


def _score(st) -> float:
    return math.inf if st.nan_inf else st.max_rel


def verdict(acc: float, sens: float, compute_dtype) -> str:
    """``acc`` = the error of the original against float64, ``sens`` = the move of float64 under
    one-ulp input nudges, both in the call's scale (module doc)."""
    t = scales.ACCURACY_UNITS * scales.unit_roundoff(compute_dtype)
    if acc > t and acc > BLAME_FACTOR * sens:
        return INACCURATE
    if sens > t:
        return ILL_CONDITIONED
    return UNCONFIRMED


def _scale(kind, cdt, r, mag):
    if kind == MAGNITUDE:
        return mag
    if kind == ELEMENT:
        return r.abs() + scales.element_offset(cdt)
    return None


def analyse(func, fresh, spec, items: list, blocks=None) -> dict:
    """``{output_index: cause}`` for the flagged outputs ``items`` = [(index, original tensor,
    output descriptor)] (descriptor: ``(index, dtype, shape, scale kind, thr, hot, compute
    dtype)``).

    ``fresh()``: the call's inputs as the original call computed with them, with the state it
    writes as fresh clones (``state.restore``), asked once per re-run. ``blocks``: the call's
    ``blocks.Plan`` when it was checked in blocks; the analysis then runs block by block. The
    caller runs this under ``no_grad`` with every function mode off; autocast is turned off
    here. Raises on failure."""
    from .guards import no_autocast

    acc = {index: 0.0 for index, _, _ in items}
    sens = dict(acc)
    kinds = {index: desc[3] for index, _, desc in items}
    cdts = {index: desc[6] for index, _, desc in items}
    parts = [None] if blocks is None else blocks.parts
    with no_autocast(True):
        for part in parts:
            def inputs():
                x = fresh()
                return x if part is None else blocks.leaves(x, *part)

            def original(o):
                return o if part is None else blocks.output(o, *part)

            x64 = [_to64(x) for x in inputs()]
            r = dict(_run(func, x64, spec))
            mag = {}
            if any(k == MAGNITUDE for k in kinds.values()):
                mag = dict(_run(func, scales.magnitude_leaves(x64), spec,
                                scales.magnitude_kwargs))
            del x64
            sc = {i: _scale(kinds[i], cdts[i], r[i], mag.get(i)) for i, _, _ in items}
            stats = compare_many([(original(o), r[i], sc[i]) for i, o, _ in items])
            for (i, _, _), st in zip(items, stats):
                acc[i] = max(acc[i], _score(st))
            for noise, first in NUDGES:
                s = dict(_run(func, [_to64(x) for x in nudged(inputs(), noise, first)], spec))
                stats = compare_many([(r[i], s[i], sc[i]) for i, _, _ in items])
                del s
                for (i, _, _), st in zip(items, stats):
                    sens[i] = max(sens[i], _score(st))
            del r, mag, sc
    return {i: verdict(acc[i], sens[i], cdts[i]) for i, _, _ in items}


def _grads64(func, leaves, spec, diff, out_index, g, kwargs_fix=None) -> list:
    """Input gradients (for the leaves in ``diff``) of the call's output ``out_index`` with
    upstream gradient ``g``, everything in float64."""
    leaves = list(leaves)
    ins = []
    for i in diff:
        leaves[i] = leaves[i].detach().requires_grad_(True)
        ins.append(leaves[i])
    y = dict(_run(func, leaves, spec, kwargs_fix))[out_index]
    return list(torch.autograd.grad(y, ins, g.to(torch.float64), allow_unused=True))


def analyse_backward(func, fresh, spec, diff: list, out_index: int, g, items: list) -> dict:
    """``analyse`` for the backward stage: ``items`` = [(input position, reference gradient,
    descriptor)], judged relative to each gradient's scale. ``g`` is the upstream gradient the
    check used. One nudged float64 gradient besides the float64 reference is alive at a time."""
    from .guards import no_autocast

    pos = {i: k for k, i in enumerate(diff)}
    cdts = {index: desc[6] for index, _, desc in items}
    mag = [None] * len(diff)
    with no_autocast(True), torch.enable_grad():
        x64 = [_to64(x) for x in fresh()]
        r = _grads64(func, x64, spec, diff, out_index, g)
        if any(desc[3] == MAGNITUDE for _, _, desc in items):   # sum |g||b| (scales.py)
            mag = _grads64(func, scales.magnitude_leaves(x64), spec, diff, out_index, g.abs(),
                           scales.magnitude_kwargs)
        del x64

    def score(a, b, k) -> float:
        return _score(compare_many([(a, b, mag[k])])[0])

    acc, sens = {}, {}
    for index, gr, _ in items:
        ref = r[pos[index]]
        if ref is not None:
            with torch.no_grad():
                acc[index] = score(gr, ref, pos[index])
            sens[index] = 0.0
    for noise, first in NUDGES:
        with no_autocast(True), torch.enable_grad():
            s = _grads64(func, [_to64(x) for x in nudged(fresh(), noise, first)], spec, diff,
                         out_index, g)
        for index in list(acc):
            k = pos[index]
            if s[k] is None:   # no gradient under the nudge: no verdict for this input
                del acc[index], sens[index]
                continue
            with torch.no_grad():
                sens[index] = max(sens[index], score(r[k], s[k], k))
        del s
    return {index: verdict(acc[index], sens[index], cdts[index])
            for index, _, _ in items if index in acc}
