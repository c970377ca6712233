"""``GradExplorer``: pick a parameter of a grad-probe run and see its history.

``GradExplorer(run)`` with ``run`` a Dataset of ``probekit.open_grads`` or a dump path;
``GradExplorer(run, other)`` also compares the two runs (``probekit.compare_grads``), or pass a
ready comparison as ``comparison=``. For the selected parameter it shows the direction
similarity over steps (with two runs), the interval distribution as a step x interval heatmap
(L2) and max/min/norm over steps, flagged steps highlighted, plus a table of the values per step.

The figure is drawn with matplotlib's object API (no pyplot state) into an ``Image`` widget, so
it updates without a front-end ``Output`` capture; the explorer's rich display also carries a
static PNG + HTML of the current view for front-ends without widgets (nbconvert, GitHub).
"""
from __future__ import annotations

import base64
import html
import io

import ipywidgets as w
import numpy as np

from .. import plot


def _open(run, rank):
    if hasattr(run, "data_vars"):
        return run
    from .. import open_grads

    return open_grads(run, rank=rank)


class GradExplorer(w.VBox):
    """Interactive per-parameter view of one grad-probe run, or of two compared runs."""

    def __init__(self, run, other=None, *, comparison=None, rank=None, param=None):
        super().__init__()
        self.run = _open(run, rank)
        if comparison is None and other is not None:
            from .. import compare_grads

            comparison = compare_grads(run, other)
        self.comparison = comparison
        self.rank = self._rank(rank)
        self.params = [str(p) for p in self.run["param"].values]
        flagged = set(self.flagged_params()) | set(self.replica_params())
        options = [(("⚠ " if p in flagged else "") + p, p) for p in self.params]
        if param is None:
            param = (self._first_flagged() or next(iter(self.replica_params()), None)
                     or self.params[0])
        self.dropdown = w.Dropdown(options=options, value=param, description="parameter",
                                   style={"description_width": "80px"},
                                   layout=w.Layout(width="560px"))
        self.header = w.HTML(self._header())
        self.image = w.Image(format="png", layout=w.Layout(max_width="900px"))
        self.table = w.HTML()
        self.figure = None
        self.dropdown.observe(lambda change: self.select(change["new"]), names="value")
        self.children = [self.header, self.dropdown, self.image, self.table]
        self.add_class("probekit-explorer")
        self.select(param)

    # -- data ----------------------------------------------------------------------------------
    def _rank(self, rank):
        if self.comparison is None or "rank" not in self.comparison.dims:
            return rank
        ranks = [int(r) for r in self.comparison["rank"].values]
        wanted = rank if rank is not None else self.run.attrs.get("rank", ranks[0])
        return int(wanted) if int(wanted) in ranks else ranks[0]

    def _cmp(self):
        if self.comparison is None:
            return None
        cmp = self.comparison
        return cmp.sel(rank=self.rank) if "rank" in cmp.dims else cmp

    def flagged_params(self) -> list:
        """Parameters with at least one flagged step (comparison order)."""
        cmp = self._cmp()
        if cmp is None:
            return []
        any_flag = cmp["flag"].any("step")
        return [str(p) for p, f in zip(cmp["param"].values, any_flag.values) if f]

    def replica_lines(self) -> list:
        """What the replica checks found: the run's own (``store.replicas``) and, compared,
        the other run's (``verdict.replica_text``)."""
        from ..grads.compare.verdict import replica_text
        from ..grads.store.replicas import from_datasets, replica_lines

        if self.comparison is not None and replica_text(self.comparison):
            return replica_text(self.comparison)
        return replica_lines(from_datasets(self.run), limit=5)

    def replica_params(self) -> list:
        """Parameters of the run whose replicas disagreed at some step."""
        if "replicas" not in self.run:
            return []
        bad = (np.asarray(self.run["replicas"].transpose("step", "param").values,
                          np.int64) & 6) > 0
        return [p for p, b in zip(self.params, bad.any(axis=0)) if b]

    def flagged_steps(self, param: str) -> list:
        cmp = self._cmp()
        if cmp is None or param not in set(str(p) for p in cmp["param"].values):
            return []
        f = cmp["flag"].sel(param=param)
        return [int(s) for s in cmp["step"].values[f.values]]

    def _first_flagged(self):
        cmp = self._cmp()
        if cmp is None or "first_param" not in cmp:
            return None
        name = str(cmp["first_param"].values)
        return name if name in self.params else None

    # -- view ----------------------------------------------------------------------------------
    def _header(self) -> str:
        ds = self.run
        level = ds.attrs.get("level", "?")
        parts = [f"<b>Grad probe</b>: level {html.escape(str(level))}, {len(self.params)} "
                 f"parameters, {ds.sizes.get('step', 0)} steps"]
        cmp = self._cmp()
        if cmp is not None:
            first = int(cmp["first_step"].values) if "first_step" in cmp else -1
            if first >= 0:
                parts.append(f"<span style='color:#c62828;font-weight:600'>⚠ first flag at step "
                             f"{first}: {html.escape(str(cmp['first_param'].values))}</span> "
                             f"({len(self.flagged_params())} parameters flagged)")
            else:
                parts.append("<span style='color:#2e7d32;font-weight:600'>✓ no step flagged"
                             "</span>")
        head = " — ".join(parts)
        for line in self.replica_lines():  # replicas that disagree: a bug, no reference needed
            head += (f"<br><span style='color:#c62828;font-weight:600'>⚠ "
                     f"{html.escape(line)}</span>")
        return head

    def select(self, param: str) -> None:
        """Show ``param`` (also what choosing it in the dropdown does)."""
        if param not in self.params:
            raise ValueError(f"param {param!r} is not in this run; accepted: "
                             f"{', '.join(self.params)}")
        if self.dropdown.value != param:
            self.dropdown.value = param        # observer calls back into select
            return
        self.param = param
        self.figure = self._figure(param)
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=90)
        self.image.value = buf.getvalue()
        self.table.value = self._table(param)

    def _figure(self, param: str):
        from matplotlib.figure import Figure

        flags = self.flagged_steps(param)
        panels = []
        if self.comparison is not None:
            panels.append("similarity")
        if "dist" in self.run:
            panels.append("dist")
        panels.append("stats")
        fig = Figure(figsize=(9.5, 3.1 * len(panels)), layout="constrained")
        axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
        for ax, kind in zip(axes, panels):
            if kind == "similarity":
                plot.similarity(self.comparison, [param], rank=self.rank, ax=ax, legend="inside")
                ax.set_title(f"Direction similarity: {plot.short_name(param, 60)}")
            elif kind == "dist":
                plot.interval_distribution(self.run, param, ax=ax, flag_steps=flags)
            else:
                plot.grad_stats(self.run, param, ax=ax, flag_steps=flags, legend="inside")
        return fig

    def _table(self, param: str) -> str:
        ds = self.run.sel(param=param)
        steps = [int(s) for s in ds["step"].values]
        cols = {}
        cmp = self._cmp()
        if cmp is not None:   # the similarity the flags are judged on, as the plot shows it
            from ..grads.compare.verdict import judged_name

            sim = cmp[judged_name(cmp)].sel(param=param).reindex(step=steps)
            cols["similarity"] = sim.values
        # a statistic recorded as NaN (a gradient gone NaN) reads "NaN"; one never recorded
        # (no gradient at that step) stays empty
        had = (np.asarray(ds["present"].values, bool) if "present" in ds
               else np.ones(len(steps), bool))
        for name in ("max", "min", "norm", "zeros"):
            if name in ds:
                cols[name] = [("NaN" if had[i] else "") if np.isnan(x) else x
                              for i, x in enumerate(np.asarray(ds[name].values, np.float64))]
        if "replicas" in ds:  # the replica check: what differed from another replica's copy
            from ..grads.store.replicas import what_text

            cols["replicas"] = [("agree" if c == 1 else what_text(c) or "") if c else ""
                                for c in np.asarray(ds["replicas"].values, np.int64)]
        flags = set(self.flagged_steps(param))
        head = "".join(f"<th style='padding:2px 8px'>{h}</th>" for h in ["step", *cols])
        rows = []
        for i, s in enumerate(steps):
            style = " style='background:rgba(198,40,40,0.12)'" if s in flags else ""
            cells = "".join(f"<td style='padding:2px 8px;text-align:right'>{_num(v[i])}</td>"
                            for v in cols.values())
            mark = " ⚠" if s in flags else ""
            rows.append(f"<tr{style}><td style='padding:2px 8px'>{s}{mark}</td>{cells}</tr>")
        return (f"<details><summary>values per step of <code>{html.escape(param)}</code> "
                f"({len(flags)} flagged)</summary><table style='border-collapse:collapse;"
                f"font-size:12px'><tr>{head}</tr>{''.join(rows)}</table></details>")

    # -- static fallback -----------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        png = base64.b64encode(self.image.value).decode()
        bundle["text/html"] = (f"<div>{self.header.value}<br>parameter: "
                               f"<code>{html.escape(self.param)}</code><br>"
                               f"<img src='data:image/png;base64,{png}'/>"
                               f"{self.table.value}</div>")
        return bundle


def _num(v) -> str:
    if isinstance(v, str):
        return html.escape(v)
    v = float(v)
    return "" if np.isnan(v) else f"{v:.4g}"
