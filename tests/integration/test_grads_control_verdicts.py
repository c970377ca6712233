"""Verdicts with a control run on a real model (issue 27): a tiny GPT-2 from transformers (random
init), 6 AdamW steps. Healthy bf16 autocast is within what bf16 rounding explains; planted bugs
(one gradient divided by 2, a LayerNorm scaled, an activation overflowing to inf, from step 2)
are beyond noise at that step and parameter; the verdict in the result, the CLI and triage,
which runs the free benchmark only beyond noise; one similarity in headline, suspects and plot.
The expensive runs (six models, 20 steps, two controls) are in benchmarks/bench_control.py."""
import math

import pytest
import torch

import _control_models as cm
import probekit
from probekit.cli import main
from probekit.grads import GradProbe, compare_grads
from probekit.grads.compare.verdict import judged_name, verdict_kind

STEPS, ONSET = 6, 2
KIND = "gpt2"
SMALL = {"width": 32, "layers": 2, "inner": 128}


def _build():
    return cm.build(KIND, **SMALL)


def _record(path, setting="fp32", control=None, bug=None, **options):
    model = _build()
    clock = cm.Clock()
    if bug:
        cm.plant(model, KIND, bug, clock, ONSET, **options)
    with GradProbe(model, dump_path=str(path), control=control):
        cm.train(model, KIND, setting, STEPS, clock=clock, size=4, seq=16)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    torch.set_num_threads(1)
    return {"ref": _record(root / "ref"),
            "ctrl": _record(root / "ctrl", control="bf16"),
            "amp": _record(root / "amp", "autocast"),
            "grad_count": _record(root / "grad_count", "autocast", bug="grad_count"),
            "norm_scale": _record(root / "norm_scale", "autocast", bug="norm_scale"),
            "inf": _record(root / "inf", "autocast", bug="overflow", saturate=False)}


def test_healthy_autocast_is_within_and_uncalibrated_says_how(runs):
    cmp = compare_grads(runs["ref"], runs["amp"], control=runs["ctrl"], progress=False)
    assert verdict_kind(cmp) == "within" and cmp.attrs["control"] == "bf16"
    assert not cmp["flag"].values.any() and not cmp["flag_total"].values.any()
    assert str(cmp).startswith("within what bf16 rounding explains over 6 steps: no parameter "
                               "departs from the reference further than the bf16 control does")
    # the control itself parts from the reference: it is not a copy of it
    assert float(cmp["similarity_control"].min()) < 1.0
    plain = compare_grads(runs["ref"], runs["amp"], progress=False)
    assert verdict_kind(plain) == "uncalibrated"
    assert str(plain).startswith("uncalibrated: ")
    assert "control='bf16'" in str(plain).split("\n")[0]


def test_scaled_gradient_found_by_its_norm(runs):
    target = cm.TARGETS[KIND]["grad_count"]
    cmp = compare_grads(runs["ref"], runs["grad_count"], control=runs["ctrl"], progress=False)
    r = cmp.isel(rank=0)
    assert (int(r["first_step"]), str(r["first_param"].item())) == (ONSET, target)
    cell = r.sel(step=ONSET, param=target)
    assert int(cell["flag_kind"]) == 2                      # scale: the signs are alike
    assert float(cell["norm_ratio"]) == pytest.approx(0.5, rel=0.05)
    assert not r["flag"].sel(param=target).values[:ONSET].any()
    assert str(cmp).startswith(f"beyond rounding noise from step {ONSET} at {target} "
                               "(gradient norm 0.")


def test_layernorm_scale_and_overflow_beyond_noise_at_their_step(runs):
    for name in ("norm_scale", "inf"):
        cmp = compare_grads(runs["ref"], runs[name], control=runs["ctrl"], progress=False)
        r = cmp.isel(rank=0)
        assert int(r["first_step"]) == ONSET, name
        assert not r["flag"].values[:ONSET].any() and not r["flag_total"].values[:ONSET].any()
        if name == "norm_scale":      # found in the block of the scaled LayerNorm
            assert str(r["first_param"].item()).startswith("transformer.h.1."), name
    # the overflow's inf turns every gradient of that step NaN (so no parameter stands out):
    # flagged as such
    assert (r["flag_kind"].sel(step=ONSET).values == 3).all()
    assert "NaN/Inf where the reference's and the control's are finite" in str(cmp)


def test_cli_prints_the_verdict(runs, tmp_path, capsys):
    assert main(["grads", "compare", runs["ref"], runs["grad_count"], "-o", str(tmp_path),
                 "--control", runs["ctrl"], "--plots", "summary"]) == 0
    out = capsys.readouterr().out
    assert "total similarity (significant signs) " in out
    assert f"rank 0: beyond rounding noise from step {ONSET} at " \
           f"{cm.TARGETS[KIND]['grad_count']} (gradient norm" in out
    assert (tmp_path / "rank0" / "similarities_picture" / "summary_similarities.png").exists()


def test_one_similarity_in_headline_suspects_and_plot(runs):
    import matplotlib

    matplotlib.use("Agg")
    from probekit import plot

    cmp = compare_grads(runs["ref"], runs["norm_scale"], control=runs["ctrl"], progress=False)
    r = cmp.isel(rank=0)
    step, param = int(r["first_step"]), str(r["first_param"].item())
    judged = float(r[judged_name(cmp)].sel(step=step, param=param))
    sus = cmp.probekit.suspects()
    assert sus.loc[0, "params"][0] == param and sus.loc[0, "similarity"] == judged
    report = probekit.triage(_build(), lambda: None, comparison=cmp, top=1,
                             pert_modes=["improve_precision"], stages=["forward"])
    assert report.divergence["similarity"] == judged
    ax = plot.similarity(cmp, params=[param]).axes[0]  # plot functions return the Figure
    line = next(x for x in ax.lines if x.get_gid() == f"similarity:{param}")
    assert line.get_ydata()[list(r["step"].values).index(step)] == judged
    band = next(c for c in ax.collections if c.get_gid() == f"band:{param}")
    assert band.get_paths()            # the control's band is shaded
    import matplotlib.pyplot as plt

    plt.close("all")


def test_triage_stops_within_noise_and_runs_beyond(runs):
    model = _build()
    ids = torch.randint(0, cm.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))

    def step_fn():
        model(input_ids=ids, labels=ids).loss.backward()

    within = probekit.triage(model, step_fn, runs["ref"], runs["amp"], control=runs["ctrl"])
    assert within.runs == [] and within.stopped.startswith("Nothing to check")
    assert str(within).startswith("Triage: within what bf16 rounding explains over 6 steps")
    beyond = probekit.triage(model, step_fn, runs["ref"], runs["grad_count"],
                             control=runs["ctrl"], top=1, pert_modes=["improve_precision"],
                             stages=["forward"])
    assert not beyond.stopped and [r["pert_mode"] for r in beyond.runs] == ["improve_precision"]
    assert str(beyond).startswith(f"Triage: beyond rounding noise from step {ONSET} at "
                                  f"{cm.TARGETS[KIND]['grad_count']}")
    assert list(beyond.suspects["module"]) == ["transformer.h.1.attn"]
    assert math.isfinite(beyond.divergence["similarity"])


def test_shared_reference_read_equals_the_plain_comparisons(runs, monkeypatch):
    """A comparison with controls counts the reference's bits once against the test and every
    control laid out alike (``counting.count_many``, issue 38): the result is that of the plain
    comparisons, each alone, judged by ``calibrate``, variable for variable and bit for bit,
    and the verdict's words with it."""
    import numpy as np

    from probekit.grads.compare import counting, planner
    from probekit.grads.compare.verdict import calibrate
    from probekit.grads.store.sources import load_runs

    shared, planned = [], []
    real, real_sets = counting.count_many, planner._slab_sets

    def spy(*args):
        out = real(*args)
        shared.append(out.shape[0])
        return out

    def spy_sets(*args):
        planned.append(1)
        return real_sets(*args)

    monkeypatch.setattr(counting, "count_many", spy)
    monkeypatch.setattr(planner, "_slab_sets", spy_sets)
    for test, controls in (("grad_count", ["ctrl", "amp"]), ("norm_scale", ["ctrl"])):
        shared.clear()
        planned.clear()
        got = compare_grads(runs["ref"], runs[test], control=[runs[c] for c in controls],
                            progress=False)
        assert shared and set(shared) == {1 + len(controls)}    # the shared read ran
        assert len(planned) == 1     # the slab sets planned once for the test and controls
        alone = [compare_grads(runs["ref"], runs[x], progress=False)
                 for x in (test, *controls)]
        # the runs differ from the reference differently: counts mixed up would show
        sims = [np.asarray(c["similarity_significant"].values) for c in alone]
        assert all(not np.array_equal(sims[0], s) for s in sims[1:])
        want = calibrate(alone[0], alone[1:], load_runs(runs["ref"]), load_runs(runs[test]),
                         [load_runs(runs[c]) for c in controls])
        assert sorted(got.data_vars) == sorted(want.data_vars)
        assert sorted(got.coords) == sorted(want.coords) and got.attrs == want.attrs
        for name in list(got.data_vars) + list(got.coords):
            g, w = np.asarray(got[name].values), np.asarray(want[name].values)
            assert g.dtype == w.dtype and g.shape == w.shape, name
            if g.dtype.kind in "fc":
                assert g.tobytes() == w.tobytes(), name          # NaNs and -0.0 included
            else:
                assert np.array_equal(g, w), name
        assert str(got) == str(want)
