"""Autocast: perturb at the precision an op computes in, and keep the dtype the caller sees.

Under ``torch.autocast(dtype=torch.bfloat16)`` a matmul or linear receives fp32 tensors and casts
them to bf16 inside the op. A one-ulp fp32 change (bit_noise, add_noise) is then rounded away by
that cast, and an upcast reference computed from the fp32 inputs would count the cast's rounding
as the kernel's error. ``compute_leaves`` casts the fp32 inputs to the dtype the op actually
computed in (its output's dtype, when that is the autocast dtype) before any mode perturbs them:
the re-run without perturbation is bit for bit the original call (autocast would have made the
same cast), the noise is one ulp of the computing precision, and improve_precision upcasts what
the kernel really received. fp64 inputs are left alone, as autocast leaves them.

One kind of call computes in autocast's dtype without returning it: a call with no autocast
rule of its own that decomposes into ATen calls autocast does run in its dtype, and mixes their
results with fp32 ones -- ``torch.gru`` on fp32 inputs runs its gate GEMMs in bf16 and adds fp32
state, so its outputs are fp32 with bf16 errors (a fp32 bound would flag it at thousands of times
the threshold). ``run`` finds these at the first call of each signature under autocast: the real
call runs under a ``TorchDispatchMode`` that passes every ATen call through and notes whether one
returned autocast's dtype (``InnerDtypes``); such a call is judged in autocast's dtype
(``Call.compute``). Its inputs are left as they are (it received fp32 ones).

``fix`` upcasts the inputs and disables autocast, so its result must be cast back to what the
caller would have seen: ``caller_dtype`` asks the original call for it when autocast is on.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..judge.guards import modes_off

LOW = (torch.float16, torch.bfloat16)

#: signatures seen by ``run``: at most this many are remembered
MAX_SIGNATURES = 4096


class InnerDtypes(TorchDispatchMode):
    """Passes every ATen call through unchanged and notes whether one returned a tensor of
    ``low`` (autocast's dtype)."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.seen:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dtype == self.low:
                    self.seen = True
                    break
        return out


def run(seen: dict, name: str, func, args: tuple, kwargs: dict, leaves: list):
    """Run the real call; returns ``(output, compute)``: ``compute`` is autocast's dtype when
    the call has fp32 floating outputs but ran ATen calls in that dtype (module doc), else None.
    ``seen``: signature (API, device type, autocast dtype, floating input dtypes) -> whether
    its ATen calls ran in autocast's dtype, learned at its first call. Only the real call is
    visible to other function modes."""
    key = inner = None
    if torch._C._is_any_autocast_enabled():
        with modes_off():
            key = _signature(name, leaves)
            inner = None if key is None else seen.get(key)
    if key is None:
        return func(*args, **kwargs), None
    if inner is None:
        mode = InnerDtypes(key[2])
        with mode:
            out = func(*args, **kwargs)
        inner = mode.seen
        if len(seen) < MAX_SIGNATURES:
            seen[key] = inner
    else:
        out = func(*args, **kwargs)
    if not inner:
        return out, None
    from ..judge.handlers import float_outputs

    with modes_off():
        outs = float_outputs(out)
        fp32 = bool(outs) and all(t.dtype == torch.float32 for _, t in outs)
    return out, (key[2] if fp32 else None)


def _signature(name: str, leaves: list):
    """``run``'s signature of a call under autocast with an fp32 input, else None."""
    x = first_tensor(leaves)
    low = enabled_dtype(x.device) if x is not None else None
    if low not in LOW:
        return None
    dtypes = tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor) and
                   t.is_floating_point())
    if torch.float32 not in dtypes:
        return None
    return (name, x.device.type, low, dtypes)


def enabled_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force for ``device``'s type on this thread, or None."""
    dev = device.type
    try:
        if not torch.is_autocast_enabled(dev):
            return None
        return torch.get_autocast_dtype(dev)
    except (RuntimeError, TypeError, AttributeError):
        return None


def first_tensor(leaves: list):
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x
    return None


def in_force(leaves: list):
    """The autocast dtype in force for the call's first floating input's device, or None (one
    flag read when autocast is off everywhere). Read before probekit's guards turn it off."""
    if not torch._C._is_any_autocast_enabled():
        return None
    with modes_off():      # (the caller's function modes see only the real call)
        x = first_tensor(leaves)
        return None if x is None else enabled_dtype(x.device)


def compute_leaves(leaves: list, outs: list) -> list:
    """``leaves`` with fp32 inputs cast to the dtype the op computed in (see module doc); the
    same list when the op computed in fp32.

    Read from the output, not from autocast's state: the forward check runs with autocast off
    (an upcast re-run must compute in the upcast dtype), and an op that returns bf16/fp16 from
    fp32 inputs computed in that dtype -- under autocast, or by type promotion (a 0-dim fp32
    tensor beside a bf16 one is cast to bf16); no op narrows fp32 inputs otherwise. Not for a
    call that writes its result into a given tensor (in place, ``out=``): its output's dtype is
    that tensor's (the caller leaves its inputs as they are)."""
    x = first_tensor(leaves)
    if x is None or not outs:
        return leaves
    out = outs[0][1].dtype
    return cast_like(leaves, out, out)


def cast_like(leaves: list, dtype, out_dtype) -> list:
    """The fp32 leaves cast to the autocast ``dtype`` when the op computed in it (its output
    has that dtype); else ``leaves`` unchanged."""
    if dtype is None or dtype not in LOW or out_dtype != dtype:
        return leaves
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
            for t in leaves]


def fix_dtype(func, args: tuple, kwargs: dict, leaves: list):
    """Under autocast, the dtype of the original call's first floating output (None when autocast
    is off, or the output holds no floating tensor). Runs the call once under ``no_grad``."""
    x = first_tensor(leaves)
    if x is None or enabled_dtype(x.device) is None:
        return None
    with torch.no_grad():
        out = func(*args, **kwargs)
    from ..judge.handlers import float_outputs

    outs = float_outputs(out)
    return outs[0][1].dtype if outs else None
