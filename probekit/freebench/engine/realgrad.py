"""The input gradients one API call hands its inputs in the training's own backward pass.

Before the forward call we read the thread's next autograd sequence number (``marker``): the
nodes the call creates are the ones reachable from its output's ``grad_fn`` numbered at or above
it. The edges from those nodes to the call's differentiable inputs (the input's ``grad_fn`` and
``output_nr``, or a leaf's ``AccumulateGrad``) carry exactly the gradients the real backward gives
each input from this call. A post-hook on each such node reads them as they are computed, so the
backward check compares against the gradients the training really used and does not recompute
the reference (one forward and one backward of the API fewer per check).

``plan`` answers None, and the check recomputes the reference as before, when this cannot be
exact: another output of the call carries gradients too, one tensor is passed twice, the output
is an input, the call built more than ``MAX_NODES`` nodes, or this torch has no sequence numbers.
"""
from __future__ import annotations

import torch

#: the most nodes one call may create for its gradients to be read off the real graph
MAX_NODES = 64

_seq = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)


def marker():
    """The sequence number the next autograd node of this thread gets (None: not available)."""
    return _seq() if _seq is not None else None


def plan(out: torch.Tensor, leaves: list, diff: list, mark):
    """``{node: [(edge index, leaf position), ...]}`` for the nodes of the call with an edge to
    a differentiable input, or None (see the module doc). ``out``: the hooked output; ``diff``:
    the positions in ``leaves`` of the inputs whose gradients are compared."""
    root = out.grad_fn
    if mark is None or root is None or root._sequence_nr() < mark:
        return None
    targets: dict = {}   # (input's grad_fn, output_nr), or id of a leaf input -> position
    for i in diff:
        x = leaves[i]
        key = id(x) if x.grad_fn is None else (x.grad_fn, x.output_nr)
        if key in targets or x is out:   # passed twice, or the output is an input
            return None
        targets[key] = i
    edges: dict = {}
    inner = {root}
    todo = [root]
    while todo:
        node = todo.pop()
        for j, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)   # AccumulateGrad: the leaf it fills
            pos = targets.get((nxt, nr) if var is None else id(var))
            if pos is not None:
                edges.setdefault(node, []).append((j, pos))
            elif var is None and nxt not in inner and nxt._sequence_nr() >= mark:
                if len(inner) >= MAX_NODES:
                    return None
                inner.add(nxt)
                todo.append(nxt)
    return edges or None


class Handles(list):
    """The hook handles of one watched call, removed together."""

    def remove(self) -> None:
        for h in self:
            h.remove()
        self.clear()


def upstream(output_nr: int, keep):
    """A pre-hook for the call's last node: ``keep(gradient of output output_nr)``."""
    def prehook(grad_outputs):
        keep(grad_outputs[output_nr])
        return None
    return prehook


class Collector:
    """Post-hooks on the ``plan``'s nodes: sums each input's gradients as the real backward
    computes them, and calls ``done(grads)`` (position -> gradient, None where none flowed) once
    every hooked node has run."""

    __slots__ = ("edges", "left", "grads", "done")

    def __init__(self, edges: dict, done):
        self.edges = edges
        self.left = len(edges)
        self.grads: dict = {}
        self.done = done

    def hooks(self):
        """(node, hook) pairs to register with ``node.register_hook``."""
        return [(node, self._hook(pairs)) for node, pairs in self.edges.items()]

    def _hook(self, pairs):
        def hook(grad_inputs, grad_outputs):
            for j, pos in pairs:
                g = grad_inputs[j]
                if g is None:
                    continue
                g = g.detach()
                have = self.grads.get(pos)
                self.grads[pos] = g if have is None else have + g
            self.left -= 1
            if self.left == 0:
                grads, self.grads = self.grads, {}
                self.done(grads)
            return None
        return hook
