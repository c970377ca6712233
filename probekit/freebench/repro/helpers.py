"""The measuring part of a repro script, standalone: it imports nothing but torch and the standard
library, and ``repro/script.py`` copies this file's source (from ``# -- standalone``) into every
script it writes. probekit imports the same functions to build a script's inputs and to run a
script's checks in-process, so a script measures with the code probekit checked it with.

What a script measures for each judged output (an output of the call, or, in the backward stage,
an input's gradient): the kernel's result ``o`` (the call as the training ran it), the float64
recomputation ``r`` (every floating input upcast, autocast off) and, for the inputs moved by one
ulp of their own dtype (``NUDGES``: the same nudges as ``cause.py``), ``s``. With the bound of a
correct kernel ``b = a |r| + b_S S`` (the free benchmark's error model: its coefficients and ``S``
come from probekit, ``scales.py`` / ``cause.py``, and are written into the script):

* ``accuracy`` = ``max |o - r| / b`` (a NaN/Inf where float64 is finite counts as infinite);
* ``moved`` = ``max |s - r| / b`` over the nudges;
* ``lost`` = the largest move beyond float64's own rounding, relative to the call's magnitude
  ``max(max S, max |r|)`` (issue 26: a result that cancels far below ``S`` keeps its bits; an
  element whose exact value is 0, within that rounding, has no bits to lose: issue 34);

``b`` reads ``S_b`` where probekit wrote one (the data-aware bound of a sum, an element-wise
function's backward-stable term, a resampling call's source-coordinate term: issue 34), ``S``
otherwise, plus the bound's absolute floor ``f`` (the underflow floor: issue 34). Where the call's
backward reads its saved forward output (``saves_output``), ``accuracy`` is measured against the
float64 backward reading the output the kernel's own forward gave (the kernel is handed it),
``moved`` and ``lost`` against the exact one; where its backward node keeps statistics below
its accumulation precision (``kept_statistics``: a CPU bf16 norm's mean and rstd), ``statistics``
is the accuracy against the float64 backward reading them as the kernel stored them;

and the verdict of ``cause.py``: ``inaccurate`` when ``accuracy > 1`` and ``accuracy > blame *
moved`` or ``accuracy > blame * statistics``; ``ill-conditioned`` when ``lost`` exceeds half the
dtype's bits (in the accuracy modes only when the kernel's own error does too, relative to that
magnitude); a ``mild`` ill-conditioned (the accuracy modes: the inputs' conditioning explains the
error, a hot spot) or ``unconfirmed`` otherwise. ``tests/unit/test_freebench_repro.py`` pins these functions to probekit's own.
"""
from __future__ import annotations

# -- standalone (copied into every repro script from here on) ----------------------------------
import contextlib
import math

import torch

INACCURATE = "inaccurate"
ILL_CONDITIONED = "ill-conditioned"
MILD = "ill-conditioned (mild)"
UNCONFIRMED = "unconfirmed"
#: the verdicts that make a finding (a defect present): the script exits 1 on them
DEFECTS = (INACCURATE, ILL_CONDITIONED)

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float32: torch.int32, torch.float64: torch.int64}


def is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


# -- the inputs ----------------------------------------------------------------------------------
def layout(base, shape, stride, device="cpu"):
    """A tensor of the recorded ``shape`` and ``stride`` over a fresh copy of its storage
    ``base`` (1-D: every element the tensor's strides reach), on ``device``."""
    return base.to(device).clone().as_strided(tuple(shape), tuple(stride))


def generate(spec: dict):
    """The storage of a generated input (1-D, ``spec["span"]`` elements of ``spec["dtype"]``),
    drawn from a generator seeded with ``spec["seed"]``: discrete values with their frequencies
    (``values``/``freqs``), or the recorded quantiles of the finite values interpolated linearly
    (``quantiles``), with the recorded shares of NaN, +Inf and -Inf; integer dtypes rounded and
    kept within the recorded range. ``layout`` gives it the recorded shape and strides."""
    g = torch.Generator().manual_seed(int(spec["seed"]))
    n = int(spec["span"])
    dtype = getattr(torch, spec["dtype"])
    f64 = torch.float64
    if spec.get("values") is not None:
        values = torch.tensor(spec["values"], dtype=f64)
        probs = torch.tensor(spec["freqs"], dtype=f64)
        pick = torch.multinomial(probs, n, replacement=True, generator=g) if n else \
            torch.zeros(0, dtype=torch.long)
        flat = values[pick]
    else:
        q = torch.tensor(spec["quantiles"], dtype=f64)
        if len(q) < 2:
            flat = q.expand(n).clone() if len(q) else torch.zeros(n, dtype=f64)
        else:
            pos = torch.rand(n, generator=g, dtype=f64) * (len(q) - 1)
            i = pos.floor().long().clamp(max=len(q) - 2)
            flat = torch.lerp(q[i], q[i + 1], pos - i)
        special = [(spec.get("nan", 0.0), math.nan), (spec.get("posinf", 0.0), math.inf),
                   (spec.get("neginf", 0.0), -math.inf)]
        if any(share for share, _ in special):
            u = torch.rand(n, generator=g, dtype=f64)
            low = 0.0
            for share, value in special:
                flat = torch.where((u >= low) & (u < low + share), value, flat)
                low += share
    if dtype == torch.bool:
        return flat != 0
    if not dtype.is_floating_point and not dtype.is_complex:
        flat = flat.round()
        if spec.get("quantiles"):
            flat = flat.clamp(spec["quantiles"][0], spec["quantiles"][-1])
    return flat.to(dtype)


# -- the one-ulp nudges (probekit.freebench.perturb.perturb's, applied as cause.py applies them)
def add_noise(t):
    """Every element with ``|x|`` >= the smallest normal moved one ulp towards +inf (the largest
    finite value stays: its next value up is Inf, which the input did not have)."""
    c = 1.0 - torch.finfo(t.dtype).eps / 2
    return torch.fmax((t / c).clamp_max_(torch.finfo(t.dtype).max), t * c)


def flip_last_bit(t):
    """The lowest mantissa bit flipped in every finite element >= the smallest normal."""
    info = torch.finfo(t.dtype)
    bits = t.view(_INT_VIEW[t.dtype])
    a = t.abs()
    return (bits ^ (a.clamp(info.smallest_normal, info.max) == a)).view(t.dtype)


#: (nudge, first floating input only?)
NUDGES = ((add_noise, False), (flip_last_bit, False), (add_noise, True), (flip_last_bit, True))


def nudged(leaves: list, noise, first_only: bool) -> list:
    """The leaves with ``noise`` applied to every floating tensor (or the first one only); a
    dtype without a bit-level ulp is left as it is."""
    out, done = list(leaves), False
    for i, x in enumerate(leaves):
        if is_float(x) and not done:
            if x.dtype in _INT_VIEW:
                out[i] = noise(x.detach())
            done = first_only
    return out


def to64(x):
    if is_float(x) and x.dtype != torch.float64:
        return x.detach().to(torch.float64)
    return x.detach() if isinstance(x, torch.Tensor) else x


# -- running the call ------------------------------------------------------------------------------
def output_leaves(out) -> list:
    if isinstance(out, (tuple, list)):
        leaves = []
        for o in out:
            leaves.extend(output_leaves(o))
        return leaves
    return [out]


def float_outputs(out) -> dict:
    """``{output index: tensor}`` of the floating tensors among the call's outputs."""
    return {i: t for i, t in enumerate(output_leaves(out)) if is_float(t)}


def _autocast(case, on: bool):
    if on and case.get("autocast"):
        return torch.autocast(case["device"], dtype=getattr(torch, case["autocast"]))
    if case["device"] in ("cpu", "cuda"):
        return torch.autocast(case["device"], enabled=False)
    return contextlib.nullcontext()


def _rng(rng_state):
    if rng_state is not None:
        torch.set_rng_state(rng_state)


_SAVED: dict = {}


def saves_output(out) -> bool:
    """Does ``out``'s backward node keep ``out`` itself (a ``_saved_*`` attribute, or a custom
    Function's ``saved_tensors``, with its storage, shape and strides)?"""
    node = getattr(out, "grad_fn", None)
    if node is None or not out.numel():
        return False
    names = _SAVED.get(type(node))
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_saved_"))
        names += ("saved_tensors",) if hasattr(node, "saved_tensors") else ()
        _SAVED[type(node)] = names
    key = (out.data_ptr(), tuple(out.shape), out.stride())
    for name in names:
        try:
            v = getattr(node, name)
        except Exception:
            continue
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor) and (t.data_ptr(), tuple(t.shape), t.stride()) == key:
                return True
    return False


def _saved_values(node):
    """(name, value) of ``node``'s saved attributes that can be read."""
    for name in (a for a in dir(node) if a.startswith("_saved_")):
        try:
            yield name, getattr(node, name)
        except Exception:     # freed, or not a tensor attribute
            continue


def kept_statistics(out, leaves, u_acc: float) -> dict:
    """``{attribute: tensor}``: the floating tensors ``out``'s backward node saved that are
    neither one of ``leaves`` (the call's inputs) nor ``out`` nor made by another node (a
    composite call's intermediate has that node as its ``grad_fn``) -- statistics its forward
    computed for the backward (a native layer, batch or group norm's mean and rstd) -- in a
    dtype whose unit roundoff is above ``u_acc``. Empty where the node keeps none below
    ``u_acc``."""
    node = getattr(out, "grad_fn", None)
    if node is None:
        return {}
    own = {t.data_ptr() for t in leaves if isinstance(t, torch.Tensor) and t.numel()}
    if out.numel():
        own.add(out.data_ptr())
    return {name: v.detach().clone() for name, v in _saved_values(node)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and
            v.grad_fn in (None, node) and v.data_ptr() not in own and
            torch.finfo(v.dtype).eps / 2 > u_acc}


def hand_statistics(out, kept: dict) -> bool:
    """Let ``out``'s backward read ``kept`` (``kept_statistics`` of the kernel's own graph,
    converted) in place of the statistics it saved, written through ``.data`` (which autograd's
    version check does not see). False, with nothing written, where this graph's node does not
    save each of them in that shape."""
    node = getattr(out, "grad_fn", None)
    if node is None:
        return False
    mine = dict(_saved_values(node))
    targets = [(mine.get(name), t) for name, t in kept.items()]
    if any(not isinstance(m, torch.Tensor) or m.shape != t.shape for m, t in targets):
        return False
    with torch.no_grad():
        for m, t in targets:
            m.data.copy_(t.to(device=m.device, dtype=m.dtype))
    return True


def run(call, leaves: list, case: dict, g=None, rng_state=None, exact: bool = False,
        handed=None, keep=None, statistics=None) -> dict | None:
    """The judged results of one run of ``call`` on ``leaves``: ``{index: tensor}`` of the judged
    outputs (forward) or of the judged inputs' gradients (backward, upstream gradient ``g``).
    ``exact``: every floating input and ``g`` in float64, autocast off (the reference);
    otherwise the call as the training made it (under its autocast dtype; the backward with
    autocast off, as a training's backward runs). Backward: ``keep["y"]`` is set to the forward
    output when the backward reads it (else None) and ``keep["stats"]`` to the statistics the
    node saved below the judged outputs' ``u_acc`` (``kept_statistics``); ``handed``: a forward
    output the backward reads instead of its own saved one; ``statistics``: saved statistics it
    reads instead of its own (None returned where this graph does not save them alike)."""
    leaves = [to64(x) for x in leaves] if exact else list(leaves)
    args = lambda: [leaves[i] for i in case["tensor_pos"]]   # noqa: E731
    if case["stage"] == "forward":
        _rng(rng_state)
        with torch.no_grad(), _autocast(case, not exact):
            out = float_outputs(call(*args()))
        return {i: out[i].detach() for i in case["judged"]}
    ins = []
    for i in case["diff"]:
        leaves[i] = leaves[i].detach().requires_grad_(True)
        ins.append(leaves[i])
    if case.get("writes"):   # an in-place call writes non-leaf copies (the gradient is the same)
        copies = {}
        with torch.enable_grad():
            leaves = [copies.setdefault(id(x), x.clone()) if any(x is t for t in ins) else x
                      for x in leaves]
    with torch.enable_grad():
        _rng(rng_state)
        with _autocast(case, not exact):
            y = float_outputs(call(*args()))[case["out_index"]]
        if keep is not None:
            keep["y"] = y.detach() if saves_output(y) else None
            keep["stats"] = kept_statistics(
                y, leaves, min(case["bound"][i]["u_acc"] for i in case["judged"]))
        if handed is not None and saves_output(y):
            with torch.no_grad():
                y.data.copy_(handed.to(device=y.device, dtype=y.dtype))
        if statistics and not hand_statistics(y, statistics):
            return None
        with _autocast(case, False):
            gy = g.to(device=y.device, dtype=torch.float64 if exact else g.dtype)
            grads = torch.autograd.grad(y, ins, gy, allow_unused=True)
    by_pos = dict(zip(case["diff"], grads))
    return {i: (None if by_pos.get(i) is None else by_pos[i].detach()) for i in case["judged"]}


# -- the measures ----------------------------------------------------------------------------------
def ratio(o, r, b) -> float:
    """``max_i |o_i - r_i| / b_i``: infinite for a NaN/Inf of ``o`` where ``r`` is finite; pairs
    that are both non-finite alike are equal; 0/0 counts 0."""
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


def magnitude(r, S=None) -> float:
    """``max(max S, max |r|)``: the scale the lost bits are counted against (``cause.py``)."""
    with torch.no_grad():
        m = r.abs().nan_to_num(nan=0.0, posinf=0.0).amax().item() if r.numel() else 0.0
        if S is not None and S.numel():
            m = max(m, S.abs().nan_to_num(nan=0.0, posinf=0.0).amax().item())
    return m


def lost_bits(s, r, floor, S=None) -> float:
    """The largest move of ``s`` from ``r`` beyond ``floor`` (float64's own rounding of the
    call), relative to ``magnitude(r, S)``."""
    with torch.no_grad():
        d = (s.to(r.device, torch.float64) - r).abs().nan_to_num(nan=math.inf)
        beyond = (d - floor).clamp_min(0) * (r.abs() > floor)    # an exact 0 has no bits
        top = beyond.amax().item() if beyond.numel() else 0.0
    m = magnitude(r, S)
    if top <= 0:
        return 0.0
    return math.inf if m == 0 else top / m


def verdict(acc: float, moved: float, lost: float, bound: dict, case: dict,
            error: float = math.inf, stat: float = math.inf) -> str:
    """``cause.py``'s verdict from the measures; ``error``: the kernel's largest error relative
    to ``max |exact|`` (an accuracy mode's ill-conditioned result is a finding only when the
    result itself lost those bits); ``stat``: the accuracy left once the backward reads the
    statistics the kernel saved below its accumulation precision (their rounding is the
    kernel's, whatever the nudges move)."""
    level = bound["lost_level"]
    if acc > 1 and (acc > case["blame"] * moved or acc > case["blame"] * stat):
        return INACCURATE
    if lost > level and (not bound["upcast"] or error > level):
        return ILL_CONDITIONED
    if bound["upcast"] and (moved > 1 or lost > level):
        return MILD
    return UNCONFIRMED


def relative_error(res: dict) -> float:
    """``max |o - r|`` relative to the call's magnitude (``res["magnitude"]``, ``max(max S,
    max |exact|)``; ``max |exact|`` where not given) of a result of ``measure`` (infinite for an
    error where that is 0)."""
    if res["max_error"] <= 0:
        return 0.0
    m = res.get("magnitude", res["scale"])
    return math.inf if m == 0 else res["max_error"] / m


def _worst(o, r, b) -> dict:
    """Where the error against the bound is largest: its index, error, |exact| and bound."""
    with torch.no_grad():
        o = o.to(r.device, torch.float64)
        d = (o - r).abs().nan_to_num(nan=math.inf)
        q = (d / b).nan_to_num(nan=0.0)
        if not q.numel():
            return {"index": [], "error": 0.0, "exact": 0.0, "bound": 0.0, "max_error": 0.0,
                    "scale": 0.0}
        flat = int(q.reshape(-1).argmax())
        idx = [int(v) for v in torch.unravel_index(torch.tensor(flat), q.shape)] if q.dim() \
            else []
        pick = (lambda t: t.reshape(-1)[flat].item())
        return {"index": idx, "error": pick(d), "exact": pick(r), "bound": pick(b),
                "max_error": d.amax().item(),
                "scale": r.abs().nan_to_num(nan=0.0, posinf=0.0).amax().item()}


def measure(call, fresh, case: dict, S: dict, g=None, rng_state=None, expected=None,
            SB=None) -> dict:
    """Every judged output's measures and verdict. ``fresh()``: the call's inputs, new tensors
    each time (an in-place call writes into them); ``S``: ``{index: S}`` in float64 (a 0-dim
    tensor stands for the tensor scale); ``SB``: ``{index: S_b}`` where the bound reads its own
    (module doc); ``expected``: ``{index: output recorded in the run}``."""
    keep = {}
    o = run(call, fresh(), case, g, rng_state, keep=keep)
    r = run(call, fresh(), case, g, rng_state, exact=True)
    r_acc = run(call, fresh(), case, g, rng_state, exact=True, handed=keep["y"]) \
        if keep.get("y") is not None else r
    r_stat = run(call, fresh(), case, g, rng_state, exact=True, handed=keep["y"],
                 statistics=keep["stats"]) if keep.get("stats") else None
    out = {}
    bounds = {}
    for i in case["judged"]:
        if o.get(i) is None or r.get(i) is None:
            continue
        bd = case["bound"][i]
        s_i = S[i].to(r[i].device, torch.float64)
        s_i = s_i.expand_as(r[i]) if s_i.dim() == 0 else s_i
        sb_i = s_i if not SB or SB.get(i) is None else SB[i].to(r[i].device, torch.float64)
        f = bd.get("f", 0.0)      # the underflow floor
        b = r[i].abs() * bd["a"] + sb_i * bd["b"] + f
        bounds[i] = (b, r[i].abs() * bd["a64"] + s_i * bd["b64"], s_i)
        acc = ratio(o[i], r_acc[i], r_acc[i].abs() * bd["a"] + sb_i * bd["b"] + f)
        res = {"accuracy": acc, "moved": 0.0, "lost": 0.0}
        if r_stat is not None and r_stat.get(i) is not None:
            res["statistics"] = ratio(o[i], r_stat[i],
                                      r_stat[i].abs() * bd["a"] + sb_i * bd["b"] + f)
        res.update(_worst(o[i], r_acc[i], b))
        res["magnitude"] = magnitude(r[i], s_i)
        if expected is not None and expected.get(i) is not None:
            e = expected[i].to(o[i].device, torch.float64)
            same = (e == o[i].double()) | (e.isnan() & o[i].double().isnan())
            res["vs_recorded"] = 0.0 if bool(same.all()) else \
                (e - o[i].double()).abs().nan_to_num(nan=math.inf).amax().item()
        out[i] = res
    del o
    for noise, first in NUDGES:
        s = run(call, nudged(fresh(), noise, first), case, g, rng_state, exact=True)
        for i, res in out.items():
            if s.get(i) is None:
                continue
            b, floor, s_i = bounds[i]
            res["moved"] = max(res["moved"], ratio(s[i], r[i], b))
            res["lost"] = max(res["lost"], lost_bits(s[i], r[i], floor, s_i))
        del s
    for i, res in out.items():
        res["verdict"] = verdict(res["accuracy"], res["moved"], res["lost"], case["bound"][i],
                                 case, relative_error(res), res.get("statistics", math.inf))
    return out
