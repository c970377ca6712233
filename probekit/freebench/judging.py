"""From a compared call to findings: the engine's judging part (``Engine`` inherits it).

``defer`` leaves a comparison on the device (``deferred.py``) or, for a call site's exact checks,
judges it at once so a finding can be explained while the call's inputs exist; ``gather`` reads
the pending verdicts back once per step; ``record`` turns findings into rows (thresholds per
(output dtype, input dtype), preheat calibration, the ``module`` and ``cause`` columns); ``_causes``
explains them (``cause.py``) or gives a deferred row the cause found for its call site.

Uses these attributes of the engine: ``fb``, ``mode``, ``mode_name``, ``stage``, ``step``,
``rank``, ``preheat``, ``verdicts``, ``coverage``, ``checked``, ``flagged``, ``emit``, ``once``,
``site_causes``, ``_uncaused``, ``_thresholds``, and its ``current_module()``.
"""
from __future__ import annotations

import math

import torch

from ..log import get_logger
from . import cause, handlers
from .deferred import OutMeta, Pending
from .guards import modes_off
from .metric import device_stats, floor_for
from .names import call_site

log = get_logger("probekit.freebench")


class Judging:
    def defer(self, key, n, name, stage, step, frame_or_site, in_dtype, triples, values=None,
              exact=None, module=None, explain=None, floors=None, originals=None) -> None:
        """Compare ``(output_index, original, perturbed)`` on the device; the verdict is read
        back at the next gather (``gather``), nothing here waits for the device.

        ``values``: comparisons already made (blocked re-runs), one per triple. ``module``: the
        innermost scoped module of the call (default: the one running now). ``floors`` and
        ``originals``: the metric's floor and the tensor a row describes (dtype, shape; what
        ``explain`` is given), per triple, when the compared tensors are not the original ones
        (the backward stage compares gradients scaled to unit size). ``explain``: the call's
        cause analysis (``cause.py``); it needs the call's inputs, so an exact check of a site
        whose cause is not known yet (its first, and the next one after it was flagged with no
        cause known) is judged at once (one read-back) and explained while the inputs exist;
        every other check waits for the gather and takes the cause found for its site (a site is
        analysed once: the float64 re-runs cost more than the check)."""
        site = (stage, key, n)
        if exact is None:
            exact = self.verdicts.want_exact(site)
        if floors is None:
            floors = [floor_for(o.dtype) for _, o, _ in triples]
        if originals is None:
            originals = [o for _, o, _ in triples]
        if values is None:
            values = [device_stats(o, p, f, exact) for (_, o, p), f in zip(triples, floors)]
        outputs = [(i, o.dtype, tuple(o.shape), f, self.threshold_of(o.dtype, in_dtype))
                   for (i, _, _), o, f in zip(triples, originals, floors)]
        if not isinstance(frame_or_site, str):
            frame_or_site = call_site(frame_or_site)
        self.checked += 1
        self.coverage.check((key, n))
        if module is None:
            module = self.modules.current if self.modules is not None else ""
        entry = Pending(site, key, name, stage, step, frame_or_site, in_dtype, outputs, values,
                        module)
        if not exact or explain is None or self.mode.exact or site in self.site_causes:
            self.verdicts.add(entry, exact)   # judged at the gather (no cause analysis needed)
            return
        with torch.no_grad():
            stats = self.verdicts.judge_now(entry)
        if stats is not None:
            items = [(i, o, st) for (i, _, _), o, st in zip(triples, originals, stats)]
            if self.record(key, name, items, in_dtype, frame_or_site, stage=stage, step=step,
                           module=module, explain=explain, site=site):
                self.verdicts.flagged_sites.add(site)

    def threshold_of(self, out_dtype, in_dtype) -> float:
        """The threshold of an output dtype for inputs of ``in_dtype`` (``handlers.threshold``,
        cached per pair)."""
        thr = self._thresholds.get((out_dtype, in_dtype))
        if thr is None:
            thr = self._thresholds[(out_dtype, in_dtype)] = handlers.threshold(
                self.fb, self.mode_name, out_dtype, in_dtype)
        return thr

    def gather(self) -> None:
        """Read back every pending verdict (one transfer per device) and record the findings."""
        with modes_off(), torch.no_grad():  # invisible to every function mode, as the checks are
            # preheat calibrates on every verdict; otherwise only findings are turned into rows
            done = self.verdicts.gather(full=self.preheat is not None)
        rows: list = []
        for e, stats in done:
            items = [(i, OutMeta(dt, shape), st)
                     for (i, dt, shape, _, _), st in zip(e.outputs, stats)]
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
            thr = self.threshold_of(o.dtype, in_dtype)
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
