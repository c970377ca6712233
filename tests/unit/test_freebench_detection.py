"""Detection zoo: single calls whose answer is known.

Calls that lose most of their bits (cancellation, overflow) or whose kernel loses precision must
be flagged by at least one mode; healthy calls -- well-conditioned ones, exact ones, and those
whose error is only what their dtype predicts (a bf16 matmul over k=4096, an fp32 dot product
that cancels inside a larger output, bf16 SDPA) -- by none. Inputs are built outside the probe,
so each case is exactly the one call under test.
"""
import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench

MODES = [("improve_precision", {}), ("bit_noise", {}), ("add_noise", {}), ("change_value", {}),
         ("no_change", {}), ("to_cpu", {"fuzz_device": "cpu"})]
bf16, fp16 = torch.bfloat16, torch.float16


def gen():
    return torch.Generator().manual_seed(0)


def run(tmp_path, mode, extra, fn, inputs):
    fb = FreeBench(dump_path=str(tmp_path / mode), pert_mode=mode, **extra)
    with fb:
        fn(*inputs)
    return fb


# (name, function, inputs, mode expected to flag, expected kind)
FLAGGED = [
    ("cancellation_positive", torch.add, (torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])),
     "bit_noise", "rel_error"),
    ("cancellation_negative", torch.add, (torch.tensor([-1e4 - 0.01]), torch.tensor([1e4])),
     "bit_noise", "rel_error"),
    ("bf16_258_minus_256", torch.sub,
     (torch.tensor([258.0], dtype=bf16), torch.tensor([256.0], dtype=bf16)), "bit_noise",
     "rel_error"),
    ("bf16_long_sum", torch.sum, (torch.randn(100_000, generator=gen()).to(bf16),), "add_noise",
     None),
    ("fp16_long_sum_overflows", torch.sum, (torch.ones(100_000, dtype=fp16),),
     "improve_precision", "nan_inf"),
    ("fp16_softmax_large_logits", torch.softmax,
     # logits near 1000 differ by O(1) while fp16's spacing there is 0.5
     ((torch.randn(4, 64, generator=gen()) * 2 + 1000).to(fp16), -1), "bit_noise", None),
    # pytorch/pytorch#57690, #123082: cdist(x, x) goes through a matmul, so the diagonal that must
    # be exactly 0 is 0.125 here (float64: 0); all the damage is on zero-valued outputs
    ("cdist_self_diagonal", torch.cdist,
     ((torch.randn(40, 8, generator=gen()) * 10 + 100,) * 2), "improve_precision", "rel_error"),
    # fp16 log_softmax of [0, -7.93]: -7.93 is -7.9296875 in fp16; the exact first output
    # is -3.598e-4, fp16 returns 0
    ("fp16_log_softmax_small_output", F.log_softmax, (torch.tensor([[0.0, -7.93]]).to(fp16), -1),
     "improve_precision", "rel_error"),
]


@pytest.mark.parametrize("name, fn, inputs, mode, kind", FLAGGED, ids=[c[0] for c in FLAGGED])
def test_flagged(tmp_path, name, fn, inputs, mode, kind):
    fb = run(tmp_path, mode, {}, fn, inputs)
    df = fb.results
    assert len(df) == 1, df
    if kind is not None:
        assert df["kind"].iloc[0] == kind
    assert df["ratio"].iloc[0] > 1 or df["kind"].iloc[0] == "nan_inf"


def test_cancellation_sign_symmetry(tmp_path):
    pos = run(tmp_path / "p", "bit_noise", {}, torch.add,
              (torch.tensor([1e4 + 0.01]), torch.tensor([-1e4]))).results
    neg = run(tmp_path / "n", "bit_noise", {}, torch.add,
              (torch.tensor([-1e4 - 0.01]), torch.tensor([1e4]))).results
    assert pos["max_rel"].tolist() == neg["max_rel"].tolist()
    assert pos["max_rel"].iloc[0] == pytest.approx(2 ** -10 / 0.009765625)


QUIET = [
    ("fp32_exp", torch.exp, (torch.rand(1000, generator=gen()),)),
    ("fp32_mul", torch.mul, (torch.rand(1000, generator=gen()), torch.rand(1000, generator=gen()))),
    ("fp32_positive_sum", torch.sum, (torch.rand(1000, generator=gen()),)),
    ("fp32_softmax", torch.softmax, (torch.randn(16, 32, generator=gen()), -1)),
    ("fp32_matmul_positive", torch.matmul, (torch.rand(16, 32, generator=gen()),
                                            torch.rand(32, 16, generator=gen()))),
    ("fp32_sqrt", torch.sqrt, (torch.rand(100, generator=gen()) + 1,)),
    ("fp32_sigmoid", torch.sigmoid, (torch.randn(100, generator=gen()),)),
    ("fp32_gelu_positive", F.gelu, (torch.rand(100, generator=gen()) + 0.5,)),
    # exact ops, even in bf16 where one ulp of noise exceeds the dtype threshold
    ("bf16_relu", torch.relu, (torch.randn(1000, generator=gen()).to(bf16),)),
    ("bf16_abs", torch.abs, (torch.randn(1000, generator=gen()).to(bf16),)),
    ("bf16_neg", torch.neg, (torch.randn(1000, generator=gen()).to(bf16),)),
    ("bf16_amax", torch.amax, (torch.randn(10, 100, generator=gen()).to(bf16), -1)),
    # fixed bugs / sums that accumulate in fp32 (torch 2.13 CPU): fp16 sum once accumulated in
    # fp16 (pytorch/pytorch#93708, inductor); scatter_add and embedding_bag accumulate fp16 in fp32
    ("fp16_positive_sum_fp32_accumulation", torch.sum,
     (torch.rand(100_000, generator=gen()).to(fp16),)),
    ("fp16_scatter_add_fp32_accumulation", torch.scatter_add,
     (torch.zeros(4, dtype=fp16), 0, torch.randint(0, 4, (20_000,), generator=gen()),
      torch.rand(20_000, generator=gen()).to(fp16))),
    ("fp32_index_add_positive", torch.index_add,
     (torch.zeros(4), 0, torch.randint(0, 4, (1000,), generator=gen()),
      torch.rand(1000, generator=gen()))),
    # what the dtype predicts, not a defect (issue 19): these were flagged before
    ("bf16_matmul_large_k", torch.matmul, (torch.randn(8, 4096, generator=gen()).to(bf16),
                                           torch.randn(4096, 8, generator=gen()).to(bf16))),
    ("fp32_matmul_random_signs", torch.matmul, (torch.randn(64, 64, generator=gen()),
                                                torch.randn(64, 64, generator=gen()))),
    ("fp32_linear", F.linear, (torch.randn(16, 256, generator=gen()),
                               torch.randn(256, 256, generator=gen()) / 16,
                               torch.randn(256, generator=gen()))),
    ("fp32_gelu_whole_range", F.gelu, (torch.randn(1000, generator=gen()) * 4,)),
    ("fp32_layer_norm_offset", F.layer_norm, (torch.randn(16, 64, generator=gen()) * 3 + 1, (64,))),
    ("bf16_layer_norm", F.layer_norm, ((torch.randn(16, 64, generator=gen()) * 3 + 1).to(bf16),
                                       (64,))),
    ("bf16_softmax", torch.softmax, ((torch.randn(16, 64, generator=gen()) * 4).to(bf16), -1)),
    ("bf16_sdpa", F.scaled_dot_product_attention,
     tuple(torch.randn(2, 4, 32, 16, generator=gen()).to(bf16) for _ in range(3))),
    # log-probabilities near 0 (a confident row): fp32's log of 1 + 6e-6 is good to its u
    ("fp32_log_softmax_confident", F.log_softmax, (torch.tensor([[0.0, -12.0, -15.0]]), -1)),
]


@pytest.mark.parametrize("name, fn, inputs", QUIET, ids=[c[0] for c in QUIET])
def test_not_flagged_by_any_mode(tmp_path, name, fn, inputs):
    for mode, extra in MODES:
        fb = run(tmp_path, mode, extra, fn, inputs)
        assert fb.results.empty, (mode, fb.results)
        s = fb.summary
        assert s["checked"] + s["skipped"].get("cancelled", 0) == 1, (mode, s)


@pytest.mark.parametrize("fn", [lambda x: x.t(), lambda x: x.flatten(), lambda x: x[1:],
                                lambda x: x[0], lambda x: x.reshape(-1), lambda x: x.view(4, 8),
                                lambda x: x.transpose(0, 1), lambda x: x.clone(),
                                lambda x: x.contiguous(), lambda x: x.detach()])
def test_bf16_bit_noise_identity_and_view_ops_not_even_checked(tmp_path, fn):
    x = torch.randn(8, 4, generator=gen()).to(bf16)
    fb = run(tmp_path, "bit_noise", {}, fn, (x,))
    assert fb.results.empty
    assert fb.summary["checked"] == 0 and fb.summary["calls"] == 1


def test_small_output_damage_values_match_float64(tmp_path):
    x = torch.tensor([[0.0, -7.93]]).to(fp16)
    fb = run(tmp_path, "improve_precision", {}, F.log_softmax, (x, -1))
    o = F.log_softmax(x, -1).double()
    p64 = F.log_softmax(x.double(), -1)
    assert o[0, 0].item() == 0.0 and p64[0, 0].item() == pytest.approx(-3.598e-4, rel=1e-3)
    # log_softmax never cancels (two terms of the same sign): S = |p| + 1, k = 2 + 2 (the error
    # model: c ((u_out + gamma_k) |p| + gamma_k), u_acc float32's u)
    gk = 4 * 2.0 ** -24 / (1 - 4 * 2.0 ** -24)
    beta = gk / (2.0 ** -11 + gk)
    p32 = F.log_softmax(x.float(), -1).double()
    expect = ((p32 - o).abs() / (p32.abs() + beta)).max()
    row = fb.results.iloc[0]
    assert row["max_rel"] == pytest.approx(expect.item(), rel=1e-6)          # fp32 metric
    assert row["max_rel"] == pytest.approx(
        ((p64 - o).abs() / (p64.abs() + beta)).max().item(), rel=1e-4)      # fp64 agrees
    assert row["threshold"] == 2 * (2.0 ** -11 + gk) and row["cause"] == "inaccurate"


def test_conditioning_the_dtype_predicts_is_a_hot_spot_not_a_finding(tmp_path):
    # (100 + 1) - 100 in fp32: a one-ulp change of 101 moves the result by 7.6e-6 of itself:
    # more than a correct kernel's rounding (16 u = 9.5e-7), far less than half of fp32's bits
    a, b = torch.tensor([101.0]), torch.tensor([100.0])
    fb = run(tmp_path, "bit_noise", {}, torch.sub, (a, b))
    assert fb.results.empty and fb.summary["flagged"] == 0
    hot = fb.hotspots
    assert hot["api_name"].tolist() == ["Torch.sub.0.forward"]
    assert hot["max_rel"].iloc[0] == 2.0 ** -17 and hot["cause"].tolist() == ["ill-conditioned"]
    assert hot["count"].tolist() == [1] and fb.summary["hotspots"] == 1
    assert not (tmp_path / "bit_noise" / "free_benchmark.csv").read_text().count("Torch.sub")
    # the findings view: none, and the hot spot counted; shown apart only when asked
    from probekit.freebench.view import Findings

    page = fb._repr_html_()
    assert "no findings" in page and "1 hot spot" in page and "Torch.sub" not in page
    page = Findings.of(fb, hotspots=True)._repr_html_()
    assert "<b>Hot spots</b>" in page and "Torch.sub.0.forward" in page
    # ten times the cancellation (1e4 + 1) - 1e4: most of fp32's bits lost, a finding
    fb = run(tmp_path / "b", "bit_noise", {}, torch.sub, (torch.tensor([10001.0]),
                                                            torch.tensor([10000.0])))
    assert fb.results["cause"].tolist() == ["ill-conditioned"] and fb.hotspots.empty
