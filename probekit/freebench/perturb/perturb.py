"""Perturbations: pure functions on tensors, and the registry that applies them to a call.

Every tensor function returns a new tensor and leaves its input, the global RNG and any module
state alone (the noise is deterministic: it comes from each element's value). Each costs one to
three kernels (what a check costs is counted in ``benchmarks/bench_freebench_ops.py``).

==================  ===========================================================================
improve_precision   every floating input upcast: fp16/bf16 -> fp32; fp32 -> fp64 (fp64: cancelled)
bit_noise           first floating input: every finite element with ``|x| > smallest normal``
                    moved one ulp, towards zero and away from zero in a checkerboard over (row,
                    column) (its last bit changes)
add_noise           first floating input: every finite element with ``|x| > smallest normal``
                    moved one ulp towards +inf (``nextafter(x, inf)``, as ``fmax(x / (1 - u),
                    x * (1 - u))``; it cannot round away, unlike msprobe's constant epsilon, which
                    left fp16 inputs unchanged)
change_value        first floating input: first and last elements of the last dimension swapped
                    (in every row). Only for APIs whose result does not depend on that order
                    (element-wise ops, reductions, softmax); the perturbed output is swapped back
                    where the swapped dimension survives. 0-dim / 1-element inputs: cancelled.
no_change           first floating input copied (the re-run flags non-determinism)
to_cpu              every tensor input copied to the CPU, fp16/bf16 upcast to fp32
==================  ===========================================================================

``apply(mode, call)`` flattens the call's arguments into leaves, perturbs them and returns a
``Perturbed`` holding the new arguments; it raises ``Cancel(reason)`` when the mode cannot apply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import names
from . import fused
from .host import host_value, note, noted
from .modes import MODES

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float32: torch.int32, torch.float64: torch.int64}
LOW_PRECISION = (torch.float16, torch.bfloat16)


class Cancel(Exception):
    """The perturbation cannot apply to this call; ``str(exc)`` is the reason (logged)."""


# -- tensor functions ---------------------------------------------------------------------------
#: per dtype: (u, 1 - u): the unit roundoff and the noise factor (representable in the dtype)
_NOISE: dict = {}


def _noise_consts(t: torch.Tensor) -> tuple:
    c = _NOISE.get(t.dtype)
    if c is None:
        if t.dtype not in _INT_VIEW:
            raise Cancel(f"dtype {t.dtype} has no bit-level perturbation")
        u = torch.finfo(t.dtype).eps / 2
        c = _NOISE[t.dtype] = (u, 1.0 - u)
    return c


#: (length, dtype, device) -> (multipliers, divisors): 1-D, ``(1 - u, 1)`` / ``(1, 1 - u)``
#: alternating from an even position
_ALTERNATE: dict = {}
#: (shape, dtype, device) -> the checkerboard views of ``_ALTERNATE``'s vectors for that shape
_CHECKER: dict = {}
_CHECKER_MAX = 4096


def _checker(t: torch.Tensor) -> tuple:
    """(multiplier, divisor) shaped like ``t``: ``(1 - u, 1)`` where the element's row (all
    dims but the last, flattened) plus its column is even, ``(1, 1 - u)`` where it is odd: a
    checkerboard, no memory beyond one vector of ``rows + cols`` (overlapping strided views)."""
    shape = tuple(t.shape)
    key = (shape, t.dtype, t.device)
    c = _CHECKER.get(key)
    if c is not None:
        return c
    cols = shape[-1] if shape else 1
    rows = t.numel() // cols if cols else 0
    need = max(1, rows + cols)
    length = 1 << (need - 1).bit_length()
    vkey = (length, t.dtype, t.device)
    vec = _ALTERNATE.get(vkey)
    if vec is None:
        f = _noise_consts(t)[1]
        even = torch.arange(length, device=t.device) % 2 == 0
        one = torch.ones(length, dtype=t.dtype, device=t.device)
        vec = _ALTERNATE[vkey] = (torch.where(even, f, one).to(t.dtype),
                                  torch.where(even, one, f).to(t.dtype))
    strides, acc = [], 1
    for size in reversed(shape[:-1]):
        strides.append(acc)
        acc *= size
    strides = tuple(reversed(strides)) + ((1,) if shape else ())
    c = tuple(v.as_strided(shape, strides) for v in vec)
    if len(_CHECKER) >= _CHECKER_MAX:
        _CHECKER.clear()
    _CHECKER[key] = c
    return c


def bit_noise(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every element above the smallest normal moved by one ulp (its last bit
    changes), towards zero and away from zero in a checkerboard (row of the flattened leading
    dims plus column even: towards zero), in two kernels: ``t * m / d`` with ``(m, d) = (1 - u,
    1)`` or ``(1, 1 - u)``.

    Neighbouring elements, along the last dim and down every column, move in opposite
    directions, which neither a shift-invariant op such as softmax nor a sum over rows (a weight
    gradient sums over tokens) ignores, as it would a shift or a scaling of every element.
    ``x * (1 - u)`` and ``x / (1 - u)`` are the next values towards and away from zero (see
    ``add_noise``); the factors are exact in every floating dtype, so every kernel path gives the
    same bits. Zeros (with their sign), subnormals, +-Inf and NaN are unchanged (so is the
    smallest normal where it moves towards zero, a tie), and so is the largest finite value
    where it would move away from zero: its next value up is Inf, and a perturbation must never
    make an Inf the input did not have (a mask's ``finfo.min`` became ``-inf``, and the re-run a
    NaN/Inf mismatch of the perturbation's own making: issue 34, class O). Two kernels more on
    an accelerator, one on the CPU (``_finite_as``: the checkerboard's sign-dependent direction
    leaves no one-kernel cap).

    The result is laid out as ``torch.empty_like(t)`` (as every other perturbation's is): for an
    expanded input (a stride-0 dim) the checkerboard's overlapping strides would otherwise pick
    the output's dim order, and a kernel that allocates ``empty_like(input)`` (a dropout's mask,
    drawn in memory order) would put the replayed draws on other elements (issue 34, defect C).

    On the CPU, bfloat16 and float32 are one pass in C where the kernel is built (``fused.py``:
    the same bits, no extremes read); the formulas below otherwise."""
    k = fused.KERNELS.get(t.dtype)
    if k is not None:   # one pass in C, the same bits (fused.py); None: the formulas below
        out = fused.bit_noise(t, _noise_consts(t)[1])
        if out is not None:
            return out
    m, d = _checker(t)
    if 0 in t.stride():
        return _finite_as(torch.mul(t, m, out=torch.empty_like(t)).div_(d), t)
    return _finite_as(t.mul(m).div_(d), t)


def _finite_as(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``out`` (``t`` moved by one ulp) with the elements that overflowed to +-Inf back at their
    value in ``t``: only the largest finite value overflows (its next value away from zero is
    Inf), and an Inf of ``t`` is Inf in ``out`` already. In place, two kernels; on the CPU only
    where ``t`` may hold +-max (``_may_overflow``, one kernel), the same bits for a fraction of
    the time (issue 38: a 16-bit ``isinf`` and ``where`` cost 7x a multiplication there, their
    boolean mask taking a slow path)."""
    if t.is_cpu and not _may_overflow(t):
        return out
    return torch.where(torch.isinf(out), t, out, out=out)


def _may_overflow(t: torch.Tensor) -> bool:
    """May ``t`` (in host memory) hold +-max, the one value ``bit_noise`` can move to +-Inf?
    One ``aminmax``, read on the host without an ATen operator (``host.py``): False when every
    element lies strictly between -max and max (True for a NaN or an Inf as well, where the fix
    is then made as on an accelerator). A tensor whose extremes were read already (by the
    comparison of the check that made it, or by this function), unchanged since, costs no
    kernel (``host.noted``)."""
    if t.numel() == 0:
        return False
    seen = noted(t)   # the comparison of the call that made t read them (``host.note``)
    if seen is not None:
        lo, hi = seen
    else:
        lo, hi = torch.aminmax(t)
        lo, hi = host_value(lo), host_value(hi)
        if lo is not None and hi is not None:
            note(t, lo, hi)   # (a tensor two calls read first: the model's input)
    big = torch.finfo(t.dtype).max
    return lo is None or not (-big < lo and hi < big)


def flip_last_bit(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the lowest mantissa bit flipped in each finite element >= the smallest normal
    (one ulp up or down, by the element's own bits: equal values move alike). Not a pert_mode:
    the cause analysis nudges inputs with it (``cause.py``), where its six kernels do not matter
    and keeping equal values equal does (a constant batch-norm channel stays constant)."""
    info = torch.finfo(t.dtype)
    bits = t.view(_INT_VIEW[t.dtype])
    a = t.abs()
    return (bits ^ (a.clamp(info.smallest_normal, info.max) == a)).view(t.dtype)


def add_noise(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every element above the smallest normal moved one ulp towards +inf, in three
    kernels: ``fmax(t / (1 - u), t * (1 - u))``.

    For ``|x| = m * 2^e`` with ``1 <= m < 2``, ``x / (1 - u) = x + (m/2)(1 + u + ...) ulp(x)``
    rounds to the next value away from zero (the ``u^2`` terms break the tie at ``m = 1``; never
    1.5 ulp), and ``x * (1 - u) = x - (m/2) ulp(x)`` to the next value towards zero (for ``m = 1``
    it is exactly the spacing below ``x``): ``fmax`` keeps the larger, the one towards +inf. Both are exact
    (a correctly rounded quotient and product; the 16-bit types divide in float32, where the
    quotient's rounding stays far inside the margin), the divisor is representable in every
    floating dtype, and no intermediate is rounded to the low-precision type, so every CPU kernel
    path gives the same bits. Zeros (with their sign), subnormals, the negative smallest normal
    (a tie), +-Inf and NaN are unchanged; so is +max, whose next value up is +Inf (a perturbation
    never makes an Inf the input did not have, issue 34 class O: ``t / c`` is capped at max, one
    kernel more; an input +Inf stays +Inf through ``t * c``, NaN through both). Unlike msprobe's
    constant epsilon (which left fp16 inputs unchanged) it cannot round away, and since every
    element moves the same way it measures the condition number of sums directly."""
    c = _noise_consts(t)[1]
    return torch.fmax((t / c).clamp_max_(torch.finfo(t.dtype).max), t * c)


def change_value(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the first and last elements of its last dimension swapped (every row)."""
    if t.dim() == 0 or t.numel() < 2:
        raise Cancel("the input has fewer than 2 elements")
    if t.shape[-1] < 2:
        raise Cancel("the last dimension has fewer than 2 elements")
    return swap_last(t)


_SWAPS: dict = {}


def swap_last(t: torch.Tensor) -> torch.Tensor:
    """Swap index 0 and -1 of the last dimension (its own inverse): one ``index_select`` with a
    permutation cached per length and device."""
    n = t.shape[-1]
    perm = _SWAPS.get((n, t.device))
    if perm is None:
        idx = list(range(n))
        idx[0], idx[-1] = idx[-1], idx[0]
        perm = _SWAPS[(n, t.device)] = torch.tensor(idx, device=t.device)
    return t.index_select(-1, perm)


def no_change(t: torch.Tensor) -> torch.Tensor:
    """An exact copy of ``t`` in new memory."""
    return t.clone()


def improve_precision(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU; fp16/bf16 upcast to fp32 (other dtypes kept)."""
    dtype = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
    return t.to("cpu", dtype=dtype, copy=True)


# -- call arguments as a flat list of leaves ----------------------------------------------------
_CONTAINERS = (list, tuple, dict)
#: the spec of ``(args, {})`` whose args hold no list/tuple/dict
_FLAT = ("flat",)

def flatten(args: tuple, kwargs: dict):
    """(leaves, spec): tensors and other values found in args/kwargs (descending into plain
    lists, tuples and dicts); ``unflatten(leaves, spec)`` rebuilds ``(args, kwargs)``.

    Plain recursive functions, not closures that call themselves: such a closure is a reference
    cycle, and it would keep the call's tensors (and a re-run's upcast copies) alive until the
    garbage collector runs."""
    if not kwargs and type(args) is tuple and not any(type(a) in _CONTAINERS for a in args):
        return list(args), _FLAT  # the common case: positional leaves only
    leaves: list = []
    spec = (_walk(tuple(args), leaves), _walk(dict(kwargs), leaves))
    return leaves, spec


def _walk(obj, leaves: list):
    tp = type(obj)
    if tp is list or tp is tuple:
        return (tp, [_walk(o, leaves) for o in obj])
    if tp is dict:
        return (dict, [(k, _walk(v, leaves)) for k, v in obj.items()])
    leaves.append(obj)
    return None


def unflatten(leaves: list, spec):
    if spec is _FLAT:
        return tuple(leaves), {}
    it = iter(leaves)
    return _build(spec[0], it), _build(spec[1], it)


def _build(node, it):
    if node is None:
        return next(it)
    tp, items = node
    if tp is dict:
        return {k: _build(v, it) for k, v in items}
    return tp(_build(o, it) for o in items)


def is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def first_float(leaves: list) -> int:
    for i, x in enumerate(leaves):
        if is_float(x):
            return i
    raise Cancel("no floating-point tensor input")


# -- the registry -------------------------------------------------------------------------------
@dataclass
class Call:
    """One intercepted call as the perturbations see it."""

    info: names.ApiInfo
    args: tuple
    kwargs: dict
    fuzz_device: str = "npu"
    #: indices of the leaves the call writes in place (``state.written``) and their clones
    #: taken before the real call (re-runs use fresh copies of these instead)
    state: tuple = ()
    snap: dict | None = None
    #: a call that draws from a generator: its ``rng.Replay`` (re-runs replay the real call's
    #: random stream), else None
    replay: object = None
    #: an in-place / ``out=`` call: the callable its re-runs use (its out-of-place form,
    #: ``state.out_of_place``), else None (the API itself)
    rerun: object = None
    #: such a call's own API and ``ApiInfo`` (``info`` is then its out-of-place form's), for
    #: what must name the call the user made (a repro record), else None
    called: tuple | None = None
    #: the dtype the call computed in when its outputs do not say it (autocast's, for a call
    #: with fp32 outputs that ran ATen calls in it: ``autocast.run``), else None
    compute: object = None
    #: the autocast dtype in force at the real call (``autocast.in_force``), else None: the
    #: forward check's guards turn autocast off, a repro record (``repro/record.py``) needs it
    autocast: object = None


@dataclass
class Perturbed:
    args: tuple
    kwargs: dict
    #: the dtype the re-run computes in: of the perturbed input (noise modes: its eps sets the
    #: noise-aware threshold), or the upcast one (fix casts outputs of that dtype back)
    in_dtype: torch.dtype | None
    #: applied to each perturbed output tensor before comparing (change_value swaps back)
    post: Callable | None = None
    #: the call's leaves before and after the perturbation
    old: list | None = None
    new: list | None = None

    @property
    def replaced(self) -> dict:
        """Leaf index -> replacement (the backward stage asks; forward checks do not)."""
        return {i: n for i, (o, n) in enumerate(zip(self.old, self.new)) if n is not o}


PERTURBATIONS: dict[str, Callable[[Call, list], tuple]] = {}


def perturbation(name: str):
    """Register ``func(call, leaves) -> (new_leaves, in_dtype, post)`` as pert_mode ``name``."""

    def deco(func):
        if name in PERTURBATIONS:
            raise ValueError(f"perturbation {name!r} registered twice")
        if name not in MODES:
            raise ValueError(f"perturbation {name!r} has no entry in modes.MODES (its traits)")
        PERTURBATIONS[name] = func
        return func

    return deco


def apply(mode: str, call: Call, leaves: list | None = None, spec=None) -> Perturbed:
    """Perturb the call's inputs with ``mode``; raises ``Cancel`` when it cannot apply."""
    if leaves is None:
        leaves, spec = flatten(call.args, call.kwargs)
    new, in_dtype, post = PERTURBATIONS[mode](call, leaves)
    args, kwargs = unflatten(new, spec)
    return Perturbed(args, kwargs, in_dtype, post, leaves, new)


def _replace_first(leaves: list, fn) -> tuple[list, torch.dtype]:
    i = first_float(leaves)
    new = list(leaves)
    new[i] = fn(leaves[i])
    return new, leaves[i].dtype


def upcast_target(leaves: list) -> torch.dtype:
    """fp32 when every floating input is fp16/bf16, fp64 when one is fp32; Cancel for fp64."""
    dtypes = {x.dtype for x in leaves if is_float(x)}
    if not dtypes:
        raise Cancel("no floating-point tensor input")
    if dtypes == {torch.float64}:
        raise Cancel("the inputs are already float64")
    return torch.float64 if dtypes - set(LOW_PRECISION) else torch.float32


@perturbation("improve_precision")
def _improve_precision(call: Call, leaves: list):
    target = upcast_target(leaves)
    new = [improve_precision(x, target) if is_float(x) and x.dtype != torch.float64 else x
           for x in leaves]
    return new, target, None


@perturbation("to_cpu")
def _to_cpu(call: Call, leaves: list):
    first_float(leaves)
    new = [to_cpu(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    # in_dtype: the dtype the CPU computes in when it differs from the inputs' (fix casts back)
    low = all(x.dtype in LOW_PRECISION for x in leaves if is_float(x))
    return new, (torch.float32 if low else None), None


@perturbation("combined")
def _combined(call: Call, leaves: list):
    """Never applied itself: the engine runs the modes of its schedule (``modes.py``), one per
    step; asked directly, it is its schedule's first."""
    return PERTURBATIONS[MODES["combined"].schedule[0]](call, leaves)


@perturbation("bit_noise")
def _bit_noise(call: Call, leaves: list):
    new, dtype = _replace_first(leaves, bit_noise)
    return new, dtype, None


@perturbation("add_noise")
def _add_noise(call: Call, leaves: list):
    new, dtype = _replace_first(leaves, add_noise)
    return new, dtype, None


@perturbation("no_change")
def _no_change(call: Call, leaves: list):
    new, dtype = _replace_first(leaves, no_change)
    return new, dtype, None


@perturbation("change_value")
def _change_value(call: Call, leaves: list):
    name = call.info.name
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if (name not in names.ELEMENTWISE and name not in names.REDUCTIONS) or len(tensors) != 1:
        raise Cancel("change_value applies only to single-tensor APIs whose result does not depend "
                     "on element order (element-wise ops, reductions, softmax)")
    i = first_float(leaves)
    x = leaves[i]
    new = list(leaves)
    new[i] = change_value(x)
    post = _swap_back(x)
    if name in names.REDUCTIONS and name not in names.ELEMENTWISE:
        dims = _reduced_dims(call, names.REDUCTIONS[name], x.dim())
        if dims is None or (x.dim() - 1) in dims:
            post = None  # the swapped dimension is reduced away: the result must not change
    return new, x.dtype, post


def _swap_back(x: torch.Tensor):
    last = x.shape[-1]

    def post(out: torch.Tensor) -> torch.Tensor:
        if out.dim() >= 1 and out.shape[-1] == last:
            return swap_last(out)
        return out

    return post


def _reduced_dims(call: Call, pos: int, ndim: int):
    """The set of reduced dims (normalised), or None for a full reduction."""
    dim = call.kwargs.get("dim", call.args[pos] if len(call.args) > pos else None)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    if isinstance(dim, torch.Tensor) or isinstance(dim, str):
        raise Cancel("change_value: unsupported dim argument")
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return {d % max(ndim, 1) for d in dims}
