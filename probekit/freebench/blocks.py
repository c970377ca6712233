"""Blocked re-runs: an element-wise call on a large input is checked block by block of rows.

``row_blocks`` says whether a call qualifies and how to split it: an API of ``names.ELEMENTWISE``
with exactly one tensor argument (floating, at least one dimension, more than ``BLOCK`` elements),
one floating output of the same shape, and a perturbation that acts element by element
(``improve_precision``, ``bit_noise``, ``add_noise``, ``no_change``, ``to_cpu``). Each block of rows
along dimension 0 is perturbed, re-run and compared on its own (``metric.device_stats``), and the
per-block values are combined on the device (``combine``): the same numbers as one comparison of the
whole tensor, with one block's upcast input and output alive at a time instead of the whole
tensor's (a float64 copy of a large fp32 activation is what made improve_precision's peak memory
grow most).
"""
from __future__ import annotations

import torch

from .metric import EXACT_LEN, combine_fast
from .modes import MODES
from .names import ELEMENTWISE

#: elements per block (8 MiB of float64)
BLOCK = 1 << 20


def row_blocks(mode: str, info, leaves: list, outs: list):
    """``[(start, length), ...]`` along dim 0, or None when the call is checked whole."""
    # a mode that reorders elements (swap_back) needs the whole tensor
    if MODES[mode].swap_back or info.name not in ELEMENTWISE or len(outs) != 1:
        return None
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if len(tensors) != 1:
        return None
    x = tensors[0]
    o = outs[0][1]
    if (not x.is_floating_point() or x.dim() == 0 or x.numel() <= BLOCK or o.shape != x.shape
            or x.shape[0] < 2):
        return None
    per_row = x.numel() // x.shape[0]
    rows = max(1, BLOCK // max(1, per_row))
    return [(s, min(rows, x.shape[0] - s)) for s in range(0, x.shape[0], rows)]


def narrow_leaves(leaves: list, start: int, length: int) -> list:
    return [x.narrow(0, start, length) if isinstance(x, torch.Tensor) else x for x in leaves]


def combine(parts: list, exact: bool) -> tuple:
    """One comparison's values from the per-block ones (on the device, no sync)."""
    if len(parts) == 1:
        return parts[0]
    s = torch.stack([torch.stack(list(p)).to(torch.float64) for p in parts])
    if exact:
        assert s.shape[1] == EXACT_LEN
        return tuple(torch.cat([s[:, :3].amax(0), s[:, 3:].sum(0)]).unbind())
    return combine_fast(s)
