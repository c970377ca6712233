"""Guards probekit's own work runs under: no TorchFunctionMode sees it, no autocast recasts it.

Both the forward checks (``intercept.py``) and the backward checks (``backward.py``) use them;
both are entered on every checked call, so they are cheap: a class rather than a generator for
``modes_off``, a shared null context for ``no_autocast`` when autocast is off.
"""
from __future__ import annotations

import contextlib

import torch

_NULL = contextlib.nullcontext()


def no_autocast(enabled: bool):
    """Disable autocast (so an upcast re-run really computes in the upcast dtype); a shared null
    context when autocast is off (the common case costs two flag reads)."""
    if not enabled:
        return _NULL
    on = []
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                on.append(dev)
        except (TypeError, RuntimeError):
            pass
    if not on:
        return _NULL
    stack = contextlib.ExitStack()
    for dev in on:
        stack.enter_context(torch.autocast(dev, enabled=False))
    return stack


class modes_off:
    """Pop every TorchFunctionMode of this thread while probekit works, so that no mode (ours or
    one the user entered, e.g. a FLOP counter) sees the re-runs; restored on exit (also on
    errors)."""

    __slots__ = ("popped",)

    def __enter__(self):
        popped = self.popped = []
        while torch._C._len_torch_function_stack():
            popped.append(torch._C._pop_torch_function_stack())
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.popped):
            torch._C._push_on_torch_function_stack(mode)
        self.popped = []
        return False


class quiet:
    """``modes_off`` and ``torch.no_grad()`` in one cheap guard (entered on every checked call:
    ``torch.no_grad()`` alone costs about 1.5 µs, this about 0.5 µs), restored on exit."""

    __slots__ = ("popped", "grad")

    def __enter__(self):
        popped = self.popped = []
        while torch._C._len_torch_function_stack():
            popped.append(torch._C._pop_torch_function_stack())
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        return self

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self.grad)
        for mode in reversed(self.popped):
            torch._C._push_on_torch_function_stack(mode)
        self.popped = []
        return False


class grad_mode:
    """``torch.no_grad()`` (``grad_mode(False)``) or ``torch.enable_grad()`` (``True``) as a
    slotted guard: the same flag set and restored, without the two ``set_grad_enabled`` objects
    and the decorator machinery torch's context managers build on every entry (a backward check
    entered five of them per call: issue 38)."""

    __slots__ = ("mode", "prev")

    def __init__(self, mode: bool) -> None:
        self.mode = mode

    def __enter__(self):
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.mode)
        return self

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self.prev)
        return False


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history: ``t`` itself when it has none (a gradient the engine
    hands a hook, one ``torch.autograd.grad`` returned), else ``t.detach()``. The same tensor
    either way for what reads it; a ``detach`` is an ATen operator, and a backward check met
    ten of them per call (issue 38)."""
    return t.detach() if t.requires_grad else t
