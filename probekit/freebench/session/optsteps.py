"""The optimizer's steps while the free benchmark is active (issue 38).

torch.optim's global step hooks (removed at ``stop()``) tell the engine that its calls are made
inside an optimizer step (``Engine.in_optimizer``: the updates under ``no_grad`` are skipped as
``optimizer``) and hand the end of each outermost step to the session (steps follow the
optimizer). A step whose calls can matter to nothing runs with the engine's mode taken off the
function-mode stack (``suspend``): 63 of the 103 calls that reach the mode in a step of the
small benchmark model are SGD's. That is the case when

* the mode is the top of the stack (another mode entered after ``start()`` stays as it is);
* no ``closure`` is passed (LBFGS's closure runs the model's forward and backward) and the
  optimizer is not ``differentiable`` (its updates run with grad enabled and are checked);
* the API counters after it cannot move (call ``i`` of an API is named ``K.i.forward``, and
  the optimizer's calls count, as msprobe counts them): the step ends at this optimizer step
  (steps follow the optimizer and every optimizer seen has stepped), or, once ``fb.step()``
  ends the steps, the session's last step counted no call after its optimizer steps (learned
  per session, ``Followed``; if a later step does, a WARNING says which step's names may differ
  from msprobe's and the optimizer's steps are intercepted from then on).

Torch runs no post hook when ``step()`` raises, so the steps running are kept as their frames
(``frames``): a step whose frame has left the stack raised. The mode goes back on the stack at
the next of: a module's forward (a global forward pre-hook held only while a step is suspended),
an optimizer step, a step boundary, ``stop()``. Function modes are per thread: only the steps of
the thread that started the session are tracked and suspended; another thread's step only ends
the step (before, it also marked the probe's thread as inside an optimizer step).

``zero_grad(set_to_none=True)`` (``torch.optim.Optimizer``'s and ``torch.nn.Module``'s, while a
session is installed) runs with the mode off the stack too: it reads and clears every
parameter's ``.grad`` (two property calls per parameter reach a function mode: 24 of the 52
calls the small benchmark model's step brings to it) and opens a profiler range, and computes
nothing; msprobe names none of those calls, so no name moves. ``set_to_none=False`` (it zeroes
the gradients with counted calls) and a class's own ``zero_grad`` are intercepted as before.
"""
from __future__ import annotations

import functools
import sys
import threading
import time
import weakref

import torch


def _on_stack(frame) -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


#: the call torch.optim's step wrapper makes after the post hooks (``record_function``'s exit)
_STEP_EXIT = "Torch._record_function_exit._RecordFunction"


def _counted(engine) -> int:
    """Calls counted in this step, the optimizer step's own closing call left out."""
    counts = engine.counts
    return sum(counts.values()) - counts.get(_STEP_EXIT, 0)


#: how many installed sessions want ``zero_grad`` unintercepted, and the originals replaced
_ZERO_GRAD = {"users": 0, "saved": {}}
_ZERO_GRAD_LOCK = threading.Lock()
#: the classes whose ``zero_grad`` is replaced
_ZERO_GRAD_OWNERS = (torch.optim.Optimizer, torch.nn.Module)


def _mode_off(orig):
    """``orig`` (a ``zero_grad``) run with a probekit mode on top of the stack taken off it."""
    @functools.wraps(orig)
    def zero_grad(self, set_to_none: bool = True):
        n = torch._C._len_torch_function_stack()
        if set_to_none and n:
            top = torch._C._get_function_stack_at(n - 1)
            if getattr(top, "probekit_suspends_zero_grad", False):
                torch._C._pop_torch_function_stack()
                try:
                    return orig(self, set_to_none)
                finally:
                    torch._C._push_on_torch_function_stack(top)
        return orig(self, set_to_none)
    zero_grad.probekit_original = orig
    return zero_grad


def hold_zero_grad() -> None:
    """One more session wants ``zero_grad`` unintercepted (the first one replaces it)."""
    with _ZERO_GRAD_LOCK:
        if _ZERO_GRAD["users"] == 0:
            for owner in _ZERO_GRAD_OWNERS:
                orig = owner.__dict__.get("zero_grad")
                if orig is None or hasattr(orig, "probekit_original"):
                    continue
                _ZERO_GRAD["saved"][owner] = orig
                owner.zero_grad = _mode_off(orig)
        _ZERO_GRAD["users"] += 1


def release_zero_grad() -> None:
    """A session no longer wants it (the last one puts the originals back, unless another
    library replaced ours since: then ours stays in its chain, calling through)."""
    with _ZERO_GRAD_LOCK:
        _ZERO_GRAD["users"] = max(0, _ZERO_GRAD["users"] - 1)
        if _ZERO_GRAD["users"]:
            return
        saved, _ZERO_GRAD["saved"] = _ZERO_GRAD["saved"], {}
        for owner, orig in saved.items():
            if getattr(owner.__dict__.get("zero_grad"), "probekit_original", None) is orig:
                owner.zero_grad = orig


class OptimizerSteps:
    """torch.optim's global step hooks for one session (``install`` at start, ``remove`` at
    stop). ``session`` provides ``may_suspend(optimizer)`` (the names cannot move) and
    ``optimizer_step(optimizer)`` (an outermost step ended); ``mode()`` the engine's mode
    while it intercepts (None otherwise)."""

    def __init__(self, engine, session) -> None:
        self.engine = engine
        self.session = session
        self.frames: list = []   # the optimizer steps running, outermost first (their frames)
        self.suspended = None    # the mode taken off the stack for the outermost step
        self.unseen = 0          # optimizer steps run with the mode off the stack
        self._handles: list = []
        #: the step hooks' handles and hooks, made at the first ``install`` and reused
        self._kept = None
        self._module_hook = None
        #: the thread that started the session: function modes are per thread, so only its
        #: steps are tracked and suspended (another thread's step only ends the step)
        self._thread = None
        #: held ``zero_grad`` unintercepted (``hold_zero_grad``) from the first ``install`` to
        #: ``close()`` or this object's end: a finalizer that releases it
        self._zero_grad = None

    # -- install / remove ------------------------------------------------------------------------
    def install(self) -> None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        self._thread = threading.get_ident()
        if self._kept is None:
            self._kept = ((register_optimizer_step_pre_hook(self.pre), self.pre),
                          (register_optimizer_step_post_hook(self.post), self.post))
        else:
            # the same handles put back (torch's hook dicts keyed by their ids, appended last as
            # a new registration is): a fresh pair of handles a block cost ~20 us right after a
            # training step (issue 38)
            for handle, hook in self._kept:
                hooks = handle.hooks_dict_ref()
                if hooks is not None:
                    hooks[handle.id] = hook
        self._handles = [handle for handle, _ in self._kept]
        if self._zero_grad is None:   # held until ``close()``: replacing a method of
            hold_zero_grad()          # nn.Module empties the type caches of every module class
            self._zero_grad = weakref.finalize(self, release_zero_grad)

    def remove(self) -> None:
        """Hooks removed; a suspended mode is forgotten, not pushed (the session is leaving the
        interception: ``release``), the steps running dropped."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self.release()
        self.frames = []
        self.engine.in_optimizer = 0

    def close(self) -> None:
        """The session ends: ``zero_grad`` given back (the last session puts torch's back)."""
        fin, self._zero_grad = self._zero_grad, None
        if fin is not None:
            fin()

    def release(self) -> bool:
        """The session leaves the interception: True when the mode is off the stack already
        (a step that raised left it suspended): it must not be popped again."""
        mode, self.suspended = self.suspended, None
        self._drop_module_hook()
        return mode is not None

    # -- the hooks -------------------------------------------------------------------------------
    def pre(self, optimizer, args, kwargs):
        if threading.get_ident() != self._thread:
            return
        t = time.perf_counter()
        try:
            self._pre(optimizer, args, kwargs, sys._getframe(1))
        finally:
            budget = self.engine.budget
            if budget is not None:    # the session's own work (budget.py: not the plain step)
                budget.own(time.perf_counter() - t)

    def _pre(self, optimizer, args, kwargs, frame):
        # ``frame``: profile_hook_step's wrapper, the step's own frame
        if self.frames:
            self._drop_finished()
        self.frames.append(frame)
        self.engine.in_optimizer = len(self.frames)
        if len(self.frames) == 1:
            self.session.optimizer_starts()
            if self._can_suspend(optimizer, args, kwargs):
                self._suspend()

    def post(self, optimizer, *_):
        budget = self.engine.budget if threading.get_ident() == self._thread else None
        if budget is not None:   # the session's own work, up to the step it may close
            budget.stepping(time.perf_counter())
        try:
            self._post(optimizer, sys._getframe(1))
        finally:
            if budget is not None:
                budget.stepped(time.perf_counter())

    def _post(self, optimizer, frame):
        if threading.get_ident() != self._thread:
            self.session.optimizer_step(optimizer, False)
            return
        if frame in self.frames:      # (an inner step that raised, caught by its wrapper)
            del self.frames[self.frames.index(frame):]
        elif self.frames:
            self._drop_finished()
        self.engine.in_optimizer = len(self.frames)
        if not self.frames:
            suspended = self.suspended is not None
            self.resume()
            self.session.optimizer_step(optimizer, suspended)

    # -- suspension ------------------------------------------------------------------------------
    def _can_suspend(self, optimizer, args, kwargs) -> bool:
        mode = self.session.mode()
        if mode is None or not torch._C._len_torch_function_stack():
            return False
        top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
        if top is not mode:
            return False
        closure = kwargs.get("closure") if kwargs else None
        if closure is None and len(args) > 1:
            closure = args[1]
        defaults = getattr(optimizer, "defaults", None) or {}
        if closure is not None or defaults.get("differentiable", False):
            return False
        return self.session.may_suspend(optimizer)

    def _suspend(self) -> None:
        self.suspended = torch._C._pop_torch_function_stack()
        self.unseen += 1
        from torch.nn.modules.module import register_module_forward_pre_hook
        self._module_hook = register_module_forward_pre_hook(self._module_called)

    def resume(self) -> None:
        """The suspended mode back on top of the stack (no-op when none is)."""
        mode, self.suspended = self.suspended, None
        self._drop_module_hook()
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)

    def repair(self) -> None:
        """Steps whose frame has left the stack raised: forgotten, and the mode resumed when
        no step is running any more (on the session's thread only)."""
        if threading.get_ident() != self._thread:
            return
        if self.frames:
            self._drop_finished()
        if not self.frames:
            self.engine.in_optimizer = 0
            self.resume()

    def _drop_finished(self) -> None:
        frames = self.frames
        keep = 0
        while keep < len(frames) and _on_stack(frames[keep]):
            keep += 1
        del frames[keep:]
        self.engine.in_optimizer = len(frames)
        if not frames:
            self.resume()

    def _module_called(self, *_):
        """A module's forward while a step is suspended: inside that step (it stays
        suspended), or after a step that raised (the mode resumes)."""
        self.repair()

    def _drop_module_hook(self) -> None:
        hook, self._module_hook = self._module_hook, None
        if hook is not None:
            hook.remove()


class Followed:
    """Whether calls were counted after an optimizer step before the step's boundary, in the
    steps ``fb.step()`` ends (where the names of those calls would move if the optimizer's
    calls were not intercepted): ``ok`` is None until a step shows it, then True (nothing
    followed: the optimizer's steps may run unintercepted) or False for the rest of the
    session."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.ok = None
        self._mark = None          # counted calls at the end of this step's last optimizer step
        self.followed = False
        self.suspended_any = False

    def starts(self) -> None:
        """An outermost optimizer step starts (calls since the last one's end: followed)."""
        self._check()

    def ended(self, suspended: bool) -> None:
        self._mark = _counted(self.engine)
        self.suspended_any = self.suspended_any or suspended

    def boundary(self, learn: bool):
        """The step ends (before the counters reset; ``learn``: a boundary ``fb.step()`` made):
        the step number whose names may differ from msprobe's (calls followed a suspended
        optimizer step), else None."""
        self._check()
        bad = None
        if self._mark is not None and learn:
            if self.followed and self.suspended_any:
                bad = self.engine.step
            if self.ok is not False:
                self.ok = not self.followed
        self._mark, self.followed, self.suspended_any = None, False, False
        return bad

    def _check(self) -> None:
        if self._mark is not None and _counted(self.engine) != self._mark:
            self.followed = True
