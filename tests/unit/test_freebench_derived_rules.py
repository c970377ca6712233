"""The error model's rules of issue 34, each derived rather than listed (docs/free_benchmark.md,
"The error model"): exact zeros have no bits to lose; a backward that reads its saved output is
measured from the output it was handed (found from autograd's saved tensors); a step across a
kink is no loss of bits; an element-wise function with no relative contract is judged against
its own variation; the data-aware bound of a sum (recall at large k, silence on alike terms);
a result that lost half its bits relative to itself is a hot spot that says how many; an
element-wise +-Inf that a +-max operand stands for is no lost result."""
import math

import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench
from probekit.freebench.judge import saved
from probekit.freebench.repro import helpers as repro_helpers

bf16, fp16 = torch.bfloat16, torch.float16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def probe(tmp_path, mode, fn, **options):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, **options)
    with fb:
        fn()
    return fb


def rows(fb):
    return list(zip(fb.results["api_name"], fb.results["cause"]))


# -- (a) a result whose exact value is 0 has no significant bits to lose -------------------------
@pytest.mark.parametrize("mode", ["bit_noise", "add_noise"])
def test_an_exact_zero_is_no_ill_conditioning(tmp_path, mode):
    # x - max(x, c) with bit-identical operands, 1 - mask with an all-ones mask: the kernel is
    # exact, a one-ulp nudge of one operand moves the result by an ulp of it, and the result was
    # judged to have lost everything (ratio inf, 20 rows over the unseen families)
    x = torch.randn(16, 32, generator=gen())

    def step():
        torch.exp(x - torch.maximum(x, torch.tensor(-10.0)))
        1 - torch.ones(16, 32)

    fb = probe(tmp_path, mode, step)
    assert fb.results.empty, fb.results
    hot = fb.hotspots
    assert sorted(hot["api_name"]) == ["Tensor.__rsub__.0.forward", "Tensor.__sub__.0.forward"]
    assert set(hot["cause"]) == {"unconfirmed"} and (hot["ratio"] == math.inf).all()


# -- (b) a backward that reads its saved output ---------------------------------------------------
def test_the_saved_output_is_found_from_autograds_saved_tensors():
    x = torch.rand(3, 4, requires_grad=True)
    reads = {"softmax": torch.softmax(x, -1), "log_softmax": F.log_softmax(x, -1),
             "logsumexp": torch.logsumexp(x, -1), "sigmoid": torch.sigmoid(x),
             "tanh": torch.tanh(x), "exp": torch.exp(x), "sqrt": torch.sqrt(x),
             "norm": torch.linalg.vector_norm(x)}
    not_ = {"sin": torch.sin(x), "linear": x @ x.t(), "layer_norm": F.layer_norm(x, (4,)),
            "gelu": F.gelu(x), "detached": torch.exp(x).detach()}
    for name, y in reads.items():
        assert saved.saves_output(y) and repro_helpers.saves_output(y), name
    for name, y in not_.items():
        assert not saved.saves_output(y) and not repro_helpers.saves_output(y), name


def test_saved_statistics_are_found_alike_by_the_analysis_and_the_repro_script():
    # the statistics a node keeps besides its inputs and output, below the accumulation's
    # precision: a bf16 layer/batch/group norm's mean and rstd; none in fp32, none for a call
    # that saves only inputs (linear) or its output (softmax), none for a composite whose last
    # op saves an intermediate another node made (normalize's divisor)
    u32 = 2.0 ** -24
    for dt, want in ((bf16, {"_saved_result1", "_saved_result2"}), (torch.float32, set())):
        x = torch.randn(4, 6, 3, dtype=dt, requires_grad=True)
        for name, y in (("layer_norm", F.layer_norm(x, (3,))),
                        ("batch_norm", F.batch_norm(x, None, None, training=True)),
                        ("group_norm", F.group_norm(x, 2))):
            mine, theirs = (m.kept_statistics(y, [x], u32) for m in (saved, repro_helpers))
            assert set(mine) == set(theirs) == want, (name, dt)
            assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == dt for k in mine)
    x = torch.randn(4, 6, dtype=bf16, requires_grad=True)
    for y in (x @ x.t(), torch.softmax(x, -1), F.normalize(x, dim=-1)):
        assert saved.kept_statistics(y, [x], u32) == {} == repro_helpers.kept_statistics(
            y, [x], u32)


@pytest.mark.parametrize("dtype, offset", [(bf16, 200.0), (torch.float32, 2000.0)])
def test_logsumexp_backward_from_its_saved_output_is_not_a_finding(tmp_path, dtype, offset):
    # dx = g exp(x - lse) reads the saved lse, rounded in the output's dtype: rows near 200 in
    # bf16 (near 2000 in fp32) put ulp(lse) into every gradient (bf16: 41x the bound, labelled
    # inaccurate; fp32: a 67x hot spot). logsumexp was not in issue 26's list of such families;
    # its reference now reads the lse the kernel was handed, and the kernel is correct
    x = (torch.randn(64, 4, generator=gen()) * 0.1 + offset).to(dtype).requires_grad_()
    w = torch.randn(64, generator=gen(1)).to(dtype)
    fb = probe(tmp_path, "improve_precision",
               lambda: (torch.logsumexp(x, -1) * w).sum().backward(), fuzz_stage="backward",
               list=["logsumexp"])
    assert fb.summary["checked"] == 1
    assert fb.results.empty and fb.hotspots.empty, (fb.results, fb.hotspots)


# -- (c) kinks: a nudge across a point where the derivative jumps -------------------------------
KINKS = {"hardswish": (F.hardswish, [3.0, -3.0]), "relu6": (F.relu6, [0.0, 6.0]),
         "hardtanh": (F.hardtanh, [1.0, -1.0]), "hardsigmoid": (F.hardsigmoid, [3.0, -3.0]),
         "clamp": (lambda x: torch.clamp(x, -1.0, 1.0), [1.0, -1.0])}


@pytest.mark.parametrize("name", list(KINKS))
@pytest.mark.parametrize("mode", ["bit_noise", "add_noise"])
def test_a_nudge_across_a_kink_is_no_loss_of_bits(tmp_path, name, mode):
    # bf16 inputs on and next to the kinks: a one-ulp nudge moves some across, and the gradient
    # jumps there (hardswish's from 1.5 to 1 at x = 3): it was ill-conditioned at 5-20x. Half
    # the nudge moves such an element by none or all of the jump -- a step, not a derivative --
    # so it loses no bits; the kernel is accurate (improve_precision: nothing)
    fn, kinks = KINKS[name]
    g = gen()
    near = torch.tensor(kinks).repeat(32) + torch.randint(-2, 3, (32 * len(kinks),),
                                                           generator=g) * 2.0 ** -6
    x = torch.cat([near, torch.randn(64, generator=g) * 3]).to(bf16).requires_grad_()
    w = torch.randn(x.numel(), generator=g).to(bf16)
    fb = probe(tmp_path, mode, lambda: (fn(x * 1.0) * w).float().sum().backward(),
               fuzz_stage="backward")
    assert fb.results.empty, fb.results
    assert set(fb.hotspots["cause"]) <= {"unconfirmed"}, fb.hotspots


# -- (d) element-wise functions with no relative contract ---------------------------------------
@pytest.mark.parametrize("fn, root", [(torch.digamma, 1.4616321449683623), (torch.lgamma, 1.0),
                                      (torch.lgamma, 2.0)])
@pytest.mark.parametrize("dtype, mode", [(torch.float32, "improve_precision"),
                                         (bf16, "bit_noise")])
def test_special_functions_next_to_their_roots_are_judged_in_absolute_terms(tmp_path, fn, root,
                                                                            dtype, mode):
    # digamma and lgamma next to a root: the result is small, its relative error or move large
    # (fp32 digamma: 7.7 u absolute, 3e7 u relative: 99x "inaccurate"; bf16 under bit_noise:
    # 15-33x "ill-conditioned"), yet next to a root f(x) ~ f'(x) x - f'(x) x0 is a difference
    # of two terms of size K = |x f'(x)|: its scale is at least K
    z = (root + torch.randn(256, generator=gen(), dtype=torch.float64) * 3e-3).to(dtype)
    fb = probe(tmp_path, mode, lambda: fn(z))
    assert fb.summary["checked"] == 1
    assert fb.results.empty, fb.results
    assert set(fb.hotspots["cause"]) <= {"unconfirmed", "ill-conditioned"}


def test_an_element_wise_function_still_loses_its_bits_where_it_is_ill_conditioned(tmp_path):
    # the absolute scale is for functions judged against their tensor's scale (no relative
    # contract); exp's relative contract stays: exp of bf16 values near 50 (one ulp = 0.25 moves
    # it by 28 %) is ill-conditioned, and (x + 0.01) - x of fp32 values near 1e4 too
    x = (torch.randn(64, generator=gen()) + 50).to(bf16)
    fb = probe(tmp_path, "bit_noise", lambda: torch.exp(x))
    assert rows(fb) == [("Torch.exp.0.forward", "ill-conditioned")]
    fb = probe(tmp_path / "sub", "bit_noise",
               lambda: torch.sub(torch.tensor([1e4 + 0.01]), torch.tensor([1e4])))
    assert rows(fb) == [("Torch.sub.0.forward", "ill-conditioned")]


# -- point 4: the data-aware bound -----------------------------------------------------------------
def test_fp16_index_put_of_random_signs_into_four_bins_is_found(tmp_path):
    # pytorch/pytorch#156173: 2x4x256x256 fp16 values into 4 bins (k = 131,072 per bin) are off
    # by 9-22 per bin. The worst case gamma_k(u32) S is about 820: missed in every mode. A
    # sequential fp32 sum of these random-sign values has a running error bound of about
    # u k (|T| / 2 + (pi / 8) sqrt(Q)) = 2.9 per bin: found, and blamed on the kernel (its
    # error is beyond what the values' own last bits move the bins by)
    torch.manual_seed(42)
    idx = torch.arange(4).view(1, 4, 1, 1).expand(2, 4, 256, 256)
    vals = torch.randn(2, 4, 256, 256, dtype=fp16)
    grad = torch.zeros(4, dtype=fp16)
    for mode in ("improve_precision", "combined"):
        fb = probe(tmp_path / mode, mode, lambda: torch.index_put(grad, [idx], vals,
                                                                  accumulate=True))
        df = fb.results
        assert rows(fb) == [("Torch.index_put.0.forward", "inaccurate")], df
        assert df["ratio"].iloc[0] > 2


def test_alike_term_sums_and_a_dominant_term_stay_silent(tmp_path):
    # the data-aware bound keeps the worst case where the data reach it: 0.1 summed 131,072
    # times (17,384 u of S, alike terms: half of gamma_k S), mean-pooled layer_norm and linear
    # bias gradients at 16k rows (every row the same gradient), fp32 GEMMs whose every output
    # has one dominant term (|T| and sqrt(Q) both near S)
    g = gen()
    a = torch.randn(64, 512, generator=g) * 1e-3
    a[:, 7] = 100.0
    b = torch.randn(512, 64, generator=g) * 1e-3
    b[7, :] = 50.0
    ln, lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)
    xx = torch.randn(16384, 64, generator=g).requires_grad_()
    for mode in ("improve_precision", "bit_noise"):
        fb = probe(tmp_path / mode, mode, lambda: (torch.sum(torch.full((131072,), 0.1)),
                                                   a @ b, F.linear(a, b.t())))
        assert fb.summary["checked"] == 3 and fb.results.empty, fb.results
        fb = probe(tmp_path / f"{mode}b", mode, lambda: lin(ln(xx)).mean(0).sum().backward(),
                   fuzz_stage="backward")
        assert fb.summary["checked"] == 4 and fb.results.empty, fb.results


# -- point 5: a result that lost half its bits relative to itself ---------------------------------
def test_a_cancelled_sum_surfaces_with_the_bits_it_lost(tmp_path):
    # [1e8, 1, -1e8, 3] * 16 sums to 24 in fp32 for an exact 64: within gamma_k S (S = 3.2e9),
    # so no finding -- yet every bit of the result is gone. It gave no row and no hot spot in
    # any mode; now the accuracy modes' exact comparison sees the error relative to the result,
    # add_noise the move, and the float64 analysis keeps it as a hot spot with the bits lost.
    # (bit_noise's checkerboard moves the +-1e8 terms towards zero alike on this periodic data:
    # the sum does not move at all, so that mode alone cannot see it; combined's first step is
    # improve_precision)
    x = torch.tensor([1e8, 1., -1e8, 3.] * 16)
    assert torch.sum(x).item() == 24.0
    for mode in ("improve_precision", "add_noise", "combined"):
        fb = probe(tmp_path / mode, mode, lambda: torch.sum(x))
        hot = fb.hotspots
        assert fb.results.empty and hot["api_name"].tolist() == ["Torch.sum.0.forward"], mode
        assert hot["cause"].tolist() == ["ill-conditioned"] and hot["bits_lost"].tolist() == [24.0]
    # the same cancellation written a - b is a finding: an element-wise result is judged against
    # itself (its S is |r|), a reduction against the sum of its terms
    fb = probe(tmp_path / "sub", "bit_noise",
               lambda: torch.sub(torch.tensor([1e8 + 64.0]), torch.tensor([1e8])))
    assert rows(fb) == [("Torch.sub.0.forward", "ill-conditioned")]


def test_the_underflow_unit_of_each_dtype():
    """eta = tiny * u: the absolute error one rounding may add below the normal range (Higham,
    Accuracy and Stability 2.1), half the smallest subnormal of the dtype."""
    from probekit.freebench.judge import scales
    assert scales.underflow(2.0 ** -24) == 2.0 ** -150            # float32
    assert scales.underflow(2.0 ** -8) == 2.0 ** -134             # bfloat16
    assert scales.underflow(2.0 ** -11) == 2.0 ** -25             # float16
    assert scales.underflow(2.0 ** -53) == 2.0 ** -1075           # float64
    # k products accumulated in u_acc (sums of subnormals are exact) and one rounding to u_out
    assert scales.underflow_floor(49, 2.0 ** -8, 2.0 ** -24) == 49 * 2.0 ** -150 + 2.0 ** -134
    assert scales.underflow_floor(0, 2.0 ** -24, 2.0 ** -24) == 2 * 2.0 ** -150


def test_a_subnormal_result_is_judged_with_the_underflow_floor(tmp_path):
    """Swin's shifted-window attention: a -100 mask makes exp(-100) = 3.7e-44, subnormal fp32
    probabilities, and the tokens left unmasked are zero padding, so ``attn @ v`` is a sum of
    subnormal products. Each product is off by up to 2^-150 absolute however correct the
    kernel: 100 % of a result near 1e-45. Without the floor the bound ``u |r| + gamma_k S`` was
    a relative one and the matmul ``inaccurate`` at 6.8e5x (issue 34, class U: 26 rows)."""
    g = gen()
    s = torch.randn(2, 3, 49, 49, generator=g)
    s[..., :25] -= 100.0
    attn = torch.softmax(s, -1)
    v = torch.randn(2, 3, 49, 8, generator=g)
    v[..., 25:, :] = 0
    tiny = torch.finfo(torch.float32).tiny
    assert bool(((attn != 0) & (attn < tiny)).any())
    exact = attn.double() @ v.double()
    err = ((attn @ v).double() - exact).abs().max().item()
    assert 0 < err <= 49 * 2.0 ** -150 + 2.0 ** -150      # within the floor, far beyond u |r|
    fb = probe(tmp_path, "improve_precision", lambda: attn @ v)
    assert fb.summary["checked"] == 1 and fb.results.empty, fb.results


def test_the_source_coordinate_term_of_a_linear_ramp():
    """``resample.term``: gamma_3(u_acc) (|x_src| + 1) |dy/dx_src|, per axis. A 1-D linear
    interpolation of the ramp 0, 1, 2, 3 (slope 1 per pixel) from 4 to 8 samples,
    align_corners=False: x_src = (dst + 1/2) / 2 - 1/2, clamped at 0 (PyTorch's linear modes)."""
    from probekit.freebench.judge import resample, scales
    x = torch.arange(4, dtype=torch.float64).view(1, 1, 4)
    r = F.interpolate(x, size=8, mode="linear", align_corners=False)
    a = scales.Args(F.interpolate, "interpolate", (x,), {"size": 8, "mode": "linear"})
    u = 2.0 ** -24
    t = resample.term("interpolate", a, [x], r, u)
    src = ((torch.arange(8, dtype=torch.float64) + 0.5) / 2 - 0.5).clamp_min(0)
    want = scales.gamma(3, u) * (src + 1)
    want[7] = 0.0       # x_src = 3.25, past the last pixel: the kernel clamps, the result is flat
    assert t.shape == r.shape
    assert torch.allclose(t.view(-1), want, rtol=1e-9, atol=0)
    # nearest has no slope: no term; a call float64 grid_sample does not reproduce: none either
    an = scales.Args(F.interpolate, "interpolate", (x,), {"size": 8, "mode": "nearest"})
    assert resample.term("interpolate", an, [x], r, u) is None
    assert resample.term("interpolate", a, [x], r + 1.0, u) is None


def test_fp32_bicubic_upsampling_is_judged_with_its_source_coordinates(tmp_path):
    """CrossViT's bicubic interpolate of a 64 px input to 240 px in fp32: the kernel computes
    the source coordinate scale (dst + 1/2) - 1/2 in fp32, 135 u of max|exact| off, 134.4 of
    them from the fp32 coordinates alone, where the tensor scale's bound allowed 30 u: it was
    ``inaccurate`` at 4.5x (issue 34, class I). With the coordinate term: no row."""
    x = torch.randn(1, 2, 64, 64, generator=gen())
    fb = probe(tmp_path, "improve_precision",
               lambda: F.interpolate(x, size=(240, 240), mode="bicubic", align_corners=False))
    assert fb.summary["checked"] == 1 and fb.results.empty, fb.results


def test_a_clamps_bound_is_judged_as_the_kernel_receives_it(tmp_path):
    """``clamp(x, min=0.001)`` on bf16: PyTorch's type promotion gives the Python number x's
    dtype in the backward's comparison ``x >= min``, so the kernel's bound is bf16(0.001) =
    0.00099945068359375, and at x equal to it the gradient passes; float64 on the literal 0.001
    stopped it, and the row was ``inaccurate`` at 128x (Zamba2's ``clamp(dt, min=dt_limit[0])``:
    4 rows of the library sweep, issue 34). The reference now takes the bound as received."""
    from probekit.freebench.judge import cause
    f = cause.bounds_as_received(lambda x, min=None, max=None: (min, max), "clamp",
                                 [torch.zeros(1, dtype=bf16)])
    assert f(None, min=0.001, max=math.inf) == (0.00099945068359375, math.inf)
    assert cause.bounds_as_received(torch.add, "add", [torch.zeros(1, dtype=bf16)]) is torch.add
    x = torch.tensor([0.001, 0.002, 0.0005, 0.001] * 8).to(bf16).requires_grad_()
    torch.clamp(x, min=0.001).backward(torch.ones(32, dtype=bf16))
    assert x.grad[0].item() == 1.0 and x[0].item() < 0.001       # the kernel passes it
    for mode in ("improve_precision", "bit_noise"):
        for name, fn in (("torch", lambda: torch.clamp(x, min=0.001)),
                         ("tensor", lambda: x.clamp(min=0.001))):
            fb = probe(tmp_path / f"{mode}{name}", mode,
                       lambda: fn().backward(torch.full((32,), 1e-8, dtype=bf16)),
                       fuzz_stage="backward")
            assert fb.summary["checked"] == 1 and fb.results.empty, (mode, name, fb.results)


# -- (O2) a +-max operand stands for +-infinity ---------------------------------------------------
@pytest.mark.parametrize("n, hold", [(16, False), (16, True), (1024, False)],
                         ids=["whole", "held", "blocked"])
def test_a_masks_finfo_min_plus_finfo_min_is_no_finding(tmp_path, n, hold):
    """GPT-Neo (issue 34, class O2): ``where(causal, scores, finfo.min) + mask`` with a mask of
    ``finfo.min`` again. fp32 ``finfo.min + finfo.min`` is -Inf (IEEE); the float64 re-run holds
    -6.8e38. The operands' ``finfo.min`` stands for -infinity, so the -Inf is the value it means:
    no row, no hot spot, over steps (the site's later checks are exact: its fast form is
    inconclusive on the Inf), on the accelerator path (held values, forced on the CPU) and
    blocked (an output of 2^20 elements). A sum of ordinary finite operands that overflows
    (fp32 ``3e38 + 3e38``) stays a NaN/Inf finding in the same setting."""
    lo = torch.finfo(torch.float32).min
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    scores = torch.randn(1, 2 if n < 64 else 1, n, n, generator=gen()).masked_fill(future, lo)
    mask = torch.zeros(1, 1, n, n).masked_fill(future, lo)
    big = torch.full((1, 1, n, n), 3e38)
    for fn, want in ((lambda: scores + mask, 0), (lambda: big + big, 2)):
        fb = FreeBench(dump_path=str(tmp_path / str(want)), pert_mode="improve_precision")
        fb._engine.verdicts.hold = hold or None
        with fb:
            for _ in range(2):
                fn()
                fb.step()
        assert fb.summary["checked"] == 2
        assert fb.results["kind"].tolist() == ["nan_inf"] * want, fb.results
        assert fb.hotspots.empty
