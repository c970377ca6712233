"""The error metric and its thresholds: exact values on small tensors, the call's own scale
(tensor, sum |a||b|, per element), NaN/Inf, chunking, thresholds from the unit roundoff."""
import math

import pytest
import torch

from probekit.config import FreeBenchmarkConfig
from probekit.freebench.judge import handlers, metric, scales


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_tensor_scale_is_the_outputs_largest_magnitude():
    o = t([2.0, -4.0, 0.0, 1e-6])
    p = t([2.5, -4.0, 1e-3, 1e-6])
    s = metric.compare(o, p)
    assert s == metric.Stats(0.5 / 4.0, 0.5, 0, 4.0)
    # a near-zero element's own relative error does not count: only the tensor's scale does
    o, p = t([0.0, 1.0]), t([2.0 ** -20, 1.0])
    assert metric.compare(o, p).max_rel == 2.0 ** -20


def test_all_zero_output():
    z = torch.zeros(4)
    assert metric.compare(z, z.clone()).max_rel == 0.0
    assert metric.compare(z, t([0.0, 0.0, 1e-30, 0.0])).max_rel == math.inf


def test_per_element_scale():
    o, p = t([1.0, -2.0, 0.0]), t([1.5, -2.0, 0.25])
    s = metric.compare(o, p, t([10.0, 1.0, 0.5]))
    assert s.max_rel == 0.5 and s.max_abs == 0.5 and s.scale == 2.0   # max|p| (issue 34)
    fast = [v.item() for v in metric.device_stats(o, p, t([10.0, 1.0, 0.5]))]
    assert fast == [0.0, 0.5] and metric.stats_from(fast, scales.MAGNITUDE).max_rel == 0.5
    # 0 / 0 where the scale is zero: the fast form is inconclusive, the exact one ignores it
    fast = [v.item() for v in metric.device_stats(t([0.0]), t([0.0]), t([0.0]))]
    assert metric.fast_error(fast) is None and metric.stats_from(fast, scales.MAGNITUDE) is None
    assert metric.compare(t([0.0]), t([0.0]), t([0.0])).max_rel == 0.0


def test_inputs_are_never_modified():
    o = torch.tensor([-1.0, 2.0, -3.0])
    p = torch.tensor([-1.5, 2.0, 3.0])
    sc = torch.tensor([1.0, 2.0, 3.0])
    oc, pc, scc = o.clone(), p.clone(), sc.clone()
    for exact in (False, True):
        metric.device_stats(o, p, None, exact)
        metric.device_stats(o, p, sc, exact)
    assert torch.equal(o, oc) and torch.equal(p, pc) and torch.equal(sc, scc)


def test_identical_outputs_score_zero():
    o = torch.randn(100)
    assert metric.compare(o, o.clone()) == metric.Stats(0.0, 0.0, 0, o.abs().max().item())


def test_compared_in_the_wider_dtype():
    o = t([1.0], torch.bfloat16)
    p = t([1.0 + 2.0 ** -10], torch.float32)     # below bf16 resolution, visible in fp32
    assert metric.compare(o, p).max_rel == 2.0 ** -10


def test_negative_cancellation_scores_like_its_positive_mirror():
    # msprobe clamps signed values to a positive floor: the negative case was never flagged
    pos_o, pos_p = t([1e4 + 0.01]) - 1e4, t([1e4 + 0.01 + 2 ** -10]) - 1e4
    sp, sn = metric.compare(pos_o, pos_p), metric.compare(-pos_o, -pos_p)
    assert sp == sn
    assert sp.max_rel == pytest.approx(2 ** -10 / 0.009765625)


def test_nan_inf_mismatch_does_not_hide_the_rest():
    o = t([1.0, 2.0, 3.0, float("nan"), float("inf")])
    p = t([float("nan"), 3.0, 3.0, float("nan"), float("inf")])
    s = metric.compare(o, p)
    assert s.nan_inf == 1            # nan==nan and inf==inf are consistent
    assert s.max_rel == 1.0 / 3.0    # the finite element 2 -> 3, against the finite scale 3
    assert s.max_abs == 1.0
    o = t([float("inf"), -float("inf"), 1.0])
    p = t([-float("inf"), 5.0, 1.0])
    assert metric.compare(o, p).nan_inf == 2
    # the fast form cannot tell: inconclusive
    fast = [v.item() for v in metric.device_stats(o, p)]
    assert metric.fast_error(fast) is None and metric.stats_from(fast) is None


def test_an_inf_one_ulp_past_the_originals_max_is_no_mismatch():
    """A nudged re-run whose result sits one ulp beyond the original's +-max rounds to +-Inf:
    the dtype holds nothing between (issue 34, class O). Same-signed +-max against +-Inf is a
    move of 0; anything else stays a NaN/Inf mismatch."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.finfo(dtype).max
        inf = float("inf")
        o = torch.tensor([-big, big, 1.0, big, -big, 2.0], dtype=dtype)
        p = torch.tensor([-inf, inf, 1.0, -inf, inf, inf], dtype=dtype)
        s = metric.compare(o, p)
        # the last three: max against -Inf (the other sign), -max against +Inf, 2 against Inf
        assert s.nan_inf == 3 and s.max_abs == 0.0, (dtype, s)
        s = metric.compare(o[:3], p[:3])
        assert s.nan_inf == 0 and s.max_abs == 0.0 and s.max_rel == 0.0, (dtype, s)


def test_an_original_inf_a_max_operand_stands_for_is_no_mismatch(monkeypatch):
    """Issue 34, class O2: an element-wise call's +-Inf at an element whose own operands include
    the same-signed +-max of their dtype (a mask's ``finfo.min``, a stand-in for -infinity) is
    the value the stand-in means, not a lost result; an Inf from ordinary finite operands, or
    against a stand-in of the other sign, stays a mismatch. Broadcast operands, a Python
    number, a bf16 stand-in in an fp32 call, and chunks cut as the output is."""
    lo32, lo16 = torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min
    inf = float("inf")
    a = torch.tensor([[lo32, 1.0, 3e38, lo32], [2.0, lo32, 3e38, -1.0]])
    b = torch.tensor([lo32, lo32, 3e38, -lo32])          # broadcast along the rows
    o = a + b                                             # fp32: -inf, lo, inf, 0 / lo, -inf,
    p = a.double() + b.double()                           # inf, max; the float64 re-run: finite
    assert o.tolist() == [[-inf, lo32, inf, 0.0], [lo32, -inf, inf, -lo32]]
    ops = metric.stand_in_operands("additive", [a, b], o)
    assert len(ops) == 2
    s = metric.device_stats(o, p, None, exact=True, operands=ops)
    # left: [0, 2] and [1, 2] (3e38 + 3e38: no stand-in)
    assert metric.stats_from([v.item() for v in s]).nan_inf == 2
    assert metric.compare(o, p).nan_inf == 4             # without the operands: every Inf
    # the other sign: -lo32 (= max) against an original -Inf stays a mismatch
    o2, p2 = torch.tensor([-inf]), torch.tensor([-6.8e38], dtype=torch.float64)
    got = metric.device_stats(o2, p2, None, True, operands=[torch.tensor([-lo32]),
                                                            torch.tensor([-3e38])])
    assert got[4].item() == 1.0
    # a Python number, and a bf16 stand-in in an fp32 sum (its own dtype's max)
    x = torch.full((3,), lo32)
    assert metric.device_stats(x + lo32, x.double() + lo32, None, True,
                               operands=[x, lo32])[4].item() == 0.0
    y = torch.full((3,), lo16, dtype=torch.bfloat16)
    z = torch.full((3,), -3e38)
    assert metric.device_stats(z + y, z.double() + y.double(), None, True,
                               operands=[z, y])[4].item() == 0.0
    # a reduction is not read against its operands; a per-element scale; chunks
    assert metric.stand_in_operands("multilinear", [a, b], o) is None
    assert metric.stand_in_operands("additive", [torch.ones(3, 4)], o) is None   # no broadcast
    sc = p.abs() + 1
    assert metric.device_stats(o, p, sc, True, operands=ops)[4].item() == 2.0
    monkeypatch.setattr(metric, "CHUNK", 3)
    for scale in (None, sc):
        assert metric.device_stats(o, p, scale, True, operands=ops)[4].item() == 2.0


def test_nan_in_one_chunk_does_not_hide_that_chunk(monkeypatch):
    monkeypatch.setattr(metric, "CHUNK", 4)
    o = torch.ones(16)
    p = o.clone()
    p[1] = float("nan")
    p[2] = 1.5               # same chunk as the NaN
    s = metric.compare(o, p)
    assert (s.nan_inf, s.max_rel) == (1, 0.5)


@pytest.mark.parametrize("per_element", [False, True])
def test_chunked_equals_unchunked(monkeypatch, per_element):
    g = torch.Generator().manual_seed(0)
    o = torch.randn(37, 53, generator=g)
    p = o * (1 + 1e-3 * torch.randn(37, 53, generator=g))
    sc = o.abs() + 1 if per_element else None
    whole = metric.compare(o, p, sc)
    fast = [v.item() for v in metric.device_stats(o, p, sc)]
    for size in (100, 10):                      # 1 row per chunk; a row split element-wise
        monkeypatch.setattr(metric, "CHUNK", size)
        assert metric.compare(o, p, sc) == whole
        assert [v.item() for v in metric.device_stats(o, p, sc)] == pytest.approx(fast,
                                                                                 rel=1e-15)
    # non-contiguous inputs are sliced, never copied whole
    assert metric.compare(o.t(), p.t(), None if sc is None else sc.t()) == whole


def test_chunks_slice_without_copies():
    x = torch.zeros(6, 5)
    chunks = list(metric._chunks(x, 10))
    assert [c.shape for c in chunks] == [torch.Size([2, 5])] * 3
    assert all(c.data_ptr() == x[2 * i].data_ptr() for i, c in enumerate(chunks))
    big_rows = list(metric._chunks(torch.zeros(2, 30), 10))     # a row above the chunk size
    assert [c.shape for c in big_rows] == [torch.Size([10])] * 6


def test_compare_many_one_entry_per_pair_and_shape_check():
    a, b = t([1.0, 2.0]), t([1.0, 2.2])
    out = metric.compare_many([(a, a, None), (a, b, None)])
    assert out[0].max_rel == 0.0 and out[1].max_rel == pytest.approx(0.1, rel=1e-6)
    assert metric.compare_many([]) == []
    with pytest.raises(ValueError, match="shapes differ"):
        metric.compare(t([1.0]), t([1.0, 2.0]))


def test_empty_tensors():
    assert metric.compare(torch.zeros(0), torch.zeros(0)).max_rel == 0.0


def test_unit_roundoff_and_thresholds():
    assert [scales.unit_roundoff(d) for d in (torch.bfloat16, torch.float16, torch.float32,
                                              torch.float64)] == [2.0 ** -8, 2.0 ** -11,
                                                                  2.0 ** -24, 2.0 ** -53]
    fb = FreeBenchmarkConfig()
    # accuracy modes: c = 2 units of roundoff of the compute dtype for an exact, per-element
    # call (a call's own adds gamma_k(u_acc) of its magnitude: test_judges_follow_the_model)
    assert handlers.threshold(fb, "improve_precision", torch.bfloat16) == 2.0 ** -7
    assert handlers.threshold(fb, "improve_precision", torch.float16) == 2.0 ** -10
    assert handlers.threshold(fb, "to_cpu", torch.float32) == 2.0 ** -23
    # sensitivity modes: sqrt(u), half of the significant bits lost
    assert handlers.threshold(fb, "bit_noise", torch.bfloat16) == 2.0 ** -4
    assert handlers.threshold(fb, "add_noise", torch.float16) == 2.0 ** -5.5
    assert handlers.threshold(fb, "change_value", torch.float32) == 2.0 ** -12
    assert handlers.threshold(fb, "no_change", torch.float32) == 0.0
    custom = FreeBenchmarkConfig(thresholds={"float32": 0.01})
    assert handlers.threshold(custom, "to_cpu", torch.float32) == 0.01
    assert handlers.threshold(custom, "to_cpu", torch.float16) == 2.0 ** -10


def test_judges_follow_the_model():
    """c (u_out |p| + gamma_k(u_acc) S) per family: the threshold and the scale's weights."""
    u32, u16 = 2.0 ** -24, 2.0 ** -8
    g = scales.gamma
    assert g(10, 0.5) == math.inf and g(3, 2.0 ** -24) == 3 * u32 / (1 - 3 * u32)
    # float32 matmul over k = 256, the data-aware bound (issue 34): c (a |p| + b sqrt(Q)),
    # a = u + k u / 2, b = k u pi / 8; the fast check divides by sqrt(Q + (a / b)^2 p^2) and
    # flags above c b
    j = scales.judge("improve_precision", "multilinear", 256, torch.float32)
    a, b = u32 + 256 * u32 / 2, 256 * u32 * math.pi / 8
    assert (j.kind, j.source, j.data) == (scales.MAGNITUDE, "data", True)
    assert j.thr == pytest.approx(2 * b, rel=1e-15) and j.hot == j.thr
    assert j.dlam == pytest.approx((a / b) ** 2, rel=1e-15)
    # bfloat16 (fp32 accumulation): a = u16 + k u32 / 2
    j = scales.judge("improve_precision", "multilinear", 256, torch.bfloat16)
    assert j.dlam == pytest.approx(((u16 + 256 * u32 / 2) / b) ** 2, rel=1e-15)
    # a mean's terms are x / k: Q of its call on squares is k times theirs
    j = scales.judge("improve_precision", "multilinear", 256, torch.float32, formula_ok="mean")
    assert j.thr == pytest.approx(2 * b / 16, rel=1e-15) and j.data == "mean"
    # the worst case over all data where the data cannot say more (a product, a mean mode)
    j = scales.judge("improve_precision", "multilinear", 256, torch.float32, formula_ok=False)
    assert (j.kind, j.source, j.lam) == (scales.MAGNITUDE, "abs", 0.0)
    assert j.thr == 2 * (u32 + g(256, u32)) == j.hot
    j = scales.judge("improve_precision", "multilinear", 256, torch.bfloat16, formula_ok=False)
    assert j.thr == 2 * u16 and j.lam == g(256, u32) / u16
    # an element-wise function: |p| (+ the smallest normal), k = 4
    j = scales.judge("improve_precision", "elementwise", 4, torch.float32)
    assert (j.kind, j.beta) == (scales.ELEMENT, torch.finfo(torch.float32).tiny)
    assert j.thr == 2 * (u32 + g(4, u32))
    # softmax over 64 (k = 66): |p| + 1/(e k), weighted by gamma / (u_out + gamma)
    j = scales.judge("improve_precision", "softmax", 66, torch.bfloat16)
    gm = g(66, u32)
    assert j.beta == pytest.approx(1 / (math.e * 66) * gm / (u16 + gm), rel=1e-12)
    # a step function is exact: k = 0
    assert scales.judge("improve_precision", "step", 0, torch.float32).thr == 2 * u32
    # the rest: the tensor's scale; the sensitivity modes: sqrt(u), hot above two runs' rounding
    j = scales.judge("improve_precision", "other", 64, torch.float32)
    assert j.kind == scales.TENSOR and j.thr == 2 * (u32 + g(64, u32))
    j = scales.judge("bit_noise", "multilinear", 64, torch.float32)
    assert j.kind == scales.TENSOR and j.thr == 2.0 ** -12 and j.hot == 4 * (u32 + g(64, u32))
    # a configured threshold replaces it, and the float64 analysis scales its bound alike
    j = scales.judge("improve_precision", "multilinear", 256, torch.bfloat16, override=0.5,
                     formula_ok=False)
    assert j.thr == 0.5 and j.factor == 0.5 / (2 * u16)
    # backward: formula families, or the tensor's scale when the formula does not apply
    assert scales.judge("improve_precision", "norm", 10, torch.float32,
                        stage="backward").source == "formula"
    assert scales.judge("improve_precision", "attention", 10, torch.float32, stage="backward",
                        formula_ok=False).kind == scales.TENSOR
    assert scales.judge("improve_precision", "norm", 10, torch.float32).kind == scales.TENSOR


def test_reduction_lengths():
    """k per family: the contracted length forward, numel(out)/numel(x) x k for a gradient."""
    import torch.nn.functional as F

    x, w, b = torch.zeros(6, 5, 32), torch.zeros(16, 32), torch.zeros(16)
    y = F.linear(x, w, b)
    a = scales.Args(F.linear, "linear", (x, w, b), {})
    assert scales.forward_length("linear", a, [x, w, b], y) == 32
    assert [scales.backward_length("linear", a, [x, w, b], i, y, 32) for i in range(3)] == \
        [16, 30, 30]            # grad x sums over the 16 outputs; w and b over the 30 rows
    c, wc = torch.zeros(2, 3, 8, 8), torch.zeros(4, 3, 3, 3)
    a = scales.Args(F.conv2d, "conv2d", (c, wc), {})
    assert scales.forward_length("conv2d", a, [c, wc], F.conv2d(c, wc)) == 27
    s = torch.zeros(7, 9)
    a = scales.Args(torch.sum, "sum", (s, 1), {})
    assert scales.forward_length("sum", a, [s, 1], s.sum(1)) == 9
    a = scales.Args(torch.softmax, "softmax", (s, -1), {})
    assert scales.forward_length("softmax", a, [s, -1], s) == 11
    a = scales.Args(F.layer_norm, "layer_norm", (s, (9,)), {})
    assert scales.forward_length("layer_norm", a, [s, (9,)], s) == 22
    assert scales.backward_length("layer_norm", a, [s, (9,)], 0, s, 22) == 22
    idx = torch.zeros(100, dtype=torch.long)
    a = scales.Args(torch.index_put, "index_put", (torch.zeros(4), (idx,), torch.zeros(100),
                                                   True), {})
    assert scales.forward_length("index_put", a, [torch.zeros(4), idx, torch.zeros(100), True],
                                 torch.zeros(4)) == 101
    e = torch.zeros(3, 4)
    a = scales.Args(torch.einsum, "einsum", ("ij,jk->ik", e, e.t()), {})
    assert scales.forward_length("einsum", a, ["ij,jk->ik", e, e.t()], torch.zeros(3, 3)) == 4
    assert scales.forward_length("exp", scales.Args(torch.exp, "exp", (s,), {}), [s], s) == 4
    assert scales.forward_length("floor", scales.Args(torch.floor, "floor", (s,), {}), [s],
                                 s) == 0
    # an in-place form is judged as its out-of-place form (checked on a copy); the MoE experts'
    # grouped GEMM is a matmul
    assert [scales.family(n) for n in ("add_", "__iadd__", "relu_", "mul_", "_grouped_mm")] == \
        ["additive", "additive", "elementwise", "arithmetic", "multilinear"]


def test_scale_kinds():
    assert scales.scale_kind("improve_precision", "matmul") == scales.MAGNITUDE
    assert scales.scale_kind("to_cpu", "index_put") == scales.MAGNITUDE
    assert scales.scale_kind("improve_precision", "log_softmax") == scales.ELEMENT
    assert scales.scale_kind("improve_precision", "layer_norm") == scales.TENSOR
    assert scales.scale_kind("bit_noise", "matmul") == scales.TENSOR
    assert scales.scale_kind("add_noise", "log_softmax") == scales.TENSOR


def test_magnitude_is_the_call_on_absolute_values():
    a = t([[1.0, -2.0], [3.0, 4.0]])
    b = t([[-1.0, 1.0], [1.0, 1.0]])
    leaves = scales.magnitude_leaves([a, b, 3, -0.5])
    assert torch.equal(leaves[0], a.abs()) and torch.equal(leaves[1], b.abs())
    assert leaves[2:] == [3, 0.5]                       # an int may be a dim: kept
    assert torch.equal(torch.matmul(*leaves[:2]), t([[3.0, 3.0], [7.0, 7.0]]))
    s = scales.magnitude_run(torch.addmm, (t([1.0, -1.0]).abs(), a.abs(), b.abs()),
                             {"beta": -1.0, "alpha": -2.0})
    assert torch.equal(s, t([[7.0, 7.0], [15.0, 15.0]]))


def test_judge_and_ratio():
    s = metric.Stats(0.01, 0.1, 0, 1.0)
    assert handlers.judge(s, 0.004) == "rel_error" and handlers.judge(s, 0.02) is None
    assert handlers.judge(metric.Stats(0.0, 0.0, 1, 1.0), 0.004) == "nan_inf"
    assert handlers.ratio(0.01, 0.004) == 2.5
    assert handlers.ratio(0.01, 0.0) == math.inf and handlers.ratio(0.0, 0.0) == 0.0
    assert handlers.risk(metric.Stats(0.0, 0.0, 1, 1.0), 0.004) == math.inf


def _reference(o: torch.Tensor, p: torch.Tensor, sc=None) -> tuple:
    """The metric's definitions element by element in float64 Python (slow, obviously right):
    (max_rel, max_abs, mismatches)."""
    d_max = o_max = r_max = 0.0
    mis = 0
    scl = [None] * o.numel() if sc is None else sc.double().tolist()

    def cls(v):
        return "nan" if math.isnan(v) else ("+inf" if v == math.inf else
                                            ("-inf" if v == -math.inf else "finite"))
    for x, y, s in zip(o.double().tolist(), p.double().tolist(), scl):
        if cls(x) != cls(y):
            mis += 1
        if math.isfinite(x):
            o_max = max(o_max, abs(x))
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        d = abs(y - x)
        d_max = max(d_max, d)
        if s is not None and s > 0:
            r_max = max(r_max, d / s)
    rel = (d_max / o_max if o_max else (0.0 if not d_max else math.inf)) if sc is None else r_max
    return rel, d_max, mis


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_element", [False, True])
def test_exact_values_match_the_definitions_elementwise(dtype, per_element):
    g = torch.Generator().manual_seed(3)
    o = torch.randn(4000, generator=g) * torch.logspace(-6, 2, 4000)
    p = o * (1 + 0.01 * torch.randn(4000, generator=g))
    p[::97] = -p[::97]
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0, math.nan, math.inf])
    o[:7], p[:7] = special, torch.tensor([math.nan, math.inf, math.inf, math.nan, -math.inf,
                                          2.0, -math.inf])
    o, p = o.to(dtype), p.to(dtype)
    sc = (o.double().abs().nan_to_num(posinf=1.0) + 1.0) if per_element else None
    st = metric.compare(o, p, sc)
    want = _reference(o, p, sc)
    assert st.nan_inf == want[2] == 5
    assert (st.max_rel, st.max_abs) == pytest.approx(want[:2], rel=1e-6, abs=0)
