"""A run whose gradients went NaN or Inf, compared without a control: flagged at the step where
its gradient is non-finite and the reference's is finite. The sign bits cannot show it (a NaN
element is neither positive nor above the rounding level, so it drops out of the
significant-sign similarity, which read 1 while the run was NaN)."""
import numpy as np
import torch

from probekit.grads import GradProbe, compare_grads
from probekit.grads.store.sources import load_runs
from probekit.grads.compare.verdict import verdict_line


def _train(path, nan_at=None, both=False, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradProbe(model, optimizer=opt, dump_path=str(path)):
        for step in range(steps):
            opt.zero_grad()
            model(torch.randn(16, 8)).square().mean().backward()
            if nan_at is not None and step == nan_at:
                model[1].weight.grad[0, 0] = float("nan")   # the weight goes NaN with it
            opt.step()
    return str(path)


def test_a_run_gone_nan_is_flagged_where_its_gradient_first_is(tmp_path):
    ref, same, bad = (_train(tmp_path / "a"), _train(tmp_path / "a2"),
                      _train(tmp_path / "c", nan_at=1))
    cmp = compare_grads(ref, bad, progress=False)
    nf = cmp["nonfinite"].values[0]
    assert nf[0].tolist() == [False] * 4                   # step 0: every gradient finite
    assert nf[1].tolist() == [False, False, True, False]   # step 1: 1.weight
    assert nf[2:].all()                                    # then everything is NaN
    assert cmp["first_step"].values.tolist() == [1]
    assert cmp["first_param"].values.tolist() == ["1.weight"]
    assert (cmp["flag"].values[0] >= nf).all()
    assert verdict_line(cmp.isel(rank=0)) == (
        "the gradient of 1.weight is NaN/Inf from step 1 where the reference's is finite "
        "(uncalibrated comparison; NaN/Inf needs no control to be told from rounding).")
    # the same from Datasets
    again = compare_grads(load_runs(ref), load_runs(bad), progress=False)
    assert np.array_equal(again["nonfinite"].values, cmp["nonfinite"].values)
    assert again["first_step"].values.tolist() == [1]
    # a healthy twin: nothing non-finite, nothing flagged
    ok = compare_grads(ref, same, progress=False)
    assert not ok["nonfinite"].values.any() and ok["first_step"].values.tolist() == [-1]
    # NaN in the reference too is not the test's defect
    twin = compare_grads(bad, _train(tmp_path / "c2", nan_at=1), progress=False)
    assert not twin["nonfinite"].values.any()
