"""Calls that write state: re-run them on clones, never on the live tensors.

Some checked calls write a tensor in place besides computing their output: the in-place
accumulating APIs (``index_put_(accumulate=True)``, ``index_add_``, ``scatter_add_``, ``put_``...)
write ``self``; a training batch norm updates its running statistics; ``embedding(max_norm=...)``
renormalises rows of its weight. ``names.state_positions`` says which tensors a call writes. Before
the real call runs, ``snapshot`` clones them (their values as the call found them); every re-run
gets fresh clones of that snapshot in their place (``restore``), so the training's tensors are
written exactly once, by the real call, and each re-run starts from the same state.
"""
from __future__ import annotations

import torch

from . import names


def written(info, args: tuple, kwargs: dict, leaves: list) -> tuple:
    """Indices of ``leaves`` that this call writes in place (empty for nearly every call)."""
    if info.rule is None:
        return ()
    tensors = names.state_positions(info, args, kwargs)
    if not tensors:
        return ()
    return tuple(i for i, x in enumerate(leaves) if any(x is t for t in tensors))


def snapshot(leaves: list, indices: tuple) -> dict:
    """Clones of the written leaves, taken before the real call (no autograd history)."""
    with torch.no_grad():
        return {i: leaves[i].detach().clone() for i in indices}


def restore(leaves: list, snap: dict | None) -> list:
    """``leaves`` with each written tensor replaced by a fresh clone of its snapshot."""
    if not snap:
        return leaves
    new = list(leaves)
    with torch.no_grad():
        for i, t in snap.items():
            new[i] = t.clone()
    return new


def writes_self(info) -> bool:
    """An in-place API (``index_put_``): its output is the written tensor itself."""
    return info.name.endswith("_")
