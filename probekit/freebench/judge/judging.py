"""From a compared call to findings and hot spots: the engine's judging part (``Engine`` inherits
it).

``defer`` leaves a comparison on the device (``deferred.py``) or, for a call site's exact checks,
judges it at once so a finding can be explained while the call's inputs exist; ``gather`` reads
the pending verdicts back once per step; ``record`` turns them into rows (thresholds per mode and
compute dtype, ``scales.py``; preheat calibration; the ``module`` and ``cause`` columns).

A compared output above its threshold (``scales.py``'s error model: ``c (u_out |p| + gamma_k
S)`` per element in the accuracy modes, ``sqrt(u)`` of the tensor's scale in the sensitivity
modes, a screen: their analysis counts the lost bits against the call's ``S``) is **flagged**. It is a **finding** (a row of ``fb.results`` and the CSV) when the float64
analysis (``cause.py``) confirms it: cause ``inaccurate`` (the kernel's error exceeds the bound
and what one-ulp input nudges explain), or, in the sensitivity modes, ``ill-conditioned`` (the
exact result moves by more than half its bits). A NaN/Inf mismatch and a no_change difference
need no confirmation. A flagged output the analysis does not confirm is a **hot spot**
(``fb.hotspots``: never in the results or the CSV), as is a sensitivity check that moved by more
than a correct kernel's rounding but kept most of its bits.

Causes: a call site's output is analysed once, at its first flagged check while the call's
inputs exist; its later flags take that cause (an output of the site flagged later for the first
time is analysed then: issue 34, defect B). On the CPU every check of a site not analysed yet is judged as
it is made -- an exact check read back at once, a fast one read on the host by its bits
(``deferred.host_errors``: no transfer, no ATen operator) -- so a flag is explained in its own
call and none waits. On an accelerator a fast verdict is read at the gather, after the inputs are
gone: a row of a site flagged first that way waits in ``fb.hotspots`` with cause ``pending``
until the site's next run, which is compared exactly and analysed (logged once per API); at
``stop()`` and exit (``settle``) the rows still waiting take the cause ``unexplained``, counted
in ``summary["unexplained"]`` (never left pending; still explained if the site runs again under
the probe). A NaN/Inf row of such a site is reported at once with the cause the measurement
shows (``inaccurate`` in the accuracy modes, ``ill-conditioned`` in the sensitivity modes),
refined in ``fb.results`` by the analysis (the CSV keeps the row as written).

Uses these attributes of the engine: ``fb``, ``mode``, ``mode_name``, ``stage``, ``step``,
``rank``, ``preheat``, ``verdicts``, ``coverage``, ``checked``, ``flagged``, ``emit``, ``once``,
``site_causes``, ``_uncaused``, ``_held``, ``_unexplained``, ``_hot``, ``_thresholds``,
``_judged``, and its ``current_module()``.
"""
from __future__ import annotations

import math

import torch

from ...log import get_logger
from . import cause, handlers, scales
from ..perturb import perturb
from .deferred import OutMeta, Pending, host_errors
from .metric import EXACT
from .guards import modes_off
from ..names import call_site
from .scales import TENSOR

log = get_logger("probekit.freebench")

PENDING = "pending"
#: the cause of a flag whose analysis could not run: its verdict was read back after the call's
#: inputs were gone (an accelerator's deferred verdict) and the call site did not run again
#: before ``stop()`` (``Judging.settle``)
UNEXPLAINED = "unexplained"


def magnitude_inputs(base, p_leaves, device) -> list:
    """The inputs ``S`` (the call on absolute values) is computed from: the call's own, in the
    dtype it computed in (``base``), rather than the re-run's upcast ones. ``S`` is a magnitude:
    its rounding in the call's dtype (a kernel accumulating as the call did) moves the bound by
    about one unit of that dtype, while the upcast re-run of a matmul costs 4-15x the call in
    float32 on a CPU with fast bfloat16 and far more in float64 (issue 38). float16 inputs keep
    the re-run's (its range cannot hold ``S`` where the output cancels), and so do inputs on
    another device than the re-run's (``to_cpu``)."""
    if base is None:
        return p_leaves
    for x in base:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and \
                (x.dtype == torch.float16 or x.device != device):
            return p_leaves
    return base


def count_scale(j, p, Q, K):
    """The per-element bound of a counted call (``scales.COUNTED``) over ``C``:
    ``u_out |p| + K u_acc (|p| / 2 + beta sqrt(Q))`` (in place on ``Q``)."""
    pa = p.abs()
    b = Q.clamp_min_(0).sqrt_().mul_(scales.DATA_BETA).add_(pa, alpha=0.5)
    return b.mul_(K).mul_(j.u_acc).add_(pa, alpha=j.u_out)


class Judging:
    def defer(self, key, n, name, stage, step, frame_or_site, in_dtype, triples, values=None,
              exact=None, module=None, explain=None, plan=None, scales_=None, originals=None,
              compute=None, operands=None) -> None:
        """Compare ``(output_index, original, perturbed)`` on the device; the verdict is read
        back at the next gather (``gather``), nothing here waits for the device.

        ``values``: comparisons already made (blocked re-runs), one per triple. ``plan``: the
        error-model family and reduction length ``(family, k, formula_ok)`` of each (``scales.py``;
        default: judged against the tensor's scale) and ``scales_`` its per-element scale tensor
        (None: the tensor's own), made for the ``Judge`` that ``judge_of`` gives. ``compute``: the dtype each compared tensor was computed
        in (default: its own; the backward stage passes the forward call's). ``module``: the
        innermost scoped module of the call (default: the one running now). ``originals``: the
        tensor a row describes, per triple, when the compared tensors are not the original ones.
        ``explain``: the call's cause analysis (``cause.py``); it needs the call's inputs, so an
        exact check of a site whose cause is not known yet is judged at once (one read-back) and
        explained while the inputs exist; every other check waits for the gather. ``operands``:
        an element-wise call's inputs (``metric.stand_in_operands``, per triple or None): an
        original +-Inf that a same-signed +-max operand stands for is no mismatch."""
        site = self.site_of(stage, key, n)
        if exact is None:
            exact = self.verdicts.want_exact(site)
        if originals is None:
            originals = [o for _, o, _ in triples]
        if plan is None:
            plan = [("other", scales.TENSOR_MIN_K, True)] * len(triples)
        given = values is not None     # compared by the caller with each Judge's own scale
        if scales_ is None:
            scales_ = [None] * len(triples)
        if compute is None:
            compute = [o.dtype for o in originals]
        if values is None:
            if operands is None:
                operands = [None] * len(triples)
            values = [self.verdicts.stats(o, p, s, exact, operands=ops, note=True)
                      for (_, o, p), s, ops in zip(triples, scales_, operands)]
        outputs = []
        for (i, _, _), o, (fam, k, formula_ok), cdt, sc in zip(triples, originals, plan, compute,
                                                             scales_):
            j = self.judge_of(fam, k, cdt, o.dtype, in_dtype, stage, formula_ok)
            if sc is None and j.kind != TENSOR and not given:   # no scale: the tensor's own
                j = self.judge_of("other", k, cdt, o.dtype, in_dtype, stage, False)
            outputs.append((i, o.dtype, tuple(o.shape), j.kind, j.thr, j.hot,
                            self.judged_dtype(cdt, o.dtype, in_dtype), j))
        if not isinstance(frame_or_site, str):
            frame_or_site = call_site(frame_or_site)
        self.checked += 1
        self.coverage.check((key, n))
        if module is None:
            module = self.modules.current if self.modules is not None else ""
        entry = Pending(site, key, name, stage, step, frame_or_site, in_dtype, outputs, values,
                        module)
        # a fast comparison found inconclusive as it was made (the CPU: deferred.py) was redone
        # exactly while the inputs exist: judged and, when flagged, explained now like an exact
        # check, rather than waiting in fb.hotspots for the site's next run
        redone = not exact and any(len(v) >= EXACT for v in values)
        # a site is analysed per output: one whose compared outputs were not all analysed yet
        # (a later flag of another output of the same site, issue 34 defect B) is explained
        # while its inputs exist, like a site never analysed
        unexplained = explain is not None and not self.mode.exact and \
            not self._analysed(site, outputs)
        # a fast verdict of a site never analysed, flagged: on the CPU its values are host
        # memory, read as they are computed (no transfer); judged and explained now, while the
        # inputs exist, rather than waiting for a next run of the site that may never come
        flagged_now = unexplained and not (exact or redone) and self._flagged_now(values,
                                                                                 outputs)
        if not (exact or redone or flagged_now) or not unexplained:
            self.verdicts.add(entry, exact)   # judged at the gather (no cause analysis needed)
            return
        if redone:
            self.verdicts.unstable.add(site)   # exact from its next run on (deferred.py)
        with torch.no_grad():
            stats = self.verdicts.judge_now(entry)
        if stats is None:
            return
        items = [(i, o, st, out) for (i, _, _), o, st, out in zip(triples, originals, stats,
                                                                  outputs)]
        if self.record(key, name, items, frame_or_site, stage=stage, step=step, module=module,
                       explain=explain, site=site):
            self.verdicts.flagged_sites.add(site)
        elif (site in self._held or site in self._unexplained) and \
                not self._analysed(site, outputs):
            # a clean run of a site with rows waiting for their cause: explain them now
            held = {r["output_index"] for r in
                    self._held.get(site, []) + self._unexplained.get(site, [])}
            self._explain(site, name, explain,
                          [(i, o, out) for i, o, _, out in items if i in held])

    def _analysed(self, site, outputs) -> bool:
        """Has every compared output of this check (its descriptors) a cause at ``site``?"""
        known = self.site_causes.get(site)
        return known is not None and all(desc[0] in known for desc in outputs)

    @staticmethod
    def _flagged_now(values, outputs) -> bool:
        """Is a fast comparison above an output's threshold, read on the host now
        (``deferred.host_errors``: the CPU)? False when it is not, or cannot be read now (an
        accelerator: judged at the gather)."""
        errors = host_errors(values)
        return errors is not None and any(err is not None and err > desc[4]
                                          for err, desc in zip(errors, outputs))

    def set_mode(self, name: str) -> None:
        """Run ``name``'s perturbation from now on (a combined mode's schedule, one mode per
        step: ``Engine.next_step``, after the step's verdicts were gathered)."""
        from ..perturb.modes import MODES

        self.mode_name, self.mode = name, MODES[name]
        self.upcast_mode = self.mode.upcast
        self.step_skip = not (self.mode.upcast or self.mode.exact)

    def site_of(self, stage, key, n) -> tuple:
        """A call site's identity for its verdicts and cause (``deferred.py``): ``(stage, API,
        counter)``, and the mode under a combined mode (each mode explains its own findings)."""
        return (stage, key, n, self.mode_name) if self.schedule else (stage, key, n)

    def judged_dtype(self, compute_dtype, tensor_dtype, in_dtype):
        """``scales.effective_dtype`` for this mode (cached)."""
        key = (self.mode_name, compute_dtype, tensor_dtype, in_dtype)
        d = self._judged.get(key)
        if d is None:
            d = self._judged[key] = scales.effective_dtype(self.mode_name, compute_dtype,
                                                           tensor_dtype, in_dtype)
        return d

    def judge_of(self, fam, k, compute_dtype, tensor_dtype=None, in_dtype=None,
                 stage="forward", formula_ok=True) -> scales.Judge:
        """How an output of family ``fam`` and reduction length ``k`` is judged in this mode
        (``scales.judge``, with the configured threshold of its dtype; cached)."""
        key = (self.mode_name, fam, k, compute_dtype, tensor_dtype, in_dtype, stage, formula_ok)
        j = self._thresholds.get(key)
        if j is None:
            cdt = self.judged_dtype(compute_dtype, tensor_dtype, in_dtype)
            j = self._thresholds[key] = scales.judge(
                self.mode_name, fam, k, cdt, stage=stage, in_dtype=in_dtype,
                override=self.fb.threshold_for(handlers.dtype_key(cdt)), formula_ok=formula_ok)
        return j

    # -- the forward check's plan and scales (intercept.py runs the re-runs) --------------------
    def forward_plan(self, info, func, args, kwargs, leaves, outs) -> list:
        """``(family, k, formula_ok)`` of each compared output of a forward call (for a
        multilinear call the third is its ``scales.data_variant``)."""
        fam = scales.family(info.name)
        a = scales.Args(func, info.name, args, kwargs)
        var = scales.data_variant(info.name, a) if fam == "multilinear" else True
        return [(fam, scales.forward_length(info.name, a, leaves, o), var) for _, o in outs]

    def forward_scales(self, plan, func, p_leaves, spec, p_outs, outs, compute=None,
                       base=None) -> list:
        """The per-element scale of each compared output (None: the tensor's own), for the
        ``Judge`` of its family (``scales.py``): ``|p| + beta``, or the call on absolute values
        ``S`` (float32/float64) or ``|p| + gamma_k / u_out * S`` (16-bit) -- that re-run only
        where a ``Judge`` needs it. ``compute``: the dtype each output was computed in (default:
        its own). ``base``: the inputs as the call computed with them (``magnitude_inputs``)."""
        compute = compute or [o.dtype for _, o in outs]
        judges = [self.judge_of(fam, k, cdt, o.dtype, None, "forward", ok)
                  for (fam, k, ok), (_, o), cdt in zip(plan, outs, compute)]
        got = squares = counts = None
        if any(j.source == "abs" for j in judges):
            src = magnitude_inputs(base, p_leaves, p_outs[0][1].device)
            a, kw = perturb.unflatten(scales.magnitude_leaves(src), spec)
            got = dict(handlers.float_outputs(scales.magnitude_run(func, a, kw)))
        if any(j.source in ("data", "count") for j in judges):   # the call on squares
            a, kw = perturb.unflatten(scales.square_leaves(p_leaves), spec)
            squares = dict(handlers.float_outputs(func(*a, **scales.square_kwargs(kw))))
        if any(j.source == "count" for j in judges):    # terms per element: the call on ones
            a, kw = perturb.unflatten(scales.count_leaves(p_leaves), spec)
            counts = dict(handlers.float_outputs(func(*a, **scales.count_kwargs(kw))))
        out = []
        for j, (i, p) in zip(judges, p_outs):
            if j.source == "data" and squares is not None and squares.get(i) is not None:
                # sqrt(Q + dlam p^2): two kernels, in place on the squares' re-run
                out.append(squares[i].addcmul_(p, p, value=j.dlam).sqrt_())
            elif j.source == "count" and counts is not None and counts.get(i) is not None:
                out.append(count_scale(j, p, squares[i], counts[i]))
            elif j.source == "element":   # |p| + beta
                if j.fam == "softmax":          # its outputs are >= 0
                    out.append(torch.add(p, j.beta))
                elif j.fam == "log_softmax":    # its outputs are <= 0
                    out.append(torch.rsub(p, j.beta))
                else:   # beta is the underflow floor (hypot(p, beta) near the floor is
                    # 10-70x an add on the CPU: its underflowing squares take a slow path)
                    out.append(p.abs().add_(j.beta))
            elif j.source == "abs" and got is not None and got.get(i) is not None:
                out.append(got[i] if not j.lam else torch.add(p.abs(), got[i], alpha=j.lam))
            elif j.source == "input":       # S = |x| of the first floating input (gelu)
                x = next(t for t in p_leaves if perturb.is_float(t))
                out.append(x.abs() if not j.lam else torch.add(p.abs(), x.abs(), alpha=j.lam))
            else:
                out.append(None)
        return out

    def gather(self) -> None:
        """Read back every pending verdict (one transfer per device) and record the findings."""
        verdicts = self.verdicts
        if not verdicts.pending:   # (at every stop() and step(): nothing to read, no context)
            if verdicts.flagged_sites:
                verdicts.flagged_sites = set()
            return
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
        """Is a flagged output a finding by its measurement alone (module doc)? A NaN/Inf
        mismatch and a no_change difference are; every other flag is a finding only when the
        float64 analysis confirms it (``confirmed``)."""
        return kind_found == "nan_inf" or self.mode.exact

    def _lost_half(self, st, desc) -> bool:
        """Did an accuracy-mode output judged against its magnitude ``S`` (a sum, a product's
        gradient) lose more than half its significant bits relative to the result itself,
        within the bound (issue 34 point 5: a sum that cancels far below its ``S`` returns 24
        for an exact 64, and ``gamma_k S`` allows it)? Read off an exact comparison, whose
        ``scale`` is the result's ``max|p|`` (the fast form does not keep it: a call site's first
        check is exact). The flag goes to the float64 analysis, which keeps it as a hot spot
        with the bits lost (``cause.lost_result``) unless the kernel is to blame."""
        if not self.mode.upcast or desc[3] != scales.MAGNITUDE or not st.scale == st.scale:
            return False
        return st.max_abs > scales.lost_bits_level(desc[6]) * st.scale

    @staticmethod
    def confirmed(why: str) -> bool:
        """Does the analysis' cause make a flagged output a finding? ``inaccurate``, or
        ``ill-conditioned`` with more than half the result's bits lost under a one-ulp input
        change; an accuracy-mode error the inputs' conditioning explains while the result keeps
        half its bits (``cause.MILD``) is a hot spot, as is ``unconfirmed``."""
        return why == cause.INACCURATE or (why == cause.ILL_CONDITIONED
                                           and not getattr(why, "mild", False))

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
            if kind is None and self._lost_half(st, desc):
                kind = "rel_error"     # within the bound, yet half the result's bits are gone
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
            if causes is None or index not in causes:   # not known yet: provisional, or wait
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
            row["cause"] = causes[index] or self._provisional(row)
            if decisive or self.confirmed(row["cause"]):
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
            # a NaN/Inf mismatch is beyond any threshold (its maxima cover the finite pairs)
            "ratio": float(handlers.risk(st, thr)), "call_site": site,
            "module": module, "cause": why,
        }

    def _provisional(self, row) -> str:
        """What the measurement itself shows, before (or without) the float64 analysis."""
        if self.mode.exact:
            return cause.NONDETERMINISTIC
        return cause.INACCURATE if self.mode.upcast else cause.ILL_CONDITIONED

    def _causes_for(self, site, name, explain, flagged):
        """``{output_index: cause}`` for a flagged call: the site's causes, with the flagged
        outputs the site's analysis has not covered yet analysed now (``explain``). An output
        whose cause cannot be known now is missing (a deferred verdict of a site not analysed
        for it: the site is re-checked exactly and explained at its next run); None when none
        is known."""
        if self.mode.exact:
            return {index: cause.NONDETERMINISTIC for index, _, _, _, _ in flagged}
        known = self.site_causes.get(site) if site is not None else None
        missing = [(index, o, desc) for index, o, desc, _, _ in flagged
                   if known is None or index not in known]
        if not missing:
            return known
        if explain is not None:
            return self._explain(site, name, explain, missing)
        if site is not None:
            self.verdicts.recheck.add(site)      # explained at its next run
        return known

    def _explain(self, site, name, explain, items) -> dict:
        """Run the cause analysis once for a site; refine its provisional rows and settle the
        rows waiting for it (findings or hot spots)."""
        try:
            causes = explain(items)
        except Exception as exc:  # the finding stands; the provisional cause is kept
            if self.once(("cause", name.rsplit(".", 2)[0])):
                log.info("Free benchmark: no cause for %s (%s: %s); the rows keep the cause "
                         "the measurement shows.", name, type(exc).__name__, exc)
            causes = {index: None for index, _, _ in items}   # tried: not asked again
        if site is None:
            return causes
        causes = self.site_causes[site] = {**self.site_causes.get(site, {}), **causes}
        capture = getattr(self, "repro_capture", None)   # issue 30: the call's repro record
        if capture is not None and causes:   # (once per call name: Recorder)
            capture(name, explain, items, causes)
        keep = []
        for row in self._uncaused.pop(site, ()):
            row["cause"] = causes.get(row["output_index"]) or row["cause"]
            if row["output_index"] not in causes:
                keep.append(row)
        if keep:
            self._uncaused[site] = keep
        settled = []
        for held in (self._held, self._unexplained):
            rows = held.pop(site, [])
            left = [r for r in rows if r["output_index"] not in causes]
            if left:   # outputs this analysis did not cover: still waiting for theirs
                held[site] = left
            for row in rows:
                if row["output_index"] not in causes:
                    continue
                row["cause"] = causes[row["output_index"]] or cause.UNCONFIRMED
                if self.confirmed(row["cause"]):
                    settled.append(row)
                else:
                    self._hotspot(row)
        if settled:
            self.flagged += len(settled)
            self.emit(settled)
        return causes

    def settle(self) -> int:
        """At ``stop()`` and exit, after the last gather: no flag is left waiting for a next run
        that may never come. On the CPU none waits (``defer`` explains a flagged fast verdict at
        once); an accelerator's deferred verdict read back after its call's inputs were gone
        cannot be analysed: its rows take the cause ``unexplained``, counted in
        ``summary["unexplained"]`` and listed in ``fb.hotspots``, and are still settled if the
        site runs again under the probe (it is compared exactly and explained then). Returns how
        many rows were settled so."""
        held, self._held = self._held, {}
        n = 0
        for site, rows in held.items():
            for row in rows:
                row["cause"] = UNEXPLAINED
            self._unexplained.setdefault(site, []).extend(rows)
            n += len(rows)
        if n and self.once(("unexplained",)):
            log.warning("Free benchmark: %d flagged check(s) could not be analysed: their "
                        "verdicts were read back after the calls' inputs were gone and the calls "
                        "did not run again before stop(); listed in fb.hotspots with cause "
                        "'unexplained' (summary['unexplained']), and explained if they run "
                        "again under the probe.", n)
        return n

    def _hotspot(self, row) -> None:
        """Keep a hot spot, one entry per call site and output (worst row kept, counted), with
        the significant bits its result lost relative to itself where the analysis measured it
        (``cause.lost_result``: issue 34 point 5)."""
        row["bits_lost"] = getattr(row.get("cause"), "bits", None)
        k = (row["stage"], row["api_name"], row["output_index"])
        have = self._hot.get(k)
        if have is None:
            self._hot[k] = dict(row, count=1)
            return
        count = have["count"] + 1
        if row["ratio"] > have["ratio"]:
            have.update(row)
        have["count"] = count
