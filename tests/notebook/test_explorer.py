"""GradExplorer on datasets following the open_grads / compare_grads schemas."""
import base64

import numpy as np
import pytest
from synthetic_grads import GRAD_PARAMS_DIVERGING, make_grads

from probekit.notebook import GradExplorer


def gids(fig, prefix):
    return [a.get_gid() for ax in fig.axes for a in ax.get_children()
            if (a.get_gid() or "").startswith(prefix)]


def test_explorer_opens_on_first_flagged_param(grads_pair, grads_cmp):
    run = grads_pair[1]
    ex = GradExplorer(run, comparison=grads_cmp)
    assert ex.param == GRAD_PARAMS_DIVERGING == ex.dropdown.value
    assert ex.flagged_params() == [GRAD_PARAMS_DIVERGING]
    assert ex.flagged_steps(GRAD_PARAMS_DIVERGING) == [4, 5, 6, 7]
    assert ex.dropdown.options[1] == (f"⚠ {GRAD_PARAMS_DIVERGING}", GRAD_PARAMS_DIVERGING)
    assert ex.dropdown.options[0] == ("embed.weight", "embed.weight")
    assert "first flag at step 4" in ex.header.value and "1 parameters flagged" in ex.header.value
    # three panels: similarity, interval heatmap, stats; flags on each
    titles = [ax.get_title() for ax in ex.figure.axes if ax.get_title()]
    assert titles == [f"Direction similarity: {GRAD_PARAMS_DIVERGING}",
                      f"Gradient value distribution: {GRAD_PARAMS_DIVERGING}",
                      f"Gradient statistics: {GRAD_PARAMS_DIVERGING} (24, 8)"]
    assert [g for g in gids(ex.figure, "flags") if g == "flags"] == ["flags"]
    assert gids(ex.figure, "flagstep:") == [f"flagstep:{s}" for s in (4, 5, 6, 7)] * 2
    sim_line = [l for l in ex.figure.axes[0].get_lines() if l.get_gid()][0]
    np.testing.assert_allclose(sim_line.get_ydata(),
                               grads_cmp.similarity.sel(rank=0, param=GRAD_PARAMS_DIVERGING))
    assert ex.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    # table: one row per step, flagged ones marked
    assert ex.table.value.count("<tr") == 1 + 8 and ex.table.value.count("⚠") == 4
    assert "(4 flagged)" in ex.table.value


def test_choosing_a_param_redraws(grads_pair, grads_cmp):
    ex = GradExplorer(grads_pair[1], comparison=grads_cmp)
    before = ex.image.value
    ex.dropdown.value = "head.weight"            # what the user does in the front-end
    assert ex.param == "head.weight"
    assert ex.image.value != before
    assert gids(ex.figure, "flag") == []
    stats = [l for l in ex.figure.axes[-2].get_lines() if l.get_gid() == "stat:norm"]
    assert len(stats) == 1
    np.testing.assert_allclose(stats[0].get_ydata(), grads_pair[1].norm.sel(param="head.weight"))
    ex.select("embed.weight")
    assert ex.dropdown.value == "embed.weight" and ex.param == "embed.weight"
    with pytest.raises(ValueError, match="'nope' is not in this run; accepted: embed.weight"):
        ex.select("nope")


def test_single_run_l1_has_no_similarity_or_heatmap():
    ex = GradExplorer(make_grads(level="L1"))
    titles = [ax.get_title() for ax in ex.figure.axes]
    assert titles == ["Gradient statistics: embed.weight (16, 8)"]
    assert ex.flagged_params() == [] and ex.flagged_steps("embed.weight") == []
    assert "flag" not in ex.header.value                  # no comparison, nothing to flag
    assert "level L1, 4 parameters, 8 steps" in ex.header.value
    assert "similarity" not in ex.table.value


def test_static_fallback_has_png_and_html(grads_pair, grads_cmp):
    ex = GradExplorer(grads_pair[1], comparison=grads_cmp)
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    html = bundle["text/html"]
    png = html.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(png) == ex.image.value
    assert "first flag at step 4" in html


def test_explorer_on_two_recorded_runs(tmp_path):
    """Real GradProbe runs on disk: run b puts its input norm in bfloat16 and diverges once the
    inputs get a large offset (step 3)."""
    import torch

    import probekit

    def train(path, dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with probekit.GradProbe(model, opt, grad_level="L2", dump_path=str(path)):
            for s in range(6):
                x = torch.randn(64, 8, generator=g) + (500.0 if s >= 3 else 0.0)
                x = x - x.to(dtype).mean(-1, keepdim=True).float()    # the low-precision centering
                loss = torch.nn.functional.mse_loss(model(x), torch.zeros(64, 2))
                opt.zero_grad()
                loss.backward()
                opt.step()

    train(tmp_path / "a", torch.float32)
    train(tmp_path / "b", torch.bfloat16)
    ex = GradExplorer(str(tmp_path / "b"), str(tmp_path / "a"))
    cmp = ex.comparison
    assert int(cmp.first_step.values[0]) == 3
    assert ex.param == str(cmp.first_param.values[0]) and ex.param in ex.flagged_params()
    assert ex.flagged_steps(ex.param)[0] == 3
    assert [ax.get_title() for ax in ex.figure.axes if ax.get_title()][0] == (
        f"Direction similarity: {ex.param}")
    assert "first flag at step 3" in ex.header.value


def test_explorer_says_the_replica_check(tmp_path):
    """A run whose replicas disagree (issue 35): said in the header, the parameter marked and
    opened first, its steps hatched in the statistics plot, what differed in the table."""
    import torch

    from probekit.grads import GradProbe, open_grads

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3)})
    model["b"].load_state_dict(model["a"].state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 3)
    with GradProbe(model, dump_path=str(tmp_path / "run"), tied=[["a.weight", "b.weight"]]):
        for _ in range(2):
            opt.zero_grad()
            (model["a"](x).sum() + model["b"](2 * x).sum()).backward()
            opt.step()
    ex = GradExplorer(open_grads(tmp_path / "run"))
    assert ("⚠ replicas of `a.weight` disagree from step 0 (tied `a.weight`/`b.weight` rank 0: "
            "gradients)") in ex.header.value.replace("&#x27;", "'")
    assert ex.param == "a.weight" and ex.dropdown.options[0] == ("⚠ a.weight", "a.weight")
    assert gids(ex.figure, "replicas:") == ["replicas:0", "replicas:1"]
    assert "<th style='padding:2px 8px'>replicas</th>" in ex.table.value
    assert "gradients and parameters" in ex.table.value  # step 1: the weights parted too


def test_explorer_flags_a_run_gone_nan_and_says_nan(tmp_path):
    """A run whose gradient went NaN (compared without a control): the explorer opens on the
    flagged parameter at the step it went NaN, and its table reads "NaN" for a statistic
    recorded as NaN (an empty cell is a step without a gradient)."""
    import re

    import torch

    import probekit

    def train(path, nan_at=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with probekit.GradProbe(model, opt, dump_path=str(path)):
            for s in range(4):
                opt.zero_grad()
                model(torch.randn(16, 8)).square().mean().backward()
                if s == nan_at:
                    model[1].weight.grad[0, 0] = float("nan")
                opt.step()

    train(tmp_path / "a")
    train(tmp_path / "c", nan_at=1)
    cmp = probekit.compare_grads(str(tmp_path / "a"), str(tmp_path / "c"), progress=False)
    html = GradExplorer(str(tmp_path / "c"), comparison=cmp)._repr_mimebundle_()["text/html"]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", re.sub(r"<img[^>]*>", "", html)))
    assert "⚠ first flag at step 1: 1.weight" in text
    assert "1 ⚠ 1 NaN NaN NaN" in text and "✓" not in text
