"""Verdicts with a null: does the test run depart from the reference further than a control does?

``compare_grads(ref, test, control=ctrl)`` compares the reference with the test and with the
control (the reference trained again with its rounding drawn at random at the precision under
test: ``control.py``) and flags a (step, parameter) only where the test departs further than the
controls do, so far that a test which is just one more such run is called beyond noise anywhere
over its parameters x steps with a chance of at most ``ALPHA`` = 1 % (docs/grad_compare.md,
docs/DESIGN.md "Verdicts with a null"):

* **the margin** ``m``: two runs that differ only in rounding part by different amounts (a
  shift of the whole run, and a term of each parameter; ``PRIOR_SPREAD``, or measured from two
  controls or more: ``spread``); ``margin`` is how many times the controls' band the test may
  reach before a false alarm over all parameters has the chance ``ALPHA / 8``.
* **scale** (a scaling bug leaves the signs alone): ``|ln(norm_t / norm_r)| > max(m * band,
  NORM_FLOOR * u)``, ``band`` the controls' largest such deviation at that parameter over the
  compared steps, ``u`` the unit roundoff of the precision under test; the same for the range
  ``max - min`` (floor ``RANGE_FLOOR * u``). A gradient that is NaN/Inf (or zero) where the
  reference's and the control's are finite (nonzero) is always flagged.
* **signs**: ``d`` of the ``n`` elements compared (significant in both runs) differ in sign.
  The control's share has the upper confidence bound ``p_c`` (Chernoff/KL bound at level
  ``ALPHA / (8 cells)``); the null allows the test ``p0 = min(1/2, m * p_c)``; the cell is
  flagged when the test's share ``q = d / n`` exceeds it beyond chance: ``n KL(q || p0) >
  ln(8 cells / ALPHA)`` (a Chernoff bound on the binomial tail, Bonferroni over the rank's
  cells); the same per step on the totals.

The result also says it in words (``verdict_text``), and renders them first
(``GradComparison``: the Dataset ``compare_grads`` returns).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import xarray as xr

#: the false-alarm rate of a whole comparison, per rank: the chance that a test which is one
#: more draw of the controls' distribution (rounding at their precision, nothing else) is
#: called beyond noise anywhere over its parameters x steps (docs/grad_compare.md). Split
#: evenly over eight ways to err (union bound): the run-to-run spread exceeding the margin in
#: each of the four tests (norm, range, signs per cell, signs per step), the control's flip
#: share under its confidence bound, the test's flips beyond chance (cells and steps)
ALPHA = 0.01
#: spread between runs that differ only in rounding, as standard deviations of the log of a
#: parameter's largest deviation from the reference over a run (its norm's or its max - min's):
#: (a shift shared by all parameters of a run, a term of each parameter). The widest measured
#: over ten controls each of three models (ConvNeXt, Qwen2, LLaMA; 16 AdamW steps; fp32
#: controls and bf16 ones), at its 95 % upper confidence bound (benchmarks/RESULTS.md; bf16's
#: shift 0.45 -> 0.80 at stop 43: ConvNeXt's ten bf16 controls measured 0.49 there,
#: ``bench_control.py priors``). With two controls or more the parameter term is measured from
#: them (``spread``)
PRIOR_SPREAD = {"fp32": (1.38, 0.24), "half": (0.80, 0.45)}
#: the least parameter term two controls may measure: fp32's is heavy-tailed (a few parameters
#: spread 5-10x the typical one; kurtosis 5-13 over the parameters, against 3-4 at bf16), so
#: two controls cannot tell the typical spread from the widest and the prior stays the floor
FLOOR_PARAM_SPREAD = {"fp32": 0.24, "half": 0.0}
#: degrees of freedom of the parameter term's Student-t tail per precision, None: Gaussian.
#: Measured kurtosis of the parameter term over the parameters (ten controls, three models):
#: fp32 4.3-12.7 (a few parameters spread 5-10x the typical one), bf16 2.8-4.0; the heaviest
#: measured, 12.7, is a t with 4 + 6 / (12.7 - 3) = 4.6 degrees of freedom
PARAM_TAIL = {"fp32": 4.6, "half": None}
#: least parameters whose controls' disagreement measures the parameter term, and over which a
#: test's own shift is measured
MIN_PARAMS_SPREAD = 8
#: draws of the simulation that turns a spread into a margin (fixed seed: the same margin for
#: the same comparison)
DRAWS = 20_000
#: scale floors, in units of the unit roundoff of the precision under test: the test may move a
#: norm by this many roundings (a range by twice as many: two single elements) whatever the
#: controls show, a systematic drift of round-to-nearest that random rounding does not sample
NORM_FLOOR = 8.0
RANGE_FLOOR = 16.0
#: unit roundoff 2^-t per control precision (t significant bits)
UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24}
KINDS = ("", "sign", "scale", "nonfinite")


# -- statistics ---------------------------------------------------------------------------------
def kl(q, p):
    """Relative entropy KL(Bernoulli(q) || Bernoulli(p)), elementwise."""
    q = np.clip(np.asarray(q, np.float64), 0.0, 1.0)
    p = np.clip(np.asarray(p, np.float64), 1e-300, 1.0 - 1e-16)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0) / p), 0.0)
        b = np.where(q < 1, (1 - q) * np.log(np.where(q < 1, 1 - q, 1.0) / (1 - p)), 0.0)
    return a + b


def upper_share(d, n, level: float):
    """The upper confidence bound of a share ``d / n`` at ``level``: the largest ``p >= d/n``
    with ``n KL(d/n || p) <= ln(1/level)`` (Chernoff; 1 where ``n`` is 0). For ``d = 0`` it is
    ``1 - level^(1/n)`` (taken in closed form). Solved once per distinct ``(d, n)`` by Newton's
    method on ``sqrt(n KL(q || p)) - sqrt(ln(1/level))``, nearly linear in ``p`` above ``q``, from
    where ``KL(q || p) >= (p - q)^2 / (2 min(p, 1 - q, 1/4))`` puts it above the root, until a
    step moves ``p`` by less than 1e-10 of it (the precision of ``n KL``'s evaluation, whose two
    terms cancel to second order: 1e-10 relative of a 70-step bisection, where the 48 steps of
    bisection it replaces were 3e-9 off; issue 38: they were a tenth of a comparison with a
    control). Five or six steps."""
    d = np.asarray(d, np.float64)
    n = np.asarray(n, np.float64)
    du, nu, inverse = _unique_pairs(d.ravel(), n.ravel())
    ok = nu > 0
    nn = np.where(ok, nu, 1.0)
    q = np.where(ok, du / nn, 0.0)
    budget = math.log(1.0 / level)
    out = np.ones_like(q)
    zero = ok & (q == 0)
    out[zero] = -np.expm1(-budget / nn[zero])
    todo = np.flatnonzero(ok & (q > 0) & (q < 1))
    if todo.size:
        qq, nq = q[todo], nn[todo]
        # KL(q || p) >= (p - q)^2 / (2 max t(1 - t) over [q, p]) >= (p - q)^2 / (2 min(p, 1 - q,
        # 1/4)): f >= 0 from the least p this gives; then Newton on sqrt(n KL) - sqrt(budget),
        # nearly linear in p (n KL is nearly quadratic in p - q)
        c = budget / nq
        p = np.minimum(np.minimum(qq + c + np.sqrt(c * c + 2 * qq * c),
                                  qq + np.sqrt(2 * c * (1 - qq))),
                       np.minimum(qq + np.sqrt(c / 2), 1.0 - 1e-16))
        root = math.sqrt(budget)
        for _ in range(60):
            k = np.sqrt(nq * kl(qq, p))
            slope = nq * (p - qq) / (p * (1 - p)) / (2 * np.maximum(k, 1e-300))
            step = (k - root) / slope
            p = np.clip(p - step, qq, 1.0 - 1e-16)
            if not (np.abs(step) > 1e-10 * p).any():
                break
        out[todo] = p
    return out[np.ravel(inverse)].reshape(d.shape)


def _unique_pairs(d, n) -> tuple:
    """The distinct pairs ``(d[i], n[i])`` (1-D float arrays) in lexicographic order, and each
    pair's index among them: ``np.unique(np.stack([d, n]), axis=1, return_inverse=True)``'s
    pairs without its sort of a structured view (several times slower than these sorts)."""
    if not d.size:
        return d.copy(), n.copy(), np.zeros(0, np.intp)
    order = np.lexsort((n, d))
    ds, ns = d[order], n[order]
    new = np.ones(ds.size, bool)
    new[1:] = (ds[1:] != ds[:-1]) | (ns[1:] != ns[:-1])
    inverse = np.empty(d.size, np.intp)
    inverse[order] = np.cumsum(new) - 1
    return ds[new], ns[new], inverse


def exceeds(d, n, p0, cells: int, alpha: float = ALPHA):
    """(flag, excess): is the share ``d / n`` above ``p0`` beyond chance, ``n KL(d/n || p0) >
    ln(cells / alpha)`` (a Chernoff bound on the binomial tail, Bonferroni over ``cells``
    tests); ``excess = (d / n) / p0``. NaN ``p0`` (no control) never flags."""
    n = np.nan_to_num(np.asarray(n, np.float64), nan=0.0)
    d = np.nan_to_num(np.asarray(d, np.float64), nan=0.0)
    p0 = np.asarray(p0, np.float64)
    ok = (n > 0) & ~np.isnan(p0)
    q = np.where(ok, d / np.where(ok, n, 1.0), 0.0)
    budget = math.log(max(int(cells), 1) / alpha)
    with np.errstate(invalid="ignore"):
        flag = ok & (q > p0) & (n * kl(q, np.nan_to_num(p0, nan=0.5)) > budget)
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(ok, q / p0, np.nan)
    return flag, excess


def allowed_share(d_c, n_c, margin: float, level: float):
    """``p0 = min(1/2, margin * upper_share(d_c, n_c, level))``; NaN where ``n_c`` is NaN (no
    control)."""
    n_c = np.asarray(n_c, np.float64)
    up = upper_share(np.nan_to_num(d_c), np.nan_to_num(n_c), level)
    return np.where(np.isnan(n_c), np.nan, np.minimum(0.5, margin * up))


def lower_share(d_c, n_c, level: float):
    """The lower confidence bound of a share ``d_c / n_c`` at ``level`` (``upper_share`` of the
    other elements' share, from 1); NaN where ``n_c`` is NaN (no control)."""
    n_c = np.asarray(n_c, np.float64)
    d = np.nan_to_num(np.asarray(d_c, np.float64))
    n = np.nan_to_num(n_c)
    return np.where(np.isnan(n_c), np.nan, 1.0 - upper_share(n - d, n, level))


def log_dev(x, r):
    """``|ln(x / r)|`` elementwise: 0 where both are 0, inf where one of them is."""
    x = np.abs(np.asarray(x, np.float64))
    r = np.abs(np.asarray(r, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.abs(np.log(x / r))
    return np.where((x == 0) & (r == 0), 0.0, out)


def typical_share(ref):
    """Per (rank, step, param): the reference's statistic at the step over its median over the
    steps (1 where that median is 0 or not finite; NaN where the step has none). A deviation
    times this share is measured against the parameter's typical magnitude, not the step's:
    rounding errs by a share of what a gradient sums, and at a step where those terms cancel
    (a bias gradient of four samples, one per class: 1/160 of the terms' magnitudes) the same
    error is a large share of the small sum, in every run alike (docs/grad_compare.md)."""
    ref = np.abs(np.asarray(ref, np.float64))
    with np.errstate(all="ignore"):
        typ = _nanmedian1(ref) if np.isfinite(ref).any() else np.full(ref[:, :1].shape, np.nan)
        return np.where((typ > 0) & np.isfinite(typ), ref / typ, np.where(np.isnan(ref),
                                                                            np.nan, 1.0))


def _nanmedian1(x):
    """``np.nanmedian(x, axis=1, keepdims=True)`` of a 3-D array, by one sort (NaNs sort last):
    the mean of the middle two of each column's values, NaN where it has none (``nanmedian``
    takes masked arrays there, several times slower on a comparison's small arrays)."""
    srt = np.sort(x, axis=1)
    cnt = (~np.isnan(x)).sum(axis=1, keepdims=True)
    lo = np.take_along_axis(srt, np.maximum(cnt - 1, 0) // 2, axis=1)
    hi = np.take_along_axis(srt, cnt // 2 - (cnt == 0), axis=1)
    return np.where(cnt > 0, (lo + hi) / 2, np.nan)


def step_dev(x, r, share):
    """``log_dev(x, r)`` times ``share`` (``typical_share``): the deviation of a statistic in
    units of the parameter's typical one; inf (one side zero, the other not) stays inf."""
    d = log_dev(x, r)
    with np.errstate(invalid="ignore"):
        return np.where(np.isinf(d), np.inf, d * share)


def margin(controls: int, params: int, run_sd: float, param_sd: float,
           alpha: float = ALPHA / 4, draws: int = DRAWS, tail=None) -> tuple:
    """``(m, c)``: a test may reach ``m * exp(credit) * band`` at a parameter, ``credit`` its
    own shift over the controls (the median over the parameters of its log largest deviation
    over the band's) clipped to ``[0, ln c]``, with a chance of a false alarm anywhere over
    ``params`` parameters of ``alpha``, if the test is one more run like the ``controls``:
    each run's log largest deviation at a parameter is a shift of the run (standard deviation
    ``run_sd``) plus a term of the parameter (``param_sd``), Gaussian, or Student-t with
    ``tail`` degrees of freedom (scaled to that standard deviation); the band is the
    controls' envelope. ``ln c`` is the (1 - alpha) quantile of a null test's shift (beyond
    it, a run-wide departure is not credited), ``ln m`` the (1 - alpha) quantile of the
    test's largest excess ``max_p [x_t(p) - band(p) - credit]``; both from ``draws`` simulated
    comparisons (fixed seed). Cached."""
    key = (int(controls), int(params), round(float(run_sd), 4), round(float(param_sd), 4),
           float(alpha), int(draws), tail)
    hit = _MARGINS.get(key)
    if hit is None:
        rng = np.random.default_rng(0)
        k, p = max(int(controls), 1), max(int(params), 1)
        chunk = max(1, min(draws, 4_000_000 // ((k + 1) * p)))
        over, shift = np.empty((draws, p)), np.empty(draws)
        for start in range(0, draws, chunk):   # in place: no temporary of the draws' size
            n = min(chunk, draws - start)
            if tail is None:
                x = rng.standard_normal((n, k + 1, p))
            else:
                x = rng.standard_t(tail, (n, k + 1, p))
                x *= math.sqrt((tail - 2) / tail)
            x *= param_sd                                  # the parameter term, plus
            x += rng.standard_normal((n, k + 1, 1)) * run_sd   # the run's shift
            o = over[start:start + n]
            np.subtract(x[:, 0], x[:, 1] if k == 1 else np.max(x[:, 1:], axis=1), out=o)
            shift[start:start + n] = np.median(o, axis=1)  # the test over the band, and
        cap = max(float(np.quantile(shift, 1 - alpha)), 0.0)   # its shift
        over -= np.clip(shift, 0.0, cap)[:, None]
        worst = np.max(over, axis=1)
        hit = _MARGINS[key] = (float(np.exp(max(np.quantile(worst, 1 - alpha), 0.0))),
                               float(np.exp(cap)))
    return hit


def family_margin(controls: int, family: int, param_sd: float, alpha: float) -> float:
    """How many times the controls' upper bound a test's share may reach at one of ``family``
    cells before a false alarm has the chance ``alpha`` (Bonferroni), if its log departs from
    each control's by a Gaussian term of standard deviation ``param_sd`` per run (its shift
    credited separately): ``exp(param_sd * t)``, ``t`` solving ``P(y - max_c y_c > t) =
    alpha / family`` for ``k + 1`` standard normals (a 1-D integral, by bisection). Cached (a
    comparison asks it per rank, for its cells and its steps: ranks alike ask the same)."""
    k, f = max(int(controls), 1), max(int(family), 1)
    key = (k, f, float(param_sd), float(alpha))
    hit = _FAMILY.get(key)
    if hit is None:
        hit = _FAMILY[key] = _family_margin(k, f, float(param_sd), float(alpha))
    return hit


_FAMILY: dict = {}


def _family_margin(k: int, f: int, param_sd: float, alpha: float) -> float:
    target = alpha / f
    y = np.linspace(-9.0, 9.0, 3601)
    dens = np.exp(-y * y / 2) / math.sqrt(2 * math.pi) * (y[1] - y[0])
    cdf = lambda x: 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))  # noqa: E731
    lo, hi = 0.0, 40.0
    for _ in range(60):
        t = (lo + hi) / 2
        if float(np.sum(dens * cdf(y - t) ** k)) > target:    # P(y - max_c y_c > t)
            lo = t
        else:
            hi = t
    return float(np.exp(param_sd * hi))


def _erf(x):
    """Vectorised error function (numpy has none): Abramowitz-Stegun 7.1.26, |error| < 1.5e-7."""
    x = np.asarray(x, np.float64)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                         + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


_MARGINS: dict = {}


def spread(peaks, controls: int, prior, floor: float = 0.0) -> tuple:
    """(run, parameter) spread of the log largest deviation for ``margin``: ``prior``
    (``PRIOR_SPREAD``) for one control; with two or more, the parameter term measured from
    how the controls' largest deviations (``peaks``: per control and statistic, one value per
    parameter, ``controls`` groups of statistics in order) disagree once each one's shift and
    each parameter's level are taken out (root mean square, at its 95 % upper confidence
    bound), no less than ``floor``, and the run term the prior's or, if more, the spread of
    their shifts."""
    run_sd, param_sd = prior
    if controls < 2:
        return float(run_sd), float(param_sd)
    stats = len(peaks) // controls
    terms, shifts = [], []
    for j in range(stats):
        with np.errstate(divide="ignore", invalid="ignore"):
            lm = np.log(np.stack([peaks[c * stats + j] for c in range(controls)]))
        lm = lm[:, np.isfinite(lm).all(axis=0)]
        if lm.shape[1] < MIN_PARAMS_SPREAD:
            continue
        own = lm - lm.mean(axis=0, keepdims=True)      # each parameter's own level out
        mid = np.median(own, axis=1, keepdims=True)    # each control's shift
        shifts.append(mid[:, 0])
        res = own - mid
        res = res - res.mean(axis=0, keepdims=True)
        dof = (controls - 1) * (lm.shape[1] - 1)
        sd = math.sqrt(float(np.sum(res ** 2)) / dof)
        terms.append(sd * math.sqrt(dof / _chi2_low(dof)))
    if not terms:
        return float(run_sd), float(param_sd)
    shift = float(np.max([np.std(x, ddof=1) for x in shifts]))
    return max(float(run_sd), shift), max(float(max(terms)), float(floor))


def _chi2_low(dof: int, z: float = -1.6449) -> float:
    """The 5 % quantile of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * dof)
    return dof * max(1.0 - c + z * math.sqrt(c), 1e-3) ** 3


# -- calibration of a comparison ------------------------------------------------------------------
def counts(cmp, dims) -> tuple:
    """(differing, compared) element counts behind the comparison's judged similarity, as float
    arrays over ``dims`` (NaN where a run had no gradient)."""
    name = judged_name(cmp)
    if name == "similarity_significant":   # Variables transposed: no DataArray built
        var = cmp.variables
        n = np.asarray(var["significant"].transpose(*dims).values, np.float64)
        n = np.where(n >= 0, n, np.nan)
        d = np.round(n * (1.0 - np.asarray(var[name].transpose(*dims).values, np.float64)))
    else:
        differ = np.asarray(cmp["differ"].transpose(*dims).values, np.float64)
        numel = cmp["numel"].broadcast_like(cmp["differ"]).transpose(*dims).values
        n = np.where(differ >= 0, np.asarray(numel, np.float64), np.nan)
        d = np.where(differ >= 0, differ, np.nan)
    return d, n


def judged_name(cmp) -> str:
    """The similarity variable flags are judged on (``similarity_significant`` when the
    comparison is noise-aware, else msprobe's ``similarity``): the one number shown."""
    return ("similarity_significant" if cmp.attrs.get("noise_aware")
            and "similarity_significant" in cmp else "similarity")


def judged_total_name(cmp) -> str:
    return "total_significant" if judged_name(cmp) == "similarity_significant" else "total"


def judged(cmp):
    """The similarity the flags are judged on, as a DataArray."""
    return cmp[judged_name(cmp)]


def _stats(runs: dict, result) -> dict:
    """norm and range (max - min) of a run (``sources.load_stats``' {rank: table}) aligned to
    ``result``'s (rank, step, param). A run of one table pairs with every rank of the
    comparison (``compare.pair_runs``' rule), else rank r with rank r; a rank whose table lacks
    some of the compared parameters takes them from the ranks of other parameters (pipeline
    stages compared as one run: their union, over the steps they all hold)."""
    from ..store.names import canonical_names

    # the variables themselves, not DataArrays (each of those costs more than its values here)
    have = result.variables
    ranks = [int(r) for r in have["rank"].values]
    steps = np.asarray(have["step"].values)
    params = [str(p) for p in have["param"].values]
    out = {k: np.full((len(ranks), steps.size, len(params)), np.nan) for k in ("norm", "range")}
    for k, r in enumerate(ranks):
        t = next(iter(runs.values())) if len(runs) == 1 else runs.get(r)
        if t is None:
            continue
        held = [t]
        if len(runs) > 1 and not set(params) <= set(t["param"]):
            mine = set(t["param"])
            held = [runs[x] for x in sorted(runs) if runs[x] is t
                    or not set(runs[x]["param"]) & mine]
        common = held[0]["step"]
        for h in held[1:]:
            common = np.intersect1d(common, h["step"])
        for h in held:
            _fill(out, k, h, common if len(held) > 1 else None, steps, params,
                  canonical_names)
    return out


def _fill(out: dict, k: int, t: dict, only, steps, params, canonical_names) -> None:
    """``_stats``' cells of rank ``k`` from table ``t`` (``only``: at those of its steps)."""
    canon = list(canonical_names(t["param"]))
    col = {n: j for j, n in enumerate(canon)}
    keep = np.ones(t["step"].size, bool) if only is None else np.isin(t["step"], only)
    srow = {int(s): j for j, s in enumerate(t["step"]) if keep[j]}
    rows = np.array([srow.get(int(s), -1) for s in steps], np.int64)
    cols = np.array([col.get(p, -1) for p in params], np.int64)
    if not (rows >= 0).any() or not (cols >= 0).any():
        return
    ri, ci = np.flatnonzero(rows >= 0), np.flatnonzero(cols >= 0)
    at = np.ix_(rows[ri], cols[ci])
    present = t["present"][at] if t["present"] is not None else np.ones((ri.size, ci.size), bool)
    out["norm"][k][np.ix_(ri, ci)] = np.where(present, t["norm"][at], np.nan)
    out["range"][k][np.ix_(ri, ci)] = np.where(present, t["max"][at] - t["min"][at], np.nan)


def calibrate(result, ctrl_cmps, ref, test, controls, storage_options=None):
    """``result`` (``compare_grads(ref, test)``, with a rank dim) judged against the control
    runs ``controls`` (paths or Datasets; several: the band is their envelope, cell by cell)
    and their comparisons with ``ref``, ``ctrl_cmps`` (``compare_grads(..., control=)`` runs
    all of them at once, then this). Returns a ``GradComparison`` with the
    calibrated ``flag``, ``flag_total``, ``first_step``, ``first_param`` and the variables
    named in ``compare_grads``'s docstring."""
    from ..store.sources import load_stats

    # an uncalibrated comparison's NaN/Inf check (compare._flag_nonfinite) is judged here again,
    # against the controls too (the "nonfinite" kind)
    if "nonfinite" in result.variables:
        result = result.drop_vars("nonfinite")
    # ref, test, controls: paths, Datasets, {rank: Dataset} or load_stats' {rank: table}
    storage = storage_options
    runs_ref = load_stats(ref, storage_options=storage)
    runs_test = load_stats(test, storage_options=storage)
    runs_ctrl = [load_stats(c, storage_options=storage) for c in controls]
    names = _control_names(runs_ctrl)
    unit = max((UNIT.get(n.partition(":")[0], UNIT["bf16"]) for n in names),
               default=UNIT["bf16"])
    dims = ("rank", "step", "param")
    where = {k: result.variables[k].values for k in ("rank", "step", "param")}
    d_t, n_t = counts(result, dims)

    # scale statistics first: norms and ranges (max - min) of the runs, aligned to the
    # comparison; each control's largest deviation of a statistic at a parameter over the
    # steps (its band: the envelope of the controls), and the spread between runs they show
    st_r = _stats(runs_ref, result)
    st_t = _stats(runs_test, result)
    # deviations in units of each parameter's typical statistic (``typical_share``)
    share = {k: typical_share(st_r[k]) for k in ("norm", "range")}
    dev_t = {k: step_dev(st_t[k], st_r[k], share[k]) for k in ("norm", "range")}
    bands = {"norm": None, "range": None}
    finite_c, ratio_c, peaks = None, {}, []
    for rc in runs_ctrl:
        st_c = _stats(rc, result)
        peak = {}
        for k in bands:
            g = step_dev(st_c[k], st_r[k], share[k])
            g = np.where(np.isfinite(g), g, np.nan)
            with np.errstate(all="ignore"):
                # fmax's reduction: nanmax's values, no warning for a parameter without any
                b = (np.fmax.reduce(g, axis=1, keepdims=True) if np.isfinite(g).any()
                     else np.full(g[:, :1].shape, np.nan))
            peak[k] = b[:, 0]
            bands[k] = b if bands[k] is None else np.fmax(bands[k], b)
            if k not in ratio_c:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio_c[k] = st_c[k] / st_r[k]
        peaks.append(peak)
        fin = np.isfinite(st_c["norm"])
        finite_c = fin if finite_c is None else finite_c & fin
    # the margin: how far the test may depart beyond the controls' band before a false alarm
    # becomes likelier than ALPHA over the whole comparison (family-wise, per rank)
    kind_u = "fp32" if unit <= UNIT["fp32"] else "half"
    nrank = d_t.shape[0]
    spreads = [spread([pk[k][r] for pk in peaks for k in ("norm", "range")], len(peaks),
                      PRIOR_SPREAD[kind_u], FLOOR_PARAM_SPREAD[kind_u]) for r in range(nrank)]
    # one margin for the comparison: its ranks' widest spreads and most parameters (a
    # simulation per rank would cost seconds each at 1024 ranks)
    params_r = max(max(int(np.isfinite(bands["norm"][r, 0]).sum()) for r in range(nrank)), 1)
    widest = (max(x[0] for x in spreads), max(x[1] for x in spreads))
    spreads = [widest] * nrank
    m1, c1 = margin(len(peaks), params_r, *widest, tail=PARAM_TAIL[kind_u])
    marg, cap = np.full(nrank, m1), np.full(nrank, c1)
    # the test's own shift over the controls' band, credited up to the cap: a run that parts
    # further everywhere, as runs that differ only in rounding do, is not a defect anywhere
    # (a parameter the test leaves unmoved counts as far below, one without data not at all)
    credit = {}
    for k in bands:
        with np.errstate(all="ignore"):
            over = np.log(np.fmax.reduce(np.where(np.isfinite(dev_t[k]), dev_t[k], np.nan),
                                         axis=1)
                          / bands[k][:, 0])
        shift = np.array([np.median(o[~np.isnan(o)]) if (~np.isnan(o)).sum()
                          >= MIN_PARAMS_SPREAD else 0.0 for o in over])
        credit[k] = np.exp(np.clip(np.nan_to_num(shift, nan=0.0), 0.0, np.log(cap)))

    # signs: the control's upper confidence bound on its flip share, cell by cell (the
    # envelope of several controls), times the margin; Bonferroni over the rank's cells
    from ...errors import GradCompareError

    present = result.variables["differ"].transpose(*dims).values >= 0
    order = np.argsort(where["step"], kind="stable")
    cells = np.maximum(present.reshape(nrank, -1).sum(axis=1), 1)
    nsteps = max(d_t.shape[1], 1)
    up = sim_c = now = None
    per_control = []
    for cc in ctrl_cmps:
        if judged_name(cc) != judged_name(result):
            raise GradCompareError(
                f"the test is judged on {judged_name(result)} but a control on "
                f"{judged_name(cc)}: a control run needs the significance bits the test has "
                "(record it with probekit's GradProbe, significance on), or compare with "
                "noise_aware=False")
        if not all(np.array_equal(cc.variables[k].values, v) for k, v in where.items()):
            cc = cc.reindex(**where)
        d_c, n_c = counts(cc, dims)
        u_now = np.stack([allowed_share(d_c[r], n_c[r], 1.0, ALPHA / (16 * cells[r]))
                          for r in range(nrank)])
        u = _so_far(u_now, order)
        # the control burst before this step: the lower bound of its share at an earlier step
        # above the upper bound of its share at this one (its own counts tell it apart)
        lower = np.stack([lower_share(d_c[r], n_c[r], ALPHA / (16 * cells[r]))
                          for r in range(nrank)])
        b = _so_far(lower, order) > u_now
        with np.errstate(divide="ignore", invalid="ignore"):
            s = 1.0 - d_c / n_c
        per_control.append((d_c, n_c))
        if up is None:
            up, sim_c, now, burst_c = u, s, u_now, b
        else:
            more = np.nan_to_num(u, nan=-1.0) > np.nan_to_num(up, nan=-1.0)
            up, sim_c = np.where(more, u, up), np.where(more, s, sim_c)
            now, burst_c = np.fmax(now, u_now), burst_c | b
    # the test's shift, measured on its deviations, is credited to its flips too (a run that
    # parts further flips more); the rest of the margin is the cells' (and steps') own spread
    credit_s = np.fmax(credit["norm"], credit["range"])
    m_cell = np.array([family_margin(len(peaks), c, sp[1], ALPHA / 8)
                       for c, sp in zip(cells, spreads)])
    m_step = np.array([family_margin(len(peaks), nsteps, sp[1], ALPHA / 8) for sp in spreads])
    p0 = np.minimum(0.5, (m_cell * credit_s)[:, None, None] * up)
    # a step's total keeps its own bound (one parameter's burst is diluted in it, and it is
    # what finds a small change spread over every parameter at its first step), over the
    # parameters a burst does not explain: a parameter whose flips at this step are within the
    # bound a control's earlier burst raised (``_so_far``), and beyond the one its flips at
    # this step alone give, is left out of the test's total and of the controls'
    with np.errstate(divide="ignore", invalid="ignore"):
        share_t = d_t / n_t
        p_now = np.minimum(0.5, (m_cell * credit_s)[:, None, None] * now)
        burst = burst_c & (share_t > p_now) & (share_t <= p0)
    keep = ~burst
    d_tt = np.nansum(np.where(keep, d_t, 0), axis=2)
    n_tt = np.nansum(np.where(keep, n_t, 0), axis=2)
    upt = tot_c = None
    for d_c, n_c in per_control:
        dct = np.nansum(np.where(keep, d_c, 0), axis=2)
        nct = np.nansum(np.where(keep, n_c, 0), axis=2)
        ut = allowed_share(dct, np.where(nct > 0, nct, np.nan), 1.0, ALPHA / (16 * nsteps))
        with np.errstate(divide="ignore", invalid="ignore"):
            st = 1.0 - dct / nct
        if upt is None:
            upt, tot_c = ut, st
        else:
            more = np.nan_to_num(ut, nan=-1.0) > np.nan_to_num(upt, nan=-1.0)
            upt, tot_c = np.where(more, ut, upt), np.where(more, st, tot_c)
    p0t = np.minimum(0.5, (m_step * credit_s)[:, None] * upt)
    flag_s = np.zeros(d_t.shape, bool)
    exc_s = np.full(d_t.shape, np.nan)
    flag_t = np.zeros(d_tt.shape, bool)
    for k in range(nrank):    # Bonferroni over each rank's cells, and over its steps
        flag_s[k], exc_s[k] = exceeds(d_t[k], n_t[k], p0[k], cells[k], ALPHA / 16)
        flag_t[k] = exceeds(d_tt[k], n_tt[k], p0t[k], nsteps, ALPHA / 16)[0]

    # scale: each statistic against its band times the margin, and no less than a floor of
    # a few roundings (round-to-nearest's systematic drift, which random rounding does not
    # sample)
    allowed = {k: np.broadcast_to(np.fmax((marg * credit[k])[:, None, None]
                                          * np.nan_to_num(bands[k], nan=0.0), f * unit),
                                  dev_t[k].shape)
               for k, f in (("norm", NORM_FLOOR), ("range", RANGE_FLOOR))}
    finite_r = np.isfinite(st_r["norm"])
    nonfinite = present & finite_r & finite_c & ~np.isfinite(st_t["norm"])
    ok = finite_r & finite_c & present
    with np.errstate(divide="ignore", invalid="ignore"):
        # a gradient gone to zero where the reference's is not: a deviation of inf, flagged
        exc_n = np.where(ok, dev_t["norm"] / allowed["norm"], np.nan)
        exc_r = np.where(ok, dev_t["range"] / allowed["range"], np.nan)
        exc_g = np.fmax(exc_n, exc_r)
        flag_g = ok & (exc_g > 1)
    flag = flag_s | flag_g | nonfinite
    # a flagged cell's excess is that of its kind: scale before signs (a defect scales the
    # gradients of the modules it feeds and passes through, while any perturbation flips
    # near-zero signs all over the network), NaN/Inf first of all
    kind = np.zeros(flag.shape, np.int8)
    kind[flag_s] = 1
    kind[flag_g] = 2
    kind[nonfinite] = 3
    excess = np.where(kind == 2, exc_g, np.where(kind == 1, exc_s, np.fmax(exc_s, exc_g)))
    excess = np.where(nonfinite, np.inf, excess)
    steps = where["step"]
    params = [str(x) for x in where["param"]]
    firsts = [_first(kind[k], flag_t[k], excess[k], steps, params)
              for k in range(flag.shape[0])]
    rs = ("rank", "step")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = {"norm_ratio": (dims, st_t["norm"] / st_r["norm"]),
                  "range_ratio": (dims, st_t["range"] / st_r["range"])}
    # one Dataset built: an assignment would align the whole Dataset again
    out = _assigned(
        result, flag_threshold=result.variables["flag"],
        flag_total_threshold=result.variables["flag_total"],
        flag=(dims, flag), flag_kind=(dims, kind), excess=(dims, excess),
        similarity_control=(dims, sim_c), similarity_band=(dims, 1.0 - p0),
        flag_total=(rs, flag_t), total_control=(rs, tot_c), total_band=(rs, 1.0 - p0t),
        burst=(dims, burst),
        **ratios, norm_ratio_control=(dims, ratio_c["norm"]),
        range_ratio_control=(dims, ratio_c["range"]), norm_dev=(dims, dev_t["norm"]),
        norm_allowed=(dims, np.array(allowed["norm"])), range_dev=(dims, dev_t["range"]),
        range_allowed=(dims, np.array(allowed["range"])), margin=(("rank",), marg),
        shift_cap=(("rank",), cap), credit_norm=(("rank",), credit["norm"]),
        credit_range=(("rank",), credit["range"]),
        spread_run=(("rank",), np.array([x[0] for x in spreads])),
        spread_param=(("rank",), np.array([x[1] for x in spreads])),
        first_step=(("rank",), np.array([s for s, _ in firsts], np.int64)),
        first_param=(("rank",), np.array([p for _, p in firsts], dtype=str)),
        # compared steps a control covers (the others are not judged)
        controlled=(rs, ~np.isnan(p0).all(axis=2)))
    out.attrs.update(calibrated=1, control=", ".join(n for n in names if n), alpha=ALPHA,
                     controls=len(peaks), scale_floor=NORM_FLOOR * unit,
                     similarity=judged_name(result))
    return GradComparison.wrap(out)


def _assigned(ds, **new):
    """``ds.assign(**new)`` for variables (``(dims, values)`` or Variables) over ``ds``'s own
    dimensions, as one Dataset built from the variables: the same Dataset, without the
    alignment and merge an assignment runs (a tenth of a small comparison's verdict). The
    constructor still refuses a size that disagrees with ``ds``'s."""
    import xarray as xr

    coords = ds.coords
    variables = {k: v for k, v in ds.variables.items() if k not in coords}
    for k, v in new.items():
        variables[k] = v if isinstance(v, xr.Variable) else xr.Variable(*v)
    return GradComparison(variables, coords=coords, attrs=dict(ds.attrs))


def _so_far(up, order):
    """A control's flip-share bound at each step raised to its largest at any earlier step
    (``order``: the steps' positions in step order; axis 1): drift between runs of rounding only
    grows, but a discrete event that flips signs in a burst (a rerouted token in a mixture of
    experts) lands at a random step, and the burst a control showed at step 3 is within what
    rounding does at step 5 too. NaN (no control there) stays NaN and raises nothing."""
    up = np.asarray(up, np.float64)
    seq = np.take(up, order, axis=1)
    run = np.fmax.accumulate(np.where(np.isnan(seq), -np.inf, seq), axis=1)
    out = np.empty_like(up)
    np.put_along_axis(out, np.expand_dims(order, tuple(i for i in range(up.ndim) if i != 1)),
                      np.where(np.isnan(seq), np.nan, run), axis=1)
    return out


def _first(kind, flag_total, excess, steps, params):
    """(step, param) of the first flag: at that step the flagged param of the strongest kind
    (NaN/Inf, then scale, then signs) departing furthest beyond what the control allows (the
    largest ``excess``); "" if only the total was flagged; (-1, "") if none."""
    flag = kind > 0
    rows = flag.any(axis=1) | flag_total
    hits = np.flatnonzero(rows)
    if hits.size == 0:
        return -1, ""
    i = int(hits[0])
    if not flag[i].any():
        return int(steps[i]), ""
    cols = np.flatnonzero(flag[i])
    e = np.nan_to_num(excess[i, cols], nan=0.0, posinf=np.inf)
    order = np.lexsort((-e, -kind[i, cols]))
    return int(steps[i]), params[int(cols[order[0]])]


def _control_names(runs_ctrl) -> list:
    names = []
    for runs in runs_ctrl:
        attrs = next(iter(runs.values()))["attrs"] if runs else {}
        names.append(str(attrs.get("control", "")))
    return list(dict.fromkeys(names))


# -- words ------------------------------------------------------------------------------------
def rank_verdict(cmp) -> dict:
    """The verdict of a one-rank comparison as a dict: ``kind`` ("beyond", "within",
    "uncalibrated"), ``step``, ``param``, ``why`` (sign / scale / nonfinite / total / ""),
    the judged ``similarity`` and the control's, ``band``, ``norm_ratio`` and the control's,
    ``flags`` ((step, param) flags), ``params`` (parameters flagged), ``steps`` (compared)."""
    steps = np.asarray(cmp["step"].values)
    step = int(cmp["first_step"].item()) if "first_step" in cmp else -1
    param = str(cmp["first_param"].item()) if "first_param" in cmp else ""
    name = judged_name(cmp)
    out = {"kind": "uncalibrated", "step": step, "param": param, "why": "",
           "similarity": math.nan, "control_similarity": math.nan, "band": math.nan,
           "norm_ratio": math.nan, "control_norm_ratio": math.nan,
           "range_ratio": math.nan, "control_range_ratio": math.nan, "by_range": False,
           "flags": int(np.asarray(cmp["flag"].values).sum()),
           "params": int(np.asarray(cmp["flag"].values).any(axis=0).sum()),
           "steps": int(steps.size), "similarity_name": name,
           "param_count": int(cmp.sizes.get("param", 0)),
           "alpha": float(cmp.attrs.get("alpha", ALPHA)),
           "controls": int(cmp.attrs.get("controls", 1)),
           "control": str(cmp.attrs.get("control", "")),
           "uncontrolled": (int((~np.asarray(cmp["controlled"].values, bool)).sum())
                            if "controlled" in cmp else 0)}
    calibrated = bool(cmp.attrs.get("calibrated"))
    if calibrated:
        out["kind"] = "beyond" if step >= 0 else "within"
    if step < 0:
        sim = np.asarray(cmp[name].values, np.float64)
        out["similarity"] = float(np.nanmin(sim)) if np.isfinite(sim).any() else math.nan
        if calibrated:
            sc = np.asarray(cmp["similarity_control"].values, np.float64)
            out["control_similarity"] = float(np.nanmin(sc)) if np.isfinite(sc).any() \
                else math.nan
        return out
    at = cmp.sel(step=step)
    if param:
        cell = at.sel(param=param)
        out["similarity"] = float(cell[name])
        if not calibrated and "nonfinite" in cmp and bool(cell["nonfinite"]):
            out["why"] = "nonfinite"
        if calibrated:
            out["why"] = KINDS[int(cell["flag_kind"])]
            out["control_similarity"] = float(cell["similarity_control"])
            out["band"] = float(cell["similarity_band"])
            out["norm_ratio"] = float(cell["norm_ratio"])
            out["control_norm_ratio"] = float(cell["norm_ratio_control"])
            out["range_ratio"] = float(cell["range_ratio"])
            out["control_range_ratio"] = float(cell["range_ratio_control"])
            with np.errstate(divide="ignore", invalid="ignore"):
                en = float(cell["norm_dev"] / cell["norm_allowed"])
                er = float(cell["range_dev"] / cell["range_allowed"])
            out["by_range"] = bool(er > en) if not math.isnan(er) else False
    else:
        out["why"] = "total"
        tname = judged_total_name(cmp)
        out["similarity"] = float(at[tname])
        if calibrated:
            out["control_similarity"] = float(at["total_control"])
            out["band"] = float(at["total_band"])
    return out


def verdict_line(cmp, rank=None) -> str:
    """One rank's verdict in words."""
    v = rank_verdict(cmp)
    who = f"rank {rank}: " if rank is not None else ""
    name = v["control"]
    ctrl = f"the {name} control" if name else "the control"
    sim = "significant-sign similarity" if v["similarity_name"] == "similarity_significant" \
        else "sign similarity"
    if v["kind"] == "uncalibrated":
        if v["why"] == "nonfinite":   # no control needed: rounding does not make a NaN
            return (f"{who}the gradient of {v['param']} is NaN/Inf from step {v['step']} where "
                    "the reference's is finite (uncalibrated comparison; NaN/Inf needs no "
                    "control to be told from rounding).")
        if v["step"] >= 0:
            where = f"parameter {v['param']}" if v["param"] else "the total similarity"
            head = (f"uncalibrated: the fixed threshold flags step {v['step']}, {where} "
                    f"({sim} {v['similarity']:.4f})")
        else:
            head = (f"uncalibrated: the fixed threshold flags nothing (lowest {sim} "
                    f"{v['similarity']:.4f} over {_steps(v['steps'])})")
        return (f"{who}{head}. Without a control run, drift from rounding after step 0 cannot "
                "be told from a divergence. To calibrate: train the reference's code again "
                "with GradProbe(model, dump_path=..., control='bf16') (the precision under "
                "test: 'bf16', 'fp16', 'fp32'; 'bf16:cast' for a model cast to bf16), then "
                "compare_grads(ref, test, control=that_run) or --control PATH.")
    if v["kind"] == "within":
        what = f"{name} rounding" if name else "rounding at the control's precision"
        return (f"{who}within what {what} explains over {_steps(v['steps'])}: no "
                f"parameter departs from the reference further than {ctrl} does "
                f"(lowest {sim} {_fmt(v['similarity'])}; the control's lowest "
                f"{_fmt(v['control_similarity'])})." + _rate(v) + _uncontrolled(v))
    where = f"at {v['param']}" if v["param"] else "in the total"
    if v["why"] == "nonfinite":
        what = "its gradient is NaN/Inf where the reference's and the control's are finite"
    elif v["why"] == "scale":
        # the statistic that went furthest beyond its band: the norm, or the range max - min
        stat, key = ("gradient range max - min", "range_ratio") if v["by_range"] else \
            ("gradient norm", "norm_ratio")
        # as many digits as it takes to tell the test's ratio from the control's and from 1
        r_t, r_c = _sig(v[key], v["control_" + key])
        what = (f"{stat} {r_t}x the reference's, {ctrl}'s {r_c}x; {sim} "
                f"{_fmt(v['similarity'])}")
    else:
        s_t, s_c, s_b = _fmt(v["similarity"], v["control_similarity"], v["band"])
        what = f"{sim} {s_t}; {ctrl} keeps {s_c}, noise allows down to {s_b}"
    n, k = v["flags"], v["params"]
    more = (f"; {n} flagged (step, parameter) pair{'s' * (n != 1)} in {k} "
            f"parameter{'s' * (k != 1)}") if n else ""
    return f"{who}beyond rounding noise from step {v['step']} {where} ({what}){more}." + \
        _split(v) + _uncontrolled(v)


def _split(v) -> str:
    """What one control cannot tell, said where it matters: after step 0, a run of rounding
    alone can take another path than its control (a ReLU input carried across zero by drift, a
    token routed to another expert) and read beyond (docs/grad_compare.md: 5 of 225 healthy
    one-control judgments on held-out models, 1 of 92 with two)."""
    if v["controls"] != 1 or v["step"] <= 0 or v["why"] == "nonfinite":
        return ""
    return (" With one control this is also what a run of rounding alone that took another "
            "path at a kink or a routing decision looks like; a second control "
            "(control_seed=1) judges it with two.")


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _rate(v) -> str:
    """The false-alarm rate the verdict holds, and over what."""
    k, n, p = v["controls"], v["steps"], v["param_count"]
    return (f" False-alarm rate at most {v['alpha']:.0%} over {'this' if n == 1 else 'these'} "
            f"{_steps(n)} x {p} parameter{'s' * (p != 1)}, judged with {k} "
            f"control{'s' * (k != 1)}.")


def _uncontrolled(v) -> str:
    u = v["uncontrolled"]
    return (f" {u} compared step{'s' * (u != 1)} without a control run there, not judged."
            if u else "")


def _sig(*xs, least: int = 4, most: int = 12) -> list:
    """``xs`` (ratios) printed with the fewest significant digits, at least ``least``, at which
    values that differ print differently and none but 1 prints as 1 (1.000008 against
    1.000002, not 1 against 1)."""
    fin = [x for x in xs if math.isfinite(x)]
    for n in range(least, most + 1):
        out = [f"{x:.{n}g}" for x in xs]
        shown = {f"{x:.{n}g}" for x in fin}
        if len(shown) == len(set(fin)) and all(
                f"{x:.{n}g}" != "1" for x in fin if x != 1.0):
            return out
    return [f"{x:.{most}g}" for x in xs]


def _fmt(*xs, least: int = 4, most: int = 10):
    """Similarities printed with the fewest decimals, at least ``least``, at which values that
    differ print differently and none below 1 prints as 1 (one string for one value)."""
    fin = [x for x in xs if math.isfinite(x)]
    digits = most
    for n in range(least, most + 1):
        if len({f"{x:.{n}f}" for x in fin}) == len(set(fin)) and all(
                f"{x:.{n}f}" != f"{1:.{n}f}" for x in fin if x < 1.0):
            digits = n
            break
    out = ["n/a (no element significant in both runs)" if math.isnan(x) else f"{x:.{digits}f}"
           for x in xs]
    return out[0] if len(xs) == 1 else out


def replica_text(cmp) -> list:
    """What the two runs' replica checks found (``compare.replica_attrs``): one line per
    disagreement, naming the run."""
    out = []
    for key, who in (("replicas_first", "the first run"), ("replicas_second", "the second run")):
        lines = cmp.attrs.get(key)
        if isinstance(lines, str):
            lines = [lines]
        out += [f"{who}: {line}" for line in (lines or [])]
    return out


def unpaired_text(cmp) -> list:
    """The ranks of either run compared with nothing (``compare._unpaired``), in words."""
    out = []
    for key, who in (("unpaired_first", "first"), ("unpaired_second", "second")):
        ranks = cmp.attrs.get(key)
        if ranks is None:
            continue
        ranks = [int(r) for r in np.atleast_1d(ranks)]
        if ranks:
            out.append(f"not compared: rank{'s' * (len(ranks) > 1)} "
                       f"{', '.join(map(str, ranks))} of the {who} run (no counterpart in the "
                       "other run; ranks=[...] picks ranks)")
    return out


def verdict_text(cmp) -> str:
    """The verdict of every rank of a comparison, one line each, after what the runs' replica
    checks found (replicas that disagree are a bug whatever the reference says)."""
    head = replica_text(cmp) + unpaired_text(cmp)
    if "rank" not in cmp.dims:
        lines = [verdict_line(cmp)]
    else:
        ranks = [int(r) for r in cmp["rank"].values]
        lines = ([verdict_line(cmp.isel(rank=0))] if len(ranks) == 1
                 else [verdict_line(cmp.sel(rank=r), r) for r in ranks])
    return "\n".join(head + lines)


def verdict_kind(cmp) -> str:
    """"beyond" if any rank is beyond noise, else "within", or "uncalibrated"."""
    if not cmp.attrs.get("calibrated"):
        return "uncalibrated"
    first = np.asarray(cmp["first_step"].values)
    return "beyond" if (first >= 0).any() else "within"


class GradComparison(xr.Dataset):
    """What ``compare_grads`` returns: an xarray Dataset whose ``str`` and HTML start with the
    verdict in words (``verdict_text``)."""

    __slots__ = ()

    @classmethod
    def wrap(cls, ds) -> "GradComparison":
        """``ds`` as a ``GradComparison`` (a shallow copy: no data copied, no alignment)."""
        if isinstance(ds, cls):
            return ds
        out = ds.copy(deep=False)
        out.__class__ = cls      # the same layout: the subclass adds no slot
        return out

    def __repr__(self) -> str:
        try:
            head = verdict_text(self)
        except (KeyError, ValueError, IndexError):
            head = ""
        body = xr.Dataset.__repr__(self)
        return f"{head}\n\n{body}" if head else body

    def _repr_html_(self) -> str:
        import html

        try:
            head = verdict_text(self)
        except (KeyError, ValueError, IndexError):
            head = ""
        body = xr.Dataset._repr_html_(self)
        if not head:
            return body
        kind = "beyond" if replica_text(self) else verdict_kind(self)
        color = {"beyond": "#b71c1c", "within": "#1b5e20"}.get(kind, "#8a6d00")
        lines = "<br>".join(html.escape(x) for x in head.splitlines())
        return (f"<p class='probekit-verdict' style='color:{color}'><b>probekit grads</b>: "
                f"{lines}</p>{body}")


# -- the verdict as data ----------------------------------------------------------------------------
#: ``Verdict.reason``: why the first flag is a flag
REASONS = {"sign": "significant signs flip more often than the control allows",
           "scale": "a gradient's norm or max - min moved further than the control allows",
           "nonfinite": "a gradient is NaN/Inf where the reference's and the control's are finite",
           "total": "the step's total similarity, no single parameter",
           "threshold": "the fixed threshold (uncalibrated: no control run)",
           "": "nothing flagged"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A comparison's verdict as data (``cmp.probekit.verdict``, ``verdict_of``, and the same
    object as ``TriageReport.verdict``): ``kind`` "beyond" (the test departs from the reference
    further than rounding at the control's precision explains), "within", or "uncalibrated" (no
    control run: the fixed threshold); ``step`` and ``parameter`` of the first flag (None when
    nothing is flagged; ``parameter`` None when only a step's total is); ``reason`` a key of
    ``REASONS`` ("sign", "scale", "nonfinite", "total", "threshold", ""); ``rank`` whose first
    flag it is; ``similarity`` the judged similarity there (the lowest over the run when nothing
    is flagged), ``control_similarity`` and ``band`` (what noise allows; NaN uncalibrated);
    ``control`` the control's precision ("bf16", ...); ``text`` the verdict in words, one line
    per rank (``str(verdict)``)."""

    kind: str
    step: int | None
    parameter: str | None
    reason: str
    rank: int | None = None
    similarity: float = math.nan
    control_similarity: float = math.nan
    band: float = math.nan
    control: str = ""
    text: str = ""

    @property
    def beyond(self) -> bool:
        return self.kind == "beyond"

    def __str__(self) -> str:
        return self.text


def verdict_of(cmp, rank: int | None = None) -> Verdict:
    """The ``Verdict`` of a comparison: of rank ``rank``, or of the first rank with a flag (the
    first rank when none has one); ``text`` holds every rank's line unless ``rank`` is given."""
    ranks = [int(r) for r in cmp["rank"].values] if "rank" in cmp.dims else [None]
    if rank is not None and rank not in ranks:
        from ...errors import GradCompareError

        raise GradCompareError(f"rank: {rank!r} is not valid; accepted: {ranks}")
    sub = (lambda r: cmp.sel(rank=r) if r is not None else cmp)
    if rank is None:
        rank = next((r for r in ranks if int(sub(r)["first_step"]) >= 0), ranks[0]) \
            if "first_step" in cmp else ranks[0]
        text = verdict_text(cmp)
    else:
        text = verdict_line(sub(rank))
    v = rank_verdict(sub(rank))
    calibrated = bool(cmp.attrs.get("calibrated"))
    flagged = v["step"] >= 0
    reason = (v["why"] if calibrated else ("total" if not v["param"] else "threshold")) \
        if flagged else ""
    return Verdict(kind=v["kind"], step=v["step"] if flagged else None,
                   parameter=(v["param"] or None) if flagged else None, reason=reason,
                   rank=rank, similarity=v["similarity"],
                   control_similarity=v["control_similarity"], band=v["band"],
                   control=v["control"], text=text)
