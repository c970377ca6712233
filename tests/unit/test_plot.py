"""probekit.plot: assertions on the plotted data (lines, markers, labels), not on pixels."""
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from synthetic_grads import GRAD_PARAMS_DIVERGING, compare_synthetic, make_grads  # noqa: E402

from probekit import plot  # noqa: E402
from probekit.freebench.report import view  # noqa: E402

COLUMNS = ["rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype", "shape",
           "output_index", "kind", "max_abs", "threshold", "ratio", "call_site"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def by_gid(ax, prefix):
    return [a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def finding(api, max_rel, kind="rel_error", dtype="float32", step=0, stage="forward"):
    thr = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 4e-3}[dtype]
    return dict(rank=0, pert_mode="bit_noise", stage=stage, step=step, api_name=api,
                max_rel=max_rel, dtype=dtype, shape="(8, 8)", output_index=None, kind=kind,
                max_abs=max_rel / 10, threshold=thr, ratio=max_rel / thr,
                call_site="model.py:12 in forward")


@pytest.fixture
def results():
    rows = [finding("Torch.matmul.0.forward", 0.05), finding("Torch.matmul.0.forward", 0.08, step=1),
            finding("Tensor.pow.4.forward", 3e-3, dtype="float16"),
            finding("Functional.softmax.0.forward", math.nan, kind="nan_inf"),
            finding("Torch.sub.1.forward", 1.5, kind="sign_flip"),
            finding("Functional.layer_norm.0.backward", 5e-4, stage="backward")]
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.loc[3, "ratio"] = math.inf
    return df


def test_similarity_lines_threshold_and_flags(grads_cmp):
    ax = plot.similarity(grads_cmp).axes[0]
    lines = by_gid(ax, "similarity:")
    assert [l.get_gid() for l in lines] == [f"similarity:{p}" for p in grads_cmp.param.values]
    diverging = next(l for l in lines if l.get_gid().endswith(GRAD_PARAMS_DIVERGING))
    np.testing.assert_array_equal(diverging.get_xdata(), np.arange(8))
    np.testing.assert_allclose(diverging.get_ydata(),
                               grads_cmp.similarity.sel(rank=0, param=GRAD_PARAMS_DIVERGING))
    (flags,) = by_gid(ax, "flags")
    offsets = flags.get_offsets()
    np.testing.assert_array_equal(offsets[:, 0], [4, 5, 6, 7])
    np.testing.assert_allclose(offsets[:, 1], diverging.get_ydata()[4:])
    threshold = [l for l in ax.get_lines() if l.get_label().startswith("step-0 threshold")]
    assert len(threshold) == 1 and threshold[0].get_ydata()[0] == pytest.approx(0.97)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "flagged (4)" in labels and "step-0 threshold 0.97" in labels
    # long names are shortened from the left (at a dot), at most 36 characters
    assert "…layers.0.self_attn.in_proj_weight" in labels
    assert max(len(t) for t in labels) <= 36
    assert ax.get_title() == "Gradient direction similarity per parameter (rank 0)"
    assert ax.get_xlabel() == "optimizer step"
    assert any("first flag: step 4" in t.get_text() for t in ax.texts)


def test_similarity_selected_param_and_existing_axes(grads_cmp):
    fig, ax = plt.subplots()
    out = plot.similarity(grads_cmp, "head.weight", ax=ax)
    assert out is fig  # the Figure of the Axes given
    assert [l.get_gid() for l in by_gid(ax, "similarity:")] == ["similarity:head.weight"]
    assert by_gid(ax, "flags") == []      # head.weight is never flagged
    with pytest.raises(ValueError, match="'nope' is not in this dataset; accepted: embed.weight"):
        plot.similarity(grads_cmp, "nope")
    with pytest.raises(ValueError, match="rank 3 is not in this comparison; accepted: 0"):
        plot.similarity(grads_cmp, rank=3)


def test_similarity_limits_lines_to_flagged_and_worst(grads_cmp):
    ax = plot.similarity(grads_cmp, max_lines=1).axes[0]
    assert [l.get_gid() for l in by_gid(ax, "similarity:")] == [
        f"similarity:{GRAD_PARAMS_DIVERGING}"]


def test_total_similarity_per_rank_with_flags(grads_pair):
    a, b = grads_pair
    cmp = compare_synthetic([a, a], [b, a])
    ax = plot.total_similarity(cmp).axes[0]
    totals = by_gid(ax, "total:")
    assert [l.get_label() for l in totals] == ["rank 0", "rank 1"]
    np.testing.assert_allclose(totals[0].get_ydata(), cmp.total.sel(rank=0))
    np.testing.assert_allclose(totals[1].get_ydata(), 1.0)
    (flags,) = by_gid(ax, "flags:")
    assert flags.get_gid() == "flags:0"
    expected = cmp.step.values[cmp.flag_total.sel(rank=0).values]
    np.testing.assert_array_equal(flags.get_offsets()[:, 0], expected)
    assert len(expected) >= 1
    assert ax.get_ylabel() == "similarity (element-weighted)"


def test_interval_distribution_heatmap(grads_l2):
    param = "head.weight"
    ax = plot.interval_distribution(grads_l2, param, flag_steps=[2, 5, 99]).axes[0]
    (image,) = by_gid(ax, "dist")
    data = np.asarray(image.get_array())
    assert data.shape == (4, 8)                        # interval x step
    np.testing.assert_allclose(data, grads_l2.dist.sel(param=param).T)
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in range(8)]
    assert sorted(p.get_gid() for p in by_gid(ax, "flagstep:")) == ["flagstep:2", "flagstep:5"]
    assert ax.get_title() == "Gradient value distribution: head.weight"
    assert len(ax.figure.axes) == 2 and ax.figure.axes[1].get_ylabel() == "share of elements"


def test_interval_distribution_needs_l2():
    with pytest.raises(ValueError, match="needs grad_level L2; this run is L1"):
        plot.interval_distribution(make_grads(level="L1"), "head.weight")


def test_grad_stats_lines(grads_l2):
    ax = plot.grad_stats(grads_l2, "embed.weight", flag_steps=[3]).axes[0]
    for name in ("max", "min", "norm"):
        (line,) = by_gid(ax, f"stat:{name}")
        np.testing.assert_allclose(line.get_ydata(), grads_l2[name].sel(param="embed.weight"))
    assert [p.get_gid() for p in by_gid(ax, "flagstep:")] == ["flagstep:3"]
    assert ax.get_title() == "Gradient statistics: embed.weight (16, 8)"
    ax = plot.grad_stats(grads_l2, "embed.weight", stats=("norm",)).axes[0]
    assert [l.get_gid() for l in by_gid(ax, "stat:")] == ["stat:norm"]


def test_findings_bars_ranked_and_merged(results):
    ax = plot.findings(results).axes[0]
    bars = by_gid(ax, "finding:")
    assert [b.get_gid() for b in bars] == [
        "finding:Functional.softmax.0.forward", "finding:Torch.sub.1.forward",
        "finding:Torch.matmul.0.forward", "finding:Functional.layer_norm.0.backward",
        "finding:Tensor.pow.4.forward"]
    widths = [b.get_width() for b in bars]
    assert widths[1:] == pytest.approx([7500, 400, 2.5, 1.5])      # worst matmul of the two
    assert widths[0] > widths[1]                                      # NaN/Inf drawn longest
    ys = [b.get_y() + b.get_height() / 2 for b in bars]
    assert ys == sorted(ys, reverse=True)                             # most severe on top
    labels = [t.get_text() for t in ax.get_yticklabels()]            # in tick order: top first
    assert labels == ["Functional.softmax.0.forward", "Torch.sub.1.forward",
                      "Torch.matmul.0.forward  steps 0–1", "Functional.layer_norm.0.backward",
                      "Tensor.pow.4.forward"]
    assert ax.get_xscale() == "log"
    assert any(l.get_xdata()[0] == 1.0 and l.get_label() == "threshold" for l in ax.get_lines())
    assert "NaN/Inf" in [t.get_text() for t in ax.texts]
    assert "max_rel 0.08 vs 0.0002 (float32)" in [t.get_text() for t in ax.texts]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(legend) == {"threshold", "nan_inf", "sign_flip", "rel_error"}


def test_merged_findings_one_row_per_call(results):
    results.loc[len(results)] = finding("Torch.matmul.0.forward", 0.01, step=4)
    merged = view.merged_findings(results)
    assert list(merged.api_name) == [
        "Functional.softmax.0.forward", "Torch.sub.1.forward", "Torch.matmul.0.forward",
        "Functional.layer_norm.0.backward", "Tensor.pow.4.forward"]
    matmul = merged.iloc[2]
    assert (matmul["steps"], matmul["count"], matmul["max_rel"]) == ([0, 1, 4], 3, 0.08)
    assert list(merged["count"]) == [1, 1, 3, 1, 1]
    empty = view.merged_findings(results.iloc[:0])
    assert empty.empty and {"steps", "count"} <= set(empty.columns)


def test_step_ranges():
    assert view.step_ranges([8, 0, 1, 2, 5, 7]) == "0–2, 5, 7–8"
    assert view.step_ranges([3]) == "3"
    assert view.step_ranges([]) == ""


def test_findings_top_and_empty(results):
    ax = plot.findings(results, top=2).axes[0]
    assert len(by_gid(ax, "finding:")) == 2
    assert ax.get_title() == "Free benchmark findings by severity (top 2 of 5)"
    ax = plot.findings(results.iloc[:0]).axes[0]
    assert by_gid(ax, "finding:") == []
    assert ax.texts[0].get_text().startswith("No findings")
    with pytest.raises(TypeError, match="expected a FreeBench or its results DataFrame"):
        plot.findings([1, 2])


def test_short_name():
    assert plot.short_name("abc", 5) == "abc"
    assert plot.short_name("abcdefghij", 5) == "…ghij"
    assert len(plot.short_name("x" * 100)) == 36
    assert plot.short_name("transformer.h.11.attn.c_proj.weight", 20) == "…attn.c_proj.weight"


DISTILBERT = ["distilbert.embeddings.LayerNorm.weight",
              "distilbert.transformer.layer.0.attention.q_lin.weight",
              "distilbert.transformer.layer.0.output_layer_norm.weight",
              "distilbert.transformer.layer.1.output_layer_norm.weight",
              "distilbert.transformer.layer.5.output_layer_norm.weight",
              "distilbert.transformer.layer.5.sa_layer_norm.weight"]


def test_legend_names_drop_the_common_prefix_and_stay_unique():
    """Issue 28: names cut in the middle read alike (three `distilbert.transf..._layer_norm.
    weight`); the shared prefix goes, long names keep their end, and no two labels are equal."""
    assert plot.legend_names(DISTILBERT) == [
        "embeddings.LayerNorm.weight", "…layer.0.attention.q_lin.weight",
        "…layer.0.output_layer_norm.weight", "…layer.1.output_layer_norm.weight",
        "…layer.5.output_layer_norm.weight", "…layer.5.sa_layer_norm.weight"]
    narrow = plot.legend_names(DISTILBERT, 20)
    assert len(set(narrow)) == len(narrow)  # lengthened where 20 characters would collide
    assert narrow[2:5] == ["…0.output_layer_norm.weight", "…1.output_layer_norm.weight",
                           "…5.output_layer_norm.weight"]
    assert plot.legend_names(["a.x.weight", "a.y.weight"]) == ["x.weight", "y.weight"]
    assert plot.legend_names(["h.0.w"]) == ["h.0.w"]  # one name: nothing to drop
    assert plot.legend_names(["blocks.2", "blocks.0"]) == ["blocks.2", "blocks.0"]  # not "2"


def test_similarity_legend_of_long_names_is_readable():
    ds = make_grads()
    ds = ds.assign_coords(param=[f"distilbert.transformer.layer.{i}.output_layer_norm.weight"
                                 for i in range(ds.sizes["param"])])
    cmp = compare_synthetic([ds], [ds])
    ax = plot.similarity(cmp).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()][:4]
    assert labels == [f"{i}.output_layer_norm.weight" for i in range(4)]


def test_plot_functions_return_the_figure():
    fig = plot.similarity(compare_synthetic([make_grads()], [make_grads()]))
    assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes) == 1
    assert type(fig).__name__ == "PlotFigure"


def test_plot_imports_no_ipython():
    import subprocess
    import sys

    code = ("import sys, probekit.plot; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('IPython', 'ipywidgets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_replica_check_in_the_plots(grads_cmp, grads_l2):
    """What the runs' replica checks found: a red line at the top of the comparison plots; the
    steps where a parameter's replicas disagree hatched in its statistics (issue 35)."""
    line = "replicas of `head.weight` disagree from step 4 (DDP ranks 0/1: gradients)"
    cmp = grads_cmp.copy()
    cmp.attrs["replicas_second"] = [line]
    for fig in (plot.similarity(cmp), plot.total_similarity(cmp)):
        notes = [t for t in fig.axes[0].texts if t.get_gid() == "replicas"]
        assert [t.get_text() for t in notes] == [f"the second run: {line}"]
    assert not [t for t in plot.similarity(grads_cmp).axes[0].texts if t.get_gid() == "replicas"]
    param = str(grads_l2["param"].values[0])
    code = np.zeros((grads_l2.sizes["step"], grads_l2.sizes["param"]), np.uint8)
    code[3:, 0] = [3] + [7] * (code.shape[0] - 4)
    ds = grads_l2.assign(replicas=(("step", "param"), code))
    ax = plot.grad_stats(ds, param).axes[0]
    steps = [int(s) for s in ds["step"].values[3:]]
    assert [p.get_gid() for p in ax.patches] == [f"replicas:{s}" for s in steps]
    assert "replicas disagree (gradients first)" in [t.get_text()
                                                    for t in ax.get_legend().get_texts()]
