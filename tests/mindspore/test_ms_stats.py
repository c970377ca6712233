"""The MindSpore statistics equal a numpy recomputation from the same gradients: exactly, and
the norm within float32 rounding."""
import hashlib

import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

from probekit.grads.numerics.stats import Layout, interval_labels, padded_nbytes  # noqa: E402
from probekit.mindspore.stats import Plan, compute  # noqa: E402

BOUNDS = (-0.5, 0, 0.25, 1)


def numpy_stats(g: np.ndarray, bounds):
    """Reference: every statistic of one gradient, from its float32 values, with numpy."""
    x = g.astype(np.float32).reshape(-1)
    n = x.size
    le = [np.count_nonzero(x <= b) for b in bounds]
    nans = np.count_nonzero(np.isnan(x))
    dist = np.diff(le, prepend=0).tolist() + [n - nans - le[-1]]
    packed = np.packbits(x > 0)
    out = {"max": np.max(x), "min": np.min(x),
           "norm": np.sqrt(np.sum(x.astype(np.float64) ** 2)),
           "zeros": np.count_nonzero(x == 0) / n, "dist": np.array(dist) / n,
           "md5": hashlib.md5(x.tobytes()).digest(),
           "bits": np.concatenate([packed, np.zeros(-(-n // 64) * 8 - packed.size, np.uint8)])}
    return out


def grads_set(rng):
    a = rng.standard_normal((37, 11)).astype(np.float32)
    a[0, :5] = 0.0
    a[1, :3] = BOUNDS[:3]  # values exactly on the bounds
    b = rng.standard_normal(64).astype(np.float32) * 1e-3
    c = (rng.standard_normal((3, 5, 7)) * 4).astype(np.float16)
    d = rng.standard_normal(1).astype(np.float32)
    e = rng.standard_normal((2, 300)).astype(np.float32)
    e[1, 7] = np.nan
    return [a, b, c, d, e]


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_statistics_equal_numpy(level, where):
    rng = np.random.default_rng(3)
    arrays = grads_set(rng)
    names = tuple(f"p{i}" for i in range(len(arrays)))
    layout = Layout(names, tuple(a.size for a in arrays), tuple(a.shape for a in arrays))
    out = compute([ms.Tensor(a) for a in arrays], Plan(layout), level, BOUNDS, where=where)
    offsets = layout.offsets
    assert out.present.tolist() == [True] * 5
    for i, a in enumerate(arrays):
        ref = numpy_stats(a, BOUNDS)
        if i == 4:  # the NaN propagates to max/min/norm and falls in no interval
            assert np.isnan(out.max[i]) and np.isnan(out.min[i]) and np.isnan(out.norm[i])
        else:
            assert out.max[i] == ref["max"] and out.min[i] == ref["min"]
            assert out.norm[i] == pytest.approx(ref["norm"], rel=2 ** -24)
        if level == "L0":
            assert out.hash[i].tobytes() == ref["md5"]
            assert out.direction is None and out.dist is None
        else:
            nb = ref["bits"].size
            assert np.array_equal(out.direction[offsets[i]:offsets[i] + nb], ref["bits"])
        if level == "L2":
            assert np.array_equal(out.dist[i], ref["dist"])
            assert out.zeros[i] == ref["zeros"]
    if level == "L2":
        assert out.dist.shape == (5, len(interval_labels(BOUNDS)))
        assert out.zeros[0] == 6 / 407  # five zeros set, and the bound 0


@pytest.mark.parametrize("where", ["device", "host"])
def test_missing_gradient_and_float64(where):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 9))  # float64: kept float64, not narrowed
    layout = Layout(("a", "b"), (36, 10), ((4, 9), (10,)))
    out = compute([ms.Tensor(a), None], Plan(layout), "L2", BOUNDS, where=where)
    assert out.present.tolist() == [True, False]
    assert out.max[0] == a.max() and out.min[0] == a.min()
    assert out.norm[0] == pytest.approx(np.linalg.norm(a), rel=1e-15)
    assert np.isnan(out.max[1]) and np.isnan(out.dist[1]).all()
    assert np.array_equal(out.direction[:5], np.packbits(a.reshape(-1) > 0))
    assert not out.direction[5:].any()  # padding, and no gradient: no sign bit


@pytest.mark.parametrize("where", ["device", "host"])
def test_wrong_size_and_dtype_are_named(where):
    layout = Layout(("w",), (6,), ((2, 3),))
    with pytest.raises(ValueError, match="'w' has 5 elements"):
        compute([ms.Tensor(np.zeros(5, np.float32))], Plan(layout), "L1", BOUNDS, where=where)
    with pytest.raises(TypeError, match="'w' has dtype Int32"):
        compute([ms.Tensor(np.zeros(6, np.int32))], Plan(layout), "L1", BOUNDS, where=where)


def test_bfloat16_and_auto_path():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((5, 13)).astype(np.float32)
    g = ms.Tensor(a).astype(ms.bfloat16)
    exact = g.astype(ms.float32).asnumpy()  # the bf16 values, widened exactly
    layout = Layout(("w",), (65,), ((5, 13),))
    outs = [compute([g], Plan(layout), "L2", BOUNDS, where=w) for w in ("device", "host", "auto")]
    for out in outs:
        assert out.max[0] == exact.max() and out.min[0] == exact.min()
        assert np.array_equal(out.direction[:9], np.packbits(exact.reshape(-1) > 0))
    assert np.array_equal(outs[0].dist, outs[1].dist)
    with pytest.raises(ValueError, match="where: 'gpu' is not valid; accepted: auto, host, device"):
        compute([g], Plan(layout), "L1", BOUNDS, where="gpu")


def significant_ref(x: np.ndarray, unit: float, scale: float) -> np.ndarray:
    """The significance rule of probekit.grads.numerics.stats: |x| > unit * scale, scale the largest
    finite |x| over the module's gradients, compared in float32; a NaN is never significant."""
    a = np.abs(x.reshape(-1).astype(np.float32))
    return a > np.float32(unit * scale)


def finite_max(x: np.ndarray) -> float:
    a = np.abs(x.reshape(-1).astype(np.float64))
    return float(a[np.isfinite(a)].max())


@pytest.mark.parametrize("where", ["device", "host"])
def test_significance_bits_by_the_pytorch_rule(where):
    """The significance bits of both paths: the largest finite |x| of the whole gradient (not a
    block's) and of its module ("m.weight" and "m.bias" share one), SIGNIFICANCE[bits] * the
    gradient's own epsilon (bf16/fp16 too), NaN never significant, padding bits set."""
    from probekit.grads.numerics.stats import CHUNK, SIGNIFICANCE

    rng = np.random.default_rng(12)
    big = rng.standard_normal(2 * CHUNK + 1000).astype(np.float32)
    big[:CHUNK] *= 1e-3
    big[7] = 2e-8  # above its first block's rounding level (~8 * 1e-3 * 2^-23), not the tensor's
    big[9] = 1e-5  # above the tensor's (max ~5: 8 * 5 * 2^-23 = 4.8e-6)
    big[CHUNK + 5] = np.nan
    big[CHUNK + 6] = np.inf  # an Inf sets no threshold either
    half = (rng.standard_normal(300) * 4).astype(np.float16)
    half[3] = np.float16(2.0 ** -13)
    bf = np.float32(rng.standard_normal(100))
    bf[0], bf[1] = 1.0, 2.0 ** -9  # above float32's rounding level, below bfloat16's
    weight = rng.standard_normal(40).astype(np.float32)
    bias = (rng.standard_normal(8) * 1e-7).astype(np.float32)  # noise at the weight's scale
    grads = [ms.Tensor(big), ms.Tensor(half), ms.Tensor(bf).astype(ms.bfloat16),
             ms.Tensor(weight), ms.Tensor(bias)]
    widened = [big, half.astype(np.float32), grads[2].astype(ms.float32).asnumpy(), weight, bias]
    layout = Layout(("big", "half", "bf", "m.weight", "m.bias"), tuple(a.size for a in widened),
                    tuple(a.shape for a in widened))
    out = compute(grads, Plan(layout), "L1", BOUNDS, where=where, significance=True)
    offsets = layout.offsets
    units = (8 * 2.0 ** -23, 2.0 ** -10, 2.0 ** -7, 8 * 2.0 ** -23, 8 * 2.0 ** -23)
    assert SIGNIFICANCE == {16: 1.0, 32: 8.0, 64: 8.0}
    scales = [finite_max(x) for x in widened[:3]] + [finite_max(weight)] * 2
    for i, (x, unit, scale) in enumerate(zip(widened, units, scales)):
        nb = -(-x.size // 64) * 8
        bits = out.significant[offsets[i]:offsets[i] + nb]
        want = significant_ref(x, unit, scale)
        assert np.array_equal(np.unpackbits(bits, count=x.size).astype(bool), want), i
        assert np.unpackbits(bits)[x.size:].all()  # padding: ones
    got = np.unpackbits(out.significant[:padded_nbytes(big.size)], count=big.size)
    assert got[7] == 0 and got[9] == 1 and got[CHUNK + 5] == 0 and got[CHUNK + 6] == 1
    assert 0 < got[CHUNK:2 * CHUNK].sum() < CHUNK
    assert not np.unpackbits(out.significant[offsets[4]:offsets[4] + 1]).any()  # the bias
    assert np.unpackbits(out.significant[offsets[2]:offsets[2] + 1])[:2].tolist() == [1, 0]
    plain = compute(grads, Plan(layout), "L1", BOUNDS, where=where)
    assert plain.significant is None and np.array_equal(plain.direction, out.direction)
