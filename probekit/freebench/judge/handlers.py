"""Turning comparisons into findings (check) and perturbed outputs into replacements (fix).

Thresholds: from the error model of ``scales.py`` (``scales.judge``: ``C (u_out + gamma_k)`` of
the call's scale, or ``C u_out`` of a two-term per-element scale, in the accuracy modes;
``sqrt(u)`` of the output's scale in the sensitivity modes; 0 for no_change), unless
``free_benchmark.thresholds`` overrides the dtype's. A row is reported (``judge``) when a NaN/Inf appears, disappears or
changes (kind ``nan_inf``), or ``max_rel > threshold`` (``rel_error``).

fix (improve_precision / to_cpu): the API is run on the upcast (or CPU) inputs *with autograd*, and
its floating outputs are cast back to the dtype the original call would have produced and moved
back to the original device. So both the forward result and the gradients flowing through this call
come from the higher-precision computation. For fp32 inputs improve_precision computes in fp64 and
casts the result back to fp32; fp64 inputs are left alone.
"""
from __future__ import annotations

import math

import torch

from . import scales
from .metric import Stats



def dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def threshold(fb_config, pert_mode: str, compute_dtype: torch.dtype) -> float:
    """The base threshold of ``pert_mode`` for a call computing in ``compute_dtype`` (an exact,
    per-element call: ``C u`` in the accuracy modes, ``sqrt(u)`` in the sensitivity modes, 0 for
    no_change); a call's own adds its accumulation term (``scales.judge``)."""
    return scales.judge(pert_mode, "step", 0, compute_dtype,
                        override=fb_config.threshold_for(dtype_key(compute_dtype))).thr


def judge(stats: Stats, thr: float) -> str | None:
    """The kind of finding, or None when the output is consistent."""
    if stats.nan_inf:
        return "nan_inf"
    if stats.max_rel > thr:
        return "rel_error"
    return None


def ratio(max_rel: float, thr: float) -> float:
    if thr > 0:
        return max_rel / thr
    return math.inf if max_rel > 0 else 0.0


def risk(stats: Stats, thr: float) -> float:
    """What preheat calibrates on: the ratio, infinite for NaN/Inf mismatches."""
    if stats.nan_inf:
        return math.inf
    return ratio(stats.max_rel, thr)


# -- outputs --------------------------------------------------------------------------------------
def output_leaves(out) -> list:
    """Every leaf of an output (tensors and other values), tuples/lists flattened in order."""
    if isinstance(out, (tuple, list)):
        leaves = []
        for o in out:
            leaves.extend(output_leaves(o))
        return leaves
    return [out]


def float_outputs(out, complex_: bool = False) -> list[tuple[int, torch.Tensor]]:
    """(output_index, tensor) of the floating-point tensors among the output's leaves
    (``complex_``: the complex ones too, as they are: a backward check differentiates through
    them)."""
    if isinstance(out, torch.Tensor):  # the common case
        return [(0, out)] if out.is_floating_point() or (complex_ and out.is_complex()) else []
    return [(i, t) for i, t in enumerate(output_leaves(out))
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or
                                                (complex_ and t.is_complex()))]


def _real_parts(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts: a real view with a trailing dim of 2."""
    return torch.view_as_real(t.resolve_conj())


def compared_outputs(out) -> list[tuple[int, torch.Tensor]]:
    """``float_outputs``, and each complex output as its real and imaginary parts
    (``torch.view_as_real``: a real tensor of the complex one's precision with a trailing dim
    of 2), so that a forward check compares an FFT's result like any other (issue 34). Their
    scale is that real tensor's own (the family ``other``), each part judged against the
    largest part of the output."""
    if isinstance(out, torch.Tensor):  # the common case
        if out.is_floating_point():
            return [(0, out)]
        return [(0, _real_parts(out))] if out.is_complex() else []
    return [(i, t if t.is_floating_point() else _real_parts(t))
            for i, t in enumerate(output_leaves(out))
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def map_outputs(fn, out):
    """Apply ``fn`` to every tensor of an output, keeping its structure (tuples, namedtuples...)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        items = [map_outputs(fn, o) for o in out]
        if type(out) in (tuple, list):
            return type(out)(items)
        if hasattr(out, "_fields"):  # namedtuple
            return type(out)(*items)
        return type(out)(items)  # torch.return_types structseq
    return out


def cast_back(p_out, target: torch.dtype | None, back_dtype: torch.dtype | None, device):
    """Fix: floating outputs of dtype ``target`` cast to ``back_dtype``; everything moved to
    ``device``. Casts are differentiable, so gradients flow back through the upcast computation."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        if target is not None and back_dtype is not None and t.dtype == target:
            t = t.to(back_dtype)
        if device is not None and t.device != device:
            t = t.to(device)
        return t

    return map_outputs(fn, p_out)
