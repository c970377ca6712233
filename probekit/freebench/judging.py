"""From a compared call to findings and hot spots: the engine's judging part (``Engine`` inherits
it).

``defer`` leaves a comparison on the device (``deferred.py``) or, for a call site's exact checks,
judges it at once so a finding can be explained while the call's inputs exist; ``gather`` reads
the pending verdicts back once per step; ``record`` turns them into rows (thresholds per mode and
compute dtype, ``scales.py``; preheat calibration; the ``module`` and ``cause`` columns).

A compared output above its threshold is a **finding** (a row of ``fb.results`` and the CSV) when
the measurement alone shows a defect or a loss of most significant bits: a NaN/Inf mismatch; a
no_change difference; a sensitivity mode (the output lost more than half its bits under a
one-ulp input change); an accuracy mode judged against a per-element scale (``sum |a||b|``: no
correct kernel exceeds it); an accuracy mode whose error exceeds ``sqrt(u)`` of the output's
scale. The remaining case -- an accuracy-mode error between ``16 u`` and ``sqrt(u)`` of the
output tensor's scale -- is a finding only when the float64 analysis (``cause.py``) calls the
kernel ``inaccurate``; when the inputs' own conditioning explains it, it is a **hot spot**
(``fb.hotspots``: what the dtype predicts, never in the results or the CSV), as is a sensitivity
check that moved by more than ``16 u`` but kept most of its bits.

Causes: a call site is analysed once, at its first flagged exact check (while its inputs exist).
A row of a site flagged first by a deferred verdict takes a provisional cause (``inaccurate`` for
the accuracy modes, ``ill-conditioned`` for the sensitivity modes: what the measurement shows)
and the site is analysed at its next run, which refines the cause in ``fb.results`` (the CSV
keeps the row as written); a row that needs the analysis to be a finding at all waits in
``fb.hotspots`` with cause ``pending`` until then (logged once per API).

Uses these attributes of the engine: ``fb``, ``mode``, ``mode_name``, ``stage``, ``step``,
``rank``, ``preheat``, ``verdicts``, ``coverage``, ``checked``, ``flagged``, ``emit``, ``once``,
``site_causes``, ``_uncaused``, ``_held``, ``_hot``, ``_thresholds``, ``_judged``, and its
``current_module()``.
"""
from __future__ import annotations

import math

import torch

from ..log import get_logger
from . import cause, handlers, scales
from .deferred import OutMeta, Pending
from .guards import modes_off
from .names import call_site
from .scales import TENSOR

log = get_logger("probekit.freebench")

PENDING = "pending"


class Judging:
    def defer(self, key, n, name, stage, step, frame_or_site, in_dtype, triples, values=None,
              exact=None, module=None, explain=None, kinds=None, scales_=None, originals=None,
              compute=None) -> None:
        """Compare ``(output_index, original, perturbed)`` on the device; the verdict is read
        back at the next gather (``gather``), nothing here waits for the device.

        ``values``: comparisons already made (blocked re-runs), one per triple. ``kinds``: the
        scale kind of each (``scales.py``; default tensor) and ``scales_`` its per-element scale
        tensor (None: the tensor's own). ``compute``: the dtype each compared tensor was computed
        in (default: its own; the backward stage passes the forward call's). ``module``: the
        innermost scoped module of the call (default: the one running now). ``originals``: the
        tensor a row describes, per triple, when the compared tensors are not the original ones.
        ``explain``: the call's cause analysis (``cause.py``); it needs the call's inputs, so an
        exact check of a site whose cause is not known yet is judged at once (one read-back) and
        explained while the inputs exist; every other check waits for the gather."""
        site = (stage, key, n)
        if exact is None:
            exact = self.verdicts.want_exact(site)
        if originals is None:
            originals = [o for _, o, _ in triples]
        if kinds is None:
            kinds = [TENSOR] * len(triples)
        if scales_ is None:
            scales_ = [None] * len(triples)
        if compute is None:
            compute = [o.dtype for o in originals]
        if values is None:
            values = [self.verdicts.stats(o, p, s, exact) for (_, o, p), s in
                      zip(triples, scales_)]
        outputs = []
        for (i, _, _), o, kind, cdt in zip(triples, originals, kinds, compute):
            cdt = self.judged_dtype(cdt, o.dtype, in_dtype)
            thr = self.threshold_of(cdt)
            outputs.append((i, o.dtype, tuple(o.shape), kind, thr,
                            scales.hot_level(self.mode_name, cdt, thr), cdt))
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
        if stats is None:
            return
        items = [(i, o, st, out) for (i, _, _), o, st, out in zip(triples, originals, stats,
                                                                  outputs)]
        if self.record(key, name, items, frame_or_site, stage=stage, step=step, module=module,
                       explain=explain, site=site):
            self.verdicts.flagged_sites.add(site)
        elif site in self._held and site not in self.site_causes:
            # a clean run of a site with rows waiting for their cause: explain them now
            held = {r["output_index"] for r in self._held[site]}
            self._explain(site, name, explain,
                          [(i, o, out) for i, o, _, out in items if i in held])

    def judged_dtype(self, compute_dtype, tensor_dtype, in_dtype):
        """``scales.effective_dtype`` for this mode (cached)."""
        key = (compute_dtype, tensor_dtype, in_dtype)
        d = self._judged.get(key)
        if d is None:
            d = self._judged[key] = scales.effective_dtype(self.mode_name, compute_dtype,
                                                           tensor_dtype, in_dtype)
        return d

    def threshold_of(self, compute_dtype) -> float:
        """The threshold of this mode for a call computing in ``compute_dtype`` (cached)."""
        thr = self._thresholds.get(compute_dtype)
        if thr is None:
            thr = self._thresholds[compute_dtype] = handlers.threshold(
                self.fb, self.mode_name, compute_dtype)
        return thr

    def gather(self) -> None:
        """Read back every pending verdict (one transfer per device) and record the findings."""
        with modes_off(), torch.no_grad():  # invisible to every function mode, as the checks are
            # preheat calibrates on every verdict; otherwise only findings are turned into rows
            done = self.verdicts.gather(full=self.preheat is not None)
        rows: list = []
        for e, stats in done:
            items = [(out[0], OutMeta(out[1], out[2]), st, out)
                     for out, st in zip(e.outputs, stats)]
            if self.record(e.key, e.name, items, e.call_site, stage=e.stage, step=e.step,
                           out=rows, module=e.module, site=e.site):
                self.verdicts.flagged_sites.add(e.site)
        if rows:
            self.emit(rows)  # one CSV append per gather

    def _decisive(self, kind_found, st, out) -> bool:
        """Is a flagged output a finding by its measurement alone (module doc)?"""
        _, _, _, kind, _, _, cdt = out
        return (kind_found == "nan_inf" or self.mode.exact or not self.mode.upcast
                or kind != TENSOR or st.max_rel > scales.lost_bits_level(cdt))

    def record(self, key, name, items, frame_or_site, stage=None, step=None, out=None,
               module=None, explain=None, site=None) -> bool:
        """Judge ``(output_index, original tensor or OutMeta, Stats, output descriptor)`` items;
        emit rows for the findings (or append them to ``out``), keep the hot spots; True when
        there were findings. ``explain(items)`` -> ``{output_index: cause}`` is asked only when
        an output is flagged (``_explain``)."""
        step = self.step if step is None else step
        module = self.current_module() if module is None else module
        if not isinstance(frame_or_site, str):
            frame_or_site = call_site(frame_or_site)
        flagged, hot = [], []
        worst = 0.0
        for index, o, st, desc in items:
            thr = desc[4]
            worst = max(worst, handlers.risk(st, thr))
            kind = handlers.judge(st, thr)
            if kind is None:
                if st.max_rel > desc[5]:
                    hot.append(self._row(name, stage, step, index, o, st, thr, "rel_error",
                                         frame_or_site, module, cause.ILL_CONDITIONED))
                continue
            row = self._row(name, stage, step, index, o, st, thr, kind, frame_or_site, module, "")
            flagged.append((index, o, desc, row, self._decisive(kind, st, desc)))
        if self.preheat is not None and self.preheat.in_preheat(step):
            self.preheat.record(key, worst if not math.isnan(worst) else math.inf)
        for row in hot:
            self._hotspot(row)
        if not flagged:
            return False
        causes = self._causes_for(site, name, explain, flagged)
        rows = []
        for index, o, desc, row, decisive in flagged:
            if causes is None:          # not known yet: provisional, or wait for the analysis
                if decisive:
                    row["cause"] = self._provisional(row)
                    self._uncaused.setdefault(site, []).append(row)
                    rows.append(row)
                else:
                    row["cause"] = PENDING
                    self._held.setdefault(site, []).append(row)
                    if self.once(("pending", key)):
                        log.info("Free benchmark: %s was flagged before its cause was known; it is "
                                 "explained at the call's next run (until then listed in "
                                 "fb.hotspots as 'pending').", name)
                continue
            row["cause"] = causes.get(index) or self._provisional(row)
            if decisive or row["cause"] == cause.INACCURATE:
                rows.append(row)
            else:
                self._hotspot(row)
        if not rows:
            return False
        self.flagged += len(rows)
        if out is None:
            self.emit(rows)
        else:
            out.extend(rows)
        return True

    def _row(self, name, stage, step, index, o, st, thr, kind, site, module, why) -> dict:
        return {
            "rank": self.rank, "pert_mode": self.mode_name, "stage": stage or self.stage,
            "step": step, "api_name": name, "max_rel": float(st.max_rel),
            "dtype": str(o.dtype), "shape": str(tuple(o.shape)), "output_index": int(index),
            "kind": kind, "max_abs": float(st.max_abs), "threshold": float(thr),
            "ratio": float(handlers.ratio(st.max_rel, thr)), "call_site": site,
            "module": module, "cause": why,
        }

    def _provisional(self, row) -> str:
        """What the measurement itself shows, before (or without) the float64 analysis."""
        if self.mode.exact:
            return cause.NONDETERMINISTIC
        return cause.INACCURATE if self.mode.upcast else cause.ILL_CONDITIONED

    def _causes_for(self, site, name, explain, flagged):
        """``{output_index: cause}`` for a flagged call, or None when it cannot be known now (a
        deferred verdict of a site never analysed: the site is re-checked exactly and explained
        at its next run)."""
        if self.mode.exact:
            return {index: cause.NONDETERMINISTIC for index, _, _, _, _ in flagged}
        if explain is not None:
            return self._explain(site, name, explain,
                                 [(index, o, desc) for index, o, desc, _, _ in flagged])
        causes = self.site_causes.get(site) if site is not None else None
        if causes is None and site is not None:
            self.verdicts.recheck.add(site)      # explained at its next run
        return causes

    def _explain(self, site, name, explain, items) -> dict:
        """Run the cause analysis once for a site; refine its provisional rows and settle the
        rows waiting for it (findings or hot spots)."""
        try:
            causes = explain(items)
        except Exception as exc:  # the finding stands; the provisional cause is kept
            if self.once(("cause", name.rsplit(".", 2)[0])):
                log.info("Free benchmark: no cause for %s (%s: %s); the rows keep the cause "
                         "the measurement shows.", name, type(exc).__name__, exc)
            causes = {}
        if site is None:
            return causes
        self.site_causes[site] = causes
        for row in self._uncaused.pop(site, ()):
            row["cause"] = causes.get(row["output_index"]) or row["cause"]
        settled = []
        for row in self._held.pop(site, ()):
            row["cause"] = causes.get(row["output_index"]) or cause.UNCONFIRMED
            if row["cause"] == cause.INACCURATE:
                settled.append(row)
            else:
                self._hotspot(row)
        if settled:
            self.flagged += len(settled)
            self.emit(settled)
        return causes

    def _hotspot(self, row) -> None:
        """Keep a hot spot, one entry per call site and output (worst row kept, counted)."""
        k = (row["stage"], row["api_name"], row["output_index"])
        have = self._hot.get(k)
        if have is None:
            self._hot[k] = dict(row, count=1)
            return
        count = have["count"] + 1
        if row["ratio"] > have["ratio"]:
            have.update(row)
        have["count"] = count
