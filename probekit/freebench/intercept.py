"""The interception engine: a ``TorchFunctionMode`` that names, filters and checks API calls.

Hot path (every torch call while the probe is active): one dict lookup to classify the callable,
one counter increment, one scope test; calls outside ``scope``/``list`` go straight to torch.
Inside ``__torch_function__`` torch has already popped the mode, so the calls an API makes
internally (``F.layer_norm`` -> ``torch.layer_norm``) and probekit's own re-runs are not seen;
``busy`` guards the paths where the mode may still be active (gradient hooks).
"""
from __future__ import annotations

import functools
import logging
import math
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

from ..log import Once, get_logger
from . import autocast, blocks, cause, handlers, perturb, state
from .backward import watch
from .budget import Budget, Coverage
from .deferred import OutMeta, Pending, Verdicts
from .guards import modes_off, no_autocast
from .metric import device_stats, floor_for
from .modes import MODES
from .names import PROPERTY, REASONS, Classifier, call_site, dynamic_skip, operator_key
from .preheat import Preheat

log = get_logger("probekit.freebench")

#: one INFO summary line every this many steps (the per-API lines appear once per run)
SUMMARY_EVERY = 100

EXTRA_REASONS = {
    "no_float_input": "unsupported input type (no floating-point tensor input)",
    "no_float_output": "the output holds no floating-point tensor",
    "no_grad": "no gradient flows through this call",
    "dtype_arg": "fix: the call fixes its output dtype explicitly",
    "meta": "meta tensors hold no values",
    "budget": "the overhead budget leaves this call to a later step (call sites rotate)",
}


def _reason_text(reason: str) -> str:
    return REASONS.get(reason) or EXTRA_REASONS.get(reason) or reason


class _Mode(TorchFunctionMode):
    def __init__(self, engine: "Engine") -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        e = self.engine
        try:
            info = e.cache.get(func)
        except TypeError:  # an unhashable callable
            info = None
        if info is None:
            info = e.classify(func)
        if info is PROPERTY or e.busy:
            return func(*args, **kwargs)
        e.calls += 1
        if not e.enabled:
            e.step_filtered += 1
            return func(*args, **kwargs)
        key = operator_key(info, sys._getframe(1)) if info.operators else info.key
        if e.selective:
            wanted = e.wanted.get(key)
            if wanted is None:
                wanted = e.want(key)
            if not wanted:
                e.out_of_scope += 1
                return func(*args, **kwargs)
        counts = e.counts
        n = counts.get(key, 0)
        counts[key] = n + 1
        if e.scope_ids and f"{key}.{n}" not in e.scope_ids:
            e.out_of_scope += 1
            return func(*args, **kwargs)
        if e.modules is not None and not e.modules.depth:  # module scope (modules.py)
            e.out_of_module += 1
            return func(*args, **kwargs)
        return e.handle(info, key, n, func, args, kwargs, sys._getframe(1))


class Engine:
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
        self.noise_mode = self.mode.noise
        classifier = Classifier()
        self.classify = classifier
        self.cache = classifier.cache
        # scope: exact names (stage suffix optional); list: substrings of the API key
        self.scope_ids = {self._strip_stage(s) for s in fb.scope}
        self.scope_keys = {s.rsplit(".", 1)[0] for s in self.scope_ids}
        self.api_list = tuple(fb.api_list)
        self.wanted: dict[str, bool] = {}
        self.selective = bool(self.scope_ids or self.api_list)
        self.preheat = Preheat(fb.preheat_step, fb.max_sample) if fb.if_preheat else None
        # state
        self.step = 0
        self.enabled = self._step_selected(0)
        self.busy = False
        self.in_optimizer = 0
        self.counts: dict[str, int] = {}
        self.handles: list = []
        self.once = Once()        # per run: perturbation applied / skip and cancel reasons, per API
        self.once_step = Once()   # per step: preheat sampling lines
        self.summary_every = SUMMARY_EVERY
        self._logged = (0, 0, 0)  # (step, checked, flagged) at the last summary line
        # summary counters
        self.calls = 0
        self.checked = 0
        self.flagged = 0
        self.out_of_scope = 0
        self.step_filtered = 0
        self.skipped: dict[str, int] = {}
        #: module scope (a ``modules.ModuleScope`` while attached, else None)
        self.modules = None
        self.out_of_module = 0
        self.verdicts = Verdicts()
        self.budget = Budget(fb.budget) if fb.budget is not None else None
        self.coverage = Coverage()
        self._thresholds: dict = {}           # (output dtype, input dtype) -> threshold
        self.site_causes: dict = {}           # call site -> {output_index: cause}
        self._uncaused: dict = {}             # call site -> its rows still without a cause

    # -- filters -------------------------------------------------------------------------------
    @staticmethod
    def _strip_stage(name: str) -> str:
        for suffix in (".forward", ".backward"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name

    def _step_selected(self, step: int) -> bool:
        return not self.config.step or step in self.config.step

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
        self.step += 1
        if self.summary_every and self.step % self.summary_every == 0:
            self.log_summary()
        self.enabled = self._step_selected(self.step)
        if self.preheat is not None and self.step == self.preheat.preheat_step:
            log.info("Free benchmark: preheat finished after %d step(s); APIs still checked: %s; "
                     "no longer checked (risk < %.2g of threshold): %s", self.step,
                     self.preheat.at_risk() or "none", 0.5, self.preheat.low_risk() or "none")

    def log_summary(self) -> None:
        """One INFO line: what the last steps checked and found (every ``summary_every`` steps)."""
        step0, checked0, flagged0 = self._logged
        self._logged = (self.step, self.checked, self.flagged)
        if log.isEnabledFor(logging.INFO):
            log.info("Free benchmark: steps %d-%d: %d call(s) checked, %d finding(s); %d step(s), "
                     "%d finding(s) in all", step0, self.step - 1, self.checked - checked0,
                     self.flagged - flagged0, self.step, self.flagged)

    def summary(self) -> dict:
        skipped = dict(self.skipped)
        if self.out_of_scope:
            skipped["out_of_scope"] = self.out_of_scope
        if self.step_filtered:
            skipped["step_filter"] = self.step_filtered
        if self.out_of_module:
            skipped["out_of_module"] = self.out_of_module
        out = {"calls": self.calls, "checked": self.checked, "skipped": skipped,
               "flagged": self.flagged, "steps": self.step}
        if self.verdicts.inconclusive:
            out["inconclusive"] = self.verdicts.inconclusive
        if self.budget is not None:
            out["coverage"] = self.coverage.share()
            out["budget_limit"] = self.budget.limit
        return out

    def remove_hooks(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()

    def stopped(self) -> None:
        """The session stopped intercepting: pending backward hooks removed, per-call state reset
        (an exception inside a check or an optimizer step may have left it set)."""
        self.remove_hooks()
        self.in_optimizer = 0
        self.busy = False

    # -- logging -------------------------------------------------------------------------------
    def note_skip(self, reason: str, key: str, name: str) -> None:
        """Count a call that is not checked and log why (once per API per run)."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if reason == "no_float_input":
            if self.once(("input", key)):
                log.warning("Free benchmark: unsupported input type for %s (no floating-point "
                            "tensor input).", name)
        elif reason != "preheat" and self.once((reason, key)):
            log.info("Free benchmark: For %s, %s. Cancel perturbation.", name, _reason_text(reason))

    def _skip(self, reason: str, key: str, name: str, func, args, kwargs):
        self.note_skip(reason, key, name)
        return func(*args, **kwargs)

    def cancelled(self, key: str, name: str, why: str) -> None:
        self.skipped["cancelled"] = self.skipped.get("cancelled", 0) + 1
        if self.once(("cancel", key)):
            log.info("Free benchmark: For %s, %s. Cancel perturbation.", name, why)

    def failed(self, key: str, name: str, exc: BaseException) -> None:
        self.skipped["error"] = self.skipped.get("error", 0) + 1
        if self.once(("error", key)):
            log.warning("Free benchmark: For %s, the check failed and was skipped (%s: %s).",
                        name, type(exc).__name__, exc)

    def applied(self, key: str, name: str) -> None:
        if self.once(("applied", key)) and log.isEnabledFor(logging.INFO):
            log.info("Free benchmark: Perturbation is %s of %s.", self.mode_name, name)

    # -- one in-scope call -----------------------------------------------------------------------
    def handle(self, info, key, n, func, args, kwargs, frame):
        name = f"{key}.{n}.{self.stage}"
        try:
            with modes_off():
                decision = self._decide(info, key, n, name, args, kwargs)
        except Exception as exc:  # probekit's own logic failed: run the call untouched
            self.failed(key, name, exc)
            return func(*args, **kwargs)
        if isinstance(decision, str):
            return self._skip(decision, key, name, func, args, kwargs)
        leaves, spec = decision
        call = perturb.Call(info, args, kwargs, self.fb.fuzz_device)
        if info.rule is not None:
            stateful = self._stateful(call, key, name, func, leaves)
            if stateful is not None:
                return stateful
        if self.fix:
            return self._fix(call, key, name, func, leaves, spec)
        self.coverage.seen(f"{key}.{n}")
        if self.budget is not None and not self.budget.admit():
            return self._skip("budget", key, name, func, args, kwargs)
        if self.stage == "backward":
            return watch(self, call, key, n, name, func, leaves, spec, frame)
        return self._check_forward(call, key, n, name, func, leaves, spec, frame)

    def _stateful(self, call, key, name, func, leaves):
        """For a call that writes state: snapshot it (check), or skip it (fix; backward of an
        in-place call). Returns the call's output when skipped, else None."""
        try:
            with modes_off():
                call.state = state.written(call.info, call.args, call.kwargs, leaves)
                if not call.state:
                    return None
                reason = None
                if self.fix:  # fix would drop the state update into an upcast copy
                    reason = "inplace" if state.writes_self(call.info) else "side_effect"
                elif self.stage == "backward" and state.writes_self(call.info):
                    reason = "inplace"
                if reason is None:
                    call.snap = state.snapshot(leaves, call.state)
        except Exception as exc:
            self.failed(key, name, exc)
            return func(*call.args, **call.kwargs)
        if reason is not None:
            return self._skip(reason, key, name, func, call.args, call.kwargs)
        return None

    def _decide(self, info, key, n, name, args, kwargs):
        """A skip reason, or the call's flattened arguments when it is to be checked."""
        reason = info.skip or dynamic_skip(info, args, kwargs)
        if reason is None and self.in_optimizer and not torch.is_grad_enabled():
            reason = "optimizer"
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
        return leaves, spec

    def _check_forward(self, call, key, n, name, func, leaves, spec, frame):
        out = func(*call.args, **call.kwargs)
        self.busy = True
        t0 = time.perf_counter() if self.budget is not None else 0.0
        try:
            with modes_off(), torch.no_grad(), no_autocast(self.upcast_mode):
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
        outs = handlers.float_outputs(out)
        if not outs:
            self.note_skip("no_float_output", key, name)
            return
        leaves = state.restore(leaves, call.snap)
        if self.noise_mode:
            leaves = autocast.noise_leaves(leaves, outs)
        base = leaves  # the inputs as the op computed with them (autocast casts included)
        rows = blocks.row_blocks(self.mode_name, call.info, leaves, outs)
        if rows is not None:
            return self._compare_blocks(call, key, n, name, func, leaves, spec, frame, outs, rows)
        pert = perturb.apply(self.mode_name, call, leaves, spec)
        self.applied(key, name)
        p_out = func(*pert.args, **pert.kwargs)
        p_outs = handlers.float_outputs(p_out)
        if len(p_outs) != len(outs) or any(a[0] != b[0] for a, b in zip(p_outs, outs)):
            raise RuntimeError("the perturbed call returned outputs of another structure")
        if pert.post is not None:
            p_outs = [(i, pert.post(t)) for i, t in p_outs]

        def explain(flagged):  # only for flagged calls: float64 re-runs
            return cause.analyse(func, lambda: state.restore(base, call.snap), spec, flagged)

        self.defer(key, n, name, self.stage, self.step, frame, pert.in_dtype,
                   [(i, o, p) for (i, o), (_, p) in zip(outs, p_outs)], explain=explain)

    def current_module(self) -> str:
        """The innermost running named module under module scope ("" without module scope)."""
        return self.modules.current if self.modules is not None else ""

    def _compare_blocks(self, call, key, n, name, func, leaves, spec, frame, outs, rows) -> None:
        """An element-wise call on a large input: perturbed, re-run and compared block by block
        of rows, so only one block's upcast input and output exist at a time."""
        (i, o), = outs
        exact = self.verdicts.want_exact((self.stage, key, n))
        f = floor_for(o.dtype)
        parts, in_dtype = [], None
        for start, length in rows:
            b_leaves = blocks.narrow_leaves(leaves, start, length)
            b_args, b_kwargs = perturb.unflatten(b_leaves, spec)
            pert = perturb.apply(self.mode_name, perturb.Call(call.info, b_args, b_kwargs,
                                                               call.fuzz_device), b_leaves, spec)
            in_dtype = pert.in_dtype
            p = func(*pert.args, **pert.kwargs)
            parts.append(device_stats(o.narrow(0, start, length), p, f, exact))
            del pert, p  # free this block's re-run before the next one
        self.applied(key, name)
        self.site_causes.setdefault((self.stage, key, n), {})   # no cause analysis in blocks
        self.defer(key, n, name, self.stage, self.step, frame, in_dtype, [(i, o, None)],
                   values=[blocks.combine(parts, exact)], exact=exact, floors=[f])

    def defer(self, key, n, name, stage, step, frame_or_site, in_dtype, triples, values=None,
              exact=None, module=None, explain=None, floors=None, originals=None) -> None:
        """Compare ``(output_index, original, perturbed)`` on the device; the verdict is read
        back at the next gather (``gather``), nothing here waits for the device.

        ``values``: comparisons already made (blocked re-runs), one per triple. ``module``: the
        innermost scoped module of the call (default: the one running now). ``floors`` and
        ``originals``: the metric's floor and the tensor a row describes (dtype, shape; what
        ``explain`` is given), per triple, when the compared tensors are not the original ones
        (the backward stage compares gradients scaled to unit size). ``explain``: the call's cause analysis (``cause.py``); it needs the
        call's inputs, so a check that can be explained — a call site's exact checks: its first,
        and the next one after it was flagged with no cause known — is judged at once (one
        read-back) and explained while the inputs exist; every other check waits for the
        gather and takes the cause already found for its site."""
        site = (stage, key, n)
        if exact is None:
            exact = self.verdicts.want_exact(site)
        if floors is None:
            floors = [floor_for(o.dtype) for _, o, _ in triples]
        if originals is None:
            originals = [o for _, o, _ in triples]
        if values is None:
            values = [device_stats(o, p, f, exact) for (_, o, p), f in zip(triples, floors)]
        outputs = [(i, o.dtype, tuple(o.shape), f) for (i, _, _), o, f in
                   zip(triples, originals, floors)]
        if not isinstance(frame_or_site, str):
            frame_or_site = call_site(frame_or_site)
        self.checked += 1
        self.coverage.check(f"{key}.{n}")
        module = self.current_module() if module is None else module
        entry = Pending(site, key, name, stage, step, frame_or_site, in_dtype, outputs, values,
                        module)
        if not (exact and explain is not None and not self.mode.exact):
            self.verdicts.add(entry, exact)
            return
        with torch.no_grad():
            stats = self.verdicts.judge_now(entry)
        if stats is not None:
            items = [(i, o, st) for (i, _, _), o, st in zip(triples, originals, stats)]
            if self.record(key, name, items, in_dtype, frame_or_site, stage=stage, step=step,
                           module=module, explain=explain, site=site):
                self.verdicts.flagged_sites.add(site)

    def gather(self) -> None:
        """Read back every pending verdict (one transfer per device) and record the findings."""
        with modes_off(), torch.no_grad():  # invisible to every function mode, as the checks are
            done = self.verdicts.gather()
        rows: list = []
        for e, stats in done:
            items = [(i, OutMeta(dt, shape), st) for (i, dt, shape, _), st in zip(e.outputs, stats)]
            if self.record(e.key, e.name, items, e.in_dtype, e.call_site, stage=e.stage,
                           step=e.step, out=rows, module=e.module, site=e.site):
                self.verdicts.flagged_sites.add(e.site)
        if rows:
            self.emit(rows)  # one CSV append per gather

    def record(self, key, name, items, in_dtype, frame_or_site, stage=None, step=None,
               out=None, module=None, explain=None, site=None) -> bool:
        """Judge ``(output_index, original_tensor_or_OutMeta, Stats)`` items; emit rows for the
        findings (or append them to ``out``); True when there were any. ``explain(flagged)`` ->
        ``{output_index: cause}`` is asked only when a row is emitted (``_causes``)."""
        step = self.step if step is None else step
        module = self.current_module() if module is None else module
        rows = []
        flagged = []
        worst = 0.0
        for index, o, st in items:
            tkey = (o.dtype, in_dtype)
            thr = self._thresholds.get(tkey)
            if thr is None:
                thr = self._thresholds[tkey] = handlers.threshold(self.fb, self.mode_name,
                                                                  o.dtype, in_dtype)
            worst = max(worst, handlers.risk(st, thr))
            kind = handlers.judge(st, thr)
            if kind is None:
                continue
            flagged.append((index, o, thr))
            if not isinstance(frame_or_site, str):
                frame_or_site = call_site(frame_or_site)
            rows.append({
                "rank": self.rank, "pert_mode": self.mode_name, "stage": stage or self.stage,
                "step": step, "api_name": name, "max_rel": float(st.max_rel),
                "dtype": str(o.dtype), "shape": str(tuple(o.shape)), "output_index": int(index),
                "kind": kind, "max_abs": float(st.max_abs), "threshold": float(thr),
                "ratio": float(handlers.ratio(st.max_rel, thr)), "call_site": frame_or_site,
                "module": module,
                "cause": "",
            })
        if self.preheat is not None and self.preheat.in_preheat(step):
            self.preheat.record(key, worst if not math.isnan(worst) else math.inf)
        if rows:
            self._causes(rows, flagged, explain, name, site)
            self.flagged += len(rows)
            if out is None:
                self.emit(rows)
            else:
                out.extend(rows)
        return bool(rows)

    def _causes(self, rows, flagged, explain, name, site=None) -> None:
        """Fill the ``cause`` of each row (see ``cause.py``); "" when it cannot be worked out.

        Without ``explain`` (a deferred verdict: the inputs are gone) a row takes the cause
        found for its call site; a site flagged with no cause known is compared exactly, and so
        explained, the next time it runs, and its earlier rows get that cause in ``results``
        (the CSV keeps the rows as they were written)."""
        if self.mode.exact:
            causes = {i: cause.NONDETERMINISTIC for i, _, _ in flagged}
        elif explain is not None:
            try:
                causes = explain(flagged)
            except Exception as exc:  # the finding stands; only its cause is unknown
                if self.once(("cause", name.rsplit(".", 2)[0])):
                    log.info("Free benchmark: no cause for %s (%s: %s).", name,
                             type(exc).__name__, exc)
                causes = {}
            if site is not None:
                self.site_causes[site] = causes
                for row in self._uncaused.pop(site, ()):
                    row["cause"] = causes.get(row["output_index"], "")
        else:
            causes = self.site_causes.get(site) if site is not None else None
            if causes is None:
                if site is not None:
                    self.verdicts.recheck.add(site)      # explained at its next run
                    self._uncaused.setdefault(site, []).extend(rows)
                return
        for row in rows:
            row["cause"] = causes.get(row["output_index"], "")

    def _fix(self, call, key, name, func, leaves, spec):
        if any(isinstance(x, torch.dtype) for x in leaves):
            return self._skip("dtype_arg", key, name, func, call.args, call.kwargs)
        self.busy = True
        try:
            with modes_off():
                pert = perturb.apply(self.mode_name, call, leaves, spec)
                self.applied(key, name)
                with no_autocast(True):
                    p_out = func(*pert.args, **pert.kwargs)
                floats = [x for x in leaves if perturb.is_float(x)]
                back = functools.reduce(torch.promote_types, [x.dtype for x in floats])
                # under autocast the caller sees the op's autocast dtype (bf16 linear...)
                back = autocast.fix_dtype(func, call.args, call.kwargs, leaves) or back
                out = handlers.cast_back(p_out, pert.in_dtype, back, floats[0].device)
            self.checked += 1
            return out
        except perturb.Cancel as exc:
            self.cancelled(key, name, str(exc))
        except Exception as exc:
            self.failed(key, name, exc)
        finally:
            self.busy = False
        return func(*call.args, **call.kwargs)

    # -- optimizer steps (global hooks, removed on stop) ----------------------------------------
    def optimizer_pre(self, *_):
        self.in_optimizer += 1

    def optimizer_post(self, *_):
        self.in_optimizer = max(0, self.in_optimizer - 1)


def make_mode(engine: Engine) -> TorchFunctionMode:
    return _Mode(engine)
