"""Calls that write tensors: the original runs on the real tensors, the re-runs never do.

A checked call may write a tensor besides computing its output (``names.written``):

* an **in-place** call (``x.add_(y)``, ``x += y``, ``torch.relu_``, ``F.relu(x, inplace=True)``,
  ``nn.ReLU(inplace=True)``, ``nn.SiLU(inplace=True)``, ``index_put_(accumulate=True)``...)
  overwrites an input it reads; an ``out=`` call writes its ``out`` tensors;
* a training batch norm updates its running statistics; ``embedding(max_norm=...)``
  renormalises rows of its weight (side effects of an out-of-place API).

``plan`` says how such a call is checked. The real call runs as it would without the probe, on
the real tensors: its output, its autograd graph and the version counters are the training's.
Just before it, ``snapshot`` clones the inputs whose values the call overwrites (``self`` of an
in-place call; an input sharing memory with an ``out=`` tensor or with ``self``; the running
statistics) -- the values as the call found them. The re-runs (the check, the magnitude re-run,
the cause analysis, the backward stage's re-runs in the backward pass) then compute from those
clones (``restore``), with

* the **out-of-place form** of an in-place API (``add_`` -> ``add``, ``relu_`` -> ``relu``,
  ``__iadd__`` -> ``add``, ``index_put_`` -> ``index_put``; ``inplace=False``; ``out=`` dropped):
  it computes what the in-place call wrote, writes nothing, and has an ordinary autograd graph,
  so the backward stage can differentiate it (an in-place op on a leaf that requires grad is an
  error);
* or, for a call whose re-runs write too (a training batch norm, an in-place API with no
  out-of-place form, which the backward stage then skips as ``inplace``), fresh clones of the
  snapshot for each re-run.

So the training's tensors are written exactly once, by the real call, with the values they
have without the probe. ``fix`` leaves these calls alone (skipped as ``inplace`` /
``side_effect``: replacing one would have to write the upcast result into the tensor).
"""
from __future__ import annotations

import sys

import torch

from .. import names
from ..perturb import perturb


class Writes:
    """How a call that writes tensors is re-run (``plan``)."""

    __slots__ = ("indices", "inplace", "rerun", "fresh")

    def __init__(self, indices: tuple, inplace: bool, rerun, fresh: bool) -> None:
        #: leaves to clone before the real call (their values as the call found them)
        self.indices = indices
        #: the call's output is a tensor it wrote (in-place or ``out=``)
        self.inplace = inplace
        #: the callable re-runs use instead of the API (its out-of-place form), or None
        self.rerun = rerun
        #: the re-runs write the cloned tensors too: each gets fresh clones
        self.fresh = fresh


class Snapshot(dict):
    """Leaf index -> its clone taken before the real call; ``fresh``: each re-run gets its own
    clones of them (the re-run writes them)."""

    fresh = True


def plan(info, func, args: tuple, kwargs: dict, leaves: list) -> Writes | None:
    """``Writes`` for a call that writes tensors, None for every other call."""
    tensors = names.written(info, args, kwargs)
    if not tensors:
        return None
    out = kwargs.get("out")
    inplace = info.inplace or out is not None or names.inplace_flag(info, args, kwargs)
    rerun = out_of_place(info, func, args, kwargs) if inplace else None
    storages = {_storage(t) for t in tensors}
    # an out= tensor is written, not read: the out-of-place re-run does not need its values,
    # unless it is an input as well
    read = None if out is None or rerun is None else \
        {id(x) for x in perturb.flatten(args, {k: v for k, v in kwargs.items() if k != "out"})[0]
         if isinstance(x, torch.Tensor)}
    indices = []
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        if any(x is t for t in tensors):
            if read is None or id(x) in read:
                indices.append(i)
        elif _storage(x) in storages:   # an input sharing memory with a written tensor
            indices.append(i)
    # the out-of-place form writes nothing, unless the API has side effects of its own
    side_effects = info.rule is not None and not info.name.endswith("_")
    return Writes(tuple(indices), inplace, rerun, rerun is None or side_effects)


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:   # no storage (a tensor subclass, a meta tensor)
        return id(t)


def out_of_place(info, func, args: tuple, kwargs: dict):
    """The callable that computes what an in-place / ``inplace=True`` / ``out=`` call writes,
    without writing: the API's out-of-place form, or None when it has none."""
    if kwargs.get("out") is not None:
        def without_out(*a, **kw):   # the result in the dtype the out= tensor has
            out = kw.pop("out", None)
            return _as_dtype(func(*a, **kw), out)
        return without_out
    if info.inplace:
        return _sibling(info, func)
    pos = info.inplace_pos   # F.relu(x, inplace=True) and friends: the same call, inplace=False

    def not_inplace(*a, **kw):
        if "inplace" in kw or len(a) <= pos:
            kw["inplace"] = False
        else:
            a = a[:pos] + (False,) + a[pos + 1:]
        return func(*a, **kw)

    return not_inplace


def _sibling(info, func):
    """``Tensor.add`` for ``Tensor.add_``, ``torch.relu`` for ``torch.relu_``, ``Tensor.add``
    for ``x += y``..., its result in the dtype of its first argument (an in-place call keeps
    ``self``'s dtype: ``x_bf16.add_(y_fp32)`` is bf16); cached on the ``ApiInfo``."""
    if info.outplace is None:
        name = info.name
        base = f"__{name[3:]}" if name.startswith("__i") else name[:-1]
        owners = [torch.Tensor] if info.prefix == "Tensor" else \
            [sys.modules.get(getattr(func, "__module__", None) or ""), torch,
             torch.nn.functional]
        found = None
        for owner in owners:
            cand = getattr(owner, base, None) if owner is not None else None
            if callable(cand):
                found = cand
                break
        if found is None:
            info.outplace = False
        else:
            def out_of_place(*a, **kw):
                return _as_dtype(found(*a, **kw), a[0] if a else None)
            out_of_place.__name__ = base   # classified as the out-of-place API
            out_of_place.__qualname__ = getattr(found, "__qualname__", base)
            out_of_place.__module__ = getattr(found, "__module__", None)
            out_of_place.__wrapped__ = found
            info.outplace = out_of_place
    return info.outplace or None


def _as_dtype(result, like):
    """``result`` cast to ``like``'s dtype where they differ (a floating tensor result)."""
    if isinstance(result, torch.Tensor) and isinstance(like, torch.Tensor) and \
            result.dtype != like.dtype and result.is_floating_point():
        return result.to(like.dtype)
    return result


def snapshot(leaves: list, indices: tuple, fresh: bool = True) -> Snapshot:
    """Clones of the leaves the call overwrites, taken before the real call (no autograd
    history)."""
    snap = Snapshot()
    snap.fresh = fresh
    with torch.no_grad():   # (a clone made under no_grad has no history: no detach needed)
        for i in indices:
            snap[i] = leaves[i].clone()
    return snap


def restore(leaves: list, snap) -> list:
    """``leaves`` with each overwritten tensor replaced by its snapshot (a fresh clone of it
    when the re-run writes it)."""
    if not snap:
        return leaves
    new = list(leaves)
    fresh = getattr(snap, "fresh", True)
    with torch.no_grad():
        for i, t in snap.items():
            new[i] = t.clone() if fresh else t
    return new
