"""The interception engine: a ``TorchFunctionMode`` that names, filters and checks API calls.

Hot path (every torch call while the probe is active): one dict lookup per callable decides
what needs no work at all (``passthrough``: property reads, and with ``scope``/``list`` every API
none of whose names is in scope: one counter increment, no allocation); the others are
classified (cached per callable), counted, and tested against the scope and module filters.
Inside ``__torch_function__`` torch has already popped the mode, so the calls an API makes
internally (``F.layer_norm`` -> ``torch.layer_norm``) and probekit's own re-runs are not seen;
``busy`` guards the paths where the mode may still be active (gradient hooks). How a compared
call becomes a verdict, a row and a cause is ``judging.py`` (the engine's ``Judging`` part).
About 650 lines: the mode, the engine's state and filters, and the one path of a checked call
(decide, watch the generators, snapshot what it overwrites, re-run, compare, fix) stay
together; what a random call's generators showed is ``rng.py``'s, what a call writes
``state.py``'s, the coverage ``budget.py``'s.
"""
from __future__ import annotations

import functools
import logging
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

from ...log import Once, get_logger
from . import autocast, blocks, passes, rng, state
from ..judge import cause, handlers, metric, scales
from ..perturb import perturb
from .backward import watch
from .budget import Budget, Coverage
from ..judge.deferred import Verdicts, combine
from ..judge.guards import modes_off, no_autocast, quiet
from ..judge.judging import Judging
from ..perturb.modes import MODES
from .. import names
from ..names import PROPERTY, REASONS, Classifier, dynamic_skip, operator_key, random_draw
from .preheat import Preheat

log = get_logger("probekit.freebench")

#: one INFO summary line every this many steps (the per-API lines appear once per run)
SUMMARY_EVERY = 100

EXTRA_REASONS = {
    "no_float_input": "no floating-point tensor input",
    "no_float_output": "the output holds no floating-point tensor",
    "no_grad": "no gradient flows through this call",
    "backward_pass": "made inside the backward pass (a custom autograd.Function's backward, a "
                     "gradient hook): checked in the backward stage",
    "dtype_arg": "fix: the call fixes its output dtype explicitly",
    "meta": "meta tensors hold no values",
    "budget": "the overhead budget leaves this call to a later step (call sites rotate)",
    "step": "a step function (piecewise constant in its floating inputs): a one-ulp move only "
            "says on which side of a discontinuity an input lies (checked exactly in the "
            "accuracy modes)",
    "selection": "its gradient goes to the elements it selects: a one-ulp tie break moves it "
                 "elsewhere, a choice rather than a precision loss (sensitivity modes, backward)",
    "no_gradient": "no gradient reached it before stop() (the backward ran outside the block, "
                   "or its output does not reach the loss)",
    "cancelled": "the perturbation does not apply to this call",
    "error": "the check failed (logged)",
}


def _reason_text(reason: str) -> str:
    return REASONS.get(reason) or EXTRA_REASONS.get(reason) or reason


#: skip reasons of calls that are not floating-point calls (not in the coverage)
_NOT_FLOAT = frozenset({"no_float_input", "meta", "metadata", "other"})


def _has_float(args, kwargs) -> bool:
    """A floating-point tensor among the arguments (one level into lists and tuples)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                return True
        elif type(a) in (list, tuple):
            for b in a:
                if isinstance(b, torch.Tensor) and b.is_floating_point():
                    return True
    if kwargs:
        return _has_float(tuple(kwargs.values()), None)
    return False


def _site(name: str) -> tuple:
    """``("Torch.matmul", 3)`` of ``"Torch.matmul.3.forward"``."""
    key, n, _ = name.rsplit(".", 2)
    return key, int(n)


class _Unfixable(Exception):
    """fix: an observed call drew (its skip is already counted): the original call runs."""


class _BackwardPass:
    """``Tensor.backward`` / ``torch.autograd.backward`` run with the mode active inside the pass
    (``passes.run``), the engine's ``in_backward`` set meanwhile: the Python calls the pass makes
    (a custom ``autograd.Function.backward``, a gradient hook) are checked in the backward
    stage and named in the coverage in the forward stage (``Engine.handle``)."""

    __slots__ = ("mode", "info", "func")

    def __init__(self, mode, info, func) -> None:
        self.mode, self.info, self.func = mode, info, func

    def __call__(self, *args, **kwargs):
        e = self.mode.engine
        e.in_backward += 1
        try:
            return passes.run(self.mode, self.info, self.func, args, kwargs)
        finally:
            e.in_backward -= 1


class _Mode(TorchFunctionMode):
    #: ``zero_grad(set_to_none=True)`` runs with this mode off the stack (``optsteps.py``)
    probekit_suspends_zero_grad = True

    def __init__(self, engine: "Engine") -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        e = self.engine
        try:
            fast = e.passthrough.get(func)
        except TypeError:  # an unhashable callable
            fast = None
        if fast is not None:   # a property, or an API no call of which is in scope: no work
            if fast and not e.busy:
                e.passed += 1
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        try:
            info = e.cache.get(func)
        except TypeError:  # an unhashable callable
            info = None
        if info is None:
            info = e.classify(func)
        if info is PROPERTY or e.busy:
            if info is PROPERTY:
                e.pass_through(func, False)
            return func(*args, **kwargs)
        if info.autograd:   # a backward pass: the calls made inside it are seen too
            func = _BackwardPass(self, info, func)
        e._calls += 1
        if not e.enabled:   # (the session pushes no mode in such a step: ``FreeBench._idle``)
            return func(*args, **kwargs)
        key = operator_key(info, sys._getframe(1)) if info.operators else info.key
        if e.selective:
            wanted = e.wanted.get(key)
            if wanted is None:
                wanted = e.want(key)
                if not wanted and not info.autograd and not e.wants_any(info):
                    # (a backward pass is never passed through: calls inside it may be in scope)
                    e.pass_through(func, True)
            if not wanted:
                e._out_of_scope += 1
                return func(*args, **kwargs)
        counts = e.counts
        n = counts.get(key, 0)
        counts[key] = n + 1
        if e.scope_ids and f"{key}.{n}" not in e.scope_ids:
            e._out_of_scope += 1
            return func(*args, **kwargs)
        if e.modules is not None and not e.modules.depth:  # module scope (modules.py)
            e.out_of_module += 1
            return func(*args, **kwargs)
        return e.handle(info, key, n, func, args, kwargs)


class Engine(Judging):
    """State of one free-benchmark session while it intercepts (counters, filters, findings)."""

    def __init__(self, config, emit, rank: int) -> None:
        fb = config.free_benchmark
        self.config = config
        self.fb = fb
        self.emit = emit                      # callable(list_of_row_dicts)
        self.rank = rank
        self.mode_name = fb.pert_mode
        self.stage = fb.fuzz_stage
        self.fix = fb.handler_type == "fix"
        self.mode = MODES[fb.pert_mode]
        self.upcast_mode = self.mode.upcast
        #: the sensitivity modes do not perturb step functions (scales.STEP)
        self.step_skip = not (self.mode.upcast or self.mode.exact)
        #: a combined mode's modes, one per step (``modes.py``; ``Judging.set_mode``)
        self.schedule = self.mode.schedule
        if self.schedule:
            self.set_mode(self.schedule[0])
        classifier = Classifier()
        self.classify = classifier
        self.cache = classifier.cache
        # scope: exact names (stage suffix optional); list: substrings of the API key
        self.scope_ids = {self._strip_stage(s) for s in fb.scope}
        self.scope_keys = {s.rsplit(".", 1)[0] for s in self.scope_ids}
        self.api_list = tuple(fb.api_list)
        self.wanted: dict[str, bool] = {}
        self.selective = bool(self.scope_ids or self.api_list)
        #: callable -> the mode calls it straight through (decided once per callable): False for
        #: a property (not a call), True for an API none of whose keys is in scope (counted
        #: in ``passed``). ``passthrough`` is the one in force: in a step the step filter
        #: excludes, only the properties
        self._through: dict = {}
        self._properties: dict = {}
        self.passed = 0
        self.preheat = Preheat(fb.preheat_step, fb.max_sample) if fb.if_preheat else None
        # state
        self.step = 0
        self._set_enabled(self._step_selected(0))
        self.busy = False
        #: optimizer steps running (``session/optsteps.py``: torch.optim's step hooks)
        self.in_optimizer = 0
        #: backward passes (``_Mode._backward_pass``) the current call is made inside
        self.in_backward = 0
        self.counts: dict[str, int] = {}
        self.handles: list = []
        self.watching: list = []  # backward checks registered in this block (backward.py)
        self.once = Once()        # per run: perturbation applied / skip and cancel reasons, per API
        self._noted: set = set()  # (reason, API) skipped early and logged (``_skip_early``)
        self.once_step = Once()   # per step: preheat sampling lines
        self.summary_every = SUMMARY_EVERY
        self._logged = (0, 0, 0, 0)  # (step, checked, flagged, float calls) at the last line
        # summary counters (``calls``, ``out_of_scope``: properties adding ``passed``)
        self._calls = 0
        self.checked = 0
        self.flagged = 0
        self.replayed = 0         # random calls re-run on their saved random stream (rng.py)
        #: call signature -> does it draw (``rng.signature``): False, True, or the ``rng.WHY``
        #: key of a random call that cannot be replayed; learned at its first checked call
        self.draws: dict = {}
        #: call signature under autocast -> did it run ATen calls in autocast's dtype
        #: (``autocast.run``); learned at its first checked call
        self.inner_dtypes: dict = {}
        self._out_of_scope = 0
        #: steps the step filter excluded (the session intercepts nothing in them)
        self.steps_filtered = 0
        self.skipped: dict[str, int] = {}
        self.integer_only: dict[str, int] = {}   # API -> calls with no floating input
        #: module scope (a ``modules.ModuleScope`` while attached, else None)
        self.modules = None
        self.out_of_module = 0
        self.verdicts = Verdicts()
        self.budget = Budget(fb.budget) if fb.budget is not None else None
        #: with a budget: call sites eligible for a check at their last call (their next call
        #: left to a later step is skipped before the decision's work)
        self.admissible: dict = {}
        self.coverage = Coverage()
        self._thresholds: dict = {}           # compute dtype -> threshold
        self._judged: dict = {}               # (compute, tensor, input dtype) -> judged dtype
        self.site_causes: dict = {}           # call site -> {output_index: cause}
        self._uncaused: dict = {}             # call site -> its rows with a provisional cause
        self._held: dict = {}                 # call site -> rows waiting for the analysis
        self._unexplained: dict = {}          # call site -> rows left unanalysed at stop()
        self._hot: dict = {}                  # (stage, api_name, output_index) -> hot spot row

    # -- filters -------------------------------------------------------------------------------
    @staticmethod
    def _strip_stage(name: str) -> str:
        for suffix in (".forward", ".backward"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name

    def _step_selected(self, step: int) -> bool:
        return not self.config.step or step in self.config.step

    def _set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled
        self.passthrough = self._through if enabled else self._properties

    def pass_through(self, func, counted: bool) -> None:
        """From now on the mode calls ``func`` straight through: a property (``counted``
        False), or an API none of whose keys is in scope (counted as out of scope)."""
        try:
            self._through[func] = counted
            if not counted:
                self._properties[func] = False
        except TypeError:  # an unhashable callable
            pass

    @property
    def calls(self) -> int:
        """Calls the mode saw (property reads not counted)."""
        return self._calls + self.passed

    @property
    def out_of_scope(self) -> int:
        """Calls outside ``scope``/``list``."""
        return self._out_of_scope + self.passed

    def totals(self) -> tuple:
        """``(calls, checked, out_of_scope, skipped)``: the running totals a coverage finding
        compares (``session/coverage.py``), one call (the skip dict copied)."""
        passed = self.passed
        return (self._calls + passed, self.checked, self._out_of_scope + passed,
                dict(self.skipped))

    def wants_any(self, info) -> bool:
        """Can any call of this callable be in scope (its key, or an operator's key)?"""
        return any([self.want(k) for k in (info.key, *info.operators.values())])

    def want(self, key: str) -> bool:
        """Can calls of API ``key`` be in scope at all? (cached per key)"""
        if self.scope_ids:
            hit = key in self.scope_keys
        else:
            hit = any(s in key for s in self.api_list)
        self.wanted[key] = hit
        return hit

    # -- step / summary ------------------------------------------------------------------------
    def next_step(self) -> None:
        if self.budget is not None:
            self.budget.end_step()
        if self.preheat is not None:
            self.preheat.end_step(self.counts)
        self.counts.clear()
        self.once_step.clear()
        if not self.enabled:
            self.steps_filtered += 1
        self.step += 1
        if self.schedule:
            # under a budget the probed steps take the modes in turn (``step % every == 0``
            # would give an even ``every`` one mode only); else the steps do
            turn = self.step if self.budget is None else self.budget.probed_steps
            self.set_mode(self.schedule[turn % len(self.schedule)])
        if self.summary_every and self.step % self.summary_every == 0:
            self.log_summary()
        self._set_enabled(self._step_selected(self.step))
        if self.preheat is not None and self.step == self.preheat.preheat_step:
            log.info("Free benchmark: preheat finished after %d step(s); APIs still checked: %s; "
                     "no longer checked (risk < %.2g of threshold): %s", self.step,
                     self.preheat.at_risk() or "none", 0.5, self.preheat.low_risk() or "none")

    def log_summary(self) -> None:
        """One INFO line: what the last steps checked (and what share of their floating-point
        calls) and found (every ``summary_every`` steps)."""
        step0, checked0, flagged0, float0 = self._logged
        cov = self.coverage
        self._logged = (self.step, self.checked, self.flagged, cov.float_calls)
        if log.isEnabledFor(logging.INFO):
            n = cov.float_calls - float0
            share = f" ({100 * min(1.0, (self.checked - checked0) / n):.0f} % of {n} " \
                    f"floating-point call(s))" if n else ""
            log.info("Free benchmark: steps %d-%d: %d call(s) checked%s, %d finding(s); %d "
                     "step(s), %d finding(s) in all", step0, self.step - 1,
                     self.checked - checked0, share, self.flagged - flagged0, self.step,
                     self.flagged)

    def summary(self) -> dict:
        skipped = dict(self.skipped)
        if self.out_of_scope:
            skipped["out_of_scope"] = self.out_of_scope
        if self.out_of_module:
            skipped["out_of_module"] = self.out_of_module
        out = {"calls": self.calls, "checked": self.checked, "skipped": skipped,
               "flagged": self.flagged, "steps": self.step}
        if self.steps_filtered:
            out["steps_filtered"] = self.steps_filtered
        if self.replayed:
            out["replayed"] = self.replayed
        if self._hot:
            out["hotspots"] = len(self._hot)
        pending = sum(len(rows) for rows in self._held.values())
        if pending:
            out["pending"] = pending
        unexplained = sum(len(rows) for rows in self._unexplained.values())
        if unexplained:
            out["unexplained"] = unexplained
        if self.verdicts.inconclusive:
            out["inconclusive"] = self.verdicts.inconclusive
        if self.verdicts.unresolved:
            out["unresolved"] = self.verdicts.unresolved
        if self.budget is not None:
            out["coverage"] = self.coverage.share()
            out["budget_limit"] = self.budget.limit
            out["budget_every"] = self.budget.every
            out["budget_steps"] = {"probed": self.budget.probed_steps,
                                   "quiet": self.budget.quiet_steps,
                                   "reference": self.budget.references}
            out["budget_cost"] = self.budget.cost()
        cov = self.coverage
        out["float_calls"] = cov.float_calls
        out["checked_share"] = cov.checked_share()
        out["float_skipped"] = dict(sorted(cov.by_reason.items(), key=lambda kv: -kv[1]))
        return out

    def remove_hooks(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()

    def stopped(self) -> None:
        """The session stopped intercepting: pending backward hooks removed (their calls counted
        as ``no_gradient``), per-call state reset (an exception inside a check or an optimizer
        step may have left it set)."""
        watching, self.watching = self.watching, []
        for check in watching:
            if check.leaves is not None:   # its gradient never arrived
                self.note_skip("no_gradient", check.key, check.name)
        self.remove_hooks()
        self.in_optimizer = 0
        self.in_backward = 0
        self.busy = False
        self.log_integer_only()

    def log_integer_only(self) -> None:
        """One INFO line, once per session, for the calls skipped because no floating-point
        tensor was among their inputs (integer indexing, masks, positions: 450 WARNING lines,
        one per API, across nine models before issue 34); ``summary["skipped"]`` counts them."""
        if not self.integer_only or not self.once(("integer_only",)):
            return
        apis = sorted(self.integer_only.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{k} {n}" for k, n in apis[:8])
        more = f", +{len(apis) - 8} more" if len(apis) > 8 else ""
        log.info("Free benchmark: %d call(s) of %d API(s) had no floating-point tensor input and "
                 "are not checked (%s%s); summary['skipped']['no_float_input'] counts them.",
                 sum(self.integer_only.values()), len(apis), shown, more)

    # -- logging -------------------------------------------------------------------------------
    def note_skip(self, reason: str, key: str, name: str, why: str | None = None,
                  text: str | None = None, counted: bool = False) -> None:
        """Count a floating-point call that is not checked (in ``skipped`` and the coverage:
        ``text`` is its ``reason`` there, default the key) and log why (once per API per run;
        ``why``: the log text, when it is more precise than the reason's). ``counted``: already
        counted in ``skipped``, not a floating-point call: only logged."""
        if not counted:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
            self.coverage.skip(_site(name), reason, text)
        if reason == "no_float_input":   # one summary line for all of them (``stopped``)
            self.integer_only[key] = self.integer_only.get(key, 0) + 1
        elif reason != "preheat" and self.once((reason, key, why)):
            log.info("Free benchmark: For %s, %s. Cancel perturbation.", name,
                     why or _reason_text(reason))

    def _skip(self, reason: str, key: str, name: str, func, args, kwargs, seen: bool = False):
        """Count a skipped call (a floating-point one in the coverage too: ``seen`` when it is
        counted there already) and run it."""
        if not seen and reason not in _NOT_FLOAT and _has_float(args, kwargs):
            self.coverage.seen(_site(name))
            seen = True
        if not seen:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.note_skip(reason, key, name, counted=not seen)
        return func(*args, **kwargs)

    def cancelled(self, key: str, name: str, why: str) -> None:
        self.skipped["cancelled"] = self.skipped.get("cancelled", 0) + 1
        self.coverage.skip(_site(name), "cancelled")
        if self.once(("cancel", key)):
            log.info("Free benchmark: For %s, %s. Cancel perturbation.", name, why)

    def failed(self, key: str, name: str, exc: BaseException) -> None:
        self.skipped["error"] = self.skipped.get("error", 0) + 1
        self.coverage.skip(_site(name), "error")
        if self.once(("error", key)):
            log.warning("Free benchmark: For %s, the check failed and was skipped (%s: %s).",
                        name, type(exc).__name__, exc)

    def applied(self, key: str, name: str) -> None:
        if self.once(("applied", key)) and log.isEnabledFor(logging.INFO):
            log.info("Free benchmark: Perturbation is %s of %s.", self.mode_name, name)

    def _skip_early(self, reason: str, key: str, n: int, func, args, kwargs):
        """A call whose reason is known before the decision's work (the API's own reason, an
        optimizer update, the budget for a site that was eligible at its last call): counted
        and logged as ``_skip`` does (a floating-point call in the coverage), then run."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if reason == "budget":
            self.coverage.unchecked((key, n), reason, admitted=True)
        elif reason not in _NOT_FLOAT and _has_float(args, kwargs):
            self.coverage.unchecked((key, n), reason)
        if (reason, key) not in self._noted:   # logged once per API (``note_skip``)
            self._noted.add((reason, key))
            self.note_skip(reason, key, f"{key}.{n}.{self.stage}", counted=True)
        return func(*args, **kwargs)

    # -- one in-scope call -----------------------------------------------------------------------
    def handle(self, info, key, n, func, args, kwargs, frame=None):
        """One call in scope: skipped (counted, with its reason) or checked. ``frame``: the
        caller's (default: the frame that called the mode, read only for a checked call)."""
        # reasons known without the decision's work: decided as ``_decide`` would decide them
        if info.skip is not None:
            return self._skip_early(info.skip, key, n, func, args, kwargs)
        if self.in_optimizer and info.rule is None and info.random is None and \
                not torch.is_grad_enabled():
            return self._skip_early("optimizer", key, n, func, args, kwargs)
        admitted = None
        if self.budget is not None and (key, n) in self.admissible:  # eligible last time
            admitted = self.budget.admit()
            if not admitted:
                return self._skip_early("budget", key, n, func, args, kwargs)
        name = f"{key}.{n}.{self.stage}"
        try:
            with modes_off():
                decision = self._decide(info, key, n, name, args, kwargs)
        except Exception as exc:  # probekit's own logic failed: run the call untouched
            self.coverage.seen((key, n))
            self.failed(key, name, exc)
            return func(*args, **kwargs)
        if isinstance(decision, str):
            return self._skip(decision, key, name, func, args, kwargs)
        leaves, spec, replay = decision
        site = (key, n)
        self.coverage.seen(site)
        if isinstance(replay, str):  # a random call whose draws cannot be replayed
            self.note_skip("random", key, name, rng.why_text(replay),
                           text=f"random: {rng.WHY[replay]}")
            return func(*args, **kwargs)
        call = perturb.Call(info, args, kwargs, self.fb.fuzz_device)
        call.replay = replay
        writes = None
        if info.rule is not None or info.inplace or info.inplace_pos is not None or \
                (kwargs and kwargs.get("out") is not None):
            writes = self._writes(call, key, name, func, leaves)
            if writes is False:        # failed (counted): the call runs untouched
                return func(*args, **kwargs)
            if isinstance(writes, str):
                return self._skip(writes, key, name, func, args, kwargs, seen=True)
        if self.fix:
            return self._fix(call, key, name, func, leaves, spec)
        self.coverage.admitted(site)
        if self.budget is not None:
            if self.preheat is None:   # (a preheat's sampling decides per call)
                self.admissible[site] = True
            if not (admitted or self.budget.admit()):
                return self._skip("budget", key, name, func, args, kwargs, seen=True)
        if writes is not None and writes.indices:   # just before the real call
            try:
                with modes_off():
                    call.snap = state.snapshot(leaves, writes.indices, writes.fresh)
                    if self.verdicts.held:   # checks of the overwritten tensor: its clone
                        for i, clone in call.snap.items():
                            self.verdicts.rebind(leaves[i], clone)
            except Exception as exc:
                self.failed(key, name, exc)
                return func(*args, **kwargs)
        if frame is None:
            frame = sys._getframe(2)   # handle <- the mode <- the caller
        if self.stage == "backward" and not self.in_backward:
            return watch(self, call, key, n, name, func, leaves, spec, frame)
        # the forward stage's calls, and in the backward stage the calls made inside the
        # backward pass (their outputs are gradients, checked as they are computed)
        return self._check_forward(call, key, n, name, func, leaves, spec, frame)

    def _writes(self, call, key, name, func, leaves):
        """For a call that writes tensors (state.py): its ``state.Writes`` (the re-runs use its
        out-of-place form, ``call.rerun``, with ``call.info`` that form's), None when it writes
        nothing, or the reason it is skipped (fix; an in-place call without an out-of-place form
        in the backward stage)."""
        if not names.written(call.info, call.args, call.kwargs):   # F.relu(inplace=False)...
            return None
        try:
            with modes_off():
                w = state.plan(call.info, func, call.args, call.kwargs, leaves)
                if w is None:
                    return None
                if self.fix:  # fix would drop the write into an upcast copy
                    return "inplace" if w.inplace else "side_effect"
                if w.inplace and w.rerun is None and self.stage == "backward":
                    return "inplace"   # an in-place op on a leaf requiring grad: no re-run
                if w.rerun is not None:
                    call.rerun = w.rerun
                    call.called = (func, call.info)   # (a repro record names the real call)
                    if call.info.inplace:   # perturbations, scales, blocks: the out-of-place API
                        call.info = self.classify(w.rerun)
                return w
        except Exception as exc:
            self.failed(key, name, exc)
            return False

    def _decide(self, info, key, n, name, args, kwargs):
        """A skip reason, or ``(leaves, spec, replay)`` when the call is to be checked: its
        flattened arguments and, for a call that draws from a generator, its ``rng.Replay`` (or
        the ``rng.WHY`` key saying why its draws cannot be replayed; None: no draw)."""
        reason = info.skip or dynamic_skip(info, args, kwargs)
        draw = None
        if reason is None and info.random is not None:
            draw = random_draw(info, args, kwargs)
            if isinstance(draw, str):
                reason, draw = draw, None
        if reason is None and self.in_optimizer and not torch.is_grad_enabled():
            reason = "optimizer"
        if reason is None and self.in_backward and self.stage == "forward":
            reason = "backward_pass"
        if reason is None and self.step_skip and scales.is_step(info.name):
            reason = "step"
        if reason is not None:
            return reason
        leaves, spec = perturb.flatten(args, kwargs)
        has_float = has_meta = False
        for x in leaves:  # one pass: floating input? meta tensor?
            if isinstance(x, torch.Tensor):
                has_float = has_float or x.is_floating_point()
                has_meta = has_meta or x.is_meta
        if not has_float:
            return "no_float_input"
        if has_meta:
            return "meta"
        if self.upcast_mode and info.name in names.NO_FLOAT64 and any(
                isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in leaves):
            return "no_float64"
        if self.preheat is not None:
            if self.preheat.in_preheat(self.step):
                if not self.preheat.sample(key, n, self.step):
                    return "preheat"
                if self.once_step(("preheat", key)):
                    log.info("Free benchmark: preheat sample in step %d api_name %s "
                             "curr_called_seq: %d/%s", self.step, name, n,
                             self.preheat.total(key))
            elif not self.preheat.wanted(key):
                return "preheat"
        if info.random is not None:   # a listed random API: its rule said whether it draws
            return leaves, spec, (None if draw is None else rng.plan(
                draw, leaves, self.mode_name, self._reporter(None, key, n, name)))
        return leaves, spec, self._observed(info, key, n, name, leaves)

    # -- random calls found by watching the generators (rng.py) --------------------------------
    def _observed(self, info, key, n, name, leaves):
        """For an API no rule lists: None when its signature is known not to draw, a
        ``rng.Replay`` (a random call, or the first call of a signature: watched), or the
        ``rng.WHY`` key of a random call that cannot be replayed."""
        sig = rng.signature(key, leaves)
        known = self.draws.get(sig)
        if known is False:
            return None
        if isinstance(known, str):
            return known
        draw = names.Draw(info.name, rng.explicit_generator(leaves), detected=True)
        report = self._reporter(sig, key, n, name)
        if known is None:
            return rng.observe(draw, leaves, self.mode_name, report)
        if self.fix:
            return "fix"
        return rng.plan(draw, leaves, self.mode_name, report)

    def _reporter(self, sig, key, n, name):
        """``Replay.report`` of one call: what its generators showed (rng.py)."""
        def report(outcome) -> None:
            if sig is not None and (sig in self.draws or len(self.draws) < rng.MAX_SIGNATURES):
                if outcome is False and self.draws.get(sig) is True:
                    self.replayed -= 1   # its re-run drew nothing: not a random call after all
                self.draws[sig] = outcome
            if outcome is True:
                self.replayed += 1
            elif isinstance(outcome, str) and outcome != "draws":  # a re-run's draws: cancelled
                self.note_skip("random", key, name, rng.why_text(outcome),
                               text=f"random: {rng.WHY[outcome]}")
        return report

    def _check_forward(self, call, key, n, name, func, leaves, spec, frame):
        if call.replay is not None:  # the generators' states the re-runs replay
            call.replay.save()
        call.autocast = autocast.in_force(leaves)   # (a repro record needs it; guards turn it off)
        out, call.compute = autocast.run(self.inner_dtypes, call.info.name, func, call.args,
                                         call.kwargs, leaves)
        func = call.rerun or func   # an in-place call: re-run out of place (state.py)
        if call.replay is not None:
            try:
                with modes_off():
                    func = call.replay.bind(func)
            except Exception as exc:  # never reaches the training code
                self.failed(key, name, exc)
                return out
            if func is None:        # it drew, and its draws cannot be replayed: skipped
                return out
            if not call.replay.drew:  # watched, and it drew nothing: a plain call
                call.replay = None
        self.busy = True
        t0 = time.perf_counter() if self.budget is not None else 0.0
        try:
            with quiet(), no_autocast(self.upcast_mode):
                self._compare_rerun(call, key, n, name, func, leaves, spec, frame, out)
        except perturb.Cancel as exc:
            self.cancelled(key, name, str(exc))
        except Exception as exc:  # never reaches the training code
            self.failed(key, name, exc)
        finally:
            self.busy = False
            if self.budget is not None:
                self.budget.spent(time.perf_counter() - t0)
        return out

    def _compare_rerun(self, call, key, n, name, func, leaves, spec, frame, out) -> None:
        outs = handlers.compared_outputs(out)
        if not outs:
            self.note_skip("no_float_output", key, name)
            return
        if call.snap:
            leaves = state.restore(leaves, call.snap)
        # the inputs as the op computed with them (autocast's casts included): every mode
        # measures the op at the precision it computes in. An in-place / out= call's output has
        # the dtype of the tensor it writes, not the one it computed in (x_bf16.add_(y_fp32)
        # adds in fp32 and rounds once; autocast casts no such call): its inputs as given
        if call.rerun is None:
            leaves = autocast.compute_leaves(leaves, outs)
        base = leaves
        judged = self.forward_plan(call.info, func, call.args, call.kwargs, leaves, outs)
        if len(outs) == 1 and outs[0][1].numel() > blocks.BLOCK and \
                (not call.snap or not call.snap.fresh) and \
                call.replay is None:  # a random call's mask is drawn whole; a re-run that
            # writes state (a training batch norm) is run whole
            plan = blocks.plan(self.mode_name, call.info, call.args, call.kwargs, leaves, outs)
            if plan is not None:
                return self._compare_blocks(call, key, n, name, func, leaves, spec, frame, outs,
                                            plan, judged)
        pert = perturb.apply(self.mode_name, call, leaves, spec)
        self.applied(key, name)
        p_out = func(*pert.args, **pert.kwargs)
        p_outs = handlers.compared_outputs(p_out)
        if len(p_outs) != len(outs) or any(a[0] != b[0] for a, b in zip(p_outs, outs)):
            raise RuntimeError("the perturbed call returned outputs of another structure")
        if pert.post is not None:
            p_outs = [(i, pert.post(t)) for i, t in p_outs]
        if self.upcast_mode and any(torch.finfo(p.dtype).eps > torch.finfo(o.dtype).eps
                                    for (_, o), (_, p) in zip(outs, p_outs)):
            # e.g. bincount: fp16 weights sum into float64, fp32 ones into float32
            raise perturb.Cancel("the upcast re-run computes in a narrower dtype than the call")
        compute = None if call.compute is None else [call.compute] * len(outs)
        scales_ = self.forward_scales(judged, func, pert.new, spec, p_outs, outs, compute,
                                      base=leaves)

        def explain(items):  # only for flagged calls: float64 re-runs
            return cause.analyse(func, lambda: state.restore(base, call.snap), spec, items,
                                 api=call.info.name)
        explain.repro = (func, call, spec, base)   # issue 30: repro_record.Recorder reads it

        self.defer(key, n, name, self.stage, self.step, frame, pert.in_dtype,
                   [(i, o, p) for (i, o), (_, p) in zip(outs, p_outs)], explain=explain,
                   plan=judged, scales_=scales_, compute=compute,
                   operands=[metric.stand_in_operands(fam, leaves, o)
                             for (fam, _, _), (_, o) in zip(judged, outs)])

    def current_module(self) -> str:
        """The innermost running named module under module scope ("" without module scope)."""
        return self.modules.current if self.modules is not None else ""

    def _compare_blocks(self, call, key, n, name, func, leaves, spec, frame, outs, plan,
                        judged) -> None:
        """A call with a large output (``blocks.plan``): perturbed, re-run and compared block by
        block, so only one block's perturbed inputs and output exist at a time."""
        (i, o), = outs
        exact = self.verdicts.want_exact(self.site_of(self.stage, key, n))
        compute = None if call.compute is None else [call.compute]
        parts, in_dtype = [], None
        for start, length in plan.parts:
            b_leaves = plan.leaves(leaves, start, length)
            b_args, b_kwargs = perturb.unflatten(b_leaves, spec)
            pert = perturb.apply(self.mode_name, perturb.Call(call.info, b_args, b_kwargs,
                                                               call.fuzz_device), b_leaves, spec)
            in_dtype = pert.in_dtype
            p = func(*pert.args, **pert.kwargs)
            (_, p), = handlers.compared_outputs(p)
            (sc,) = self.forward_scales(judged, func, pert.new, spec, [(i, p)], outs, compute,
                                        base=b_leaves)
            o_b = plan.output(o, start, length)
            parts.append(self.verdicts.stats(o_b, p, sc, exact, whole=False,
                                             operands=metric.stand_in_operands(
                                                 judged[0][0], b_leaves, o_b)))
            del pert, p, sc  # free this block's re-run before the next one
        self.applied(key, name)

        def explain(items):  # only for flagged calls: float64 re-runs, block by block
            return cause.analyse(func, lambda: leaves, spec, items, blocks=plan,
                                 api=call.info.name)
        explain.repro = (func, call, spec, leaves)   # issue 30: repro_record.Recorder reads it

        self.defer(key, n, name, self.stage, self.step, frame, in_dtype, [(i, o, None)],
                   values=[combine(parts)], exact=exact, explain=explain, plan=judged,
                   compute=compute)

    def _fix(self, call, key, name, func, leaves, spec):
        if any(isinstance(x, torch.dtype) for x in leaves):
            return self._skip("dtype_arg", key, name, func, call.args, call.kwargs, seen=True)
        replay = call.replay
        self.busy = True
        try:
            with modes_off():
                probe = func
                if replay is not None:        # the upcast call draws what the original would;
                    replay.save()             # the dtype probe below must not draw at all
                    if replay.detect is None:
                        probe = replay.bind(func)
                pert = perturb.apply(self.mode_name, call, leaves, spec)
                self.applied(key, name)
                with no_autocast(True):
                    p_out = func(*pert.args, **pert.kwargs)
                if replay is not None and replay.detect is not None:
                    if replay.moved():  # a call nobody listed drew: not known to draw the
                        replay.report("fix")  # same in every dtype: the original runs instead
                        raise _Unfixable
                    replay.report(False)
                    replay = None
                floats = [x for x in leaves if perturb.is_float(x)]
                back = functools.reduce(torch.promote_types, [x.dtype for x in floats])
                # under autocast the caller sees the op's autocast dtype (bf16 linear...)
                back = autocast.fix_dtype(probe, call.args, call.kwargs, leaves) or back
                out = handlers.cast_back(p_out, pert.in_dtype, back, floats[0].device)
            self.checked += 1
            self.coverage.check(_site(name))
            return out
        except _Unfixable:
            pass
        except perturb.Cancel as exc:
            self.cancelled(key, name, str(exc))
        except Exception as exc:
            self.failed(key, name, exc)
        finally:
            self.busy = False
        if replay is not None and replay.before is not None:
            replay.rewind()   # the original call draws what it would have drawn
        return func(*call.args, **call.kwargs)


def make_mode(engine: Engine) -> TorchFunctionMode:
    return _Mode(engine)
