"""Sampled sign bits (``grad_probe.sample``) on real models: a run records its sample and, at
the same steps, a second probe records every element. The sampled comparison of two runs
(fp32 against bf16) lies within its confidence interval of the full comparison and finds the
same first divergence; the recorded sample is the full run's bits at the chosen elements."""
import os
import sys

import numpy as np
import pytest
import torch

from probekit.grads import GradProbe, compare_grads, open_grads
from probekit.grads.numerics.sampling import subsample

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def record_both(path, model, train, sample):
    """One training, two probes on it: every element into ``path/full``, a sample of each
    parameter into ``path/sampled``."""
    full = GradProbe(model, dump_path=str(path / "full")).start()
    sampled = GradProbe(model, dump_path=str(path / "sampled"), sample=sample).start()
    try:
        train(model)
    finally:
        sampled.stop()
        full.stop()


def coverage(full, sampled, var):
    """Share of the (step, parameter) cells of sampled parameters whose full value lies in the
    sampled comparison's interval, and the number of such cells."""
    low, high = sampled[var + "_low"].values, sampled[var + "_high"].values
    truth = full[var].values
    active = (sampled["sampled"].values < sampled["numel"].values)[None, :] & ~np.isnan(truth)
    inside = (truth >= low - 1e-12) & (truth <= high + 1e-12)
    return float(inside[active].mean()), int(active.sum())


def check_pair(base, a, b, sample, same_first=True, min_cells=20):
    """The recorded sample is the full bits at the chosen elements; the sampled comparison
    finds the full one's first divergence (``same_first``), and its intervals hold the full
    similarities. Returns (full, sampled comparison, coverage per variable)."""
    full_a, samp_a = open_grads(base / a / "full"), open_grads(base / a / "sampled")
    assert samp_a.attrs["sample"] == sample
    want = subsample(full_a, sample)  # the recorded sample: the full bits at those elements
    for var in ("direction", "significant"):
        np.testing.assert_array_equal(samp_a[var].values, want[var].values)
    np.testing.assert_array_equal(samp_a["norm"].values, full_a["norm"].values)
    out = {}
    for aware in (True, False):
        full = compare_grads(base / a / "full", base / b / "full", noise_aware=aware,
                             progress=False).isel(rank=0)
        samp = compare_grads(base / a / "sampled", base / b / "sampled", noise_aware=aware,
                             progress=False).isel(rank=0)
        if same_first:  # the same first divergence, by the same rule on the estimates
            assert int(samp["first_step"]) == int(full["first_step"]), aware
            assert str(samp["first_param"].item()) == str(full["first_param"].item()), aware
        out[aware] = (full, samp)
    full, samp = out[True]
    whole = samp["sampled"].values == samp["numel"].values  # small parameters: exact
    np.testing.assert_array_equal(samp["differ"].values[:, whole], full["differ"].values[:, whole])
    got = {var: coverage(full, samp, var) for var in ("similarity", "similarity_significant")}
    for var, (share, cells) in got.items():
        assert cells >= min_cells, (var, cells)
        # a 95 % interval (conservative for this stratified design): a few outside is chance
        assert share >= 0.9, (var, share, cells)
    inside = ((full["total"].values >= samp["total_low"].values)
              & (full["total"].values <= samp["total_high"].values))
    assert inside.mean() >= 0.5, inside
    return full, samp, got


class Bf16(torch.nn.Module):
    """A module run under bf16 autocast inside an fp32 model: the precision problem the
    comparison is for (its gradients part from the fp32 run's above fp32's rounding level)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x).float()


def gpt_train(model, steps=6, seed=1):
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 16), generator=gen)
        loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 64), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_gpt_with_a_bf16_block_sampled_like_full(tmp_path):
    """nanoGPT (tests/integration/test_grads_noise.py) against itself with one MLP in bf16:
    the same first divergence; and against a run on other data (every large parameter parts):
    the full similarities lie in the sampled intervals."""
    from test_grads_noise import GPT

    for name, mixed, seed in (("fp32", False, 1), ("bf16mlp", True, 1), ("other", False, 2)):
        torch.manual_seed(0)
        model = GPT()
        if mixed:
            model.h[1].mlp = Bf16(model.h[1].mlp)
        record_both(tmp_path / name, model, lambda m, s=seed: gpt_train(m, seed=s), sample=256)
    full, samp, _ = check_pair(tmp_path, "fp32", "bf16mlp", 256)
    assert int(full["first_step"]) >= 0  # there is a divergence to find
    assert samp.attrs["confidence"] == 0.95
    full, samp, got = check_pair(tmp_path, "fp32", "other", 256, same_first=False)
    big = samp["sampled"].values < samp["numel"].values
    assert float(full["similarity"].values[:, big].min()) < 0.9  # the intervals are tested


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hugging_face_models_sampled_like_full(tmp_path, kind):
    """fp32 against bf16 parameters: the same first divergence; fp32 against fp32 on other
    data: the full similarities within the sampled intervals."""
    from _hf_models import zoo_model, zoo_train

    for name, setting, seed in (("fp32", "fp32", 1), ("bf16", "bf16", 1), ("other", "fp32", 2)):
        model = zoo_model(kind, setting)
        record_both(tmp_path / name, model,
                    lambda m, s=setting, d=seed: zoo_train(m, kind, s, steps=3, seed=d),
                    sample=1024)
    check_pair(tmp_path, "fp32", "bf16", 1024)
    check_pair(tmp_path, "fp32", "other", 1024, same_first=False)
