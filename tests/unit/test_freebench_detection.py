"""Detection zoo: single calls whose answer is known.

Calls that lose most of their bits (cancellation, overflow) or whose kernel loses precision must
be flagged by at least one mode; healthy calls -- well-conditioned ones, exact ones, and those
whose error is only what their dtype predicts (a bf16 matmul over k=4096, an fp32 dot product
that cancels inside a larger output, bf16 SDPA) -- by none. Inputs are built outside the probe,
so each case is exactly the one call under test.
"""
import pandas as pd
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
    from probekit.freebench.report.view import Findings

    page = fb._repr_html_()
    assert "no findings" in page and "1 hot spot" in page and "Torch.sub" not in page
    page = Findings.of(fb, hotspots=True)._repr_html_()
    assert "<b>Hot spots</b>" in page and "Torch.sub.0.forward" in page
    # ten times the cancellation (1e4 + 1) - 1e4: most of fp32's bits lost, a finding
    fb = run(tmp_path / "b", "bit_noise", {}, torch.sub, (torch.tensor([10001.0]),
                                                            torch.tensor([10000.0])))
    assert fb.results["cause"].tolist() == ["ill-conditioned"] and fb.hotspots.empty


# -- issue 26: one error model; step functions; noise modes on the same footing ------------------
def test_fp16_index_put_accumulate_is_found_against_fp32_accumulation(tmp_path):
    # pytorch/pytorch#156173 below its stall: 4000 values in [0, 1) into 4 bins sum to about
    # 500 in fp16 steps of 0.25-0.5, an error of 3.9 (15 fp16 u of the bin's sum |v|). Judged
    # against sum |v| at the output's u (16 u) it passed; the model's bound with fp32
    # accumulation, c (u16 |p| + gamma_4001(u32) sum |v|), is 5 times smaller than the error
    g = gen()
    idx = torch.randint(0, 4, (4000,), generator=g)
    v = torch.rand(4000, generator=g).to(fp16)
    t = torch.zeros(4, dtype=fp16)
    for mode, extra in (("improve_precision", {}), ("to_cpu", {"fuzz_device": "cpu"})):
        fb = run(tmp_path / mode, mode, extra, torch.index_put, (t, (idx,), v, True))
        df = fb.results
        assert df["cause"].tolist() == ["inaccurate"] and df["ratio"].iloc[0] > 4, (mode, df)


def test_histc_of_integer_ids_is_not_perturbed_across_bin_edges(tmp_path):
    # a MoE router's expert counts: histc over integer ids stored as floats. One ulp above max
    # moves an element out of the last bin (its count drops to 0): a step function is checked
    # exactly by the accuracy modes and skipped by the sensitivity modes, with its reason listed
    ids = torch.randint(0, 8, (64,), generator=gen()).float()
    for mode in ("bit_noise", "add_noise", "change_value"):
        fb = run(tmp_path / mode, mode, {}, torch.histc, (ids, 8, 0, 7))
        assert fb.results.empty and fb.hotspots.empty
        assert fb.summary["checked"] == 0 and fb.summary["skipped"] == {"step": 1}, mode
    fb = run(tmp_path / "ip", "improve_precision", {}, torch.histc, (ids.bfloat16(), 8, 0, 7))
    assert fb.summary["checked"] == 1 and fb.results.empty


@pytest.mark.parametrize("fn", [torch.floor, torch.round, torch.sign, torch.frac])
def test_step_functions_are_compared_exactly_by_the_accuracy_modes(tmp_path, fn):
    x = (torch.randn(256, generator=gen()) * 8).to(bf16)
    fb = run(tmp_path, "improve_precision", {}, fn, (x,))
    assert fb.summary["checked"] == 1 and fb.results.empty
    fb = run(tmp_path / "n", "bit_noise", {}, fn, (x,))
    assert fb.summary["skipped"] == {"step": 1}


def test_layer_norm_of_constant_rows_is_not_a_finding_under_bit_noise(tmp_path):
    # exact output 0: a one-ulp checkerboard makes a constant row non-constant and its
    # normalised output jumps to about 0.8 (bf16); rounding keeps equal values equal, so the
    # float64 recomputation with such nudges does not move: unconfirmed, a hot spot at most
    x = torch.full((4, 64), 3.0).to(bf16)
    for mode in ("bit_noise", "add_noise", "improve_precision"):
        fb = run(tmp_path / mode, mode, {}, F.layer_norm, (x, (64,)))
        assert fb.results.empty, (mode, fb.results)
        assert set(fb.hotspots["cause"]) <= {"unconfirmed"}


def test_a_long_sum_that_cancels_keeps_its_bits_relative_to_its_magnitude(tmp_path):
    # 100000 bf16 values of random sign: the sum (-244) is 1/327 of sum |x| (79907). add_noise
    # moves every term up by one ulp, so the exact sum moves by about u S = 312, 1.8 times
    # itself; but S is what a correct kernel's rounding is measured against (gamma_k S), and
    # one ulp of each term moves a sum by at most u S, never by sqrt(u) S: no bits lost
    # relative to S, not ill-conditioned (issue 26 point 2). Flagged by the fast check (tensor
    # scale), settled by the float64 analysis: a hot spot
    x = torch.randn(100_000, generator=gen()).to(bf16)
    fb = run(tmp_path, "add_noise", {}, torch.sum, (x,))
    assert fb.results.empty, fb.results
    hot = fb.hotspots
    assert hot["cause"].tolist() == ["unconfirmed"] and hot["max_rel"].iloc[0] > 1


def test_one_pass_variance_in_bf16_is_ill_conditioned(tmp_path):
    # E[x^2] - E[x]^2 of features whose mean is 40 times their spread: the subtraction of two
    # bf16 numbers near 1600 keeps no correct digit, found by the sensitivity modes and
    # confirmed in float64
    x = (torch.randn(64, 64, generator=gen()) + 40).to(bf16)

    def var(x):
        m = x.mean(-1, keepdim=True)
        return (x * x).mean(-1, keepdim=True) - m * m

    for mode in ("bit_noise", "add_noise"):
        df = run(tmp_path / mode, mode, {}, var, (x,)).results
        assert df["api_name"].tolist() == ["Tensor.__sub__.0.forward"], (mode, df)
        assert df["cause"].tolist() == ["ill-conditioned"] and df["ratio"].iloc[0] >= 8


def test_autocast_reruns_start_from_the_inputs_the_op_computed_with(tmp_path):
    # under bf16 autocast an addmm receives fp32 tensors and computes on their bf16 roundings;
    # the upcast re-run must start from those (issue 26: it started from the fp32 inputs,
    # counting autocast's own casts as the kernel's error: a healthy GPT-2 Conv1D at 60-100x)
    g = gen()
    x, w = torch.randn(32, 96, generator=g), torch.randn(96, 288, generator=g) * 0.02
    b = torch.randn(288, generator=g) * 0.5
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision",
                   thresholds={"bfloat16": 1e-12})
    with fb, torch.autocast("cpu", dtype=bf16):
        o = torch.addmm(b, x, w)
    xb, wb, bb = x.to(bf16).float(), w.to(bf16).float(), b.to(bf16).float()
    p = torch.addmm(bb, xb, wb).double()
    # S from the inputs the op computed with, in its dtype (issue 38: not the upcast re-run's)
    s = torch.addmm(b.to(bf16).abs(), x.to(bf16).abs(), w.to(bf16).abs()).double()
    lam = 96 * 2.0 ** -24 / (1 - 96 * 2.0 ** -24) / 2.0 ** -8     # gamma_96(u32) / u_bf16
    expect = ((p - o.double()).abs() / (p.abs() + lam * s)).max().item()
    rows = pd.concat([fb.results, fb.hotspots])
    assert rows["max_rel"].iloc[0] == pytest.approx(expect, rel=1e-6)
    assert expect < 2 * 2.0 ** -8          # within the model's bound: no finding by default
    fb = FreeBench(dump_path=str(tmp_path / "d"), pert_mode="improve_precision")
    with fb, torch.autocast("cpu", dtype=bf16):
        torch.addmm(b, x, w)
        F.linear(x, w.t(), b)
    assert fb.results.empty and fb.hotspots.empty and fb.summary["checked"] == 2


def test_combined_mode_finds_an_inaccurate_kernel_and_an_ill_conditioned_computation(tmp_path):
    """Where to start (issue 26): pert_mode="combined" runs improve_precision and bit_noise on
    alternate steps, so two steps find a kernel that accumulates in fp16 (which no sensitivity
    mode sees: both runs accumulate alike) and a one-pass bf16 variance (which no accuracy mode
    sees: each call in it is exact); either mode alone finds one of the two."""
    g = gen()
    idx = torch.randint(0, 4, (4000,), generator=g)
    v = torch.rand(4000, generator=g).to(fp16)
    t = torch.zeros(4, dtype=fp16)
    x = (torch.randn(64, 64, generator=g) + 40).to(bf16)

    def step():
        torch.index_put(t, (idx,), v, accumulate=True)
        m = x.mean(-1, keepdim=True)
        return (x * x).mean(-1, keepdim=True) - m * m

    def found(mode, steps=2):
        fb = FreeBench(dump_path=str(tmp_path / mode), pert_mode=mode)
        for _ in range(steps):
            with fb:
                step()
            fb.step()
        df = fb.results
        return sorted(zip(df["api_name"].str.rsplit(".", n=2).str[0], df["pert_mode"],
                          df["cause"], df["step"]))

    assert found("combined") == [("Tensor.__sub__", "bit_noise", "ill-conditioned", 1),
                                 ("Torch.index_put", "improve_precision", "inaccurate", 0)]
    assert {a for a, *_ in found("improve_precision")} == {"Torch.index_put"}
    assert {a for a, *_ in found("bit_noise")} == {"Tensor.__sub__"}
    # msprobe's configs keep msprobe's default; probekit's configs accept the combined mode
    from probekit.config import FreeBenchmarkConfig

    assert FreeBenchmarkConfig().pert_mode == "improve_precision"
    with pytest.raises(Exception, match="handler_type"):
        FreeBench(dump_path=str(tmp_path / "fix"), pert_mode="combined", handler_type="fix")
