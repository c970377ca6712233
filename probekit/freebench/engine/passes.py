"""A backward pass run with the probe's mode active, so the calls made inside it are seen.

``loss.backward()`` is itself a torch function: torch pops every ``TorchFunctionMode`` while it
runs it, and the autograd engine captures the thread's state (the mode stack included) when the
pass starts. So the Python calls a backward pass makes -- a custom ``autograd.Function.backward``
(reversible layers, custom kernels' reference formulas), a gradient hook, a recomputation inside
a checkpointed or reversible block -- never reached the probe (issue 34: 7 of 135 calls per step
checked in a model with reversible layers).

Pushing the mode back around the call does not work: ``Tensor.backward`` and
``torch.autograd.backward`` test for a mode first and would dispatch to it again, endlessly. So
``run`` does what ``torch.autograd.backward`` does after that test, with torch's own helpers
(``_tensor_or_tensors_to_tuple``, ``_make_grads``, ``graph._engine_run_backward``: the
arguments normalised, the implicit gradient of a scalar made, the engine started), with the
mode pushed just around the engine's start. A call it does not recognise (an unknown keyword,
a ``GradientEdge``, a tensor subclass with its own ``__torch_function__``, a torch without these
helpers), or one made while another ``TorchFunctionMode`` is active below the probe's (that mode
sees ``backward`` and what it does with it is its own: the probe does not take the call from it),
runs as before: its pass is not seen. ``torch.autograd.grad`` is not redone here (its
own argument handling is larger); the calls of a ``grad`` inside an observed pass run without
the mode.
"""
from __future__ import annotations

import torch

try:   # torch's own steps of autograd.backward after its __torch_function__ test
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward
except ImportError:     # another torch: passes are run as torch runs them (not seen)
    _make_grads = _tensor_or_tensors_to_tuple = _engine_run_backward = None

_TENSOR_BACKWARD = ("gradient", "retain_graph", "create_graph", "inputs")
_AUTOGRAD_BACKWARD = ("grad_tensors", "retain_graph", "create_graph", "inputs")


def _plain(t) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _arguments(info, args: tuple, kwargs: dict):
    """``(tensors, grads, retain_graph, create_graph, inputs)`` of a ``Tensor.backward`` /
    ``torch.autograd.backward`` call, or None when ``run`` leaves it to torch."""
    if info.prefix == "Tensor":
        names, first = _TENSOR_BACKWARD, args[:1]
        rest = args[1:]
    else:
        names, first = _AUTOGRAD_BACKWARD, args[:1] or (kwargs.get("tensors"),)
        rest = args[1:]
        kwargs = {k: v for k, v in kwargs.items() if k != "tensors"}
    if len(rest) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = dict(zip(names, rest))
    if any(k in bound for k in kwargs):
        return None
    bound.update(kwargs)
    tensors = first[0] if first else None
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors or ())
    inputs = bound.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else \
        inputs
    if not isinstance(inputs, tuple):
        if isinstance(inputs, dict):
            return None
        inputs = tuple(inputs)
    if not tensors or not all(_plain(t) for t in tensors + inputs):
        return None
    if bound.get("inputs") is not None and not inputs:
        return None   # torch's own error message for an empty inputs
    grads = bound.get("gradient" if info.prefix == "Tensor" else "grad_tensors")
    create = bool(bound.get("create_graph", False))
    retain = bound.get("retain_graph")
    return tensors, grads, create if retain is None else retain, create, inputs


def run(mode, info, func, args: tuple, kwargs: dict):
    """Run the backward pass ``func(*args, **kwargs)`` with ``mode`` active inside it where the
    call is recognised (module doc), else as torch runs it. Returns what the call returns."""
    parsed = None
    if _engine_run_backward is not None and info.name == "backward" and \
            not torch._C._len_torch_function_stack():   # (another mode below: module doc)
        try:
            parsed = _arguments(info, args, kwargs or {})
        except Exception:
            parsed = None
    if parsed is None:
        return func(*args, **kwargs)
    tensors, grads, retain, create, inputs = parsed
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)),
                        is_grads_batched=False)
    torch._C._push_on_torch_function_stack(mode)
    try:
        _engine_run_backward(tensors, grads, retain, create, inputs, allow_unreachable=True,
                             accumulate_grad=True)
    finally:
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is mode:
            torch._C._pop_torch_function_stack()
    return None
