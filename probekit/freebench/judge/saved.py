"""Does a backward read its forward's saved output? Read off autograd's own saved tensors.

Autograd saves, for some functions, their **output** ``y`` and computes the gradient from it
(``softmax``, ``log_softmax``, ``logsumexp``, ``sigmoid``, ``tanh``, ``exp``, ``sqrt``,
``norm``, ``std``, ``cumprod``, CPU flash attention's output...). A kernel's backward is then
handed ``y`` as the forward rounded it, and the exact gradient of the function at ``x`` differs
from the exact gradient computed from that ``y`` by what the rounding moves the formula: a term
no correct kernel can avoid (issue 26 listed four families and bounded their term by formula;
``logsumexp``'s was missing). Rather than list the functions, ``saves_output`` asks the graph:
the output's ``grad_fn`` holds a saved tensor (a ``_saved_*`` attribute, or a custom
``Function``'s ``saved_tensors``) that *is* the output (same storage, shape and strides). For
such a call the reference gradient reads the output the kernel was handed (``hand``): the saved
output is one of the backward's inputs, taken as the kernel received it, as every other input
is (docs/free_benchmark.md, "Backward formulas that read the saved output").

A node may also keep **statistics** its forward computed for the backward: tensors that are
neither the call's inputs nor its output (a native layer, batch or group norm's mean and
``rstd``). ``kept_statistics`` finds those a kernel stored in a dtype less precise than it
accumulates in (CPU bf16 norms keep them in bf16; CUDA's and the CPU mixed-type kernels in
fp32), and ``hand_statistics`` lets a float64 graph read them as the kernel stored them: what
of the kernel's error that rounding explains is the kernel's (docs/free_benchmark.md, "Saved
statistics").
"""
from __future__ import annotations

import torch

#: node type -> the names of its saved-tensor attributes
_ATTRS: dict = {}


def _attributes(node) -> tuple:
    tp = type(node)
    names = _ATTRS.get(tp)
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_saved_"))
        if hasattr(node, "saved_tensors"):     # a custom autograd.Function's context
            names += ("saved_tensors",)
        _ATTRS[tp] = names
    return names


def _saved(node):
    """(name, value) of ``node``'s saved attributes that can be read."""
    for name in _attributes(node):
        try:
            yield name, getattr(node, name)
        except Exception:     # freed, or not a tensor attribute
            continue


def kept_statistics(out: torch.Tensor, leaves, u_acc: float) -> dict:
    """``{attribute: tensor}``: the floating tensors ``out``'s backward node saved that are
    neither one of ``leaves`` (the call's inputs) nor ``out``, nor made by another node of the
    graph (a composite call's intermediate: its ``grad_fn`` is that node), in a dtype whose unit
    roundoff is above ``u_acc``. Empty for a node that keeps none (or only at ``u_acc`` or
    better). (The repro scripts carry a standalone twin, ``repro/helpers.py``, pinned to this
    one by the tests.)"""
    node = getattr(out, "grad_fn", None)
    if node is None:
        return {}
    own = {t.data_ptr() for t in leaves if isinstance(t, torch.Tensor) and t.numel()}
    if out.numel():
        own.add(out.data_ptr())
    return {name: v.detach().clone() for name, v in _saved(node)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and
            v.grad_fn in (None, node) and v.data_ptr() not in own and
            torch.finfo(v.dtype).eps / 2 > u_acc}


def hand_statistics(out: torch.Tensor, kept: dict) -> bool:
    """Let ``out``'s backward read ``kept`` (``kept_statistics`` of the kernel's own graph,
    converted) in place of the statistics it saved (through ``.data``, as ``hand``). False,
    with nothing written, where this graph's node does not save each of them in that shape."""
    node = getattr(out, "grad_fn", None)
    if node is None:
        return False
    mine = dict(_saved(node))
    targets = [(mine.get(name), t) for name, t in kept.items()]
    if any(not isinstance(m, torch.Tensor) or m.shape != t.shape for m, t in targets):
        return False
    with torch.no_grad():
        for m, t in targets:
            m.data.copy_(t.to(device=m.device, dtype=m.dtype))
    return True


def saves_output(out: torch.Tensor) -> bool:
    """Does ``out``'s backward node keep ``out`` itself for its backward?"""
    node = getattr(out, "grad_fn", None)
    if node is None or not out.numel():
        return False
    ptr, shape, stride = out.data_ptr(), tuple(out.shape), out.stride()
    for name in _attributes(node):
        try:
            v = getattr(node, name)
        except Exception:     # freed, or not a tensor attribute
            continue
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor) and t.data_ptr() == ptr and \
                    tuple(t.shape) == shape and t.stride() == stride:
                return True
    return False


def hand(out: torch.Tensor, handed: torch.Tensor) -> None:
    """Let ``out``'s backward read ``handed`` (converted) as its saved output: written through
    ``.data``, which autograd's version check does not see, so the graph stays valid."""
    with torch.no_grad():
        out.data.copy_(handed.to(device=out.device, dtype=out.dtype))
