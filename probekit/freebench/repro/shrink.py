"""Make a repro's inputs smaller while the finding still reproduces (rows, batch, sequence).

A candidate is one dimension of one input (every dimension but the last, which is usually the
feature dimension a normalisation or product works over; the only one of a 1-D input) together
with every other tensor of the call that has as many dimensions and the same size there (the
upstream gradient of the backward stage among them): a layer_norm's input and its gradient
along the rows, a sum's values and their indices. A candidate is halved while the finding still
reproduces (``reproduces(leaves, g)``: the session's own float64 analysis, with the bound
rebuilt for the new shapes), then bisected between the last size that reproduced and the first
that did not; a shape the call refuses counts as not reproducing. Largest dimensions first,
each tried once; at most ``MAX_TRIES`` analyses and ``SECONDS`` seconds in all.

Narrowed tensors keep their dimension order (a transposed input stays transposed) and the
aliasing between arguments (a tensor passed twice stays one tensor).
"""
from __future__ import annotations

import time

import torch

MAX_TRIES = 48
SECONDS = 120.0


def _narrow(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    part = t.narrow(dim, 0, size)
    return torch.empty_like(part, memory_format=torch.preserve_format).copy_(part)


def _tensors(leaves: list, g) -> list:
    """(key, tensor) of the distinct tensors: key a leaf position or ``"g"``."""
    out, seen = [], set()
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            out.append((i, x))
    if g is not None:
        out.append(("g", g))
    return out


def candidates(leaves: list, g) -> list:
    """``[(size, ((key, dim), ...))]``: each shrinkable dimension with the tensors that share it,
    largest first, duplicates removed."""
    ts = _tensors(leaves, g)
    seen, out = set(), []
    for key, x in ts:
        if x.dim() == 0:
            continue
        dims = range(x.dim() - 1) if x.dim() > 1 else (0,)
        for d in dims:
            n = x.shape[d]
            if n < 2:
                continue
            group = tuple((k, d) for k, t in ts if t.dim() == x.dim() and t.shape[d] == n)
            if group not in seen:
                seen.add(group)
                out.append((n, group))
    out.sort(key=lambda c: -c[0])
    return out


def _apply(leaves: list, g, group, size: int):
    keys = {k for k, _ in group}
    dim = group[0][1]
    done = {}
    new = list(leaves)
    for i, x in enumerate(leaves):
        if i in keys or (isinstance(x, torch.Tensor) and id(x) in done):
            if id(x) not in done:
                done[id(x)] = _narrow(x, dim, size)
            new[i] = done[id(x)]
    new_g = _narrow(g, dim, size) if "g" in keys and g is not None else g
    return new, new_g


def shrink(leaves: list, g, reproduces, *, max_tries: int = MAX_TRIES,
           seconds: float = SECONDS) -> tuple:
    """(leaves, g, steps): the smallest inputs found that still reproduce; ``steps``:
    ``[{"tensors": [names], "dim", "from", "to"}]``, one per dimension that shrank."""
    t0 = time.monotonic()
    tries = 0
    steps = []
    tried = set()

    def ok(lv, gg) -> bool:
        nonlocal tries
        tries += 1
        try:
            return bool(reproduces(lv, gg))
        except Exception:   # a shape the call refuses: not a smaller repro
            return False

    def budget() -> bool:
        return tries < max_tries and time.monotonic() - t0 < seconds

    while budget():
        todo = [c for c in candidates(leaves, g) if c[1] not in tried]
        if not todo:
            break
        n, group = todo[0]
        tried.add(group)
        good, bad = n, None
        size = n // 2
        while size >= 1 and budget():
            lv, gg = _apply(leaves, g, group, size)
            if ok(lv, gg):
                good, leaves_ok = size, (lv, gg)
                size //= 2
            else:
                bad = size
                break
        while bad is not None and good - bad > 1 and budget() and good < n:
            mid = (good + bad) // 2
            lv, gg = _apply(leaves, g, group, mid)
            if ok(lv, gg):
                good, leaves_ok = mid, (lv, gg)
            else:
                bad = mid
        if good < n:
            leaves, g = leaves_ok
            names = [("g" if k == "g" else f"x{k}") for k, _ in group]
            steps.append({"tensors": names, "dim": group[0][1], "from": n, "to": good})
    return leaves, g, steps


def describe(steps: list, before: int, after: int) -> str:
    """One line: what shrank and by how much (``before``/``after``: bytes of the inputs)."""
    if not steps:
        return "not shrunk: no smaller input reproduced the finding"
    parts = [f"{' and '.join(s['tensors'])} along dim {s['dim']} from {s['from']} to {s['to']}"
             for s in steps]
    factor = before / after if after else float("inf")
    return f"shrunk: {'; '.join(parts)} ({_size(before)} -> {_size(after)} of inputs, " \
           f"{factor:.3g}x smaller); the finding still reproduces"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"
