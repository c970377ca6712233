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
