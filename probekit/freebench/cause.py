"""Why a call was flagged: ill-conditioned or inaccurate (run only for flagged calls).

Two float64 re-runs of the flagged call, on its own inputs upcast to float64:

* ``r``: the exact-ish result (every floating input in float64);
* ``s``: the same with every floating input first moved by one ulp of its *own* dtype, then
  upcast, twice: every element towards +inf (``perturb.add_noise``: the condition number of a
  sum) and every element's last bit flipped (``perturb.bit_noise``: up or down element by
  element, which a shift-invariant op such as softmax does not ignore). How far the mathematical
  result moves under a one-ulp input change, whatever the kernel; the larger of the two counts.

With the metric of ``metric.py`` (the floor of the original output's dtype) and the row's
threshold ``thr``:

* ``accuracy`` = error of the original output against ``r`` (a NaN/Inf where float64 is finite,
  e.g. fp32 overflow of ``var`` at 1e20, counts as infinite);
* ``sensitivity`` = error of ``s`` against ``r``.

``inaccurate`` when ``accuracy > thr`` and it exceeds ``sensitivity`` (the result is off by more
than the input's own last bit explains: the kernel lost precision); else ``ill-conditioned`` when
``sensitivity > thr`` (the output itself moves that far under a one-ulp change); else
``unconfirmed`` (a float64 recomputation explains neither; e.g. change_value ordering effects);
``nondeterministic`` for no_change rows; ``""`` when the analysis could not run.
``analyse_backward`` does the same for input gradients (backward metric, same upstream gradient).
"""
from __future__ import annotations

import math

import torch

from . import handlers, perturb
from .metric import compare_many, floor_for

INACCURATE = "inaccurate"
ILL_CONDITIONED = "ill-conditioned"
UNCONFIRMED = "unconfirmed"
NONDETERMINISTIC = "nondeterministic"


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


def _run(func, leaves, spec) -> list:
    args, kwargs = perturb.unflatten(leaves, spec)
    return handlers.float_outputs(func(*args, **kwargs))


def _score(st) -> float:
    return math.inf if st.nan_inf or st.sign_flip else st.max_rel


def _verdict(acc: float, sens: float, thr: float) -> str:
    """``acc`` = the worst error of the original against float64, ``sens`` = the worst error of
    float64 against its one-ulp nudges: inaccurate when ``acc`` exceeds the threshold and the
    sensitivity, ill-conditioned when the sensitivity alone exceeds the threshold, unconfirmed
    otherwise."""
    if acc > thr and acc > sens:
        return INACCURATE
    if sens > thr:
        return ILL_CONDITIONED
    return UNCONFIRMED


def analyse(func, fresh, spec, items: list, blocks=None) -> dict:
    """``{output_index: cause}`` for the flagged outputs ``items`` = [(index, tensor, thr)].

    ``fresh()``: the call's inputs as the original call saw them, with the state it writes as
    fresh clones (``state.restore``), asked once per re-run. ``blocks``: the call's
    ``blocks.Plan`` when it was checked in blocks; the analysis then runs block by block (the
    worst errors of the blocks are those of the whole tensor). One float64 result besides the
    reference is alive at a time. The caller runs this under ``no_grad`` with every function mode
    off; autocast is turned off here. Raises on failure."""
    from .guards import no_autocast

    acc = {index: 0.0 for index, _, _ in items}
    sens = dict(acc)
    parts = [None] if blocks is None else blocks.parts
    with no_autocast(True):
        for part in parts:
            def inputs():
                x = fresh()
                return x if part is None else blocks.leaves(x, *part)

            def original(o):
                return o if part is None else blocks.output(o, *part)

            r = dict(_run(func, [_to64(x) for x in inputs()], spec))
            stats = compare_many([(original(o), r[i], floor_for(o.dtype)) for i, o, _ in items])
            for (i, _, _), st in zip(items, stats):
                acc[i] = max(acc[i], _score(st))
            for noise in (perturb.add_noise, perturb.bit_noise):
                s = dict(_run(func, [_to64(_nudge(noise)(x)) for x in inputs()], spec))
                stats = compare_many([(r[i], s[i], floor_for(o.dtype)) for i, o, _ in items])
                del s
                for (i, _, _), st in zip(items, stats):
                    sens[i] = max(sens[i], _score(st))
            del r
    return {i: _verdict(acc[i], sens[i], thr) for i, _, thr in items}


def _grads64(func, leaves, spec, diff, out_index, g) -> list:
    """Input gradients (for the leaves in ``diff``) of the call's output ``out_index`` with
    upstream gradient ``g``, everything in float64."""
    leaves = list(leaves)
    ins = []
    for i in diff:
        leaves[i] = leaves[i].detach().requires_grad_(True)
        ins.append(leaves[i])
    y = dict(_run(func, leaves, spec))[out_index]
    return list(torch.autograd.grad(y, ins, g.to(torch.float64), allow_unused=True))


def analyse_backward(func, fresh, spec, diff: list, out_index: int, g, items: list) -> dict:
    """``analyse`` for the backward stage: ``items`` = [(input position, reference gradient,
    thr)], judged with the backward metric (relative to the gradient's scale). ``g`` is the
    upstream gradient the check used. One nudged float64 gradient besides the float64
    reference is alive at a time, and the comparisons make no scaled copies."""
    from .backward import BACKWARD_FLOOR, grad_stats
    from .guards import no_autocast
    from .metric import stats_from

    def score(a, b) -> float:
        values = torch.stack([v.to(torch.float64) for v in grad_stats(a, b, True)]).tolist()
        return _score(stats_from(values, BACKWARD_FLOOR))

    pos = {i: k for k, i in enumerate(diff)}
    with no_autocast(True), torch.enable_grad():
        r = _grads64(func, [_to64(x) for x in fresh()], spec, diff, out_index, g)
    acc, sens = {}, {}
    for index, gr, _ in items:
        ref = r[pos[index]]
        if ref is not None:
            with torch.no_grad():
                acc[index] = score(gr, ref)
            sens[index] = 0.0
    for noise in (perturb.add_noise, perturb.bit_noise):
        with no_autocast(True), torch.enable_grad():
            s = _grads64(func, [_to64(_nudge(noise)(x)) for x in fresh()], spec, diff,
                         out_index, g)
        for index in list(acc):
            k = pos[index]
            if s[k] is None:   # no gradient under the nudge: no verdict for this input
                del acc[index], sens[index]
                continue
            with torch.no_grad():
                sens[index] = max(sens[index], score(r[k], s[k]))
        del s
    return {index: _verdict(acc[index], sens[index], thr)
            for index, _, thr in items if index in acc}
