"""matplotlib figures for both features. Headless: no IPython, no ipywidgets.

Every function takes ``ax=None`` (a new figure is made through pyplot, so it shows inline in a
notebook) or an existing Axes (nothing touches pyplot then), draws, and returns the Figure it drew
on (its Axes: ``fig.axes[0]``). A figure made here shows once in a notebook, with no text repr
above it, also as the cell's last expression.

Names in legends and labels are shortened for reading (``legend_names``): the dotted prefix all
of them share is dropped and a long name keeps its end (``…layer.5.ffn.lin2.weight``), where
parameter names differ.

Grad probe (datasets of ``probekit.open_grads`` / ``probekit.compare_grads``):

* :func:`similarity` - direction similarity per parameter over steps, threshold line, flags
* :func:`total_similarity` - element-weighted similarity per rank over steps, flags
* :func:`interval_distribution` - share of elements per interval, a step x interval heatmap
* :func:`grad_stats` - max / min / norm of one parameter's gradient over steps

Free benchmark (``FreeBench.results`` or a DataFrame with its columns):

* :func:`findings` - APIs ranked by max_rel / threshold

Triage (``probekit.triage``): :func:`triage` - the flagged calls of the suspect modules
"""
from __future__ import annotations

import math

import numpy as np

FLAG_COLOR = "#d62728"
THRESHOLD_COLOR = "#7f7f7f"
KIND_COLORS = {"nan_inf": "#7b1fa2", "sign_flip": "#d62728", "rel_error": "#ff7f0e",
               "abs_error": "#1f77b4"}


def _axes(ax, figsize):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, layout="constrained", FigureClass=_figure_class())[1]


_FIGURE_CLASS = None


def _figure_class():
    """``PlotFigure``: a matplotlib Figure that shows once in a notebook, without a text repr.

    Made on first use (matplotlib is imported by the plot functions only). However it comes to
    be displayed -- as a cell's last expression, by the inline backend at the end of the cell, by
    ``display(fig)`` -- it shows as one PNG and leaves pyplot, so nothing draws it a second
    time (the inline backend closes its figures after a cell anyway). ``savefig`` writes no
    metadata that changes from run to run or version to version (matplotlib's version in a
    PNG, a date in an SVG or PDF) unless given ``metadata=``: the same figure is the same bytes
    (the README's pictures, redrawn by ``make demo``, stay what is committed)."""
    global _FIGURE_CLASS
    if _FIGURE_CLASS is None:
        from matplotlib.figure import Figure

        class PlotFigure(Figure):
            def savefig(self, fname, *args, **kwargs):
                if "metadata" not in kwargs:
                    fmt = _save_format(fname, kwargs.get("format"))
                    if fmt in _NO_METADATA:
                        kwargs["metadata"] = dict(_NO_METADATA[fmt])
                return super().savefig(fname, *args, **kwargs)

            def _ipython_display_(self):
                import io

                from matplotlib import pyplot as plt
                from matplotlib._pylab_helpers import Gcf

                from .notebook.display import show_png

                if any(m.canvas.figure is self for m in Gcf.get_all_fig_managers()):
                    plt.close(self)
                buf = io.BytesIO()
                self.savefig(buf, format="png", bbox_inches="tight")
                show_png(buf.getvalue())

        _FIGURE_CLASS = PlotFigure
    return _FIGURE_CLASS


#: the metadata a saved figure leaves out, per format (matplotlib writes its version, dates)
_NO_METADATA = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None},
                "pdf": {"CreationDate": None, "Creator": None, "Producer": None}}


def _save_format(fname, fmt) -> str:
    """The format ``savefig`` writes: ``format=``, else the file's extension, else
    ``savefig.format``."""
    import os

    from matplotlib import rcParams

    if fmt:
        return str(fmt).lower()
    if isinstance(fname, (str, os.PathLike)):
        ext = os.path.splitext(os.fspath(fname))[1].lstrip(".").lower()
        if ext:
            return ext
    return str(rcParams["savefig.format"]).lower()


def short_name(name: str, width: int = 36) -> str:
    """``name`` shortened from the left to at most ``width`` characters, at a dot where one is
    near: the end of a dotted name is what tells it apart (``…layer.5.output_layer_norm.weight``)."""
    name = str(name)
    if len(name) <= width:
        return name
    tail = name[len(name) - (width - 1):]
    dot = tail.find(".")
    if 0 <= dot < (width - 1) // 2:  # start at a component when that loses less than half
        tail = tail[dot + 1:]
    return "…" + tail


def legend_names(names, width: int = 36) -> list:
    """Readable, unique labels for ``names``: the dotted prefix they all share is dropped (with
    two or more names; each keeps at least two parts, so ``blocks.2`` stays ``blocks.2``), then
    each is shortened from the left (``short_name``); a label that would then equal another's is
    lengthened until they differ (the full name at most).

    >>> legend_names(["distilbert.transformer.layer.0.attention.q_lin.weight",
    ...               "distilbert.transformer.layer.5.output_layer_norm.weight"])
    ['0.attention.q_lin.weight', '5.output_layer_norm.weight']
    """
    names = [str(n) for n in names]
    if len(names) > 1:
        parts = [n.split(".") for n in names]
        common = 0
        while (all(len(p) > common + 2 for p in parts)  # each keeps two parts: not a bare "2"
               and len({p[common] for p in parts}) == 1):
            common += 1
        stripped = [".".join(p[common:]) for p in parts]
    else:
        stripped = names
    labels = [short_name(n, width) for n in stripped]
    for w in range(width + 1, max((len(n) for n in stripped), default=0) + 2):
        dupes = {lab for lab in labels if labels.count(lab) > 1}
        if not dupes:
            break
        labels = [short_name(n, w) if lab in dupes else lab for n, lab in zip(stripped, labels)]
    return labels


def _one_rank(cmp, rank):
    if "rank" not in cmp.dims:
        return cmp, None
    if rank is None:
        rank = int(cmp["rank"].values[0])
    if rank not in set(int(r) for r in cmp["rank"].values):
        raise ValueError(f"rank {rank!r} is not in this comparison; accepted: "
                         f"{', '.join(str(int(r)) for r in cmp['rank'].values)}")
    return cmp.sel(rank=rank), rank


def _params(ds, params):
    names = [str(p) for p in ds["param"].values]
    if params is None:
        return names
    params = [params] if isinstance(params, str) else list(params)
    missing = [p for p in params if p not in names]
    if missing:
        raise ValueError(f"param {missing[0]!r} is not in this dataset; accepted: "
                         f"{', '.join(names)}")
    return params


def _threshold_line(ax, value, label):
    ax.axhline(value, color=THRESHOLD_COLOR, linestyle="--", linewidth=1, label=label, zorder=1)


def _legend(ax, n, where="outside"):
    """Legend right of the axes (``"outside"``, keeps long names off the data) or inside."""
    if n <= 0:
        return
    if where == "outside":
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                  frameon=False, borderaxespad=0)
    else:
        ax.legend(loc="best", fontsize="small", framealpha=0.8)


def _step_ticks(ax, steps):
    steps = np.asarray(steps)
    if len(steps) <= 12 and len(steps):
        ax.set_xticks(steps)


def _step0_threshold(cmp) -> float:
    """The comparison's step-0 threshold (its attribute; the comparison's default otherwise)."""
    from .grads.compare.compare import STEP0_THRESHOLD

    return float(cmp.attrs.get("step0_threshold", STEP0_THRESHOLD))


def _judged(cmp):
    """(the similarity variable flags are judged on, its axis label): the one number shown."""
    from .grads.compare.verdict import judged_name

    name = judged_name(cmp)
    label = ("share of equal gradient signs (significant elements)"
             if name == "similarity_significant" else "share of equal gradient signs")
    return name, label


def _ylim(ax, lo, lows, thr, calibrated) -> None:
    """Down to the threshold (uncalibrated), or to the lowest of the data and ``lows`` (the
    total's band) with a margin of a tenth of the shown range (calibrated: data near 1 stay
    readable; a parameter's band reaching further down is cut)."""
    if not calibrated:
        ax.set_ylim(min(lo, thr) - 0.02, 1.005)
        return
    floor = min([lo, *lows])
    span = max(1.0 - floor, 1e-4)
    ax.set_ylim(floor - 0.1 * span, 1.0 + 0.05 * span)


def _control_label(cmp) -> str:
    """"the bf16 control" or "the control" (a control run recorded without its name)."""
    name = str(cmp.attrs.get("control", ""))
    return f"{name} control" if name else "control"


def similarity(cmp, params=None, *, rank=None, ax=None, max_lines: int = 12,
               legend: str = "outside"):
    """Direction similarity of each parameter over steps for one rank of a comparison: the
    similarity the flags are judged on (significant signs when the comparison is noise-aware).

    Calibrated by a control run (``compare_grads(..., control=)``), each line's shaded band is
    what the control allows (down to ``similarity_band``, dotted); red markers say why a point
    is flagged (a cross: its signs; a diamond: its scale, the norm or max - min, whatever its
    similarity; a plus: NaN/Inf). Otherwise a dashed line marks the comparison's
    ``step0_threshold`` and red crosses the flagged (step, param) points. With more
    than ``max_lines`` parameters (and ``params`` not given), the flagged ones and the lowest
    ones are drawn, up to ``max_lines``.
    """
    ds, rank = _one_rank(cmp, rank)
    ax = _axes(ax, (9, 4.2))
    names = _params(ds, params)
    name, ylabel = _judged(cmp)
    sim = ds[name]
    flag = ds["flag"]
    calibrated = bool(cmp.attrs.get("calibrated")) and "similarity_band" in ds
    if params is None and len(names) > max_lines:
        worst = sim.min("step").to_series()
        flagged = flag.any("step").to_series()
        order = sorted(names, key=lambda p: (not flagged[p], worst[p]))
        names = [p for p in ds["param"].values if p in set(order[:max_lines])]
    steps = ds["step"].values
    lows = []
    for i, (p, label) in enumerate(zip(names, legend_names(names))):
        (line,) = ax.plot(steps, sim.sel(param=p).values, marker="o", markersize=3,
                          linewidth=1.5, label=label, gid=f"similarity:{p}")
        if calibrated:   # what the control allows: shaded, its lower edge dashed
            band = ds["similarity_band"].sel(param=p).values
            ax.fill_between(steps, band, 1.0, color=line.get_color(), alpha=0.07, linewidth=0,
                            label=f"{_control_label(cmp)} allows" if i == 0 else None,
                            gid=f"band:{p}")
            ax.plot(steps, band, color=line.get_color(), linestyle=":", linewidth=1,
                    gid=f"band_edge:{p}")
    fx, fy, fk = [], [], []
    kinds = ds["flag_kind"] if calibrated and "flag_kind" in ds else None
    for p in names:
        f = flag.sel(param=p).values
        fx.extend(steps[f])
        fy.extend(sim.sel(param=p).values[f])
        fk.extend(kinds.sel(param=p).values[f] if kinds is not None else [1] * int(f.sum()))
    thr = _step0_threshold(cmp)
    if not calibrated:
        _threshold_line(ax, thr, f"step-0 threshold {thr:g}")
    if fx:
        fx, fy, fk = np.asarray(fx), np.asarray(fy, np.float64), np.asarray(fk)
        if kinds is None:
            ax.scatter(fx, fy, marker="X", s=70, color=FLAG_COLOR, zorder=5,
                       label=f"flagged ({len(fx)})", gid="flags")
        else:   # the kind of flag: its signs (X), its scale (diamond: norm or max - min)
            for code, marker, what in ((1, "X", "signs"), (2, "D", "scale"),
                                       (3, "P", "NaN/Inf")):
                sel = fk == code
                if sel.any():
                    ax.scatter(fx[sel], np.nan_to_num(fy[sel], nan=1.0), marker=marker,
                               s=70 if code != 2 else 40, color=FLAG_COLOR, zorder=5,
                               label=f"flagged: {what} ({int(sel.sum())})",
                               gid=f"flags:{what}")
    lo = float(np.nanmin(sim.sel(param=names).values)) if names else thr
    _ylim(ax, lo, lows, thr, calibrated)
    _step_ticks(ax, steps)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    title = "Gradient direction similarity per parameter"
    ax.set_title(title + (f" (rank {rank})" if rank is not None else ""))
    first = _first_flag(ds)
    if first:
        ax.text(0.01, 0.02, first, transform=ax.transAxes, fontsize="small", color=FLAG_COLOR,
                va="bottom")
    _replica_note(ax, cmp)
    ax.grid(True, alpha=0.3)
    _legend(ax, len(names), legend)
    return ax.figure


def _replica_note(ax, cmp) -> None:
    """What the runs' replica checks found (``verdict.replica_text``), in red at the top of the
    plot: replicas that disagree are a bug whatever the similarity shows."""
    from .grads.compare.verdict import replica_text

    lines = replica_text(cmp)
    if not lines:
        return
    text = lines[0] if len(lines) == 1 else f"{lines[0]} (+{len(lines) - 1} more)"
    ax.text(0.01, 0.98, text, transform=ax.transAxes, fontsize="small", color=FLAG_COLOR,
            va="top", wrap=True, gid="replicas")


def _first_flag(ds) -> str:
    if "first_step" not in ds:
        return ""
    step = int(ds["first_step"].values)
    if step < 0:
        return ""
    return f"first flag: step {step}, {short_name(str(ds['first_param'].values), 48)}"


def total_similarity(cmp, *, rank=None, ax=None):
    """Element-weighted direction similarity over steps (the one the flags are judged on), one
    line per rank, flags marked; calibrated by a control run, the control's own total is drawn
    dashed and the band it allows shaded."""
    from .grads.compare.verdict import judged_total_name

    ax = _axes(ax, (8, 3.6))
    ranks = [rank] if rank is not None else [int(r) for r in cmp["rank"].values]
    steps = cmp["step"].values
    name = judged_total_name(cmp)
    calibrated = bool(cmp.attrs.get("calibrated")) and "total_band" in cmp
    flagged = 0
    lows = []
    for r in ranks:
        ds, _ = _one_rank(cmp, r)
        total = ds[name].values
        (line,) = ax.plot(steps, total, marker="o", markersize=3, linewidth=1.8,
                          label=f"rank {r}", gid=f"total:{r}")
        if calibrated:
            band = ds["total_band"].values
            ctrl = _control_label(cmp)
            ax.plot(steps, ds["total_control"].values, color=line.get_color(), linestyle="--",
                    linewidth=1, label=ctrl, gid=f"control:{r}")
            ax.fill_between(steps, band, 1.0, color=line.get_color(), alpha=0.12, linewidth=0,
                            label=f"{ctrl} allows", gid=f"band:{r}")
            lows.append(np.nanmin(band) if np.isfinite(band).any() else 1.0)
        f = ds["flag_total"].values
        if f.any():
            ax.scatter(steps[f], total[f], marker="X", s=70, color=FLAG_COLOR, zorder=5,
                       label="flagged" if not flagged else None, gid=f"flags:{r}")
            flagged += int(f.sum())
    thr = _step0_threshold(cmp)
    if not calibrated:
        _threshold_line(ax, thr, f"step-0 threshold {thr:g}")
    lo = float(np.nanmin(cmp[name].sel(rank=ranks).values))
    _ylim(ax, lo, lows, thr, calibrated)
    _step_ticks(ax, steps)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("similarity (element-weighted)" if name == "total" else
                  "similarity (significant, element-weighted)")
    ax.set_title("Total gradient direction similarity")
    _replica_note(ax, cmp)
    ax.grid(True, alpha=0.3)
    _legend(ax, len(ranks))
    return ax.figure


def _flag_steps(ax, steps, flag_steps, *, label=True):
    for i, s in enumerate(sorted(set(int(s) for s in flag_steps))):
        ax.axvspan(s - 0.5, s + 0.5, color=FLAG_COLOR, alpha=0.12, linewidth=0,
                   label="flagged step" if (label and i == 0) else None, gid=f"flagstep:{s}")


def _replica_steps(ax, ds, param, steps) -> None:
    """The steps at which ``param``'s replicas disagreed (the run's replica check: hatched),
    labelled with what differed."""
    if "replicas" not in ds:
        return
    from .grads.store.replicas import what_text

    from matplotlib.colors import to_rgba

    code = np.asarray(ds["replicas"].sel(param=param).values, np.int64)
    bad = (code & 6) > 0
    for i, s in enumerate(np.asarray(steps)[bad]):
        ax.axvspan(s - 0.5, s + 0.5, facecolor="none", edgecolor=to_rgba(FLAG_COLOR, 0.35),
                   hatch="//", linewidth=0, label=(f"replicas disagree ({what_text(code[bad][0])} first)"
                                       if i == 0 else None), gid=f"replicas:{int(s)}")


def interval_distribution(ds, param: str, *, ax=None, flag_steps=(), cmap="viridis"):
    """Share of ``param``'s gradient elements per ``bounds`` interval: rows are intervals
    (lowest at the bottom), columns are steps; flagged steps are outlined in red."""
    if "dist" not in ds:
        raise ValueError(f"the interval distribution needs grad_level L2; this run is "
                         f"{ds.attrs.get('level', '?')}")
    _params(ds, param)
    ax = _axes(ax, (8, 3.4))
    data = ds["dist"].sel(param=param).transpose("interval", "step").values
    steps = ds["step"].values
    labels = [str(i) for i in ds["interval"].values]
    image = ax.imshow(data, aspect="auto", origin="lower", cmap=cmap, vmin=0, vmax=1,
                      extent=(-0.5, len(steps) - 0.5, -0.5, len(labels) - 0.5),
                      interpolation="nearest")
    image.set_gid("dist")
    ax.set_yticks(range(len(labels)), labels)
    ticks = range(len(steps)) if len(steps) <= 16 else np.linspace(0, len(steps) - 1, 9).astype(int)
    ax.set_xticks(list(ticks), [str(int(steps[i])) for i in ticks])
    if len(labels) * len(steps) <= 160:
        for (i, j), v in np.ndenumerate(data):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if v < 0.55 else "black")
    index = {int(s): i for i, s in enumerate(steps)}
    from matplotlib.patches import Rectangle

    for s in sorted(set(int(s) for s in flag_steps)):
        if s in index:
            ax.add_patch(Rectangle((index[s] - 0.5, -0.5), 1, len(labels), fill=False,
                                   edgecolor=FLAG_COLOR, linewidth=2, gid=f"flagstep:{s}"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient value interval")
    ax.set_title(f"Gradient value distribution: {short_name(param, 48)}")
    ax.figure.colorbar(image, ax=ax, label="share of elements", fraction=0.05, pad=0.02)
    return ax.figure


def grad_stats(ds, param: str, *, ax=None, stats=("max", "min", "norm"), flag_steps=(),
               legend: str = "outside"):
    """``max``, ``min`` and ``norm`` of ``param``'s gradient over steps (flagged steps shaded)."""
    _params(ds, param)
    ax = _axes(ax, (8, 3.4))
    steps = ds["step"].values
    styles = {"max": ("#2ca02c", "^"), "min": ("#1f77b4", "v"), "norm": ("#000000", "o")}
    for name in stats:
        if name not in ds:
            raise ValueError(f"stat {name!r} is not in this dataset; accepted: max, min, norm")
        color, marker = styles.get(name, (None, "o"))
        ax.plot(steps, ds[name].sel(param=param).values, color=color, marker=marker,
                markersize=3, linewidth=1.5, label=name, gid=f"stat:{name}")
    _flag_steps(ax, steps, flag_steps)
    _replica_steps(ax, ds, param, steps)
    ax.axhline(0, color=THRESHOLD_COLOR, linewidth=0.8)
    _step_ticks(ax, steps)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient value")
    shape = f" {ds['shape'].sel(param=param).values}" if "shape" in ds.coords else ""
    ax.set_title(f"Gradient statistics: {short_name(param, 48)}{shape}")
    ax.grid(True, alpha=0.3)
    _legend(ax, len(stats), legend)
    return ax.figure


# -- free benchmark ---------------------------------------------------------------------------

def _steps_label(steps) -> str:
    from .freebench.report.view import step_ranges

    if list(steps) == [0]:
        return ""
    return f"  step{'s' if len(steps) > 1 else ''} {step_ranges(steps)}"


def findings(results, *, ax=None, top: int = 15):
    """Free-benchmark findings ranked by ``max_rel / threshold`` (log scale, 1 = threshold).

    Rows of the same API call over several steps are merged (``merged_findings``: the worst is
    drawn, its steps named). NaN/Inf findings are drawn as hatched bars at the right edge.
    """
    from .freebench.report.view import merged_findings

    merged = merged_findings(results)
    n_all = len(merged)
    groups = [row for _, row in merged.head(top).iterrows()]
    ax = _axes(ax, (9, 0.9 + 0.38 * max(len(groups), 2)))
    if not groups:
        ax.text(0.5, 0.5, "No findings: every checked output is within its threshold",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        ax.set_title("Free benchmark findings")
        return ax.figure
    ratios = np.array([row["ratio"] for row in groups], dtype=float)
    finite = ratios[np.isfinite(ratios) & (ratios > 0)]
    right = max(float(finite.max()) if finite.size else 10.0, 2.0) * 3
    left = min(float(finite.min()) if finite.size else 1.0, 1.0) / 3
    y = np.arange(len(groups))[::-1]
    seen_kinds = set()
    for yi, row, r in zip(y, groups, ratios):
        kind = row["kind"]
        bad = not math.isfinite(r)
        width = right if bad else max(r, left)
        color = KIND_COLORS.get(kind, "#8c564b")
        ax.barh(yi, width, height=0.6, left=0, color=color, hatch="//" if bad else None,
                alpha=0.85, label=kind if kind not in seen_kinds else None,
                gid=f"finding:{row['api_name']}")
        seen_kinds.add(kind)
        text = "NaN/Inf" if bad else (f"max_rel {float(row['max_rel']):.2g} vs "
                                      f"{float(row['threshold']):.2g} "
                                      f"({str(row['dtype']).removeprefix('torch.')})")
        # label inside the bar when the bar is long (log position), else just right of it
        inside = bad or math.log(width / left) > 0.6 * math.log(right * 1.5 / left)
        ax.text(width * (0.85 if inside else 1.1), yi, text, va="center",
                ha="right" if inside else "left", fontsize="small",
                color="white" if inside else "black")
    # API names carry the stage (….forward / ….backward); steps say when it was seen
    labels = [short_name(row["api_name"], 40) + _steps_label(row["steps"]) for row in groups]
    ax.set_yticks(y, labels)
    ax.set_xscale("log")
    ax.set_xlim(left, right * 1.5)
    ax.axvline(1.0, color=THRESHOLD_COLOR, linestyle="--", linewidth=1, label="threshold")
    ax.set_xlabel("max_rel / threshold (log scale; > 1 is flagged)")
    more = f" (top {len(groups)} of {n_all})" if n_all > len(groups) else ""
    ax.set_title(f"Free benchmark findings by severity{more}")
    ax.grid(True, axis="x", alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize="small")
    return ax.figure


SUSPECT_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def triage(report, *, ax=None, top: int = 15):
    """A ``probekit.triage`` report: its flagged calls by ``max_rel / threshold`` (log scale),
    coloured by suspect module (in suspect order, most severe first within each)."""
    df = report.findings.head(top)
    ax = _axes(ax, (10, 1.2 + 0.38 * max(len(df), 2)))
    d = report.divergence
    title = (f"Triage: runs part at step {d['step']}, {short_name(d['param'], 40)}"
             if d["step"] >= 0 else "Triage: the runs do not diverge")
    if df.empty:
        names = ", ".join(report.suspects["module"]) or "none"
        ax.text(0.5, 0.5, f"No flagged call in the suspect modules ({short_name(names, 60)})",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        ax.set_title(title)
        return ax.figure
    ratios = np.array(df["ratio"], dtype=float)
    finite = ratios[np.isfinite(ratios) & (ratios > 0)]
    right = max(float(finite.max()) if finite.size else 10.0, 2.0) * 3
    left = min(float(finite.min()) if finite.size else 1.0, 1.0) / 3
    colors = {m: SUSPECT_COLORS[i % len(SUSPECT_COLORS)]
              for i, m in enumerate(report.suspects["module"])}
    modules = list(report.suspects["module"])
    legend = dict(zip(modules, legend_names(modules, 32)))
    y = np.arange(len(df))[::-1]
    seen = set()
    for yi, (_, row), r in zip(y, df.iterrows(), ratios):
        bad = not math.isfinite(r)
        width = right if bad else max(r, left)
        ax.barh(yi, width, height=0.6, color=colors.get(row["suspect"], "#7f7f7f"),
                hatch="//" if bad else None, alpha=0.85,
                label=legend.get(row["suspect"], row["suspect"]) if row["suspect"] not in seen
                else None,
                gid=f"triage:{row['api_name']}")
        seen.add(row["suspect"])
        text = "NaN/Inf" if bad else f"{r:,.0f}× {row['kind']} ({row['pert_modes']})"
        inside = bad or math.log(width / left) > 0.6 * math.log(right * 1.5 / left)
        ax.text(width * (0.85 if inside else 1.1), yi, text, va="center",
                ha="right" if inside else "left", fontsize="small",
                color="white" if inside else "black")
    labels = [f"{short_name(row['api_name'], 34)}  in {short_name(row['module'], 24)}"
              for _, row in df.iterrows()]
    ax.set_yticks(y, labels)
    ax.set_xscale("log")
    ax.set_xlim(left, right * 1.5)
    ax.axvline(1.0, color=THRESHOLD_COLOR, linestyle="--", linewidth=1, label="threshold")
    ax.axvline(report.min_ratio, color=THRESHOLD_COLOR, linestyle=":", linewidth=1,
               label=f"listed from {report.min_ratio:g}×")
    ax.set_xlabel("max_rel / threshold (log scale)")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
              title="suspect module", title_fontsize="small")
    return ax.figure
