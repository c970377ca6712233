"""PNG pictures of a one-rank comparison, in msprobe's folder layout, rendered fast.

A single Agg figure is built once; each picture only swaps the line data, the flag markers and
the title before ``savefig`` (no pyplot state, no new figure per parameter). The line is the
similarity the flags are judged on (significant signs when the comparison is noise-aware); a
comparison calibrated by a control run shades the band the control allows instead of drawing the
fixed threshold.
"""
from __future__ import annotations

import numpy as np

from .compare import STEP0_THRESHOLD


class SimilarityFigure:
    def __init__(self, r, width: float = 6.4, height: float = 3.6, dpi: int = 80) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from .verdict import judged_name, judged_total_name

        self.r = r
        self.steps = np.asarray(r["step"].values)
        self.params = [str(p) for p in r["param"].values]
        self.t0 = float(r.attrs.get("step0_threshold", STEP0_THRESHOLD))
        self.name, self.total = judged_name(r), judged_total_name(r)
        self.calibrated = bool(r.attrs.get("calibrated")) and "similarity_band" in r
        self.band = None
        self.rank = int(r["rank"].item()) if "rank" in r.coords else 0
        # fixed margins: a layout engine would lay the figure out again at every savefig
        self.fig = Figure(figsize=(width, height), dpi=dpi)
        self.fig.subplots_adjust(left=0.14, right=0.98, top=0.9, bottom=0.14)
        FigureCanvasAgg(self.fig)
        ax = self.ax = self.fig.add_subplot()
        (self.line,) = ax.plot([], [], marker="o", markersize=3, lw=1.5, color="C0",
                               label="similarity")
        (self.flags,) = ax.plot([], [], ls="none", marker="x", markersize=9, mew=2, color="C3",
                                label="flagged step (signs or scale)" if self.calibrated
                                else "flagged step")
        if not self.calibrated:
            ax.axhline(self.t0, color="0.4", ls="--", lw=1, label=f"threshold {self.t0:g}")
        else:
            ctrl = str(r.attrs.get("control", "")) or "the"
            # a proxy for the legend; each picture draws its own band
            ax.fill_between([], [], [], color="C0", alpha=0.15, lw=0,
                            label=f"{ctrl} control allows")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("significant-sign similarity" if self.name == "similarity_significant"
                      else "sign similarity")
        ax.grid(alpha=0.3)
        self.legend = ax.legend(loc="best", fontsize=8)
        x0 = self.steps.min() if self.steps.size else 0
        x1 = self.steps.max() if self.steps.size else 1
        ax.set_xlim(x0 - 0.5, x1 + 0.5)

    def render(self, param: str | None, path: str) -> None:
        if param is None:
            y = np.asarray(self.r[self.total].values, np.float64)
            flag = np.asarray(self.r["flag_total"].values, bool)
            band = (np.asarray(self.r["total_band"].values, np.float64) if self.calibrated
                    else None)
            title = f"rank {self.rank} · summary (element-weighted, all parameters)"
        else:
            j = self.params.index(param)
            y = np.asarray(self.r[self.name].values[:, j], np.float64)
            flag = np.asarray(self.r["flag"].values[:, j], bool)
            band = (np.asarray(self.r["similarity_band"].values[:, j], np.float64)
                    if self.calibrated else None)
            title = f"rank {self.rank} · {param}"
        self.line.set_data(self.steps, y)
        self.flags.set_data(self.steps[flag], y[flag])
        lo = np.nanmin(y) if np.isfinite(y).any() else self.t0
        if self.band is not None:
            self.band.remove()
            self.band = None
        if band is not None:
            self.band = self.ax.fill_between(self.steps, band, 1.0, color="C0", alpha=0.15,
                                             lw=0)
            floor = min(lo, np.nanmin(band)) if np.isfinite(band).any() else lo
            span = max(1.0 - floor, 1e-4)
            self.ax.set_ylim(floor - 0.1 * span, 1.0 + 0.05 * span)
        else:
            self.ax.set_ylim(min(lo, self.t0) - 0.02, 1.005)
        self.ax.set_title(title, fontsize=10)
        self.fig.savefig(path)
