"""The error metric: exact values on small tensors, NaN/Inf, sign flips, floors, chunking."""
import math

import pytest
import torch

from probekit.freebench import handlers, metric
from probekit.config import FreeBenchmarkConfig


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_relative_above_floor_absolute_below():
    o = t([2.0, 4.0, 0.0, 1e-6])
    p = t([2.5, 4.0, 0.0, 1e-6])
    s = metric.compare(o, p)
    assert (s.max_rel, s.max_abs, s.nan_inf, s.sign_flip, s.rel_part) == (0.25, 0.5, 0, 0, True)
    # below the fp32 floor (1e-4) the error is measured against the floor
    o = t([0.0, 1.0])
    p = t([2.0 ** -20, 1.0])
    s = metric.compare(o, p)
    assert s.max_rel == pytest.approx(2.0 ** -20 / 1e-4, rel=1e-12)
    assert s.max_abs == 2.0 ** -20 and s.rel_part is False


def test_inputs_are_never_modified():
    o = torch.tensor([-1.0, 2.0, -3.0])
    p = torch.tensor([-1.5, 2.0, 3.0])
    oc, pc = o.clone(), p.clone()
    metric.compare(o, p)
    metric.exact_stats(o, p, 1e-4)
    assert torch.equal(o, oc) and torch.equal(p, pc)


def test_identical_outputs_score_zero():
    o = torch.randn(100)
    assert metric.compare(o, o.clone()) == metric.Stats(0.0, 0.0, 0, 0, True)


def test_compared_in_the_wider_dtype():
    o = t([1.0], torch.bfloat16)
    p = t([1.0 + 2.0 ** -10], torch.float32)     # below bf16 resolution, visible in fp32
    assert metric.compare(o, p).max_rel == 2.0 ** -10


def test_negative_cancellation_scores_like_its_positive_mirror():
    # msprobe clamps signed values to a positive floor: the negative case was never flagged
    pos_o, pos_p = t([1e4 + 0.01]) - 1e4, t([1e4 + 0.01 + 2 ** -10]) - 1e4
    neg_o, neg_p = -pos_o, -pos_p
    sp, sn = metric.compare(pos_o, pos_p), metric.compare(neg_o, neg_p)
    assert sp == sn
    assert sp.max_rel == pytest.approx(2 ** -10 / 0.009765625)


def test_nan_inf_mismatch_does_not_hide_the_rest():
    o = t([1.0, 2.0, 3.0, float("nan"), float("inf")])
    p = t([float("nan"), 3.0, 3.0, float("nan"), float("inf")])
    s = metric.compare(o, p)
    assert s.nan_inf == 1            # nan==nan and inf==inf are consistent
    assert s.max_rel == 0.5          # the finite element 2 -> 3 is still measured
    assert s.max_abs == 1.0
    o = t([float("inf"), -float("inf"), 1.0])
    p = t([-float("inf"), 5.0, 1.0])
    assert metric.compare(o, p).nan_inf == 2


def test_nan_in_one_chunk_does_not_hide_that_chunk(monkeypatch):
    monkeypatch.setattr(metric, "CHUNK", 4)
    o = torch.ones(16)
    p = o.clone()
    p[1] = float("nan")
    p[2] = 1.5               # same chunk as the NaN
    s = metric.compare(o, p)
    assert (s.nan_inf, s.max_rel) == (1, 0.5)


def test_sign_flip_counted_above_floor_only():
    o = t([1.0, -2.0, 1e-6, 5.0])
    p = t([-1.0, -2.0, -1e-6, 5.0])
    s = metric.compare(o, p)
    assert s.sign_flip == 1 and s.max_rel == 2.0
    assert handlers.judge(s, 0.0002) == "sign_flip"


def test_chunked_equals_unchunked(monkeypatch):
    g = torch.Generator().manual_seed(0)
    o = torch.randn(37, 53, generator=g)
    p = o * (1 + 1e-3 * torch.randn(37, 53, generator=g))
    whole = metric.compare(o, p)
    monkeypatch.setattr(metric, "CHUNK", 100)          # rows of 53: 1 row per chunk
    assert metric.compare(o, p) == whole
    monkeypatch.setattr(metric, "CHUNK", 10)           # a row is split element-wise
    assert metric.compare(o, p) == whole
    # non-contiguous inputs are sliced, never copied whole
    assert metric.compare(o.t(), p.t()) == whole


def test_chunks_slice_without_copies():
    x = torch.zeros(6, 5)
    chunks = list(metric._chunks(x, 10))
    assert [c.shape for c in chunks] == [torch.Size([2, 5])] * 3
    assert all(c.data_ptr() == x[2 * i].data_ptr() for i, c in enumerate(chunks))
    big_rows = list(metric._chunks(torch.zeros(2, 30), 10))     # a row above the chunk size
    assert [c.shape for c in big_rows] == [torch.Size([10])] * 6


def test_compare_many_one_entry_per_pair_and_shape_check():
    a, b = t([1.0, 2.0]), t([1.0, 2.2])
    out = metric.compare_many([(a, a, 1e-4), (a, b, 1e-4)])
    assert out[0].max_rel == 0.0 and out[1].max_rel == pytest.approx(0.1, rel=1e-6)
    assert metric.compare_many([]) == []
    with pytest.raises(ValueError, match="shapes differ"):
        metric.compare(t([1.0]), t([1.0, 2.0]))


def test_empty_tensors():
    assert metric.compare(torch.zeros(0), torch.zeros(0)).max_rel == 0.0


def test_floors_per_dtype():
    assert metric.floor_for(torch.bfloat16) == 1e-2
    assert metric.floor_for(torch.float16) == 1e-3
    assert metric.floor_for(torch.float32) == 1e-4
    assert metric.floor_for(torch.float64) == 1e-8


def test_thresholds():
    fb = FreeBenchmarkConfig()
    assert handlers.threshold(fb, "improve_precision", torch.bfloat16, torch.float32) == 0.004
    assert handlers.threshold(fb, "improve_precision", torch.float16, torch.float32) == 0.002
    assert handlers.threshold(fb, "improve_precision", torch.float32, torch.float64) == 0.0002
    assert handlers.threshold(fb, "improve_precision", torch.float64, None) == 0.0002
    # noise modes: at least twice the relative size of a one-ulp input change
    assert handlers.threshold(fb, "bit_noise", torch.bfloat16, torch.bfloat16) == 2 * 2 ** -7
    assert handlers.threshold(fb, "add_noise", torch.float16, torch.float16) == 0.002
    assert handlers.threshold(fb, "bit_noise", torch.float32, torch.float32) == 0.0002
    assert handlers.threshold(fb, "no_change", torch.float32, torch.float32) == 0.0
    custom = FreeBenchmarkConfig(thresholds={"float32": 0.01})
    assert handlers.threshold(custom, "to_cpu", torch.float32, None) == 0.01


def test_judge_and_ratio():
    s = metric.Stats(0.01, 0.1, 0, 0, True)
    assert handlers.judge(s, 0.004) == "rel_error" and handlers.judge(s, 0.02) is None
    assert handlers.judge(metric.Stats(0.01, 0.1, 0, 0, False), 0.004) == "abs_error"
    assert handlers.judge(metric.Stats(0.0, 0.0, 1, 0, True), 0.004) == "nan_inf"
    assert handlers.ratio(0.01, 0.004) == 2.5
    assert handlers.ratio(0.01, 0.0) == math.inf and handlers.ratio(0.0, 0.0) == 0.0
    assert handlers.risk(metric.Stats(0.0, 0.0, 1, 0, True), 0.004) == math.inf


def _reference(o: torch.Tensor, p: torch.Tensor, floor: float) -> tuple:
    """The metric's definitions element by element in float64 Python (slow, obviously right)."""
    r_hi = r_lo = a_max = 0.0
    mis = flips = 0
    for x, y in zip(o.double().tolist(), p.double().tolist()):
        def cls(v):
            return "nan" if math.isnan(v) else ("+inf" if v == math.inf else
                                                ("-inf" if v == -math.inf else "finite"))
        if cls(x) != cls(y):
            mis += 1
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        d = abs(y - x)
        a_max = max(a_max, d)
        if abs(x) >= floor:
            r_hi = max(r_hi, d / abs(x))
            if abs(y) >= floor and (x > 0) != (y > 0):
                flips += 1
        else:
            r_lo = max(r_lo, d / floor)
    return r_hi, r_lo, a_max, mis, flips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_values_match_the_definitions_elementwise(dtype):
    g = torch.Generator().manual_seed(3)
    o = torch.randn(4000, generator=g) * torch.logspace(-6, 2, 4000)
    p = o * (1 + 0.01 * torch.randn(4000, generator=g))
    p[::97] = -p[::97]                                   # sign flips, above and below the floor
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0, math.nan, math.inf])
    o[:7], p[:7] = special, torch.tensor([math.nan, math.inf, math.inf, math.nan, -math.inf,
                                          2.0, -math.inf])
    o, p = o.to(dtype), p.to(dtype)
    f = metric.floor_for(dtype)
    got = [v.item() for v in metric.device_stats(o, p, f, exact=True)]
    want = _reference(o, p, f)
    assert got[3:] == [float(want[3]), float(want[4])] and want[3] == 5 and want[4] > 10
    assert got[:3] == pytest.approx(want[:3], rel=1e-6, abs=0)
