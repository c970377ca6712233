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
    round-to-nearest does; NaN stays NaN. Draws from ``gen`` only."""
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        return _bf16_from_fp32(x, gen, spread)
    near = x.to(dtype)
    wide = near.to(x.dtype)
    inf = torch.tensor(float("inf"), dtype=dtype, device=x.device)
    other = torch.nextafter(near, torch.where(wide < x, inf, -inf))
    gap = (other.to(x.dtype) - wide).abs()
    dist = (x - wide).abs() / gap
    p = ((dist - 0.5 + spread) / (2 * spread)).clamp_(0, 1)
    u = torch.rand(x.shape, generator=gen, dtype=x.dtype, device=x.device)
    return torch.where(u < p, other, near)   # NaN p (inf, NaN x): u < NaN is False


def _bf16_from_fp32(x, gen, spread: float):
    """``round_random`` to bf16 on the bits: bf16 is fp32's upper half, so adding a random
    16-bit offset to the magnitude and dropping the lower half rounds at random (an offset
    uniform in [0, 2^16) is stochastic rounding; ``2^15 (1 - 2 spread) + [0, 2^17 spread)`` is
    round-to-nearest after a move of up to ``spread`` units). Inf keeps its bits (its lower
    half is zero); NaN stays NaN."""
    lo = int(round(0x10000 * (0.5 - spread)))
    width = int(round(0x10000 * 2 * spread))
    if width & (width - 1) == 0:   # a power of two: full-range draws, masked (twice as fast)
        r = torch.empty(x.shape, dtype=torch.int32, device=x.device).random_(generator=gen)
        r = (r & (width - 1)) + lo if lo else r & (width - 1)
    else:
        r = torch.randint(lo, lo + width, x.shape, generator=gen, dtype=torch.int32,
                          device=x.device)
    bits = x.contiguous().view(torch.int32)
    out = ((bits + r) & -0x10000).view(torch.float32)   # inf stays inf: its lower half is 0
    special = torch.isnan(x)
    return torch.where(special, x, out).to(torch.bfloat16)


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

    def __init__(self, spec: ControlSpec, device="cpu") -> None:
        super().__init__()
        self.spec = spec
        self.low = spec.dtype
        self.wide = WIDE[spec.dtype]
        self.gens: dict = {}
        self.calls = 0
        self.rounded = 0
        self.fallbacks: dict = {}   # call name -> the error its wide kernel raised
        self._fixed_seen = False    # a value computed from integers alone was made
        self._dtypes: dict = {}     # (func, argument dtypes) -> result dtypes
        self._skip: dict = {}       # func -> runs unchanged (views, exact, random)
        self._writes: dict = {}     # func -> its written arguments (position, name)
        self._gen(torch.device(device))

    def _gen(self, device) -> torch.Generator:
        key = (device.type, device.index)
        g = self.gens.get(key)
        if g is None:
            g = self.gens[key] = torch.Generator(device=device)
            g.manual_seed(self.spec.seed + 7919 * len(self.gens))
        return g

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        skip = self._skip.get(func)
        if skip is None:
            # in-place views (transpose_) change a tensor's shape, not its values
            skip = self._skip[func] = bool(func.is_view or func in _EXACT or (
                torch.Tag.nondeterministic_seeded in func.tags) or (
                torch.Tag.inplace_view in func.tags))
        if skip or getattr(_STATE, "paused", 0) or not (
                _has_low(args, self.low) or _has_low(kwargs.values(), self.low)):
            out = func(*args, **kwargs)
            if self._fixed_seen and skip and args and _is_fixed(args[0]):
                _mark_fixed(out)    # a view or copy of a fixed value
            return out
        flat = tree_flatten((args, kwargs))[0]
        if _from_constants(flat):
            self._fixed_seen = True
            out = func(*args, **kwargs)
            _mark_fixed(out)
            return out
        return self._emulate(func, args, kwargs, flat)

    def _emulate(self, func, args, kwargs, flat):
        low, wide = self.low, self.wide

        def up(t):
            if isinstance(t, torch.Tensor) and t.dtype == low:
                return t.to(wide)
            return wide if t is low else t

        wargs = tree_map(up, args)
        wkwargs = tree_map(up, kwargs)
        try:
            out = func(*wargs, **wkwargs)
        except (RuntimeError, NotImplementedError) as err:
            # no kernel in the wider dtype: nothing was written (the wide copies are fresh)
            return self._fallback(func, args, kwargs, err)
        expected = self._result_dtypes(func, args, kwargs, flat)
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
        leaves, spec = tree_flatten(out)
        if expected is not None and len(expected) != sum(
                isinstance(t, torch.Tensor) for t in leaves):
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

        return spec.unflatten([down(t) for t in leaves])

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
        return tree_map(lambda t: t if not isinstance(t, torch.Tensor) or id(t) in written
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

    def _result_dtypes(self, func, args, kwargs, flat):
        """The dtypes of ``func``'s tensor results for the original (low) arguments: from a run
        on meta tensors, once per (call, argument dtypes); None when the call has no meta
        kernel (then: low where the wide run gives the wide dtype)."""
        key = (func, tuple(t.dtype if isinstance(t, torch.Tensor) else
                           t if isinstance(t, torch.dtype) else None for t in flat))
        if key in self._dtypes:
            return self._dtypes[key]

        def meta(t):
            return (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) else t)

        try:
            res = func(*tree_map(meta, args), **tree_map(meta, kwargs))
            found = [t.dtype for t in tree_flatten(res)[0] if isinstance(t, torch.Tensor)]
        except Exception:  # noqa: BLE001 - no meta kernel: the fallback rule
            found = None
        self._dtypes[key] = found
        return found


#: the attribute a value computed from integers and constants alone carries (``RoundingMode``)
_FIXED = "_probekit_fixed"


def _is_fixed(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _FIXED, False)


def _mark_fixed(out) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, _FIXED, True)


def _unmark_fixed(t) -> None:
    if getattr(t, _FIXED, False):
        setattr(t, _FIXED, False)


def _from_constants(flat) -> bool:
    """Are all floating tensors among a call's arguments values computed from integers and
    constants alone (none at all: a factory call, a float made from an integer tensor)?"""
    for t in flat:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and \
                not getattr(t, _FIXED, False):
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
        self.mode = RoundingMode(spec, self.device)
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
