"""Backward severities relative to the gradient's scale: rounding noise on near-zero gradient
elements is not a finding (healthy fp32 models are quiet); real bf16 losses still are."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from test_freebench_training import make  # noqa: E402

bf16 = torch.bfloat16


def gen():
    return torch.Generator().manual_seed(0)


def expected(gr: torch.Tensor, gq: torch.Tensor) -> float:
    """The backward metric in float64: |q - r| / max(|r|, S), S the largest power of two
    <= max|r|."""
    r, q = gr.double(), gq.double()
    s = 2.0 ** math.floor(math.log2(r.abs().max().item()))
    return ((q - r).abs() / r.abs().clamp_min(s)).max().item()


@pytest.mark.parametrize("mode", ["bit_noise", "add_noise", "improve_precision"])
def test_healthy_fp32_model_has_no_backward_findings(tmp_path, mode):
    # before: 8-12 findings (ratio up to 6) of ~4 fp32 eps of the gradient's scale
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, _, step = make(seed=0, dtype=torch.float32)
        fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage="backward")
        for _ in range(2):
            with fb:
                step()
            fb.step()
    finally:
        torch.set_num_threads(n)
    assert fb.summary["checked"] > 40
    assert fb.results.empty, fb.results


def test_bf16_layer_norm_backward_loss_still_flagged_with_exact_value(tmp_path):
    x = (torch.randn(16, 64, generator=gen()) * 3 + 1).to(bf16).requires_grad_(True)
    w = (torch.rand(64, generator=gen()) + 0.5).to(bf16)
    g = torch.randn(16, 64, generator=gen())
    g = (g / g.abs().max() * 0.75).to(bf16)      # the probe's perturbed re-run uses g as is
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", fuzz_stage="backward",
                   list=["layer_norm"])
    with fb:
        F.layer_norm(x, (64,), w).backward(g)
    df = fb.results
    assert df["output_index"].tolist() == [0] and df["stage"].tolist() == ["backward"]
    # recomputed: the bf16 input gradient against the fp32 one (and the fp64 one)
    x16 = x.detach().requires_grad_(True)
    (gr,) = torch.autograd.grad(F.layer_norm(x16, (64,), w), x16, g)
    x32 = x.detach().float().requires_grad_(True)
    (gq,) = torch.autograd.grad(F.layer_norm(x32, (64,), w.float()), x32, g.float())
    x64 = x.detach().double().requires_grad_(True)
    (g64,) = torch.autograd.grad(F.layer_norm(x64, (64,), w.double()), x64, g.double())
    assert df["max_rel"].iloc[0] == pytest.approx(expected(gr, gq), rel=1e-9)
    assert expected(gr, g64) == pytest.approx(expected(gr, gq), rel=1e-3)
    assert df["ratio"].iloc[0] > 2, df
    # the exact gradient moves beyond the threshold under a one-bf16-ulp input change
    assert df["cause"].tolist() == ["ill-conditioned"]


def test_fp32_matmul_backward_rounding_on_near_zero_elements_is_not_a_finding(tmp_path):
    # grad_a = g @ b^T in fp32 over k=256: its elements close to 0 carry a few fp32 eps of the
    # gradient's scale of rounding error, which the per-dtype floor 1e-4 turned into ratios > 1
    a = torch.randn(64, 256, generator=gen()).requires_grad_(True)
    b = torch.randn(256, 64, generator=gen())
    g = torch.randn(64, 64, generator=gen())
    g = g / g.abs().max() * 0.75
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", fuzz_stage="backward",
                   list=["matmul"])
    with fb:
        torch.matmul(a, b).backward(g)
    assert fb.summary["checked"] == 1 and fb.results.empty, fb.results
    # float64 recomputation: the fp32 gradient is accurate to ~1e-6 of its scale, while its
    # smallest elements are ~1e-4 of it (judged elementwise they looked inaccurate)
    gr = g @ b.t()
    g64 = g.double() @ b.double().t()
    assert expected(gr, g64) < 1e-5
    per_element = ((gr.double() - g64).abs() / gr.double().abs().clamp_min(1e-4)).max().item()
    assert per_element > 2e-4   # what the old metric saw (fp32 threshold 2e-4)


def unit_scaled(gr, gq):
    """The definition: both gradients (in at least fp32) times the power of two that brings
    max|gr| into [0.5, 1) (1/2 when max|gr| is 0 or not finite)."""
    cdt = torch.promote_types(torch.promote_types(gr.dtype, gq.dtype), torch.float32)
    a, b = gr.to(cdt), gq.to(cdt)
    m = a.abs().amax()
    ok = torch.isfinite(m) & (m > 0)
    _, exp = torch.frexp(torch.where(ok, m, torch.ones_like(m)))
    f = torch.ldexp(torch.ones_like(m), -exp)
    return a * f, b * f


def _pair(n, odt, pdt, special):
    g = gen()
    r = torch.randn(n, generator=g) * torch.logspace(-6, 3, n, dtype=torch.float64).float()
    q = r.double() * (1 + torch.randn(n, generator=g, dtype=torch.float64) * 1e-3)
    q[: n // 7] = -q[: n // 7]                       # sign flips
    r, q = r.to(odt), q.to(pdt)
    if special:
        r[1], q[2], r[3], q[3], q[5] = math.nan, math.inf, -math.inf, math.inf, -math.inf
    return r, q


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("n", [1000, (1 << 18) * 3 + 5])
@pytest.mark.parametrize("odt,pdt,special", [(bf16, torch.float32, False),
                                              (torch.float32, torch.float64, False),
                                              (torch.float32, torch.float32, True),
                                              (torch.float16, torch.float32, True)])
def test_grad_stats_equal_the_metric_of_the_unit_scaled_pair(exact, n, odt, pdt, special):
    # the hot path compares in the gradient's own units; the values must be those of the pair
    # scaled to max|gr| in [0.5, 1) with the floor 0.5, bit for bit
    from probekit.freebench.backward import BACKWARD_FLOOR, grad_stats
    from probekit.freebench.metric import device_stats

    r, q = _pair(n, odt, pdt, special)
    got = [float(v) for v in grad_stats(r, q, exact)]
    want = [float(v) for v in device_stats(*unit_scaled(r, q), BACKWARD_FLOOR, exact)]
    assert len(got) == (5 if exact else 4)
    assert got == pytest.approx(want, rel=0, abs=0, nan_ok=True)


def test_grad_stats_of_an_all_zero_gradient():
    from probekit.freebench.backward import grad_stats

    r = torch.zeros(8)
    q = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0.25])
    # max|r| = 0: floor 1 (f = 1/2), so |q - r| / 1 = 0.25 below the floor (signed negative)
    # and the scaled difference 0.125
    assert [float(v) for v in grad_stats(r, q, False)] == [-0.25, 0.0, 0.0, 0.125]
    assert [float(v) for v in grad_stats(r, q, True)] == [0.0, 0.25, 0.125, 0.0, 0.0]
