"""Why a call was flagged: inaccurate, ill-conditioned or unconfirmed (run only for flagged calls,
once per call site). The float64 recomputation every finding must survive.

Float64 re-runs of the call, on its inputs as the op computed with them (autocast's casts
included) upcast to float64:

* ``r``: the reference (every floating input in float64), and the call's magnitude ``S`` in
  float64 by the row's family (``scales.py``: the call on absolute values, ``|r|`` plus a floor,
  a family's formula from ``magnitudes.py``, or the tensor's scale ``max|r|``);
* ``s``: the same with the floating inputs first moved by one ulp of their *own* dtype, then
  upcast (``NUDGES``): every element towards +inf (``perturb.add_noise``: the condition number of
  a sum) and every element's last bit flipped (``perturb.flip_last_bit``: up or down by the
  element's own bits, which a shift-invariant op such as softmax does not ignore, while equal
  values stay equal, as rounding keeps them), in every input and in the first alone. How far the
  mathematical result moves under a one-ulp input change, whatever the kernel.

With the error model's bound ``b_i = C (u_out |r_i| + gamma_k(u_acc) S_i)`` of the row (its
compute dtype, its reduction length):

* ``accuracy`` = ``max_i |o_i - r_i| / b_i`` (a NaN/Inf where float64 is finite, e.g. fp32
  overflow of ``var`` at 1e20, counts as infinite);
* ``moved`` = ``max_i |s_i - r_i| / b_i`` over the nudges (the same units);
* ``lost`` = the largest move beyond float64's own rounding of the call
  (``|s_i - r_i| - C (u64 |r_i| + gamma_k(u64) S_i)``) relative to the call's magnitude
  ``max(max S, max|r|)`` (issue 26: half the significant bits *relative to S*; a result that
  cancels far below its ``S``, a gradient that is 0 by structure, moves by about ``u S`` under
  one-ulp nudges, as rounding does, and keeps its bits). The sensitivity modes' rows carry their
  family too (``S`` by the same formulas as the accuracy modes'), only their fast check uses the
  tensor's scale.

``inaccurate`` when ``accuracy > 1`` and ``accuracy > 2 * moved`` (the kernel lost more than a
correct kernel may and more than the inputs' own last bit explains, with a factor 2 for the
rounding of the nudged inputs); else ``ill-conditioned`` when ``lost > sqrt(u_in)`` (the exact
result loses more than half its significant bits under a one-ulp change; ``u_in`` the least
precise of the row's dtype and its inputs') -- for the rows of the accuracy modes only when the
original's own error is also beyond ``sqrt(u_in)`` of that magnitude (the result visibly lost
those bits: the sensitivity modes' rule on the accuracy modes' measurement); a finding. Rows of
the accuracy modes whose error the conditioning explains otherwise (``moved > 1``, or ``lost``
without that visible loss) are ``ill-conditioned`` too but ``MILD``: hot spots. Else
``unconfirmed``; ``nondeterministic`` for no_change rows. ``analyse_backward`` does the same for
input gradients (same upstream gradient).
"""
from __future__ import annotations

import math

import torch

from . import handlers, magnitudes, resample, saved, scales
from ..perturb import perturb
from .metric import CHUNK, _chunks

INACCURATE = "inaccurate"
ILL_CONDITIONED = "ill-conditioned"


class _Mild(str):
    """``ill-conditioned`` of a row whose error the inputs' conditioning explains without the
    result losing half its bits relative to its magnitude ``S``: the same label, a hot spot
    rather than a finding. ``bits``: the significant bits the result lost relative to itself
    (issue 34 point 5: a sum that cancels far below its ``S``), None when it kept half."""

    mild = True
    bits = None


def lost_result(bits: float) -> _Mild:
    """``ill-conditioned``, a hot spot, with the ``bits`` the result lost relative to itself."""
    why = _Mild(ILL_CONDITIONED)
    why.bits = bits
    return why


#: (accuracy modes) the error is what one-ulp input nudges move the exact result by, and the
#: result keeps more than half its bits
MILD = _Mild(ILL_CONDITIONED)
UNCONFIRMED = "unconfirmed"
NONDETERMINISTIC = "nondeterministic"
#: how much more than the nudged inputs' move the error must be to blame the kernel
BLAME_FACTOR = 2.0
#: a move is a step (a nudge across a kink of a piecewise function's derivative) when half
#: the nudge moves the result by none or all of it, within this share: a function continuous
#: over the nudge moves by a part between (a linear one by half)
JUMP = 1.0 / 8
_U64 = 2.0 ** -53
#: the roundings of a normalisation's folded scale and shift: ``x a`` and ``mu a``
#: (``magnitudes.norm_fold``)
FOLD_ROUNDINGS = 2


def to64(x):
    """A floating tensor in float64, a complex one in complex128 (detached); anything else as
    it is."""
    if perturb.is_float(x):
        return x.detach().to(torch.float64) if x.dtype != torch.float64 else x.detach()
    if isinstance(x, torch.Tensor) and x.is_complex():
        return x.detach().to(torch.complex128)
    return x


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


def outputs(func, leaves, spec, kwargs_fix=None, compared: bool = False) -> list:
    """``handlers.float_outputs`` of the call on ``leaves`` (``kwargs_fix``: applied to its
    keyword arguments first, e.g. ``scales.magnitude_kwargs``; ``compared``: complex outputs
    too, as the forward check compares them, ``handlers.compared_outputs``)."""
    args, kwargs = perturb.unflatten(leaves, spec)
    if kwargs_fix is not None:
        kwargs = kwargs_fix(kwargs)
    out = func(*args, **kwargs)
    return handlers.compared_outputs(out) if compared else handlers.float_outputs(out, True)


#: calls that compare their input with Python-number bounds in the input's dtype: PyTorch's type
#: promotion gives a Python number the tensor's dtype in a comparison (``clamp_backward``'s
#: ``self >= min``), so the kernel's bound is the number rounded to that dtype (issue 34: a bf16
#: ``clamp(x, min=0.001)`` passes the gradient at ``x = bf16(0.001) = 0.00099945``, which is
#: below ``0.001`` in float64: 4 Zamba2 rows, ``inaccurate``)
BOUNDED = frozenset({"clamp", "clip", "clamp_", "clip_", "clamp_min", "clamp_max", "clamp_min_",
                     "clamp_max_"})


def bounds_as_received(func, api, leaves: list):
    """``func`` with its Python-number bounds rounded to its input's dtype, as the kernel
    receives them (``BOUNDED``); ``func`` itself for any other call."""
    dtype = next((t.dtype for t in leaves if perturb.is_float(t)), None)
    if api not in BOUNDED or dtype is None:
        return func

    def rounded(v):
        if isinstance(v, float) and math.isfinite(v):
            return torch.tensor(v, dtype=dtype).item()
        return v

    def call(*args, **kwargs):
        return func(*[rounded(a) for a in args], **{k: rounded(v) for k, v in kwargs.items()})
    return call


def input_roundoff(leaves: list, judged) -> float:
    """``u_in``: the least precise of the row's dtype and the floating inputs' dtypes."""
    u = scales.unit_roundoff(judged)
    for x in leaves:
        if perturb.is_float(x):
            u = max(u, scales.unit_roundoff(x.dtype))
    return u


class Score:
    """Accuracy, move and lost bits of one row, accumulated over blocks and nudges. ``bound``
    is the row's bound ``c (u_out |r| + gamma_k S)`` (its ``Judge``; a configured threshold
    scales it; ``B``, where given, replaces ``gamma_k S``: the data-aware bound of a sum, or an
    element-wise function's backward-stable term), ``floor64`` float64's own rounding of the
    call; ``verdict`` the cause.

    Besides ``lost`` (relative to ``S``), ``lost_r`` is the largest move relative to the result
    itself (``max|r|``), and ``dmax / rmax_r`` the kernel's error relative to it (issue 34 point
    5). Elements whose exact value is 0 -- at or below float64's own rounding of the call --
    have no significant bits and are left out of both (issue 34, exact zeros). A move that is a
    jump (a nudge across a kink of a piecewise function: half the nudge does not move it half as
    far) is no loss of bits and is left out of ``moved`` and the lost bits (``move``'s
    ``half``: the backward stage, where piecewise functions' gradients jump at their kinks)."""

    __slots__ = ("judge", "u_in", "acc", "moved", "lost", "dmax", "rmax", "lost_r", "rmax_r",
                 "stat")

    def __init__(self, judge, u_in: float) -> None:
        self.judge, self.u_in = judge, u_in
        self.acc = self.moved = self.lost = self.lost_r = 0.0
        self.stat = math.inf            # the error left once the kernel's saved statistics
        #                                 are read as it stored them (``statistics``)
        self.dmax = self.rmax = 0.0     # the original's largest error, the result's scale
        self.rmax_r = 0.0               # the result's own largest element

    def bound(self, r: torch.Tensor, S, B=None) -> torch.Tensor:
        j = self.judge
        c = scales.C * (j.factor if j.upcast else 1.0)
        # u_out |r| plus the underflow floor: below the normal range a correct kernel is off by
        # a few units of the smallest subnormal, 100 % of a subnormal result (issue 34, class U)
        b = r.abs().mul_(c * j.u_out).add_(c * scales.underflow_floor(j.k, j.u_out, j.u_acc))
        if B is not None:
            return b + B * c
        g = scales.accumulation_term(j.fam, j.k, j.u_out, j.u_acc, j.saved)
        if S is not None and g:
            b = b + S * (c * g)
        return b

    def floor64(self, r: torch.Tensor, S) -> torch.Tensor:
        f = r.abs() * (scales.C * _U64)
        if S is not None:
            f = f + S * (scales.C * scales.gamma(max(self.judge.k, 1), _U64))
        return f

    def accuracy(self, o: torch.Tensor, r: torch.Tensor, S, B=None) -> None:
        for oc, rc, sc, bc in _pieces(o.to(r.device), r, S, B):   # chunk-sized temporaries
            self.acc = max(self.acc, ratio(oc, rc, self.bound(rc, sc, bc)))
            with torch.no_grad():
                d = (oc.to(torch.float64) - rc).abs().nan_to_num(nan=math.inf)
                if d.numel():
                    self.dmax = max(self.dmax, d.amax().item())
                    self.rmax = max(self.rmax, _scale(rc, sc))
                    self.rmax_r = max(self.rmax_r, _scale(rc, None))

    def statistics(self, o: torch.Tensor, r_stat: torch.Tensor, S, B=None) -> None:
        """The kernel's error against the float64 gradient that reads the statistics the
        kernel saved below its accumulation precision as it stored them (same units as
        ``accuracy``): what is left of the error once their rounding is the kernel's."""
        stat = 0.0
        for oc, rc, sc, bc in _pieces(o.to(r_stat.device), r_stat, S, B):
            stat = max(stat, ratio(oc, rc, self.bound(rc, sc, bc)))
        self.stat = stat

    def worth_half(self, s: torch.Tensor, r: torch.Tensor, S, B=None) -> bool:
        """Could this nudge's move raise the verdict (a move beyond the bound, or lost bits
        beyond half)? Only then is it measured again at half its size (``move``'s ``half``)."""
        level = math.sqrt(self.u_in)
        for sc_, rc, Sc, Bc in _pieces(s, r, S, B):
            if ratio(sc_, rc, self.bound(rc, Sc, Bc)) > 1:
                return True
            with torch.no_grad():
                d = (sc_.double() - rc).abs().nan_to_num(nan=math.inf)
                top = d.sub_(self.floor64(rc, Sc)).amax().item() if d.numel() else 0.0
                if top > level * _scale(rc, None) or top > level * _scale(rc, Sc):
                    return True
        return False

    def move(self, s: torch.Tensor, r: torch.Tensor, S, B=None, half=None,
             uniform: bool = False) -> None:
        """One nudge's move (``uniform``: every element moved the same way, ``add_noise``).
        Against a data-aware bound (``Judge.data``: a sum whose roundings are taken to combine
        as a random walk) only the nudges whose directions follow the data count in ``moved``:
        ``flip_last_bit``, whose direction is each element's own bits (alike terms move alike,
        random ones at random, as their roundings do); the uniform nudge moves a sum of random
        signs linearly, the worst case the data-aware bound sets aside. It still counts in the
        lost bits."""
        skip_moved = uniform and B is not None and bool(self.judge.data)
        top = scale = scale_r = 0.0
        for sc_, rc, Sc, Bc, hc in _pieces(s, r, S, B, half):
            with torch.no_grad():
                floor = self.floor64(rc, Sc)
                ds = sc_.double() - rc
                # an exact zero has no significant bits: its move is not a loss (issue 34)
                keep = rc.abs() > floor
                if hc is not None:    # a step: half the nudge moves it by none or all of it
                    dh = hc.double() - rc
                    tol = ds.abs() * JUMP + floor
                    jump = (ds.abs() > floor) & ((dh.abs() <= tol) | ((ds - dh).abs() <= tol))
                    keep &= ~jump
                    sc_ = torch.where(jump, rc, sc_.double())
            if not skip_moved:
                self.moved = max(self.moved, ratio(sc_, rc, self.bound(rc, Sc, Bc)))
            with torch.no_grad():
                d = ds.abs().nan_to_num(nan=math.inf)
                beyond = d.sub_(floor).clamp_min_(0).mul_(keep)
                if beyond.numel():
                    top = max(top, beyond.amax().item())
                    scale = max(scale, _scale(rc, Sc))
                    scale_r = max(scale_r, _scale(rc, None))
        if top > 0:
            self.lost = max(self.lost, math.inf if scale == 0 else top / scale)
            scale_r = max(scale_r, self.rmax_r)
            self.lost_r = max(self.lost_r, math.inf if scale_r == 0 else top / scale_r)

    def verdict(self, upcast: bool) -> str:
        # the inputs' last bit excuses what it can explain; a rounding of the kernel's own
        # saved statistics does not (docs/free_benchmark.md, "Saved statistics")
        if self.acc > 1 and (self.acc > BLAME_FACTOR * self.moved or
                             self.acc > BLAME_FACTOR * self.stat):
            return INACCURATE
        level = math.sqrt(self.u_in) * (1.0 if upcast else self.judge.factor)
        if self.lost > level and (not upcast or self.dmax > level * self.rmax):
            return ILL_CONDITIONED
        # relative to the result itself: the nudges' move, and (accuracy modes) the kernel's
        # own error: a sum that cancels far below its S (issue 34 point 5), a hot spot
        rel = max(self.lost_r, (self.dmax / self.rmax_r if self.rmax_r else
                                (math.inf if self.dmax else 0.0)) if upcast else 0.0)
        if rel > level:
            return lost_result(bits_lost(rel, self.u_in))
        if upcast and (self.moved > 1 or self.lost > level):
            return MILD
        return UNCONFIRMED


def bits_lost(rel: float, u: float) -> float:
    """The significant bits a result with relative error ``rel`` lost, of the ``-log2(u)`` of
    its dtype (all of them once ``rel >= 1``)."""
    p = -math.log2(u)
    if rel <= 0:
        return 0.0
    return float(min(p, max(0.0, p + math.log2(rel))))


def _scale(r: torch.Tensor, S) -> float:
    """The scale the lost bits are counted against: the largest of the call's own magnitude
    ``S`` (the row's family) and of the result (``max|r|``, the whole scale where ``S`` is the
    tensor's). A result whose exact value cancels far below ``S`` (a gradient that is 0 by
    structure, its float64 value only the residue of its terms) has no bits of its own to lose:
    one-ulp nudges move it by about ``u S``, as rounding does, never by ``sqrt(u) S``."""
    m = r.abs().nan_to_num(nan=0.0, posinf=0.0).amax().item() if r.numel() else 0.0
    if S is not None and S.numel():
        m = max(m, S.abs().nan_to_num(nan=0.0, posinf=0.0).amax().item())
    return m


def _pieces(a: torch.Tensor, r: torch.Tensor, *others):
    """``(a, r, *others)`` in matching pieces of at most ``metric.CHUNK`` elements (views; an
    ``other`` that is None stays None)."""
    if r.numel() <= CHUNK:
        yield (a, r, *others)
        return
    rest = [_chunks(o, CHUNK) if o is not None else iter(lambda: None, 0) for o in others]
    yield from zip(_chunks(a, CHUNK), _chunks(r, CHUNK), *rest)


def ratio(o: torch.Tensor, r: torch.Tensor, b: torch.Tensor) -> float:
    """``max_i |o_i - r_i| / b_i`` (infinite for a NaN/Inf of ``o`` where ``r`` is finite; pairs
    that are both non-finite alike are equal; 0/0 counts 0)."""
    with torch.no_grad():
        o = o.to(r.device, torch.float64)
        same = (o == r) | (o.isnan() & r.isnan())
        d = (o - r).abs()
        bad = ~same & ~(d.isfinite() & r.isfinite())
        if bool(bad.any()):
            return math.inf
        q = torch.where(same, torch.zeros_like(d), d / b)
        q = q.nan_to_num(nan=0.0, posinf=math.inf)
        return q.amax().item() if q.numel() else 0.0


def _forward_magnitude(judge, api, func, x64, spec, r, i, abs_out):
    """``S`` of output ``i`` in float64 by the row's family (module doc)."""
    fam = judge.fam
    if fam == "multilinear" and abs_out is not None and abs_out.get(i) is not None:
        return abs_out[i]
    if fam == "gelu":
        x = next((t for t in x64 if perturb.is_float(t)), None)
        if x is not None and x.shape == r.shape:
            return x.abs()
    if fam in ("arithmetic", "elementwise", "saturating", "step"):
        return r.abs()
    if fam in ("softmax", "log_softmax"):
        return r.abs() + scales.element_floor(fam, judge.k, torch.float64)
    if fam == "norm" and api is not None:
        args, kwargs = perturb.unflatten(x64, spec)
        s = magnitudes.forward(api, scales.Args(func, api, args, kwargs), x64)
        if s is not None and s.shape == r.shape:
            return s
    m = r.abs().nan_to_num(nan=0.0, posinf=0.0).amax() if r.numel() else r.new_zeros(())
    if fam == "other" and r.numel():
        # an element-wise function judged against its tensor's scale (no relative contract:
        # digamma, lgamma): that scale is at least the function's own variation at its inputs,
        # K = sum |x df/dx|. Next to a root f(x) ~ f'(x) x - f'(x) x0, a difference of two terms
        # of size K: accurate in absolute terms, judged against them (issue 34)
        K = _input_terms(func, x64, spec, i, r.shape)
        if K is not None and K.numel():
            m = torch.maximum(m, K.nan_to_num(nan=0.0, posinf=0.0).amax())
    return m.expand_as(r)


def forward_magnitudes(judges: dict, api, func, x64, spec, r: dict) -> dict:
    """``{output index: S}`` in float64 of the outputs ``judges`` names (``{index: Judge}``),
    by each one's family: the call on absolute values (run once, only when a multilinear output
    needs it), the input, ``|r|`` plus a floor, a normalisation's formula, or the tensor scale
    (``r``: the float64 outputs on ``x64``)."""
    abs_out = None
    if any(j.fam == "multilinear" for j in judges.values()):
        abs_out = dict(outputs(func, scales.magnitude_leaves(x64), spec,
                               scales.magnitude_kwargs))
    return {i: _forward_magnitude(j, api, func, x64, spec, r[i], i, abs_out)
            for i, j in judges.items()}


def _input_terms(func, x64, spec, i, shape) -> torch.Tensor | None:
    """``K = sum_j |x_j d f / d x_j|`` of output ``i`` of an element-wise call, per element
    (every floating input broadcast to the output's ``shape``): what a relative change of the
    inputs moves the exact result by, per unit. None when the call is not element-wise (its
    Jacobian is not diagonal: two vector-Jacobian products, with ones and with alternating
    signs, do not agree element by element) or has no gradient."""
    leaves, ins = list(x64), []
    for j, t in enumerate(leaves):
        if perturb.is_float(t):
            try:
                leaves[j] = torch.broadcast_to(t, shape).clone().requires_grad_(True)
            except RuntimeError:
                return None
            ins.append(leaves[j])
    if not ins:
        return None
    try:
        with torch.enable_grad():
            y = dict(outputs(func, leaves, spec, compared=True)).get(i)
            if y is None or not y.requires_grad or y.shape != shape:
                return None
            ones = torch.ones_like(y)
            signs = ones.flatten().clone()
            signs[1::2] = -1
            signs = signs.view_as(y)
            grads = torch.autograd.grad(y, ins, ones, retain_graph=True, allow_unused=True)
            mixed = torch.autograd.grad(y, ins, signs, allow_unused=True)
    except RuntimeError:    # no derivative (a custom op without one, an integer-valued op)
        return None
    k = None
    for t, gr, gm in zip(ins, grads, mixed):
        if gr is None:
            continue
        if gm is None or not torch.allclose(gm, gr * signs, rtol=1e-9, atol=0, equal_nan=True):
            return None     # not element-wise: each output reads other elements
        term = (t.detach() * gr).abs_().nan_to_num_(nan=0.0, posinf=0.0)
        k = term if k is None else k.add_(term)
    return k


def _plus_gamma_s(j, term: torch.Tensor, s) -> torch.Tensor:
    """A bound term of a row added to its ``gamma_k S`` (``S`` None: the term alone)."""
    if s is None:
        return term
    g = scales.accumulation_term(j.fam, j.k, j.u_out, j.u_acc, j.saved)
    return term.add(s.to(torch.float64) * g)


def forward_bounds(judges: dict, func, x64, spec, r: dict, S: dict, api=None) -> dict:
    """``{output index: B}``: what replaces ``gamma_k S`` in a row's bound where the data say
    more than the worst case (None elsewhere):

    * a multilinear call (``Judge.data``): the data-aware bound of its sums, ``u_acc k (|r| / 2
      + beta sqrt(Q))`` (``scales.data_bound``; ``Q`` the call on squared inputs, ``k`` counted
      per element for an index accumulation), capped at ``gamma_k S``;
    * a resampling call (``resample.APIS``): ``gamma_k S`` plus its source coordinates' term
      (``resample.term``);
    * a normalisation: ``gamma_k S`` plus its fold term, ``gamma_2(u_acc) rstd |w| (|x| + |mu|)``
      where ``x`` differs from its mean (``magnitudes.norm_fold``: the two rounded products of
      ``x a + (b - mu a)``)."""
    out = {}
    norms = [i for i, j in judges.items() if j.fam == "norm" and r.get(i) is not None]
    if norms and api is not None:
        args, kwargs = perturb.unflatten(x64, spec)
        T = magnitudes.fold(api, scales.Args(func, api, args, kwargs), x64)
        for i in norms:
            if T is None or T.shape != r[i].shape:
                continue
            out[i] = _plus_gamma_s(judges[i], T * scales.gamma(FOLD_ROUNDINGS, judges[i].u_acc),
                                   S.get(i))
    if api in resample.APIS and 0 in judges and r.get(0) is not None:
        args, kwargs = perturb.unflatten(x64, spec)
        j = judges[0]
        T = resample.term(api, scales.Args(func, api, args, kwargs), x64, r[0], j.u_acc)
        if T is not None:
            out[0] = _plus_gamma_s(j, T, S.get(0))
    data = {i: j for i, j in judges.items() if j.fam == "multilinear" and j.data}
    if data:
        squares = dict(outputs(func, scales.square_leaves(x64), spec, scales.square_kwargs))
        counts = None
        if any(j.data == "count" for j in data.values()):
            counts = dict(outputs(func, scales.count_leaves(x64), spec, scales.count_kwargs))
        for i, j in data.items():
            Q = squares.get(i)
            if Q is None or Q.shape != r[i].shape:
                continue
            k = counts[i] if j.data == "count" and counts is not None else j.k
            b = scales.data_bound(r[i].abs(), Q, k, j.u_acc, mean=j.data == "mean")
            if S.get(i) is not None:
                b = torch.minimum(b, S[i] * scales.gamma(j.k, j.u_acc))
            out[i] = b
    return out


def _halved(x, n):
    """Inputs halfway between ``x`` and their nudged ``n`` (float64: exact midpoints)."""
    return [(a + b) * 0.5 if perturb.is_float(a) and a.dtype == torch.float64 else a
            for a, b in zip(x, n)]


def analyse(func, fresh, spec, items: list, blocks=None, api: str | None = None) -> dict:
    """``{output_index: cause}`` for the flagged outputs ``items`` = [(index, original tensor,
    output descriptor)] (descriptor: ``(index, dtype, shape, scale kind, thr, hot, judged dtype,
    Judge)``).

    ``fresh()``: the call's inputs as the original call computed with them, with the state it
    writes as fresh clones (``state.restore``), asked once per re-run. ``blocks``: the call's
    ``blocks.Plan`` when it was checked in blocks; the analysis then runs block by block.
    ``api``: the API's name (its family's formula). The caller runs this under ``no_grad`` with
    every function mode off; autocast is turned off here. Raises on failure."""
    from .guards import no_autocast

    judges = {index: judge_of(desc) for index, _, desc in items}
    parts = [None] if blocks is None else blocks.parts
    scores = None
    with no_autocast(True):
        for part in parts:
            def inputs():
                x = fresh()
                return x if part is None else blocks.leaves(x, *part)

            def original(o):
                return o if part is None else blocks.output(o, *part)

            x = inputs()
            if scores is None:
                scores = {i: Score(judges[i], input_roundoff(x, items_dtype(items, i)))
                          for i, _, _ in items}
            call = bounds_as_received(func, api, x)
            x64 = [to64(t) for t in x]
            r = dict(outputs(call, x64, spec, compared=True))
            S = forward_magnitudes(judges, api, call, x64, spec, r)
            B = forward_bounds(judges, call, x64, spec, r, S, api)
            for i, o, _ in items:
                scores[i].accuracy(original(o), r[i], S[i], B.get(i))
            for noise, first in NUDGES:
                s = dict(outputs(call, [to64(t) for t in nudged(inputs(), noise, first)], spec,
                                 compared=True))
                for i, _, _ in items:
                    scores[i].move(s[i], r[i], S[i], B.get(i),
                                   uniform=noise is perturb.add_noise)
                del s
            del r, S, B, x64
    return {i: scores[i].verdict(judges[i].upcast) for i, _, _ in items}


def items_dtype(items, index):
    for i, _, desc in items:
        if i == index:
            return desc[6]
    return torch.float32


def judge_of(desc) -> scales.Judge:
    """The ``Judge`` of an output descriptor (``Pending.outputs``' 8th element; the tensor
    scale of its judged dtype for a descriptor without one)."""
    if len(desc) > 7 and desc[7] is not None:
        return desc[7]
    cdt = desc[6]
    return scales.judge("improve_precision", "other", scales.TENSOR_MIN_K, cdt)


def grads64(func, leaves, spec, diff, out_index, g, kwargs_fix=None, handed=None,
            saves: dict | None = None, statistics: dict | None = None) -> list | None:
    """Input gradients (for the leaves in ``diff``) of the call's output ``out_index`` with
    upstream gradient ``g``, everything in float64. ``handed``: the forward output the kernel's
    backward was handed; where this graph's backward reads its saved output it reads that one
    instead (``saved.py``). ``saves``: told whether it does (``saves["output"]``).
    ``statistics``: the saved statistics the kernel stored (``saved.kept_statistics``), read in
    place of this graph's own; None when this graph does not save them alike."""
    leaves = list(leaves)
    ins = []
    for i in diff:
        leaves[i] = leaves[i].detach().requires_grad_(True)
        ins.append(leaves[i])
    y = dict(outputs(func, leaves, spec, kwargs_fix))[out_index]
    if saves is not None or handed is not None:
        reads = saved.saves_output(y)
        if saves is not None:
            saves["output"] = reads
        if reads and handed is not None:
            saved.hand(y, handed)
    if statistics and not saved.hand_statistics(y, statistics):
        return None
    return list(torch.autograd.grad(y, ins, g.to(_wide(g)), allow_unused=True))


def kernel_statistics(func, leaves, spec, diff, out_index, u_acc: float) -> dict:
    """The statistics the kernel's own forward saved for its backward below ``u_acc``
    (``saved.kept_statistics``), from the call re-run on ``leaves`` as it received them."""
    leaves = list(leaves)
    for i in diff:
        leaves[i] = leaves[i].detach().requires_grad_(True)
    y = dict(outputs(func, leaves, spec))[out_index]
    return saved.kept_statistics(y, leaves, u_acc)


def _wide(t: torch.Tensor) -> torch.dtype:
    """float64, or complex128 for a complex tensor (an FFT's upstream gradient)."""
    return torch.complex128 if t.is_complex() else torch.float64


def backward_magnitudes(func, api, leaves, spec, diff, out_index, g, judges: dict,
                        kwargs_fix=None, fast: bool = False) -> dict:
    """``{input position: S}`` of the input gradients by each row's family, in the leaves'
    precision: the backward on absolute values with ``|g|`` (multilinear and arithmetic
    families), a formula (``magnitudes.py``), or None (the tensor's scale). ``fast``: what the
    fast check's scale is made of instead (``Judge.source``): for the data-aware bound the
    backward on squared inputs with ``g^2`` (``Q``), with a counted call's terms per element
    (``(Q, K)``: the backward on ones with ones)."""
    out = {}
    src = {i: (judges[i].source if fast else
               "abs" if judges[i].fam in ("multilinear", "arithmetic") else
               scales.magnitude_source(judges[i].fam, "backward"))
           for i in diff if i in judges}
    need_abs = [i for i in diff if src.get(i) == "abs"]
    if need_abs:
        signed = any(judges[i].fam != "multilinear" for i in need_abs)
        mags = _grads_abs(func, leaves, spec, diff, out_index, g, signed)
        for i, m in zip(diff, mags):
            if i in need_abs and m is not None:
                out[i] = m
    need_sq = [i for i in diff if src.get(i) in ("data", "count")]
    if need_sq:
        sq = _grads_abs(func, leaves, spec, diff, out_index, g, True, squares=True)
        cnt = _grads_abs(func, leaves, spec, diff, out_index, g, False, counts=True) \
            if any(src[i] == "count" for i in need_sq) else None
        for i, q, k in zip(diff, sq, cnt or [None] * len(diff)):
            if i in need_sq and q is not None:
                out[i] = (q, k) if src[i] == "count" and k is not None else q
    need_formula = [i for i in diff if src.get(i) == "formula"]
    if need_formula and api is not None:
        args, kwargs = perturb.unflatten([x.detach() if isinstance(x, torch.Tensor) else x
                                          for x in leaves], spec)
        plain = perturb.flatten(args, kwargs)[0]
        got = magnitudes.backward(api, scales.Args(func, api, args, kwargs), plain,
                                  g.to(_dtype_of(leaves)))
        for i in need_formula:
            if got is not None and got.get(i) is not None:
                out[i] = got[i]
    return out


def _norm_backward_bounds(func, leaves, spec, diff, g, judges, r, S, api) -> dict:
    norms = [i for i in diff if i in judges and judges[i].fam == "norm" and r.get(i) is not None]
    if not norms or api is None:
        return {}
    args, kwargs = perturb.unflatten([x.detach() if isinstance(x, torch.Tensor) else x
                                      for x in leaves], spec)
    T = magnitudes.backward_fold(api, scales.Args(func, api, args, kwargs),
                                 perturb.flatten(args, kwargs)[0], g.to(_dtype_of(leaves)))
    out = {}
    for i in norms:
        t = None if T is None else T.get(i)
        if t is None or t.shape != r[i].shape:
            continue
        out[i] = _plus_gamma_s(judges[i], t.to(torch.float64)
                               * scales.gamma(FOLD_ROUNDINGS, judges[i].u_acc), S.get(i))
    return out


def backward_bounds(func, leaves, spec, diff, out_index, g, judges: dict, r: dict,
                    S: dict, api: str | None = None) -> dict:
    """``forward_bounds`` for the input gradients ``r`` (``{position: float64 gradient}``):
    the data-aware bound of the multilinear and arithmetic families' gradients (their sums over
    the rows, the broadcast dims), from the backward on squared inputs with ``g^2``, capped at
    ``gamma_k S``; a normalisation's gradients: ``gamma_k S`` plus their fold term
    (``magnitudes.norm_backward_fold``, ``api`` given)."""
    out = _norm_backward_bounds(func, leaves, spec, diff, g, judges, r, S, api)
    data = [i for i in diff if i in judges and judges[i].data and r.get(i) is not None]
    if not data:
        return out
    sq = _grads_abs(func, leaves, spec, diff, out_index, g, True, squares=True)
    cnt = _grads_abs(func, leaves, spec, diff, out_index, g, False, counts=True) \
        if any(judges[i].data == "count" for i in data) else [None] * len(diff)
    for i, Q, K in zip(diff, sq, cnt):
        if i not in data or Q is None or Q.shape != r[i].shape:
            continue
        j = judges[i]
        k = K if j.data == "count" and K is not None else j.k
        b = scales.data_bound(r[i].abs(), Q.to(torch.float64), k, j.u_acc)
        if S.get(i) is not None:
            b = torch.minimum(b, S[i].to(torch.float64) * scales.gamma(j.k, j.u_acc))
        out[i] = b
    return out


def _dtype_of(leaves):
    for x in leaves:
        if perturb.is_float(x):
            return x.dtype
    return torch.float32


def _grads_abs(func, leaves, spec, diff, out_index, g, signed: bool = True,
               squares: bool = False, counts: bool = False) -> list:
    """The backward of the call on absolute values with ``|g|``; ``signed``: a family whose
    coefficients may be negative (``div``'s ``-a/b^2``): absolute values of the results too
    (a multilinear call's are non-negative already). ``squares``: on squared inputs with
    ``g^2`` (the data-aware bound's ``Q``); ``counts``: on ones with ones (terms per
    element)."""
    plain = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
    if squares:
        a_leaves, fix, up = scales.square_leaves(plain), scales.square_kwargs, g.abs() ** 2
    elif counts:
        a_leaves, fix, up = scales.count_leaves(plain), scales.count_kwargs, torch.ones_like(g)
    else:
        a_leaves, fix, up = scales.magnitude_leaves(plain), scales.magnitude_kwargs, g.abs()
    ins = []
    for i in diff:
        a_leaves[i] = a_leaves[i].requires_grad_(True)
        ins.append(a_leaves[i])
    a, kw = perturb.unflatten(a_leaves, spec)
    y = dict(handlers.float_outputs(func(*a, **fix(kw)), True))[out_index]
    grads = torch.autograd.grad(y, ins, up.to(y.dtype), allow_unused=True)
    if not signed:
        return list(grads)
    # in place where the gradient owns its memory (an expanded one, a sum's, is a view)
    return [None if t is None else (t.abs_() if t._base is None else t.abs()) for t in grads]


def analyse_backward(func, fresh, spec, diff: list, out_index: int, g, items: list,
                     api: str | None = None) -> dict:
    """``analyse`` for the backward stage: ``items`` = [(input position, reference gradient,
    descriptor)], each judged with its row's bound (``S`` of the gradient in float64 by its
    family, the data-aware bound where it applies: ``backward_bounds``). ``g`` is the upstream
    gradient the check used. Where the backward reads its saved forward output (``saved.py``),
    the kernel's error is measured against the float64 backward reading the output the kernel
    was handed (the call's own forward on these inputs), the moves against the exact one. One
    nudged float64 gradient besides the float64 references is alive at a time."""
    from .guards import no_autocast

    pos = {i: k for k, i in enumerate(diff)}
    judges = {index: judge_of(desc) for index, _, desc in items}
    saves: dict = {}
    with no_autocast(True), torch.enable_grad():
        x = fresh()
        func = bounds_as_received(func, api, x)
        x64 = [to64(t) for t in x]
        r = grads64(func, x64, spec, diff, out_index, g, saves=saves)
        r_acc, handed = r, None
        if saves.get("output"):     # the forward output the kernel's backward read
            with torch.no_grad():
                handed = dict(outputs(func, fresh(), spec))[out_index]
            r_acc = grads64(func, [to64(t) for t in fresh()], spec, diff, out_index, g,
                            handed=handed)
        # statistics the kernel saved below its accumulation precision: the reference that
        # reads them as stored tells how much of its error is that rounding (``Score.stat``)
        r_stat = None
        kept = kernel_statistics(func, fresh(), spec, diff, out_index,
                                 min(j.u_acc for j in judges.values()))
        if kept:
            r_stat = grads64(func, [to64(t) for t in fresh()], spec, diff, out_index, g,
                             handed=handed, statistics=kept)
        S = backward_magnitudes(func, api, x64, spec, diff, out_index, g.to(_wide(g)),
                                judges)
        B = backward_bounds(func, x64, spec, diff, out_index, g.to(_wide(g)), judges,
                            {i: r[pos[i]] for i in diff}, S, api)
        del x64
    scores = {}
    for index, gr, desc in items:
        ref = r[pos[index]]
        if ref is None:
            continue
        sc = Score(judges[index], input_roundoff(x, desc[6]))
        s_i = S.get(index)
        if s_i is None:
            m = ref.abs().amax() if ref.numel() else ref.new_zeros(())
            s_i = m.expand_as(ref)
        elif s_i.dtype == torch.float64:
            s_i = s_i.float()      # a scale: kept through the nudges at half the memory
        S[index] = s_i
        sc.accuracy(gr, r_acc[pos[index]], s_i, B.get(index))
        if r_stat is not None and r_stat[pos[index]] is not None:
            sc.statistics(gr, r_stat[pos[index]], s_i, B.get(index))
        scores[index] = sc
    del x, r_acc, r_stat
    for noise, first in NUDGES:
        with no_autocast(True), torch.enable_grad():
            n64 = [to64(t) for t in nudged(fresh(), noise, first)]
            s = grads64(func, n64, spec, diff, out_index, g)
            half = None
            if any(s[pos[i]] is not None and sc.worth_half(s[pos[i]], r[pos[i]], S[i],
                                                            B.get(i))
                   for i, sc in scores.items()):
                # (fresh copies of both: a call that writes state wrote into these)
                half = grads64(func, _halved([to64(t) for t in fresh()],
                                             [to64(t) for t in nudged(fresh(), noise, first)]),
                               spec, diff, out_index, g)
            del n64
        for index in list(scores):
            k = pos[index]
            if s[k] is None:   # no gradient under the nudge: no verdict for this input
                del scores[index]
                continue
            scores[index].move(s[k], r[k], S[index], B.get(index),
                               None if half is None else half[k],
                               uniform=noise is perturb.add_noise)
        del s, half
    return {index: sc.verdict(sc.judge.upcast) for index, sc in scores.items()}


def verdict(acc: float, moved: float, lost: float, u_in: float, upcast: bool = True,
            error: float = math.inf, stat: float = math.inf) -> str:
    """The cause from the measures (module doc), for callers that have them apart; ``error``:
    the original's largest error relative to the result's tensor scale (accuracy modes);
    ``stat``: the accuracy left once the backward reads its saved statistics as the kernel
    stored them (``Score.statistics``)."""
    level = math.sqrt(u_in)
    if acc > 1 and (acc > BLAME_FACTOR * moved or acc > BLAME_FACTOR * stat):
        return INACCURATE
    if lost > level and (not upcast or error > level):
        return ILL_CONDITIONED
    return MILD if upcast and (moved > 1 or lost > level) else UNCONFIRMED
