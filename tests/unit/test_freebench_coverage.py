"""No silent zero coverage: filters and stages that leave nothing checked are reported once."""
import logging

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench
from probekit.freebench.engine import rng

X = torch.randn(4, 8)
W = torch.randn(8, 8)


def train_steps(fb, steps=3, backward_inside=True):
    w = W.clone().requires_grad_(True)
    for _ in range(steps):
        with fb:
            loss = torch.matmul(X, w).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        fb.step()


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("probekit")]


@pytest.mark.parametrize("options, expect", [
    ({"scope": ["Torch.matmull.0"]}, "scope ['Torch.matmull.0'] matched none of the"),
    ({"list": ["softmaxx"]}, "list ['softmaxx'] matched none of the"),
    ({"scope": ["Torch.matmul.7"]}, "scope ['Torch.matmul.7'] matched none of the"),
    ({"list": ["backward"]}, "matched the filter but none was checked (skipped: {'metadata': 1})"),
    ({"fuzz_stage": "backward", "backward_outside": True},
     "fuzz_stage backward watched 2 call(s) but no gradient reached them"),
])
def test_zero_coverage_warned_once(tmp_path, caplog, options, expect):
    options = dict(options)
    outside = options.pop("backward_outside", False)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", **options)
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=3, backward_inside=not outside)
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and expect in msgs[0], msgs
    assert fb.summary["checked"] == 0


def test_no_snapshot_once_every_step_finding_was_logged(tmp_path, caplog):
    """A step finding is logged once per kind; once every kind the filters can give was logged
    the session stops counting (no snapshot at the step's start), and logs nothing more."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", scope=["Torch.matmull.0"])
    assert fb._step_kinds == ("scope", "unchecked") and fb._step_start is not None
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=2)
    assert fb._step_kinds == ("unchecked",) and fb._step_start is not None
    fb2 = FreeBench(dump_path=str(tmp_path / "b"), pert_mode="no_change", step=[100])
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb2, steps=3)
    assert fb2._step_kinds == () and fb2._step_start is None
    steps = [m for m in (r.getMessage() for r in caplog.records) if "step filter" in m]
    assert steps == ["[probekit] Free benchmark: step 0 is not in the step filter; checking "
                     "starts at step 100 (0 calls checked so far)."]


def test_step_filter_excluding_everything(tmp_path, caplog):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", step=[1])
    fb2 = FreeBench(dump_path=str(tmp_path / "b"), pert_mode="no_change", step=[100])
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=1)    # step 0 excluded, step 1 still to come: INFO only
        train_steps(fb2, steps=2)
    assert warnings_of(caplog) == []
    infos = [r.getMessage() for r in caplog.records if "not in the step filter" in r.getMessage()]
    assert infos == [
        "[probekit] Free benchmark: step 0 is not in the step filter; checking starts at step 1 "
        "(0 calls checked so far).",
        "[probekit] Free benchmark: step 0 is not in the step filter; checking starts at step 100 "
        "(0 calls checked so far).",
    ]
    assert fb2.summary["checked"] == 0 and fb2.summary["steps_filtered"] == 2
    # the selected steps went by without the probe; the first probed step is past the filter
    fb3 = FreeBench(dump_path=str(tmp_path / "c"), pert_mode="no_change", step=[0, 1])
    with caplog.at_level(logging.INFO, logger="probekit"):
        fb3.step()
        fb3.step()
        train_steps(fb3, steps=2)
    assert warnings_of(caplog) == [
        "[probekit] Free benchmark: step() was called before any start(): step 0 ends with "
        "nothing checked and the next block is step 1. step() ends a training step whose calls "
        "ran between start() and stop() (or inside `with fb:`); the step filter [0, 1] leaves "
        "steps [1] to check",  # issue 28: said at the first step() before any start()
        "[probekit] Free benchmark: the step filter [0, 1] selects no step after step 2; "
        "0 calls checked."]


def test_rank_filter_excluding_this_process(tmp_path, caplog):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", rank=[3])
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=2)
    assert warnings_of(caplog) == [
        "[probekit] Free benchmark: rank filter [3] excludes this process; 0 calls checked."]
    assert fb.summary["checked"] == 0


@pytest.mark.parametrize("options", [{}, {"scope": ["Torch.matmul.0"]}, {"list": ["matmul"]},
                                     {"fuzz_stage": "backward"}, {"step": [1, 2]}])
def test_covered_runs_are_not_warned(tmp_path, caplog, options):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", **options)
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=3)
    assert warnings_of(caplog) == []
    assert fb.summary["checked"] > 0


# -- what share of the floating-point calls was checked, and why not ------------------------------
def test_share_of_floating_point_calls_and_a_count_per_skip_reason(tmp_path):
    """A floating-point call: a float tensor among the arguments, not a metadata query. The
    summary says how many there were, what share was checked, and a count per skip reason;
    fb.coverage has one row per such call site with the reason it was not checked."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision")
    x = torch.randn(4, 8)
    i = torch.arange(4)
    for _ in range(2):
        with fb:
            y = torch.matmul(x, W)           # checked
            y.t()                            # view
            y.clone()                        # copy
            y.relu_()                        # in-place: checked
            x.size()                         # metadata: not a floating-point call
            i + i                            # no floating-point input
            torch._foreach_add([x], 1.0)     # private
            torch.poisson(x.abs())           # random, its draws depend on the values
        fb.step()
    s = fb.summary
    assert s["float_calls"] == 2 * 7 and s["checked"] == 2 * 3
    assert s["checked_share"] == 6 / 14
    assert s["float_skipped"] == {"view": 2, "copy": 2, "private": 2, "random": 2}
    assert s["skipped"] == {"view": 2, "copy": 2, "private": 2, "random": 2, "metadata": 2,
                            "no_float_input": 2}
    rows = {r.api_name: (r.calls, r.checked, r.reason) for r in fb.coverage.itertuples()}
    assert rows == {"Torch.matmul.0": (2, 2, ""), "Tensor.t.0": (2, 0, "view"),
                    "Tensor.clone.0": (2, 0, "copy"), "Tensor.relu_.0": (2, 2, ""),
                    "Torch._foreach_add.0": (2, 0, "private"), "Tensor.abs.0": (2, 2, ""),
                    "Torch.poisson.0": (2, 0, "random: " + rng.WHY["values"])}
    assert "6 checked (43 % of 14 floating-point calls)" in str(s)


def test_backward_calls_whose_gradient_never_arrives_are_counted(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", fuzz_stage="backward")
    train_steps(fb, steps=1, backward_inside=False)
    s = fb.summary
    assert s["float_skipped"] == {"no_gradient": 2} and s["checked_share"] == 0.0
    assert set(fb.coverage["reason"]) == {"no_gradient"}


# -- private calls public APIs make ------------------------------------------------------------
def _grouped(dtype, stage, mode, tmp_path):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(24, 16, generator=g).to(dtype)
    w0 = torch.randn(3, 16, 8, generator=g).to(dtype)
    r = torch.randn(24, 8, generator=g)
    offs = torch.tensor([5, 13, 24], dtype=torch.int32)

    def run(probe):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with probe if probe is not None else torch.enable_grad():
            y = F.grouped_mm(x, w, offs=offs)          # torch._grouped_mm underneath
            (y.float() * r).sum().backward()
        return y, x.grad, w.grad

    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage=stage,
                   list=["grouped_mm"])
    got, ref = run(fb), run(None)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    return fb


@pytest.mark.parametrize("dtype, mode", [(torch.bfloat16, "improve_precision"),
                                         (torch.float32, "bit_noise"),
                                         (torch.bfloat16, "bit_noise")])
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_grouped_mm_of_moe_experts_is_checked(tmp_path, dtype, mode, stage):
    """F.grouped_mm (the expert GEMMs of MoE layers) is plain Python over the private
    torch._grouped_mm, which is all the probe sees: it is checked, forward and backward."""
    fb = _grouped(dtype, stage, mode, tmp_path)
    rows = {r.api_name: (r.calls, r.checked, r.reason) for r in fb.coverage.itertuples()}
    assert rows == {"Torch._grouped_mm.0": (1, 1, "")}
    assert fb.results.empty, fb.results[["api_name", "output_index", "ratio", "cause"]]


def test_fp32_grouped_mm_has_no_float64_kernel_to_upcast_to(tmp_path):
    fb = _grouped(torch.float32, "forward", "improve_precision", tmp_path)
    rows = {r.api_name: (r.calls, r.checked, r.reason) for r in fb.coverage.itertuples()}
    assert rows == {"Torch._grouped_mm.0": (1, 0, "no_float64")}


def test_weight_norm_is_checked(tmp_path):
    """nn.utils.parametrizations.weight_norm computes the weight with torch._weight_norm (a
    speech model's positional conv): checked."""
    torch.manual_seed(0)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3), dim=2)
    x = torch.randn(2, 4, 16)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision")
    with fb:
        y = conv(x)
    assert torch.equal(y, conv(x))
    cov = fb.coverage.set_index("api_name")
    assert cov.loc["Torch._weight_norm.0", "checked"] == 1 and fb.results.empty


# -- issue 34: coverage holes -----------------------------------------------------------------------
class _FNet(torch.nn.Module):
    """An FFT-mixing block (FNet): token mixing by the real part of a 2-D FFT."""

    def __init__(self, d=32):
        super().__init__()
        self.emb, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.GELU(),
                                      torch.nn.Linear(64, d))

    def forward(self, x):
        x = self.emb(x)
        x = self.ln(x + torch.fft.fftn(x, dim=(-2, -1)).real)
        return x + self.ff(x)


@pytest.mark.parametrize("mode", ["improve_precision", "bit_noise"])
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_complex_outputs_are_compared(tmp_path, mode, stage):
    # an FFT's output is complex: it was never compared (no_float_output); its real and
    # imaginary parts are now, with their own scale, forward and backward, and a healthy FFT
    # gives nothing
    torch.manual_seed(0)
    m = _FNet()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage=stage)
    with fb:
        m(torch.randn(4, 16, 32)).pow(2).mean().backward()
    cov = fb.coverage.set_index("api_name")
    assert cov.loc["Torch.fft_fftn.0", "checked"] == 1, cov
    assert fb.results.empty and fb.hotspots.empty, (fb.results, fb.hotspots)
    if mode == "bit_noise" and stage == "backward":
        return   # the FFT is linear: its gradient does not move when its input does
    # the comparison is real: with a threshold below any rounding the parts differ (the
    # real and imaginary parts side by side, a trailing dim of 2)
    fb = FreeBench(dump_path=str(tmp_path / "tiny"), pert_mode=mode, fuzz_stage=stage,
                   thresholds={"float32": 1e-15}, list=["fft"])
    with fb:
        m(torch.randn(4, 16, 32)).pow(2).mean().backward()
    rows = pd.concat([fb.results, fb.hotspots.drop(columns="count")])
    assert rows["api_name"].tolist() == [f"Torch.fft_fftn.0.{stage}"] and \
        (rows["max_rel"] > 0).all(), rows
    if stage == "forward":
        assert rows["shape"].tolist() == ["(4, 16, 32, 2)"]


class _Reversible(torch.autograd.Function):
    """A layer whose backward recomputes its forward and states its gradient in Python (the
    calls a reversible network's backward makes)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        y = torch.tanh(x @ w)
        gz = g * (1 - y * y)
        return gz @ w.t(), x.t() @ gz


def test_calls_inside_a_custom_backward_are_checked_in_the_backward_stage(tmp_path):
    # issue 34: a custom autograd.Function's backward ran with the mode popped (loss.backward()
    # is itself a torch function): its calls were invisible. Now the backward stage checks them
    # as they compute (their outputs are gradients), the forward stage names them in the coverage
    # (backward_pass), and the training is bit for bit the same
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)

    def train(fb=None):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if fb is None:
            _Reversible.apply(x * 1.0, w).sum().backward()
        else:
            with fb:
                _Reversible.apply(x * 1.0, w).sum().backward()
        return x.grad, w.grad

    plain = train()
    inside = ["Tensor.__matmul__.1", "Torch.tanh.1", "Tensor.__mul__.1", "Tensor.__rsub__.0",
              "Tensor.__mul__.2", "Tensor.__matmul__.2", "Tensor.__matmul__.3"]
    for stage, reason in (("backward", ""), ("forward", "backward_pass")):
        fb = FreeBench(dump_path=str(tmp_path / stage), pert_mode="improve_precision",
                       fuzz_stage=stage)
        got = train(fb)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
        cov = fb.coverage.set_index("api_name")
        assert (cov.loc[inside, "reason"] == reason).all(), cov
        assert (cov.loc[inside, "checked"] == (1 if stage == "backward" else 0)).all(), cov
        assert fb.results.empty
    # retain_graph / create_graph / an explicit gradient take the same path
    fb = FreeBench(dump_path=str(tmp_path / "args"), pert_mode="bit_noise", fuzz_stage="backward")
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with fb:
        y = _Reversible.apply(x * 1.0, w)
        y.backward(torch.ones_like(y), retain_graph=True)
        torch.autograd.backward([y], [torch.ones_like(y)])
    assert torch.equal(x.grad, 2 * plain[0]) and fb.summary["checked"] >= 14
