"""Blocked re-runs: a call with a large output is checked block by block along an independent dim.

A forward check holds the call's re-run output, its perturbed (or upcast: float64 for fp32)
inputs and the comparison's temporaries. For a large activation that is several times the
activation itself, which is what made the forward check's peak memory grow. ``plan`` finds a
dimension of the output whose slices depend only on the same slices of some inputs (the "rows"),
and the call is perturbed, re-run and compared block by block of rows (``metric.device_stats`` per
block, combined on the device by ``combine``), so only one block's upcast inputs and output exist
at a time. The numbers are those of one comparison of the whole tensor: every perturbation that
qualifies acts element by element (``improve_precision``, ``bit_noise``, ``add_noise``,
``no_change``, ``to_cpu``; not change_value, which reorders), and the metric's maxima and counts
combine exactly. The cause analysis of a flagged call (``cause.py``) runs over the same blocks.
The backward stage (``backward.py``) re-runs its perturbed forward and backward by the same plans
(an input kept whole has its gradient summed over the blocks, in upcast modes only).

Calls that qualify (one floating output of more than ``BLOCK`` elements, no state written):

==========================  ======================================================================
element-wise APIs           any output dim; each tensor input sliced where it has that dim
                            (broadcast inputs of size 1 there, or without it, are kept whole)
softmax, log_softmax,       any dim but the normalised one
softmin
linear                      the leading dims of ``input`` (the weight and bias are kept whole)
matmul, ``@``               the leading dims of the first input when the second is a matrix;
                            the batch dims of both when both are batched (same rank)
bmm                         dim 0 of both
layer_norm, rms_norm        the dims before ``normalized_shape`` (weight and bias whole)
==========================  ======================================================================
"""
from __future__ import annotations

import torch

from ..judge.metric import combine as _combine
from ..perturb.modes import MODES
from ..names import ELEMENTWISE

#: output elements per block (4 MiB of float64)
BLOCK = 1 << 19

_SOFTMAX = frozenset({"softmax", "log_softmax", "softmin"})
_MATMUL = frozenset({"matmul", "__matmul__"})
_NORMS = frozenset({"layer_norm", "rms_norm"})


class Plan:
    """How to cut a call: output ``dim``, ``parts`` = [(start, length)], and ``split`` =
    [(leaf index, that leaf's dim)] for the inputs sliced with the output."""

    __slots__ = ("dim", "parts", "split")

    def __init__(self, dim: int, parts: list, split: list) -> None:
        self.dim, self.parts, self.split = dim, parts, split

    def leaves(self, leaves: list, start: int, length: int) -> list:
        new = list(leaves)
        for i, d in self.split:
            new[i] = leaves[i].narrow(d, start, length)
        return new

    def output(self, t: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return t.narrow(self.dim, start, length)


def _arg(args, kwargs, pos: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _aligned(leaves: list, out_shape, dim: int, only=None):
    """[(leaf index, leaf dim)] of the tensors holding output dim ``dim`` (right-aligned
    broadcasting); None when a tensor can neither be sliced nor kept whole."""
    split = []
    nd = len(out_shape)
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) or (only is not None and i not in only):
            continue
        j = dim - (nd - x.dim())
        if j < 0 or x.shape[j] == 1:
            continue                      # broadcast along dim: the whole tensor each block
        if x.shape[j] != out_shape[dim]:
            return None
        split.append((i, j))
    return split


def _tensor_positions(leaves: list) -> list:
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]


def _candidates(name: str, args: tuple, kwargs: dict, leaves: list, out: torch.Tensor):
    """(candidate output dims, leaf indices that may be sliced) for API ``name``, or None."""
    nd = out.dim()
    tensors = _tensor_positions(leaves)
    if name in _SOFTMAX:
        dim = _arg(args, kwargs, 1, "dim")
        if not isinstance(dim, int) or len(tensors) != 1:
            return None
        return [d for d in range(nd) if d != dim % nd], tensors
    if name in ELEMENTWISE:
        return list(range(nd)), tensors
    if not args or not tensors or leaves[tensors[0]] is not args[0]:
        return None  # the first positional argument must be the first tensor leaf
    x = args[0]
    if name == "linear":
        return list(range(x.dim() - 1)), [tensors[0]]
    if name in _NORMS:
        shape = _arg(args, kwargs, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape or ())
        return list(range(x.dim() - k)), [tensors[0]]
    if name in _MATMUL or name == "bmm":
        if len(tensors) != 2 or len(args) < 2 or not isinstance(args[1], torch.Tensor):
            return None
        b = args[1]
        if name == "bmm" or (x.dim() >= 3 and b.dim() >= 3):
            if x.dim() != b.dim():
                return None
            return list(range(x.dim() - 2)), tensors
        if x.dim() >= 2 and b.dim() == 2:
            return list(range(x.dim() - 1)), [tensors[0]]
    return None


def _even_rows(x: torch.Tensor, dim: int) -> bool:
    """Does one slice of ``x`` along ``dim`` hold an even number of flattened rows?"""
    if dim >= x.dim() - 1:
        return False
    n = 1
    for size in x.shape[dim + 1:-1]:
        n *= size
    return n % 2 == 0


def plan(mode: str, info, args: tuple, kwargs: dict, leaves: list, outs: list):
    """A ``Plan`` for a call whose single floating output exceeds ``BLOCK`` elements, or None
    (checked whole)."""
    if MODES[mode].swap_back or len(outs) != 1:
        return None
    o = outs[0][1]
    n = o.numel()
    if n <= BLOCK or o.dim() == 0:
        return None
    found = _candidates(info.name, args, kwargs, leaves, o)
    if found is None:
        return None
    dims, sliceable = found
    best = None   # (elements per slice, dim, split): the first dim whose slices fit a block
    for d in dims:
        size = o.shape[d]
        if size < 2:
            continue
        split = _aligned(leaves, o.shape, d, only=set(sliceable))
        if not split:
            continue
        per = n // size
        if best is None or per < best[0]:
            best = (per, d, split)
        if per <= BLOCK:
            break
    if best is None:
        return None
    per, d, split = best
    size = o.shape[d]
    rows = max(1, BLOCK // per)
    # bit_noise's checkerboard follows each input's indices: a block must start at an even
    # flattened row (or column) of every sliced input, so its pattern is the whole call's
    if rows % 2 and not all(_even_rows(leaves[i], j) for i, j in split):
        if rows < 2:
            return None
        rows -= 1
    if rows >= size:
        return None
    return Plan(d, [(s, min(rows, size - s)) for s in range(0, size, rows)], split)


def combine(parts: list, exact: bool = False) -> tuple:
    """One comparison's values from the per-block ones (on the device, no sync)."""
    return _combine(parts)
