"""Raw gradients (``grad_point="backward"``): the statistics of every monitored gradient as the
backward pass that last wrote it left it, before anything between backward and ``step()``
(gradient clipping, GradScaler's unscaling) changes it.

Which backward is the last before a step is not known while it runs (with accumulation over k
micro-batches, k backward passes write into the same ``.grad``), and a copy of the gradients per
backward would double their memory. So the statistics are computed at the end of *every*
backward pass, for the parameters it wrote, and only the newest statistics of each parameter are
kept (a later backward supersedes them); the optimizer's pre-step hook takes them. Cost: one
statistics pass per backward pass instead of one per step, no gradient copy.

Mechanics: a ``register_post_accumulate_grad_hook`` on each monitored parameter marks it
written and queues an autograd final callback, which queues a second one; the statistics are
computed in the second. DDP writes its all-reduced (averaged) gradients back into ``.grad`` in a
final callback of its own, queued during the backward, after the parameter's post-accumulate
hook ran, so a hook or a first-level callback still sees the local gradient; the second level
runs after every callback queued during the backward (checked under DDP and FSDP2 at 2 ranks:
``tests/integration/test_grads_preclip.py``). FSDP2 calls the hooks of its sharded parameters
itself once their reduce-scatter wrote them (the sharded ``DTensor`` gradient: the shard is
recorded, as at the step).
"""
from __future__ import annotations

import copy
import time

import numpy as np
from torch.autograd import Variable

from ...log import get_logger

log = get_logger(__name__)


class BackwardTap:
    """Post-accumulate-grad hooks on ``params``; ``compute(indices)`` -> the ``StepStats`` of
    those parameters' current gradients (or None: nothing to keep), called at the end of every
    backward pass that wrote some of them, unless ``synced()`` says that backward did not
    synchronise the gradients (DDP's ``no_sync``: a later backward of the same step will, so
    its statistics would be superseded unread)."""

    def __init__(self, params, compute, synced=None) -> None:
        self._params = params
        self._compute = compute
        self._synced = synced
        self.passes = 0  # statistics passes (backward passes computed)
        self.skipped = 0  # backward passes without gradient sync, not computed
        self._handles: dict = {}  # parameter index -> hook handle
        self._unhooked = list(range(len(params)))
        self._written: set = set()  # written by the running backward pass, not computed yet
        self._queued = False
        #: partial statistics, newest last; ``present`` marks the rows not superseded or taken
        self._parts: list = []
        #: written by a synchronised backward since their optimizer last stepped (the same on
        #: every rank, recording or not: a rank that only joins the gathers decides alike)
        self._pending = np.zeros(len(params), bool)
        self.seconds = 0.0  # spent computing, in total (the recorder reads the increments)

    # -- hooks -----------------------------------------------------------------------------
    def attach(self) -> None:
        """Hook every parameter that requires grad and has no hook yet (a parameter unfrozen
        later is hooked at the next step; until then it is taken at the step)."""
        if not self._unhooked:
            return
        left = []
        for i in self._unhooked:
            p = self._params[i]
            if p.requires_grad and p.is_leaf:
                self._handles[i] = p.register_post_accumulate_grad_hook(self._hook_for(i))
            else:
                left.append(i)
        self._unhooked = left

    def _hook_for(self, i):
        def hook(_param):
            self._written.add(i)
            if not self._queued:
                try:
                    Variable._execution_engine.queue_callback(self._after_backward)
                    self._queued = True
                except RuntimeError:  # called outside a backward pass: compute now
                    self._end()
        return hook

    def _after_backward(self) -> None:
        # callbacks queued during the backward (DDP's write-back of the all-reduced gradients)
        # run before this one's own
        Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._queued = False
        idx, self._written = sorted(self._written), set()
        if not idx:
            return
        written = np.zeros(len(self._params), bool)
        written[idx] = True
        for old in self._parts:  # this backward accumulated into them: superseded
            old.present &= ~written
        self._parts = [p for p in self._parts if p.present.any()]
        if self._synced is not None and not self._synced():
            self._pending[written] = False
            self.skipped += 1
            return
        t0 = time.perf_counter()
        part = self._compute(idx)
        self._pending[written] = True
        self.passes += 1
        if part is not None and part.present.any():
            self._parts.append(part)
        self.seconds += time.perf_counter() - t0

    def remove(self) -> None:
        handles, self._handles = self._handles, {}
        self._unhooked = list(range(len(self._params)))
        for h in handles.values():
            h.remove()
        self._parts, self._written, self._queued = [], set(), False
        self._pending[:] = False

    # -- the step --------------------------------------------------------------------------
    def pending(self) -> np.ndarray:
        """(P,) bool: the parameters a synchronised backward pass wrote since their optimizer
        last stepped (their statistics are taken from it, not from the gradient at the step)."""
        return self._pending.copy()

    def take(self, use, drop) -> list:
        """The pending statistics of the parameters in ``use`` (shallow views: ``present``
        restricted to them), oldest first; the pending rows of ``drop`` (the stepping
        optimizer's parameters) are discarded, the others kept for their own optimizer."""
        # a backward that raised never ran its callback: the next one must queue its own
        self._queued = False
        n = len(self._params)
        use_mask, drop_mask = np.zeros(n, bool), np.zeros(n, bool)
        use_mask[list(use)] = True
        drop_mask[list(drop)] = True
        views = []
        for part in self._parts:
            keep = part.present & use_mask
            if keep.any():
                view = copy.copy(part)  # the arrays shared, never written to
                view.present = keep
                views.append(view)
            part.present = part.present & ~drop_mask
        self._parts = [p for p in self._parts if p.present.any()]
        self._pending &= ~drop_mask
        return views

