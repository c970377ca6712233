"""Guided triage: from "two runs part at step s, parameter p" to the API call that did it.

    report = probekit.triage(model, step_fn, "runs/gpu", "runs/npu")
    report                 # in a notebook: divergence, suspect modules, flagged calls (HTML)
    print(report)          # the same as text
    report.findings        # DataFrame, one row per flagged call, most severe first

1. ``compare_grads(run_a, run_b, control=control)`` (or ``comparison=``) gives the first
   divergence and the verdict; the free benchmark runs only when the test departs from the
   reference beyond rounding noise (``grads/verdict.py``): a calibrated comparison within what
   the control explains stops here, saying why, and so does an uncalibrated one whose first
   flag comes after step 0 (where rounding drift alone parts two runs; step 0 is judged on the
   significant signs, which keep rounding noise out); the report says how to calibrate;
2. ``suspects(cmp, model)`` ranks the modules owning the first diverging parameters; each is
   widened ``up`` levels (default 1: ``h.2.attn.c_attn`` -> ``h.2.attn``, where the op feeding the
   parameter's layer usually lives) and the first ``top`` distinct ones are kept;
3. the free benchmark runs ``step_fn()`` once per perturbation and stage, scoped to those modules
   (``FreeBench(module=...)``): forward and backward, ``improve_precision`` (a low-precision op
   losing accuracy; re-runs fp16/bf16 in fp32, fp32 in fp64) and ``add_noise`` (an
   ill-conditioned op amplifying one-ulp input changes); ``add_noise`` only when every floating
   parameter/buffer of the suspects is float64, where there is nothing wider to re-run in;
4. the findings (each a defect or a loss of most significant bits, docs/free_benchmark.md) are
   listed per suspect, most severe first (NaN/Inf, then by ``max_rel / threshold``: the call
   that loses most is the likeliest cause); with ``min_ratio`` above 1 (default 1) the weaker
   ones are only counted.

Check mode: the model's parameters, buffers, ``.grad`` tensors (the same objects), train/eval
flags, the optimizer's state (``optimizer=``) and the RNG states (torch, CUDA, ``random``, numpy)
are saved before and restored after every ``step_fn()`` run, so the training continues exactly as
if triage had not run, and every run sees the same random draws. ``step_fn`` should run the
forward and backward of one training step; if it also steps an optimizer, pass that optimizer as
``optimizer=`` so its state is restored too.

Over 400 lines: the whole triage (its one public function, the state it saves and restores, and
the report with its text, HTML and plot) reads top to bottom here.
"""
from __future__ import annotations

import dataclasses
import html
import logging
import math
import tempfile

import torch

from .log import ROOT as LOG_ROOT, get_logger
from .trainstate import TrainingState, check_step, tensors

log = get_logger(__name__)

STAGES = ("forward", "backward")
#: every finding is listed: each means a defect or a loss of most significant bits (issue 19)
MIN_RATIO = 1.0
LOW_PRECISION = (torch.float16, torch.bfloat16)


# -- suspects ------------------------------------------------------------------------------------
def widen(name: str, up: int) -> str:
    """``name`` ``up`` levels up, never above a child of the root (``head`` stays ``head``)."""
    for _ in range(up):
        if "." not in name:
            break
        name = name.rsplit(".", 1)[0]
    return name


def scoped_suspects(cmp, model, top: int, up: int, order=None):
    """``suspects(cmp, model)`` widened ``up`` levels, merged, the first ``top`` kept; with a
    forward ``order`` (the model's modules in the order they run: ``named_modules()``'s,
    construction order, is the forward's for most models), the first suspect's nearest flagged
    module before it (``walk_back``) is kept too, where the divergence it shows may start."""
    import pandas as pd

    from .grads.compare.suspects import suspects, walk_back

    df = suspects(cmp, model=model, order=order)
    back = walk_back(df)[:1] if order is not None else []
    rows: dict[str, dict] = {}
    for _, row in df.iterrows():
        if not row["module"]:
            log.info("triage: %s belong(s) to the root module; not a module to scope",
                     ", ".join(row["params"]))
            continue
        name = widen(row["module"], up)
        if name not in rows:
            if len(rows) >= top and row["module"] not in back:
                continue
            rows[name] = {"module": name, "step": row["step"], "similarity": row["similarity"],
                          "params": list(row["params"]), "owners": [row["module"]],
                          "rank": row["rank"]}
        else:
            rows[name]["params"] += [p for p in row["params"] if p not in rows[name]["params"]]
            rows[name]["owners"].append(row["module"])
    out = pd.DataFrame(list(rows.values()),
                       columns=["module", "step", "similarity", "params", "owners", "rank"])
    out["params"] = out["params"].map(tuple)
    out["owners"] = out["owners"].map(tuple)
    return out


def pert_modes_for(model, modules) -> tuple:
    """``improve_precision`` and ``add_noise``; ``add_noise`` alone when every floating
    parameter/buffer of ``modules`` is float64 (nothing wider to re-run in)."""
    named = dict(model.named_modules())
    dtypes = {t.dtype for m in modules for t in tensors(named[m]) if t.is_floating_point()}
    if dtypes and dtypes <= {torch.float64}:
        return ("add_noise",)
    return ("improve_precision", "add_noise")


# -- the report ------------------------------------------------------------------------------------
@dataclasses.dataclass
class TriageReport:
    """What ``triage`` found: ``divergence`` (rank, step, param, similarity), ``suspects``
    (DataFrame: module, step, similarity, params, owners, rank, findings, minor), ``findings``
    (DataFrame, one row per flagged call and stage: the free benchmark's columns plus ``suspect``
    and ``pert_modes``, suspects in rank order, most severe first within each), ``runs`` (per
    perturbation and stage: the free benchmark's summary), ``comparison`` (the Dataset)."""

    divergence: dict
    suspects: object
    findings: object
    runs: list
    comparison: object
    min_ratio: float = MIN_RATIO
    #: why the free benchmark did not run ("" when it ran, or when nothing diverges)
    stopped: str = ""
    #: the comparison's verdict (``grads.compare.verdict.Verdict``: kind, step, parameter,
    #: reason; ``str()`` of it is the line), the same object as ``comparison.probekit.verdict``
    #: (of the rank triaged)
    verdict: object = None
    #: what the uncalibrated verdict cannot say ("" when calibrated or nothing is flagged)
    caveat: str = ""
    #: the suspects flagged at the first step that run before the first one in the forward
    #: pass, in words (``suspects.walk_back_text``): where the divergence may start
    walk_back: str = ""

    @property
    def calibrated(self) -> bool:
        """Was the comparison judged against a control run?"""
        return bool(getattr(self.comparison, "attrs", {}).get("calibrated"))

    def _headline(self) -> list:
        d = self.divergence
        if self.calibrated:
            return [f"Triage: {self.verdict}"]
        lines = [f"Triage: runs diverge first at step {d['step']}, parameter {d['param']!r} "
                 f"(similarity {d['similarity']:.3f}, rank {d['rank']})."]
        if self.caveat:
            lines.append(self.caveat)
        return lines

    def summary(self, top: int = 5) -> str:
        d = self.divergence
        if d["step"] < 0:
            if self.calibrated:
                return f"Triage: {self.verdict} {self.stopped}".rstrip()
            return "Triage: the runs do not diverge (no parameter flagged); nothing to check."
        lines = self._headline()
        if self.stopped:
            lines.append(self.stopped)
            return "\n".join(lines)
        if self.suspects.empty:
            lines.append("No module to check.")
            return "\n".join(lines)
        if self.walk_back:
            lines.append(self.walk_back)
        modes = list(dict.fromkeys(r["pert_mode"] for r in self.runs))
        lines.append(f"Checked {len(self.suspects)} suspect module(s) with "
                     f"{', '.join(modes)}, forward and backward:")
        for i, s in self.suspects.iterrows():
            rows = self.findings[self.findings["suspect"] == s["module"]]
            head = (f"{i + 1}. {s['module']} (flagged at step {s['step']}, similarity "
                    f"{s['similarity']:.3f}; {_names(s['params'])})")
            if rows.empty:
                lines.append(f"{head}: no flagged call" + (f" ({s['minor']} below "
                             f"{self.min_ratio:g}x threshold)" if s["minor"] else ""))
                continue
            lines.append(f"{head}: {len(rows)} flagged call(s)")
            sites = _cell_sites()
            for _, r in rows.head(top).iterrows():
                lines.append(f"     {r['api_name']} [{r['pert_modes']}] {r['kind']} "
                             f"{_ratio(r['ratio'])} threshold, {r['module']}, "
                             f"{_site(r['call_site'], sites)}")
            if len(rows) > top:
                lines.append(f"     ... {len(rows) - top} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        """The verdict first: each table starts with what was found (flagged calls, how far
        over the threshold, the kind) and ends with the long names, which wrap, so the verdict
        stays in view in a narrow output area."""
        d = self.divergence
        esc = html.escape
        th = "text-align:left;padding:3px 8px;border-bottom:1px solid #999;vertical-align:bottom"
        td = "text-align:left;padding:2px 8px;border-bottom:1px solid #ddd;vertical-align:top"
        short = td + ";white-space:nowrap"  # numbers and verdicts: one line
        name = td + ";font-family:monospace"  # names wrap after their dots (_wrap)
        sites = _cell_sites()
        if d["step"] < 0:
            return (f"<p><b>probekit triage</b>: "
                    f"{esc(self.summary().removeprefix('Triage: '))}</p>")
        if self.calibrated:
            out = [f"<div class='probekit-triage'><p><b>probekit triage</b>: "
                   f"{esc(str(self.verdict))}</p>"]
        else:
            out = [f"<div class='probekit-triage'><p><b>probekit triage</b>: runs diverge first "
                   f"at step <b>{d['step']}</b>, parameter <code>{esc(d['param'])}</code> "
                   f"(similarity {d['similarity']:.3f}, rank {d['rank']}).</p>"]
            if self.caveat:
                out.append(f"<p>{esc(self.caveat)}</p>")
        if self.stopped:
            return "".join(out) + f"<p>{esc(self.stopped)}</p></div>"
        if self.suspects.empty:
            return "".join(out) + "<p>No module to check.</p></div>"
        if self.walk_back:
            out.append(f"<p>{esc(self.walk_back)}</p>")
        table = "<table style='table-layout:auto;max-width:100%'>"
        out.append(table + "<thead><tr>" + "".join(
            f"<th style='{th}'>{h}</th>" for h in ("#", "flagged calls",
                                                    f"below {self.min_ratio:g}×", "suspect module",
                                                    "flagged at step", "similarity",
                                                    "parameters")) + "</tr></thead><tbody>")
        for i, s in self.suspects.iterrows():
            n = int(s["findings"])
            style = "color:#b71c1c;font-weight:600" if n else "color:#1b5e20"
            out.append(f"<tr><td style='{short}'>{i + 1}</td><td style='{short};{style}'>{n}</td>"
                       f"<td style='{short}'>{int(s['minor'])}</td>"
                       f"<td style='{name}'>{_wrap(s['module'])}</td>"
                       f"<td style='{short}'>{s['step']}</td>"
                       f"<td style='{short}'>{s['similarity']:.3f}</td>"
                       f"<td style='{name}'>{_wrap(_names(s['params']))}</td></tr>")
        out.append("</tbody></table>")
        if not self.findings.empty:
            cols = [("suspect", "suspect"), ("× threshold", "ratio"), ("kind", "kind"),
                    ("perturbations", "pert_modes"), ("API call", "api_name"),
                    ("module", "module"), ("call site", "call_site"), ("dtype, shape", "dtype")]
            wraps = {"suspect", "api_name", "module", "call_site", "dtype", "pert_modes"}
            out.append("<p>Flagged calls, most severe first within each suspect:</p>" + table
                       + "<thead><tr>" + "".join(f"<th style='{th}'>{h}</th>" for h, _ in cols)
                       + "</tr></thead><tbody>")
            for _, r in self.findings.iterrows():
                cells = []
                for _, c in cols:
                    v = r[c]
                    v = (_ratio(v) if c == "ratio" else _site(v, sites) if c == "call_site"
                         else str(v).removeprefix("torch."))
                    if c == "dtype":
                        v = f"{v} {r['shape']}"
                    cells.append(f"<td style='{name}'>{_wrap(v)}</td>" if c in wraps else
                                 f"<td style='{short}'>{esc(v)}</td>")
                out.append("<tr>" + "".join(cells) + "</tr>")
            out.append("</tbody></table>")
        return "".join(out) + "</div>"

    def plot(self, ax=None, top: int = 15):
        """The flagged calls by severity, coloured by suspect (``probekit.plot.triage``)."""
        from .plot import triage as plot_triage

        return plot_triage(self, ax=ax, top=top)


def _wrap(text) -> str:
    """``text`` escaped; a long one (over 20 characters) with a line-break opportunity after each
    ``.``, ``_``, ``,`` and ``:`` (a dotted name wraps between its parts, never inside a word;
    a short one never wraps)."""
    out = html.escape(str(text))
    if len(str(text)) <= 20:
        return out
    for ch in (".", "_", ",", ":"):
        out = out.replace(ch, ch + "<wbr>")
    return out


def _names(names, n: int = 3) -> str:
    names = list(names)
    more = f", +{len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _cell_sites() -> dict:
    """Notebook cell file names -> ``In [n]`` when an IPython shell is running (else empty);
    the notebook layer is only imported then."""
    import sys

    if "IPython" not in sys.modules:
        return {}
    try:
        from .notebook.display import cell_sites  # {} when no IPython shell is running

        return cell_sites()
    except Exception:  # a display nicety: never fail the report over it
        return {}


def _site(site, sites: dict) -> str:
    name, sep, line = str(site).rpartition(":")
    return f"{sites[name]} line {line}" if sep and name in sites else str(site)


def _ratio(v) -> str:
    v = float(v)
    return "∞×" if math.isinf(v) else f"{v:,.1f}×"


# -- triage ----------------------------------------------------------------------------------------
def triage(model, step_fn, run_a=None, run_b=None, *, control=None, comparison=None,
           top: int = 3, up: int = 1,
           pert_modes=None, stages=STAGES, min_ratio: float = MIN_RATIO, optimizer=None,
           dump_path=None, rank=None, verbose: bool = False) -> TriageReport:
    """Compare two runs, check their top suspect modules with the free benchmark, report.

    ``model``: the ``nn.Module`` to check (as in the run under suspicion); ``step_fn()``: runs
    one training step (forward + backward) of it; ``run_a``, ``run_b``: grad-probe runs (paths or
    Datasets, as ``compare_grads`` takes them) and ``control``: a control run of ``run_a`` (or a
    list; ``GradProbe(..., control="bf16")``), or ``comparison=`` an existing comparison. The
    free benchmark runs only when the comparison is beyond rounding noise (or, uncalibrated,
    flags step 0); otherwise the report says why it stopped (``report.stopped``).
    ``top``: suspect modules checked; ``up``: levels each suspect is widened by;
    ``pert_modes``: default ``pert_modes_for`` the suspects' dtype; ``stages``: forward,
    backward; ``min_ratio``: findings listed from this ``max_rel / threshold`` on (default 1: all;
    NaN/Inf always); ``optimizer``: restored too if ``step_fn`` steps it; ``dump_path``: where
    the free benchmark's CSV goes (default: a temporary folder, removed afterwards); ``rank``:
    the rank whose divergence is reported (default: the first with a flag); ``verbose``: keep
    the free benchmark's per-API INFO log lines (default: warnings only while it runs).
    """
    import pandas as pd

    from .config import FUZZ_STAGES, PERT_MODES, ConfigError
    from .freebench.perturb.modes import MODES
    from .freebench import FreeBench
    from .freebench.report.results import COLUMNS

    check_step(model, step_fn)
    for name, value in (("top", top), ("up", up)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "top"
                                                                             else 0):
            raise ConfigError(f"{name}: {value!r} is not valid; accepted: an integer >= "
                              f"{1 if name == 'top' else 0}")
    stages = (stages,) if isinstance(stages, str) else tuple(stages)
    for st in stages:
        if st not in FUZZ_STAGES:
            raise ConfigError(f"stages: {st!r} is not valid; accepted: {', '.join(FUZZ_STAGES)}")
    if comparison is None:
        if run_a is None or run_b is None:
            raise TypeError("run_a, run_b: two grad-probe runs are needed (or comparison=)")
        from .grads.compare.compare import compare_grads

        comparison = compare_grads(run_a, run_b, control=control)
    divergence = _divergence(comparison, rank)
    verdict, caveat, stopped = _plan(comparison, divergence, rank)
    order, walk = None, ""
    if divergence["step"] >= 0 and not stopped:  # where to walk back to: the modules in
        from .grads.compare.suspects import suspects as _suspects, walk_back_text

        order = [name for name, _ in model.named_modules()]  # construction (forward) order
        walk = walk_back_text(_suspects(comparison, model=model, order=order))
    sus = scoped_suspects(comparison, model, top, up, order)
    modules = list(sus["module"]) if not stopped else []
    if pert_modes is None:
        pert_modes = pert_modes_for(model, modules) if modules else ()
    pert_modes = (pert_modes,) if isinstance(pert_modes, str) else tuple(pert_modes)
    for mode in pert_modes:
        in_place = [m for m in PERT_MODES if MODES[m].fuzz_device == "npu"]  # no to_cpu
        if mode not in in_place:
            raise ConfigError(f"pert_modes: {mode!r} is not valid; accepted: "
                              f"{', '.join(in_place)}")
    runs, frames = [], []
    if modules:
        tmp = tempfile.TemporaryDirectory(prefix="probekit-triage-") if dump_path is None \
            else None
        folder = tmp.name if tmp is not None else dump_path
        state = TrainingState(model, optimizer)
        logger = logging.getLogger(LOG_ROOT)
        level = logger.level
        if not verbose:
            logger.setLevel(logging.WARNING)
        try:
            for mode in pert_modes:
                for stage in stages:
                    state.restore()
                    # one dump for the whole triage: the later runs append to the first's
                    fb = FreeBench(dump_path=folder, pert_mode=mode, fuzz_stage=stage,
                                   model=model, module=modules, resume=bool(runs))
                    with fb:
                        step_fn()
                    runs.append({"pert_mode": mode, "stage": stage, **fb.summary})
                    frames.append(fb.results)
        finally:
            logger.setLevel(level)
            state.restore()
            if tmp is not None:
                tmp.cleanup()
    results = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=list(COLUMNS))
    findings, counts = _findings(results, modules, min_ratio)
    sus["findings"] = [counts.get(m, (0, 0))[0] for m in sus["module"]]
    sus["minor"] = [counts.get(m, (0, 0))[1] for m in sus["module"]]
    return TriageReport(divergence, sus, findings, runs, comparison, float(min_ratio), stopped,
                        verdict, caveat, walk)


def _plan(cmp, divergence, rank=None) -> tuple:
    """(the ``Verdict`` (of the rank triaged), an uncalibrated caveat or "", why the free
    benchmark stops or "")."""
    from .grads.compare.verdict import verdict_line, verdict_of

    verdict = verdict_of(cmp, rank)
    if cmp.attrs.get("calibrated"):
        if divergence["step"] >= 0:
            return verdict, "", ""
        return verdict, "", ("Nothing to check: the free benchmark was not run (the test "
                             "departs from the reference no further than rounding at the "
                             "control's precision does).")
    if divergence["step"] < 0:
        return verdict, "", ""
    if divergence["step"] == 0 and cmp.attrs.get("noise_aware"):
        return verdict, ("Uncalibrated (no control run): a flag at step 0 is judged on the "
                         "significant signs, which keep rounding noise out; after step 0 a "
                         "control is needed."), ""
    r = divergence["rank"]
    line = verdict_line(cmp.sel(rank=r) if "rank" in cmp.dims else cmp)
    how = line[line.index("To calibrate:"):] if "To calibrate:" in line else ""
    why = (f"the first flag is at step {divergence['step']}, after step 0, where rounding "
           "drift alone parts two runs" if cmp.attrs.get("noise_aware") else
           "the comparison is judged on plain signs, which rounding noise flips")
    return verdict, "", (f"Stopped before the free benchmark: the comparison is uncalibrated "
                         f"and {why}. " + how)


def _divergence(cmp, rank) -> dict:
    ranks = [int(r) for r in cmp["rank"].values] if "rank" in cmp.dims else [0]
    if rank is not None and rank not in ranks:
        from .config import ConfigError

        raise ConfigError(f"rank: {rank!r} is not valid; accepted: {ranks}")
    from .grads.compare.verdict import judged_name, judged_total_name

    order = [rank] if rank is not None else ranks
    for r in order:
        sub = cmp.sel(rank=r) if "rank" in cmp.dims else cmp
        step = int(sub["first_step"]) if "first_step" in sub else -1
        if step >= 0:
            param = str(sub["first_param"].item())
            # the judged similarity: the number behind the flag (significant signs when the
            # comparison is noise-aware)
            sim = float(sub[judged_name(cmp)].sel(step=step, param=param)) if param else \
                float(sub[judged_total_name(cmp)].sel(step=step))
            return {"rank": r, "step": step, "param": param, "similarity": sim}
    return {"rank": order[0], "step": -1, "param": "", "similarity": float("nan")}


def _owner(module: str, modules) -> str:
    """The scoped module containing ``module`` (the longest name that is it or a prefix)."""
    best = ""
    for m in modules:
        if (module == m or module.startswith(m + ".")) and len(m) > len(best):
            best = m
    return best


def _findings(results, modules, min_ratio):
    """(listed findings, {suspect: (listed, minor)}): one row per (suspect, call, stage), NaN/Inf
    mismatches first, then by ``max_rel / threshold`` (sign flips by theirs too)."""
    import pandas as pd

    counts: dict[str, tuple] = {}
    if results.empty:
        cols = ["suspect", *results.columns, "pert_modes"]
        return pd.DataFrame(columns=cols), counts
    df = results.assign(suspect=[_owner(m, modules) for m in results["module"]])
    strong = df["kind"].isin(["nan_inf", "sign_flip"]) | (df["ratio"] >= min_ratio)
    rows = []
    for suspect in modules:
        part = df[df["suspect"] == suspect]
        listed = part[strong[part.index]]
        listed = listed.assign(_o=(listed["kind"] != "nan_inf"), _r=-listed["ratio"]).sort_values(
            ["_o", "_r"], kind="stable").drop(columns=["_o", "_r"])
        merged = []
        for _, group in listed.groupby(["api_name", "stage"], sort=False):
            row = group.iloc[0].copy()
            row["pert_modes"] = ", ".join(dict.fromkeys(group["pert_mode"]))
            merged.append(row)
        minor = part[~strong[part.index]].drop_duplicates(["api_name", "stage"])
        counts[suspect] = (len(merged), len(minor))
        rows += merged
    out = pd.DataFrame(rows).reset_index(drop=True) if rows else pd.DataFrame(
        columns=["suspect", *results.columns, "pert_modes"])
    front = ["suspect", "api_name", "stage", "kind", "ratio", "pert_modes"]
    return out[front + [c for c in out.columns if c not in front]], counts
