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

**A cast node between the call and an input is read on its way in** (issue 34, defect A). Under
autocast an op casts its fp32 inputs to bf16 inside (a ``ToCopyBackward0`` node), and autocast
caches the cast of a leaf that requires grad: every later call of the step that uses the same
parameter reuses that bf16 tensor, so one ``ToCopyBackward0`` node hands the leaf the *sum* of
every call's gradient (a layer run on two streams, a discriminator on real and fake images: the
first call's reference was that sum, tens of thousands of times off; the later calls found no
edge at all). A cast node only converts: its gradient is ``grad.to(input's dtype)``. So the
edge from a cast node to an input is never hooked; the edges *into* the cast node from this
call's own nodes are (whether the cast node is the call's or cached from an earlier call), their
gradients summed in the cast's dtype (as the cast node's input buffer sums them) and converted
to the input's dtype and device, which is what the cast node computes for this call alone.
"""
from __future__ import annotations

import torch

from ..judge.guards import modes_off

#: the most nodes one call may create for its gradients to be read off the real graph
MAX_NODES = 64
#: autograd's node of a dtype/device conversion (``_to_copy``: ``tensor.to``, autocast's casts)
CAST_NODE = "ToCopyBackward0"

_seq = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)


def marker():
    """The sequence number the next autograd node of this thread gets (None: not available)."""
    return _seq() if _seq is not None else None


def _cast_target(node, targets: dict):
    """The leaf position a cast node (``CAST_NODE``) converts for, when its one input is a
    compared input, else None."""
    if type(node).__name__ != CAST_NODE:
        return None
    nxt = node.next_functions
    if len(nxt) != 1 or nxt[0][0] is None:
        return None
    fn, nr = nxt[0]
    var = getattr(fn, "variable", None)
    return targets.get((fn, nr) if var is None else id(var))


def plan(out: torch.Tensor, leaves: list, diff: list, mark):
    """``{node: [(edge index, leaf position, cast), ...]}`` for the nodes of the call with an
    edge to a differentiable input (``cast``: None, or ``(dtype, device)`` when the edge goes
    into a cast node converting for that input: its gradient is converted so), or None (see the
    module doc). ``out``: the hooked output; ``diff``: the positions in ``leaves`` of the inputs
    whose gradients are compared."""
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
                edges.setdefault(node, []).append((j, pos, None))
                continue
            pos = _cast_target(nxt, targets)
            if pos is not None:   # read on its way into the (maybe shared) cast: module doc
                x = leaves[pos]
                edges.setdefault(node, []).append((j, pos, (x.dtype, x.device)))
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
        with modes_off():   # probekit's own work: invisible to the mode in the backward pass
            keep(grad_outputs[output_nr])
        return None
    return prehook


class Collector:
    """Post-hooks on the ``plan``'s nodes: sums each input's gradients as the real backward
    computes them, and calls ``done(grads)`` (position -> gradient, None where none flowed) once
    every hooked node has run."""

    __slots__ = ("edges", "left", "grads", "casts", "done")

    def __init__(self, edges: dict, done):
        self.edges = edges
        self.left = len(edges)
        self.grads: dict = {}
        #: position -> (gradient summed in the cast's dtype, (dtype, device) it converts to)
        self.casts: dict = {}
        self.done = done

    def hooks(self):
        """(node, hook) pairs to register with ``node.register_hook``."""
        return [(node, self._hook(pairs)) for node, pairs in self.edges.items()]

    def _hook(self, pairs):
        def hook(grad_inputs, grad_outputs):
            with modes_off():   # probekit's own work: invisible to the mode in the backward pass
                self._collect(pairs, grad_inputs)
            return None
        return hook

    def _collect(self, pairs, grad_inputs) -> None:
        for j, pos, cast in pairs:
            g = grad_inputs[j]
            if g is None:
                continue
            g = g.detach()   # a detach, not the tensor itself (guards.detached): the
            # engine steals a gradient whose tensor it alone holds for a leaf's ``.grad``; held
            # here, it would copy it (issue 38: measured, one copy per parameter gradient)
            if cast is not None:    # summed as the cast node sums, converted at the end
                have = self.casts.get(pos)
                self.casts[pos] = (g if have is None else have[0] + g, cast)
                continue
            have = self.grads.get(pos)
            self.grads[pos] = g if have is None else have + g
        self.left -= 1
        if self.left == 0:
            grads, self.grads = self.grads, {}
            casts, self.casts = self.casts, {}
            for pos, (g, (dtype, device)) in casts.items():
                if g.is_complex() and not dtype.is_complex:   # a real input's cast
                    g = g.real                               # (an FFT's), as the node does
                g = g.to(device=device, dtype=dtype)
                have = grads.get(pos)
                grads[pos] = g if have is None else have + g
            self.done(grads)
