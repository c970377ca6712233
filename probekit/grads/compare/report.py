"""msprobe's ``GradComparator.compare_distributed``: similarities.csv and plots per rank, and
``unmatched_params.csv`` naming the parameters of one run only."""
from __future__ import annotations

import csv
import os

import numpy as np

from ...log import get_logger
from ...paths import safe_join, unique_names
from .compare import DROP_THRESHOLD, STEP0_THRESHOLD, compare_grads
from .unmatched import unmatched

log = get_logger(__name__)
PLOTS = ("all", "summary", "none")
UNMATCHED_CSV = "unmatched_params.csv"


def write_similarities_csv(result, rank: int, path: str) -> None:
    """msprobe's similarities.csv: a row per param plus ``summary``, a column per step."""
    r = result.sel(rank=rank)
    steps = [int(s) for s in r["step"].values]
    rows = [["step", *[str(s) for s in steps]]]
    sim = np.asarray(r["similarity"].values)
    for j, name in enumerate(r["param"].values):
        if np.all(np.isnan(sim[:, j])):
            continue
        rows.append([str(name), *[repr(float(v)) for v in sim[:, j]]])
    rows.append(["summary", *[repr(float(v)) for v in np.asarray(r["total"].values)]])
    with open(path, "w", encoding="utf-8-sig", newline="") as fh:
        csv.writer(fh).writerows(rows)


def write_unmatched_csv(result, rank: int, path: str) -> bool:
    """``run,param`` rows (``first``/``second``), one per parameter of one run only; no file
    (an earlier one removed) when every parameter has its counterpart. True if written."""
    u = unmatched(result.sel(rank=rank))
    rows = [("first", n) for n in u["first"]] + [("second", n) for n in u["second"]]
    if not rows:
        if os.path.exists(path):
            os.remove(path)
        return False
    with open(path, "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([("run", "param"), *rows])
    return True


class GradComparator:
    """msprobe's entry point for comparing two grad dumps."""

    @staticmethod
    def compare_distributed(dump_path1, dump_path2, output_path, *, plots: str = "all",
                            step0_threshold: float = STEP0_THRESHOLD,
                            drop_threshold: float = DROP_THRESHOLD, **compare_options):
        """Compare every rank two runs share; write ``rank{r}/similarities.csv`` and plots, and
        ``rank{r}/unmatched_params.csv`` when some parameters are in one run only.

        ``plots``: ``"all"`` (msprobe's per-parameter PNGs + summary), ``"summary"`` (only
        ``summary_similarities.png``) or ``"none"``. ``compare_options`` go to
        ``compare_grads`` (``client``, ``scheduler``, ``progress``, ``storage_options``, ...).
        Returns the comparison Dataset.
        """
        if plots not in PLOTS:
            raise ValueError(f"plots: {plots!r} is not valid; accepted: {', '.join(PLOTS)}")
        result = compare_grads(dump_path1, dump_path2, step0_threshold=step0_threshold,
                               drop_threshold=drop_threshold, **compare_options)
        os.makedirs(output_path, exist_ok=True)
        for rank in result["rank"].values:
            rank_dir = os.path.join(output_path, f"rank{int(rank)}")
            os.makedirs(rank_dir, exist_ok=True)
            write_similarities_csv(result, int(rank), os.path.join(rank_dir, "similarities.csv"))
            write_unmatched_csv(result, int(rank), os.path.join(rank_dir, UNMATCHED_CSV))
            if plots != "none":
                _write_pictures(result.sel(rank=rank), os.path.join(rank_dir,
                                "similarities_picture"), per_param=plots == "all")
            step = int(result["first_step"].sel(rank=rank).item())
            param = str(result["first_param"].sel(rank=rank).item())
            if step >= 0:
                log.warning("rank %d: gradients part at step %d%s", int(rank), step,
                            f" (first: {param})" if param else " (total similarity)")
        return result

    @staticmethod
    def compare(path1, path2, output_dir, **kwargs):
        """Compare two dumps (msprobe's single-rank entry point); same outputs."""
        return GradComparator.compare_distributed(path1, path2, output_dir, **kwargs)


def _write_pictures(r, picture_dir: str, per_param: bool) -> None:
    """Render with one reused figure (only line data changes), so PNGs stay cheap."""
    from .pictures import SimilarityFigure

    os.makedirs(picture_dir, exist_ok=True)
    fig = SimilarityFigure(r)
    fig.render(None, os.path.join(picture_dir, "summary_similarities.png"))
    if per_param:
        sim = np.asarray(r["similarity"].values)
        names = [str(n) for n in r["param"].values]
        # msprobe's names, each parameter its own file (a parameter named "summary" or two that
        # clean alike would share one otherwise: the later gets a digest in its name)
        files = unique_names(names, "_similarities.png", taken={"summary_similarities.png"})
        for j, (name, fname) in enumerate(zip(names, files)):
            if not np.all(np.isnan(sim[:, j])):
                fig.render(name, safe_join(picture_dir, fname))
