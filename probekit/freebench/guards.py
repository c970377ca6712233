"""Guards probekit's own work runs under: no TorchFunctionMode sees it, no autocast recasts it.

Both the forward checks (``intercept.py``) and the backward checks (``backward.py``) use them.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_autocast(enabled: bool):
    """Disable autocast (so an upcast re-run really computes in the upcast dtype)."""
    with contextlib.ExitStack() as stack:
        if enabled:
            for dev in ("cpu", "cuda"):
                try:
                    on = torch.is_autocast_enabled(dev)
                except (TypeError, RuntimeError):
                    on = False
                if on:
                    stack.enter_context(torch.autocast(dev, enabled=False))
        yield


@contextlib.contextmanager
def modes_off():
    """Pop every TorchFunctionMode of this thread while probekit works, so that no mode (ours or
    one the user entered, e.g. a FLOP counter) sees the re-runs; restored in ``finally``."""
    popped = []
    try:
        while torch._C._len_torch_function_stack():
            popped.append(torch._C._pop_torch_function_stack())
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)
