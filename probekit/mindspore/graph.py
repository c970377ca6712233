"""The tap: how a MindSpore optimizer's gradients reach probekit in every execution mode.

A MindSpore optimizer is a ``Cell`` called with the tuple of gradients. ``install`` replaces its
``construct`` (an instance attribute, as msprobe does for static graphs) with::

    def construct(self, gradients):
        gradients = tap(gradients)        # a Cell: compiled where the optimizer is compiled
        return original(gradients)

* **Compiled** (``GRAPH_MODE``, an ``@ms.jit`` train step with the optimizer inside, a
  ``TrainOneStepCell``, or an optimizer whose own ``construct`` is ``@jit``, as ``nn.SGD`` and
  ``nn.Adam`` are): MindSpore parses ``tap.construct`` into the graph. ``HostTap`` (MindSpore on
  the CPU) hands each gradient, in place, to a Python callback (a ``pyfunc`` ``Custom`` op),
  which computes its statistics with probekit's CPU path; ``DeviceTap`` (Ascend, GPU) computes
  the statistics with ops in the graph (``stats.DeviceStats``) and hands the small results to
  one callback. The optimizer's update depends on the callbacks (``ops.depend``), so they see
  each step's gradients before the update and the step cannot finish without them.
* **PyNative**, optimizer not compiled: the wrapper runs as Python and ``tap(gradients)`` is the
  tap's ``__call__`` (never parsed), which hands the gradient tensors to the probe directly.

Each optimizer keeps one tap (``TAP_ATTR``) for its lifetime: a graph compiled while a probe was
attached keeps calling that tap, so the tap forwards to whichever probe is attached now, and
drops the calls when none is. A compiled graph never changes, so a train step compiled *before*
``monitor()`` holds no tap; the probe notices from the optimizer's ``global_step`` (see
``GradProbe.stop``).
"""
from __future__ import annotations

import inspect
import os

import numpy as np

from .compat import check_numpy

check_numpy()  # before MindSpore is imported: numpy 2 beside its numpy-1 wheel

import mindspore as ms  # noqa: E402
from mindspore import nn, ops

from .stats import DeviceStats

#: attribute of the optimizer holding its tap, and marking the wrapper construct
TAP_ATTR = "_probekit_tap"
WRAPPED_ATTR = "__probekit_wrapped__"

_ONE = None


def _one() -> np.ndarray:
    global _ONE
    if _ONE is None:
        _ONE = np.zeros(1, np.float32)
    return _ONE


def _pyfunc(fn, dtype=None):
    """A ``Custom`` op running ``fn`` (host arrays in, a 1-element array out, float32 unless
    ``dtype``)."""
    dtype = ms.float32 if dtype is None else dtype
    op = ops.Custom(fn, out_shape=lambda *shapes: (1,), out_dtype=lambda *types: dtype,
                    func_type="pyfunc")
    op.add_prim_attr("primitive_target", "CPU")  # a host callback, also in a device graph
    return op


class Tap(nn.Cell):
    """Base of the taps: the attached probe (or None) and the PyNative entry point."""

    kind = "?"

    def __init__(self, optimizer, original) -> None:
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "probe", None)
        object.__setattr__(self, "original", original)

    def attach(self, probe) -> None:
        object.__setattr__(self, "probe", probe)

    def __call__(self, gradients):
        """PyNative: the optimizer's wrapper runs as Python. When its original ``construct`` is
        ``@jit``, that graph (the wrapper, tap included) records; else record from here."""
        probe = self.probe
        if probe is not None and not original_compiles(self.original):
            probe._on_eager(gradients)
        return gradients


def original_compiles(original) -> bool:
    """True when calling ``original`` compiles the optimizer (an ``@jit`` construct)."""
    return bool(getattr(original, "__wrapped_by_jit__", False)) and os.getenv("MS_JIT") != "0"


class HostTap(Tap):
    """Two callbacks per parameter, each handed the gradient's host memory (CPU) as it is: the
    first returns its largest finite |x|; the second, given every gradient's (the significance
    scale is its module's), computes the statistics. The gradients stay alive in between: they
    are the second callbacks' inputs."""

    kind = "host"

    def __init__(self, optimizer, original) -> None:
        super().__init__(optimizer, original)
        params = optimizer.parameters
        self.idx = tuple(range(len(params)))
        # numpy has no bfloat16: such a gradient is widened (exactly) on its way out
        self.widen = tuple(p.dtype == ms.bfloat16 for p in params)
        self.peaks = tuple(_pyfunc(self._peak(j), ms.float64) for j in self.idx)
        self.taps = tuple(_pyfunc(self._callback(j)) for j in self.idx)

    def _peak(self, j: int):
        def on_peak(array):
            probe = self.probe
            return np.array([probe._on_host_amax(j, array) if probe is not None else 0.0])

        on_peak.__name__ = f"probekit_peak_{j}"
        return on_peak

    def _callback(self, j: int):
        def on_grad(array, peaks):
            probe = self.probe
            if probe is not None:
                probe._on_host_grad(j, array, peaks)
            return _one()

        on_grad.__name__ = f"probekit_grad_{j}"
        return on_grad

    def construct(self, gradients):
        wide = []
        peaks = []
        for j in self.idx:
            g = gradients[j]
            if self.widen[j]:
                g = g.astype(ms.float32)
            wide.append(g)
            peaks.append(self.peaks[j](g))
        every = ops.cat(peaks)
        outs = []
        for j in self.idx:
            outs.append(self.taps[j](wide[j], every))
        return ops.depend(gradients, outs)


class DeviceTap(Tap):
    """The statistics computed in the graph (``DeviceStats``), one callback per step."""

    kind = "device"

    def __init__(self, optimizer, original, index, level: str, bounds, significance: bool,
                 modules=None, sample=None, sample_size: int = 0):
        super().__init__(optimizer, original)
        params = optimizer.parameters
        self.index = tuple(index)
        self.signature = (self.index, level, tuple(bounds), bool(significance), sample_size)
        self.stats = DeviceStats([params[i].size for i in self.index],
                                 [params[i].dtype for i in self.index], level, bounds,
                                 significance, modules=modules, sample=sample)
        # statistics, then the sign bits (L1/L2; and the significance bits) or the L0 bytes
        self.nout = 3 if significance and level != "L0" else 2
        self.sink = _pyfunc(self._callback())

    def _callback(self):
        # the pyfunc kernel takes its inputs from the callback's signature: no *args
        def forward(arrays):
            probe = self.probe
            if probe is not None:
                probe._on_device_stats(self, arrays)
            return _one()

        if self.nout == 2:
            def on_stats(stats, bits):
                return forward((stats, bits))
        else:
            def on_stats(stats, bits, more):
                return forward((stats, bits, more))
        return on_stats

    def construct(self, gradients):
        picked = []
        for i in self.index:
            picked.append(gradients[i])
        outs = self.stats(tuple(picked))
        if self.nout == 2:
            done = self.sink(outs[0], outs[1])
        else:
            done = self.sink(outs[0], outs[1], outs[2])
        return ops.depend(gradients, done)


def check_construct(construct) -> str | None:
    """Why an optimizer's (bound) ``construct`` cannot be wrapped, or None."""
    try:
        sig = inspect.signature(construct)
    except (TypeError, ValueError):
        return "its construct has no readable signature"
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 1 or any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        return (f"its construct takes {sig} instead of the one tuple of gradients of "
                "mindspore.nn.Optimizer")
    return None


def sharding() -> str | None:
    """What in MindSpore's parallel context hands the optimizer slices of its parameters (their
    gradients then differ from the shapes probekit recorded), or None."""
    mode = ms.get_auto_parallel_context("parallel_mode")
    if mode in ("semi_auto_parallel", "auto_parallel"):
        return f"parallel_mode={mode!r} (parameters sliced by the compiler)"
    if ms.get_auto_parallel_context("enable_parallel_optimizer"):
        return "enable_parallel_optimizer=True (optimizer states and updates sharded)"
    return None


def current_tap(optimizer) -> Tap | None:
    return optimizer.__dict__.get(TAP_ATTR)


def original_construct(optimizer):
    """The optimizer's construct before probekit wrapped it."""
    tap = current_tap(optimizer)
    return tap.original if tap is not None else optimizer.construct


def install(optimizer, tap: Tap) -> None:
    """Make ``tap`` the optimizer's tap and wrap its ``construct`` (kept until ``uninstall``)."""
    original = tap.original

    def construct(self, gradients):
        gradients = tap(gradients)
        return original(gradients)

    setattr(construct, WRAPPED_ATTR, True)
    object.__setattr__(optimizer, TAP_ATTR, tap)
    object.__setattr__(optimizer, "construct", construct.__get__(optimizer, type(optimizer)))


def uninstall(optimizer) -> None:
    """Give the optimizer back its own construct. Graphs compiled meanwhile keep their tap,
    which then drops its calls (nothing is attached)."""
    tap = current_tap(optimizer)
    if tap is None:
        return
    tap.attach(None)
    if getattr(optimizer.__dict__.get("construct"), WRAPPED_ATTR, False):
        original = tap.original
        if getattr(original, "__self__", None) is optimizer and \
                getattr(type(optimizer), "construct", None) is getattr(original, "__func__", None):
            del optimizer.__dict__["construct"]  # the class's own construct again
        else:
            object.__setattr__(optimizer, "construct", original)


def global_step(optimizer) -> int | None:
    """The optimizer's own count of its calls (``nn.Optimizer.global_step``), or None."""
    gs = getattr(optimizer, "global_step", None)
    if gs is None:
        return None
    try:
        return int(np.asarray(gs.asnumpy()).reshape(-1)[0])
    except Exception:  # not a readable Parameter in this optimizer
        return None


def synchronize() -> None:
    """Wait for MindSpore's queued work (a PyNative ``ms.jit`` step returns before its graph
    and the tap's callbacks have run; on an accelerator, its streams too)."""
    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:  # pragma: no cover - older layout
        from mindspore.common.api import _pynative_executor
    _pynative_executor.sync()
    if ms.get_context("device_target") != "CPU":  # MindSpore logs an error for the CPU
        ms.runtime.synchronize()
