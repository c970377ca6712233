"""A control run: the reference trained again with its rounding drawn at random.

    with GradProbe(model, dump_path="runs/control", control="bf16"):
        train(model)              # the reference's code, as in the reference run

``compare_grads(ref, test, control="runs/control")`` then flags only where the test departs from
the reference further than this run does (``verdict.py``).

What the control does (docs/DESIGN.md, "A control run"): the model's forward runs under the
precision recipe of the test (``autocast``: bf16/fp16 autocast, fp32 weights; ``cast``: the
model's parameters and floating inputs in the dtype), and every operation whose result is in a
low-precision dtype, forward, backward and optimizer, is computed by the reference kernels in
the wider dtype (fp32 for bf16/fp16; fp64 for an fp32 control) and rounded to the low dtype at
random (``round_random``): the same rounding points as the test, the same error size, a random
draw instead of round-to-nearest, and no low-precision kernel involved. Calls that draw from a
generator (dropout) run unchanged, so the training's random stream is the reference's; the
rounding draws from the control's own ``torch.Generator`` (``seed``). Fresh results are rounded
stochastically; results written in place (weights, optimizer moments) to nearest after a random
move of up to a quarter unit, so updates below it are lost as round-to-nearest loses them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ...config import CONTROL_DTYPES, CONTROL_RECIPES
from ...log import get_logger
from ..numerics import kernel as _kernel

log = get_logger(__name__)

#: dtype names a control accepts, and the wider dtype its operations are computed in
DTYPES = dict(zip(CONTROL_DTYPES, (torch.bfloat16, torch.float16, torch.float32)))
WIDE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
#: how the test runs the model in the low dtype: under autocast (fp32 parameters), cast to it,
#: or as the reference already does ("none": a reference in that dtype, or an fp32 control)
RECIPES = CONTROL_RECIPES
#: rounding spread of a fresh result: 1/2 = stochastic rounding (unbiased); smaller: round to
#: nearest after moving the value by a uniform random amount of up to ``spread`` units in the
#: last place
SPREAD = 0.5
#: rounding spread of a result written in place (weights, optimizer moments, accumulated
#: gradients): an update below a quarter unit is lost, as round-to-nearest loses it
SPREAD_IN_PLACE = 0.25

_STATE = threading.local()
_META = torch.device("meta")


@dataclasses.dataclass(frozen=True)
class ControlSpec:
    """What a control run emulates: ``dtype`` (the precision under test), ``recipe`` (how the
    test runs in it), ``seed`` (the rounding's own generator), ``spread``."""

    dtype: torch.dtype
    recipe: str
    seed: int = 0
    spread: float = SPREAD
    spread_in_place: float = SPREAD_IN_PLACE

    @property
    def name(self) -> str:
        short = {v: k for k, v in DTYPES.items()}[self.dtype]
        return short if self.recipe == default_recipe(self.dtype) else f"{short}:{self.recipe}"


def default_recipe(dtype: torch.dtype) -> str:
    return "none" if dtype == torch.float32 else "autocast"


def parse_control(spec, seed: int = 0) -> ControlSpec:
    """``"bf16"``, ``"fp16"``, ``"fp32"``, optionally ``":autocast"`` / ``":cast"`` / ``":none"``,
    or a ``torch.dtype`` -> ``ControlSpec``; a clear error otherwise."""
    from ...errors import ConfigError

    if isinstance(spec, ControlSpec):
        return spec
    if isinstance(spec, torch.dtype):
        spec = {v: k for k, v in DTYPES.items()}.get(spec, str(spec))
    accepted = ("bf16, fp16, fp32 (a torch.dtype too), optionally followed by :autocast, "
                ":cast or :none")
    if not isinstance(spec, str):
        raise ConfigError(f"control: {spec!r} is not valid; accepted: {accepted}",
                          key="control", value=spec, accepted=accepted)
    name, _, recipe = spec.partition(":")
    if name not in DTYPES or (recipe and recipe not in RECIPES):
        raise ConfigError(f"control: {spec!r} is not valid; accepted: {accepted}",
                          key="control", value=spec, accepted=accepted)
    dtype = DTYPES[name]
    return ControlSpec(dtype, recipe or default_recipe(dtype), int(seed))


# -- random rounding --------------------------------------------------------------------------
def round_random(x: torch.Tensor, dtype: torch.dtype, gen: torch.Generator,
                 spread: float = SPREAD) -> torch.Tensor:
    """``x`` (a wider floating tensor) rounded to ``dtype`` at random: to the nearest value of
    ``dtype`` or to the neighbour on the other side of ``x``, the latter with probability
    ``clamp((d - 1/2 + spread) / (2 spread), 0, 1)``, ``d`` the distance to the nearest in units
    of the gap between the two, i.e. round-to-nearest of ``x`` moved by a uniform random amount
    of up to ``spread`` units. ``spread = 1/2`` is stochastic rounding (probability ``d``:
    unbiased); a value ``dtype`` holds exactly is returned unchanged; overflow gives inf as
    round-to-nearest does; NaN stays NaN. Draws from ``gen`` only.

    On the CPU, where the compiled kernel is built (``numerics/kernel.rounding()``), the passes
    below run as one C pass each and the draws are computed from the generator's state
    (``_draw``): the same draws, values and result layout as the torch operations, which run
    elsewhere (issue 38; ``test_compiled_rounding_is_the_torch_form_bit_for_bit``)."""
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        return _bf16_from_fp32(x, gen, spread)
    if x.dtype == torch.float64 and dtype == torch.float32:
        out = _fp32_from_fp64(x, gen, spread)
        if out is not None:
            return out
        lib = _kernel.rounding()
        if lib is not None and x.device.type == "cpu" and x.is_contiguous():
            # the form below in one pass, in C (a strided x: below, whose result keeps x's
            # layout, as later calls see it)
            u = _draw(gen, tuple(x.shape), torch.float64)
            out = torch.empty(x.shape, dtype=dtype)
            lib.pk_round_f32_general(x.data_ptr(), u.data_ptr(), x.numel(), float(spread),
                                     out.data_ptr())
            return out
    near = x.to(dtype)
    wide = near.to(x.dtype)
    inf = torch.tensor(float("inf"), dtype=dtype, device=x.device)
    other = torch.nextafter(near, torch.where(wide < x, inf, -inf))
    gap = (other.to(x.dtype) - wide).abs()
    dist = (x - wide).abs() / gap
    p = ((dist - 0.5 + spread) / (2 * spread)).clamp_(0, 1)
    u = (_draw(gen, tuple(x.shape), x.dtype) if x.dtype == torch.float64 and
         x.device.type == "cpu" else
         torch.rand(x.shape, generator=gen, dtype=x.dtype, device=x.device))
    return torch.where(u < p, other, near)   # NaN p (inf, NaN x): u < NaN is False


#: from this many elements a draw is computed by the C kernel from the generator's state
#: (``_draw``): below it torch's own call costs less than the state's round trip
_DRAW_C = 1024
_DRAW_DTYPES = (torch.int32, torch.int64, torch.float64)
_draw_checked = None   # the C draws checked against torch's (once per process): True / False


def _draw(gen, shape, dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype).random_(generator=gen)`` (int32, int64) or
    ``torch.rand(shape, generator=gen, dtype=torch.float64)``: the same values and the same
    generator state after. On the CPU with the compiled kernel, from ``_DRAW_C`` elements,
    computed by ``pk_mt_draw`` from the generator's state (``get_state``, ``set_state``):
    torch's mt19937 draws one word at a time, 3-4x slower (issue 38: the draws were the largest
    part of a bf16 control's rounding). Checked against torch's draws at first use; torch's
    own call wherever that check failed (another state layout)."""
    lib = _kernel.rounding()
    n = 1
    for d in (shape if isinstance(shape, tuple) else (shape,)):
        n *= d
    if lib is not None and n >= _DRAW_C and gen.device.type == "cpu" and _draw_ok(lib):
        state = gen.get_state()
        out = torch.empty(shape, dtype=dtype)
        if lib.pk_mt_draw(state.data_ptr(), n, _DRAW_DTYPES.index(dtype), out.data_ptr()):
            gen.set_state(state)
            return out
    if dtype == torch.float64:
        return torch.rand(shape, generator=gen, dtype=dtype, device=gen.device)
    return torch.empty(shape, dtype=dtype, device=gen.device).random_(generator=gen)


def _draw_ok(lib) -> bool:
    """Do ``pk_mt_draw``'s values and states equal torch's here (every kind, across the
    state's twists, after other draws)? Decided once per process."""
    global _draw_checked
    if _draw_checked is None:
        ok = True
        try:
            a, b = torch.Generator().manual_seed(20261204), torch.Generator().manual_seed(
                20261204)
            for n, kind in ((5, 0), (700, 1), (1300, 2), (623, 0), (2000, 0), (625, 2)):
                torch.rand(3, generator=a), torch.rand(3, generator=b)
                dtype = _DRAW_DTYPES[kind]
                state = a.get_state()
                mine = torch.empty(n, dtype=dtype)
                ok = ok and bool(lib.pk_mt_draw(state.data_ptr(), n, kind, mine.data_ptr()))
                a.set_state(state)
                theirs = (torch.rand(n, generator=b, dtype=dtype) if kind == 2 else
                          torch.empty(n, dtype=dtype).random_(generator=b))
                ok = ok and torch.equal(mine, theirs) and torch.equal(a.get_state(),
                                                                      b.get_state())
        except Exception:  # noqa: BLE001 - any surprise: torch's own draws
            ok = False
        if not ok:
            log.info("control: the compiled draws differ from torch's here; torch draws")
        _draw_checked = ok
    return _draw_checked


#: below this many elements ``_bf16_from_fp32`` takes its form with the fewest operators
_FEW = 1 << 15
#: float64 bits of float32's largest finite value and smallest normal one
_FP32_MAX_BITS = 0x47EFFFFFE0000000
_FP32_TINY_BITS = 897 << 52


def _fp32_from_fp64(x, gen, spread: float):
    """``round_random`` to float32 on float64's bits, as ``_bf16_from_fp32`` does: a value of
    float32's normal range is a float64 whose lower 29 mantissa bits are zero, so adding a random
    29-bit offset to the magnitude and dropping those bits rounds at random (one 63-bit draw
    serves two elements: bits 0-28 and 32-60). Only for a CPU tensor of at least ``_FEW``
    elements each zero or of float32's normal range (the maximum and minimum of the magnitudes'
    bits, read without a device sync there); otherwise None, and ``round_random``'s general
    form runs (NaN, inf, overflow, float32's subnormal range: its grid is coarser). Issue 38:
    the float64 rounding was three quarters of an fp32 control's step. With the compiled
    kernel the check and the rounding are one C pass each (``pk_fp32_range_f64``,
    ``pk_round_f32_bits``)."""
    n = x.numel()
    lo = int(round((1 << 29) * (0.5 - spread)))
    width = int(round((1 << 29) * 2 * spread))
    if n < _FEW or x.device.type != "cpu" or not width or width & (width - 1) or \
            width > 1 << 29:
        return None
    bits = x.contiguous().view(torch.int64).reshape(-1)
    lib = _kernel.rounding()
    if lib is not None:     # the range check and the rounding, one pass each (C)
        if not lib.pk_fp32_range_f64(bits.data_ptr(), n):
            return None
        r = _draw(gen, (n + 1) // 2, torch.int64)
        out = torch.empty(x.shape, dtype=torch.float32)
        lib.pk_round_f32_bits(bits.data_ptr(), r.data_ptr(), n, width, lo, out.data_ptr())
        return out
    a = bits & 0x7FFFFFFFFFFFFFFF
    if int(a.max()) > _FP32_MAX_BITS:          # NaN, inf, or beyond float32's range
        return None
    a.sub_(1).bitwise_and_(0x7FFFFFFFFFFFFFFF)   # a zero becomes the largest: not tiny
    if int(a.min()) < _FP32_TINY_BITS - 1:     # float32's subnormal range
        return None
    half = (n + 1) // 2
    r = torch.empty(half, dtype=torch.int64).random_(generator=gen)   # 63 random bits
    t = torch.empty_like(bits)
    torch.add(bits[:half], r & (width - 1), out=t[:half])
    torch.add(bits[half:], r.bitwise_right_shift(32).bitwise_and_(width - 1)[:n - half],
              out=t[half:])
    if lo:
        t.add_(lo)
    t.bitwise_and_(-(1 << 29))
    return t.view(torch.float64).view(x.shape).to(torch.float32)


def _bf16_from_fp32(x, gen, spread: float):
    """``round_random`` to bf16 on the bits: bf16 is fp32's upper half, so adding a random
    16-bit offset to the magnitude and dropping the lower half rounds at random (an offset
    uniform in [0, 2^16) is stochastic rounding; ``2^15 (1 - 2 spread) + [0, 2^17 spread)`` is
    round-to-nearest after a move of up to ``spread`` units). Inf keeps its bits (its lower
    half is zero); a NaN gets its lower half cleared and its quiet bit set first, so it stays
    NaN whatever its payload.

    Cost (issue 38): one 31-bit draw of the generator serves two elements (the first half's
    offsets from its low bits, the second half's from its high ones: 16 and 15 random bits at
    spread 1/2, so the second half's mean offset is half a 2^-16 unit low; 15 and 15 at spread
    1/4), the integer passes run in place on one buffer, and on the CPU a tensor without NaN
    (the maximum of its magnitudes' bits, no device sync there) skips the NaN passes: 1.4-2x
    less CPU than drawing per element and masking NaNs with ``where(isnan(x))`` at 131072
    elements. Below ``_FEW`` elements, where the operators' count costs more than their
    passes, that simpler form is used. With the compiled kernel either form is one C pass
    (``pk_round_bf16``) over the same draws (``_draw``): 62 us for 131072 elements here,
    draws included, against 290-730 us for this form; a NaN is converted by torch as here."""
    lo = int(round(0x10000 * (0.5 - spread)))
    width = int(round(0x10000 * 2 * spread))
    bits = x.contiguous().view(torch.int32)
    n = bits.numel()
    lib = _kernel.rounding() if x.device.type == "cpu" else None
    if lib is not None and width and width & (width - 1) == 0 and (
            (n < _FEW and x.is_contiguous()) or (n >= _FEW and width <= 0x10000)):
        # the same draws as below, the passes fused in C: one word per element below _FEW
        # elements (mode 0), else one for two (mode 1 at spread 1/2, else 2); a strided x of
        # few elements below (its result keeps x's layout there, as later calls see it)
        if n < _FEW:
            mode, r = 0, _draw(gen, tuple(x.shape), torch.int32)
        else:
            mode = 1 if width == 0x10000 else 2
            r = _draw(gen, (n + 1) // 2, torch.int32)
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        if lib.pk_round_bf16(bits.data_ptr(), r.data_ptr(), n, mode, width, lo,
                             out.data_ptr(), None):
            # a NaN: the float32 the torch form converts, converted by torch as there
            t = torch.empty(x.shape, dtype=torch.float32)
            lib.pk_round_bf16(bits.data_ptr(), r.data_ptr(), n, mode, width, lo, None,
                              t.data_ptr())
            out = t.to(torch.bfloat16)
        return out
    if n < _FEW and width and width & (width - 1) == 0:   # few elements: fewest operators
        r = (_draw(gen, tuple(x.shape), torch.int32) if x.device.type == "cpu" else
             torch.empty(x.shape, dtype=torch.int32, device=x.device).random_(generator=gen))
        r = (r & (width - 1)) + lo if lo else r & (width - 1)
        out = ((bits + r) & -0x10000).view(torch.float32)
        return torch.where(torch.isnan(x), x, out).to(torch.bfloat16)
    flat = bits.reshape(-1)
    m = flat & 0x7FFFFFFF
    if n and flat.device.type == "cpu" and int(m.max()) <= 0x7F800000:
        t = None   # no NaN (read without a device sync on the CPU): the offsets are added alone
    else:
        # a NaN (|bits| above inf's: |bits| - 0x7F800001 >= 0) gets its lower half cleared (no
        # offset can carry out of it) and its quiet bit set (a NaN still): m = -1 there, else 0
        m.sub_(0x7F800001).bitwise_not_().bitwise_right_shift_(31)
        keep = m & 0xFFFF
        t = flat & keep.bitwise_not_()
        t.bitwise_or_(m.bitwise_and_(0x400000))
    half = (n + 1) // 2
    if width and width & (width - 1) == 0 and width <= 0x10000 and n:
        r = torch.empty(half, dtype=torch.int32, device=x.device).random_(generator=gen)
        if width == 0x10000:   # spread 1/2: bits 0-15, then bits 16-30 (even offsets)
            first = r & 0xFFFF
            second = r.bitwise_right_shift(16).bitwise_left_shift_(1)
        else:                  # bits 0-14 and 16-30, at most 15 each
            first = r & (width - 1)
            second = r.bitwise_right_shift(16).bitwise_and_(width - 1)
        if t is None:
            t = torch.empty_like(flat)
            torch.add(flat[:half], first, out=t[:half])
            torch.add(flat[half:], second[:n - half], out=t[half:])
        else:
            t[:half].add_(first)
            t[half:].add_(second[:n - half])
        if lo:
            t.add_(lo)
    else:
        if t is None:
            t = flat.clone()
        if width:
            t.add_(torch.randint(lo, lo + width, (n,), generator=gen, dtype=torch.int32,
                                 device=x.device))
        else:                  # spread 0: round half up after no move
            t.add_(lo)
    t.bitwise_and_(-0x10000)   # inf stays inf: its lower half is 0
    return t.view(torch.float32).view(x.shape).to(torch.bfloat16)


# -- the dispatch mode ------------------------------------------------------------------------
_AT = torch.ops.aten
#: calls computing nothing a rounding could change (their low-precision results are exact)
_EXACT = {_AT.detach.default, _AT.clone.default, _AT.alias.default, _AT.cat.default,
          _AT.stack.default, _AT.zeros_like.default, _AT.ones_like.default,
          _AT.empty_like.default, _AT.empty.memory_format, _AT.zeros.default,
          _AT.empty_strided.default, _AT.fill_.Scalar, _AT.zero_.default,
          _AT.embedding.default, _AT.index_select.default, _AT.gather.default,
          _AT.neg.default, _AT.abs.default, _AT.relu.default, _AT.where.self,
          _AT.masked_fill.Scalar, _AT.masked_fill_.Scalar, _AT.max.default, _AT.min.default,
          _AT.slice_backward.default, _AT.select_backward.default,
          _AT.constant_pad_nd.default, _AT.index.Tensor, _AT.eq.Tensor, _AT.eq.Scalar,
          _AT.ne.Scalar, _AT.gt.Scalar, _AT.lt.Scalar, _AT.ge.Scalar, _AT.le.Scalar,
          _AT._local_scalar_dense.default}


class RoundingMode(TorchDispatchMode):
    """Every ATen call with a floating tensor of ``spec.dtype`` among its arguments or results
    is computed in the wider dtype and its low-precision results rounded at random: fresh
    results with ``spec.spread``, results written in place with ``spec.spread_in_place``.

    Two exceptions, each noted in docs/DESIGN.md ("A control run"):

    * *values computed from integers and constants alone* (a float made from an integer tensor,
      a factory call, and what is computed from such values only: relative-position buckets,
      masks, tables from ``arange``) run unchanged on the reference's kernels and are tagged
      ``fixed``: they are the same at every step of any real run, so the integer results made
      from them (bucketing, truncation) are the reference's, not redrawn at each call;
    * *a call with no kernel in the wider dtype* (oneDNN's LSTM has no float64 one, nor a
      dynamically quantized linear) runs on the low-precision kernel, and its results are
      rounded at random as if the exact value lay anywhere in the rounding interval of that
      result (``fallbacks`` names them; noted once per call in the log)."""

    def __init__(self, spec: ControlSpec, device="cpu", caches: dict | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.low = spec.dtype
        self.wide = WIDE[spec.dtype]
        self.gens: dict = {}
        self.calls = 0
        self.rounded = 0
        self.fallbacks: dict = {}   # call name -> the error its wide kernel raised
        self._fixed_seen = False    # a value computed from integers alone was made
        # what is decided once per call (its schema) or per call and argument dtypes: kept
        # by the session across its start()s (``caches``), computed again by none of them
        caches = {} if caches is None else caches
        self._dtypes: dict = caches.setdefault("dtypes", {})   # (func, arg dtypes) -> results
        self._skip: dict = caches.setdefault("skip", {})       # func -> runs unchanged
        self._writes: dict = caches.setdefault("writes", {})   # func -> written arguments
        self._gen(torch.device(device))

    def _gen(self, device) -> torch.Generator:
        key = (device.type, device.index)
        g = self.gens.get(key)
        if g is None:
            g = self.gens[key] = torch.Generator(device=device)
            g.manual_seed(self.spec.seed + 7919 * len(self.gens))
        return g

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # a control emulates eager calls (not torch.compile'd graphs: docs): no dynamo-disabling
        # wrapper around every call (about 2 us each, issue 38)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        skip = self._skip.get(func)
        if skip is None:
            # in-place views (transpose_) change a tensor's shape, not its values
            skip = self._skip[func] = bool(func.is_view or func in _EXACT or (
                torch.Tag.nondeterministic_seeded in func.tags) or (
                torch.Tag.inplace_view in func.tags))
        if skip or getattr(_STATE, "paused", 0) or not (
                _has_low(args, self.low) or (kwargs and _has_low(kwargs.values(), self.low))):
            out = func(*args, **kwargs) if kwargs else func(*args)
            if self._fixed_seen and skip and args and _is_fixed(args[0]):
                _mark_fixed(out)    # a view or copy of a fixed value
            return out
        kwargs = kwargs or {}
        if _from_constants(args, kwargs):
            self._fixed_seen = True
            out = func(*args, **kwargs)
            _mark_fixed(out)
            return out
        return self._emulate(func, args, kwargs)

    def _emulate(self, func, args, kwargs):
        """``func`` on the arguments' wide copies; its low-precision results rounded at random
        (ATen arguments and results are tensors, lists of them or other values, one level
        deep: mapped directly, not through pytree)."""
        low, wide = self.low, self.wide

        def up(t):
            if isinstance(t, torch.Tensor) and t.dtype == low:
                return t.to(wide)
            return wide if t is low else t

        wargs = _map(up, args)
        wkwargs = {k: _map_one(up, v) for k, v in kwargs.items()} if kwargs else kwargs
        try:
            out = func(*wargs, **wkwargs)
        except (RuntimeError, NotImplementedError) as err:
            # no kernel in the wider dtype: nothing was written (the wide copies are fresh)
            return self._fallback(func, args, kwargs, err)
        expected = self._result_dtypes(func, args, kwargs)
        # in-place / out= arguments: the wide copy was written; round it into the original
        back = {}
        for i, name in self._written(func):
            if i is None or i >= len(args):
                value, wvalue = kwargs.get(name), wkwargs.get(name)
            else:
                value, wvalue = args[i], wargs[i]
            pairs = (zip(value, wvalue) if isinstance(value, (list, tuple))
                     else [(value, wvalue)])
            for orig, w in pairs:
                if isinstance(orig, torch.Tensor):
                    _unmark_fixed(orig)     # it now holds what the run computed
                if isinstance(orig, torch.Tensor) and orig.dtype == low:
                    with torch.no_grad():
                        orig.copy_(self._round(w, self.spec.spread_in_place))
                    back[id(w)] = orig
        if expected is not None and len(expected) != _count_tensors(out):
            expected = None     # the meta run gave another structure: the rule instead
        it = iter(expected) if expected is not None else None

        def down(t):
            if not isinstance(t, torch.Tensor):
                return t
            dt = next(it) if it is not None else None
            if id(t) in back:
                return back[id(t)]
            if dt is None:
                dt = low if t.dtype == wide else t.dtype
            if dt == low and t.dtype == wide:
                return self._round(t)
            return t if t.dtype == dt else t.to(dt)

        return _map_one(down, out)

    def _fallback(self, func, args, kwargs, err):
        """``func`` on the low-precision kernel, its low-precision results (and those it wrote)
        moved by a uniform amount within their rounding interval and rounded at random: a
        random rounding of the same size as the other calls get, with this kernel's own
        error under it. Noted once per call."""
        out = func(*args, **kwargs)     # a genuine error raises here, unnoted
        name = str(func)
        if name not in self.fallbacks:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            self.fallbacks[name] = first
            log.warning("control: %s has no %s kernel (%s); computed in %s and rounded at "
                        "random from that result", name, str(self.wide).replace("torch.", ""),
                        first, str(self.low).replace("torch.", ""))
        written = set()
        for i, arg_name in self._written(func):
            value = kwargs.get(arg_name) if i is None or i >= len(args) else args[i]
            for orig in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(orig, torch.Tensor) and orig.dtype == self.low:
                    with torch.no_grad():
                        orig.copy_(self._reround(orig, self.spec.spread_in_place))
                    written.add(id(orig))
        return _map_one(lambda t: t if not isinstance(t, torch.Tensor) or id(t) in written
                        or t.dtype != self.low else self._reround(t), out)

    def _reround(self, r, spread=None):
        """``r`` (low precision, a kernel's result) moved uniformly within its rounding
        interval (half a unit either side) in the wider dtype and rounded at random."""
        w = r.detach().to(self.wide)
        inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
        gap = (torch.nextafter(r.detach(), inf).to(self.wide) - w).abs()
        u = torch.rand(r.shape, generator=self._gen(r.device), dtype=self.wide, device=r.device)
        moved = torch.where(torch.isfinite(gap), w + (u - 0.5) * gap, w)
        return self._round(moved, spread)

    def _round(self, w, spread=None):
        self.rounded += 1
        return round_random(w, self.low, self._gen(w.device),
                            self.spec.spread if spread is None else spread)

    def _written(self, func) -> list:
        """(position or None for keyword-only, name) of the arguments ``func`` writes."""
        found = self._writes.get(func)
        if found is None:
            found = self._writes[func] = [
                (None if a.kwarg_only else i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write]
        return found

    def _result_dtypes(self, func, args, kwargs):
        """The dtypes of ``func``'s tensor results for the original (low) arguments: from a run
        on meta tensors, once per (call, argument dtypes); None when the call has no meta
        kernel (then: low where the wide run gives the wide dtype)."""
        key = (func, *(_dtype_key(a) for a in args),
               *(x for k, v in kwargs.items() for x in (k, _dtype_key(v))))
        if key in self._dtypes:
            return self._dtypes[key]

        def meta(t):
            if isinstance(t, torch.device):   # ``_to_copy(..., device=cpu)``: the dtypes are
                return _META                  # the same on meta; a copy to cpu has no meta run
            return (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) else t)

        try:
            res = func(*tree_map(meta, args), **tree_map(meta, kwargs))
            found = [t.dtype for t in tree_flatten(res)[0] if isinstance(t, torch.Tensor)]
        except Exception:  # noqa: BLE001 - no meta kernel: the fallback rule
            found = None
        self._dtypes[key] = found
        return found


def _map_one(fn, value):
    """``fn`` on a value, or on each item of a list or tuple, depth first (ATen's arguments and
    results: tensors, lists of them, tuples of both; a result tuple may be a structseq,
    ``torch.return_types``)."""
    if isinstance(value, (list, tuple)):
        items = [_map_one(fn, x) for x in value]
        kind = type(value)
        if kind is list or kind is tuple:
            return kind(items)
        return kind(*items) if hasattr(kind, "_fields") else kind(items)
    return fn(value)


def _map(fn, args: tuple) -> tuple:
    return tuple(_map_one(fn, a) for a in args)


def _tensors(value):
    """The tensors of an ATen argument or result (a tensor, lists and tuples of them), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for x in value:
            yield from _tensors(x)


def _count_tensors(value) -> int:
    return sum(1 for _ in _tensors(value))


def _dtype_key(v):
    """What of an argument decides its call's result dtypes: a tensor's dtype, a dtype, the
    dtypes of a list's tensors (None for anything else)."""
    if isinstance(v, torch.Tensor):
        return v.dtype
    if isinstance(v, torch.dtype):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(x.dtype if isinstance(x, torch.Tensor) else None for x in v)
    return None


#: the attribute a value computed from integers and constants alone carries (``RoundingMode``)
_FIXED = "_probekit_fixed"


def _is_fixed(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _FIXED, False)


def _mark_fixed(out) -> None:
    for t in _tensors(out):
        setattr(t, _FIXED, True)


def _unmark_fixed(t) -> None:
    if getattr(t, _FIXED, False):
        setattr(t, _FIXED, False)


def _from_constants(args, kwargs) -> bool:
    """Are all floating tensors among a call's arguments values computed from integers and
    constants alone (none at all: a factory call, a float made from an integer tensor)?"""
    for value in (*args, *kwargs.values()):
        for t in _tensors(value):
            if (t.is_floating_point() or t.is_complex()) and not getattr(t, _FIXED, False):
                return False
    return True


def _has_low(values, low) -> bool:
    """Is a tensor of dtype ``low`` (or ``low`` itself, a dtype argument) among ``values``,
    one list deep (ATen arguments: tensors, lists of tensors, scalars)?"""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype == low:
                return True
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor) and x.dtype == low:
                    return True
        elif v is low:
            return True
    return False


@contextlib.contextmanager
def paused():
    """Probekit's own calls (the grad probe's statistics) run without the rounding."""
    _STATE.paused = getattr(_STATE, "paused", 0) + 1
    try:
        yield
    finally:
        _STATE.paused -= 1


# -- the recipe and the session ---------------------------------------------------------------
class Perturbation:
    """The control's session: the recipe applied to ``model`` and the rounding mode, from
    ``start()`` to ``stop()`` (or a ``with`` block) on this thread."""

    def __init__(self, model, control, seed: int = 0) -> None:
        self.model = model
        self.spec = parse_control(control, seed)
        self.mode = None
        self._handles = []
        self._autocast = []
        self._mkldnn = None
        self._scoped = 0        # recipe() blocks open
        self._caches: dict = {}  # the rounding mode's decisions per call, across start()s

    @property
    def device(self):
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def start(self) -> "Perturbation":
        if self.mode is not None:
            return self
        spec, model = self.spec, self.model
        if spec.recipe == "cast":
            model.to(spec.dtype)
            self._handles.append(model.register_forward_pre_hook(
                _cast_inputs(spec.dtype), with_kwargs=True, prepend=True))
        elif spec.recipe == "autocast":
            kind = self.device.type
            stack = self._autocast

            def enter(module, args):
                if self._scoped:     # inside recipe(): the block applies it, as the test does
                    stack.append(None)
                    return
                ctx = torch.autocast(kind, dtype=spec.dtype)
                ctx.__enter__()
                stack.append(ctx)

            def leave(module, args, output):
                ctx = stack.pop() if stack else None
                if ctx is not None:
                    ctx.__exit__(None, None, None)

            self._handles.append(model.register_forward_pre_hook(enter, prepend=True))
            self._handles.append(model.register_forward_hook(leave, always_call=True))
        if self.spec.dtype == torch.float32 and torch._C._get_mkldnn_enabled():
            # oneDNN has no float64 kernels, and PyTorch picks it for fp32 above the dispatch
            # mode (the LSTM/GRU): off, those calls take PyTorch's own kernels, which the mode
            # computes in float64 op by op (oneDNN's fp32 convolutions are not affected: the
            # mode computes them in float64, where PyTorch never uses oneDNN)
            self._mkldnn = True
            torch._C._set_mkldnn_enabled(False)
            log.info("control fp32: oneDNN off while the control runs (no float64 kernels); "
                     "its calls computed by PyTorch's own kernels in float64")
        self.mode = RoundingMode(spec, self.device, self._caches)
        self.mode.__enter__()
        return self

    @contextlib.contextmanager
    def recipe(self):
        """The test's precision recipe over a block of the step, not only the model's forward:
        where the test runs ``with torch.autocast(...):`` around more than ``model(...)`` (a
        loss computed from the outputs, a second model), the reference's code marks the same
        lines ``with control.recipe():`` and the control applies autocast there, as the test
        does (inside it the model's own hooks leave it alone). Nothing outside a started
        control (the reference's own run) or for a recipe other than autocast (``cast``: the
        model and its inputs are cast whatever the block; ``none``)."""
        if self.mode is None or self.spec.recipe != "autocast":
            yield
            return
        self._scoped += 1
        try:
            with torch.autocast(self.device.type, dtype=self.spec.dtype):
                yield
        finally:
            self._scoped -= 1

    def remove(self) -> None:
        """``stop()``: the probe removes it with its hooks."""
        self.stop()

    def stop(self) -> None:
        mode, self.mode = self.mode, None
        handles, self._handles = self._handles, []
        try:
            for h in handles:
                h.remove()
        finally:
            while self._autocast:
                ctx = self._autocast.pop()
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            if mode is not None:
                mode.__exit__(None, None, None)
            if self._mkldnn is not None:
                torch._C._set_mkldnn_enabled(self._mkldnn)
                self._mkldnn = None

    def __enter__(self) -> "Perturbation":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cast_inputs(dtype):
    def cast(module, args, kwargs):
        conv = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() \
            else t  # noqa: E731
        return tree_map(conv, args), tree_map(conv, kwargs)
    return cast


def perturb(model, control="bf16", seed: int = 0) -> Perturbation:
    """A control run's perturbation as a context manager (``GradProbe(..., control=)`` uses
    it): ``with probekit.perturb(model, "bf16"): train(model)``. ``control``: as
    ``parse_control`` takes it (``"bf16"``, ``"bf16:cast"``, ``torch.float16``, ...)."""
    return Perturbation(model, control, seed)
