"""The fused chunk kernel: every compiled path (AVX-512, AVX2, portable C) gives the numpy
twin's bits and counts exactly, and sums of squares equal up to the order of float64 additions;
edge values (NaN, Inf, -0.0, subnormals, tails that are not a whole byte or vector) included."""
import numpy as np
import pytest

from probekit.grads import kernel


def compiled_paths():
    got = []
    for name in ("avx512", "avx2", "c"):
        if kernel.set_path(name) == name:
            got.append(name)
    kernel.set_path("auto")
    return got


PATHS = compiled_paths()


def edge_array(n, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(dtype)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, np.finfo(dtype).tiny / 4,
                -np.finfo(dtype).tiny, 1.0, -1.0, 0.5, np.finfo(dtype).max]
    for k, v in enumerate(specials):
        if k * 7 < n:
            a[k * 7] = v
    return a


def run(path, a, thr, bounds, counts=True):
    kernel.set_path(path)
    try:
        k = -(-a.size // 8)
        signs = np.full(k + 2, 0xAA, np.uint8)  # bytes past the chunk must stay untouched
        sig = np.full(k + 2, 0xAA, np.uint8)
        mm = kernel.minmax(a)
        sumsq, c = kernel.chunk_stats(a, thr, signs, sig, bounds, counts)
    finally:
        kernel.set_path("auto")
    return mm, sumsq, None if c is None else c.tolist(), signs.tobytes(), sig.tobytes()


@pytest.mark.skipif(not PATHS, reason="the compiled kernel is not built here")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 63, 1000, 4099, 1 << 18])
def test_compiled_paths_equal_numpy(n, dtype):
    a = edge_array(n, dtype, n)
    bounds = np.array([-1.0, -0.1, 0.0, 0.1, 0.5, 1.0])
    want = run("numpy", a, 0.5, bounds)
    for path in PATHS:
        got = run(path, a, 0.5, bounds)
        assert got[0] == want[0], path  # max, min, finite |x| max, NaNs: exact
        assert got[2:] == want[2:], path  # counts, sign and significance bytes: exact
        if np.isnan(want[1]):
            assert np.isnan(got[1]), path
        else:
            assert got[1] == pytest.approx(want[1], rel=1e-14, abs=0), path


def test_numpy_twin_against_definitions():
    a = np.array([0.5, -2.0, 0.0, 3.0, -0.25, 1.0, np.nan, -0.0, 1e-3], np.float32)
    mm, sumsq, counts, signs, sig = run("numpy", a, 0.3, np.array([-1.0, 0.0, 1.0]))
    assert mm == (3.0, -2.0, 3.0, 1)
    assert np.isnan(sumsq)
    # x <= -1: -2; x <= 0: -2, 0, -0.25, -0.0; x <= 1: + 0.5, 1, 1e-3; zeros: 0, -0.0; NaN: 1
    assert counts == [1, 4, 7, 2, 1]
    assert signs[:2] == bytes([0b10010100, 0b10000000])  # 0.5, 3, 1 | 1e-3
    assert sig[:2] == bytes([0b11010100, 0b00000000])  # |x| > 0.3 (NaN never)
    assert signs[2:] == b"\xaa\xaa"  # nothing written past the chunk's bytes


@pytest.mark.skipif(not PATHS, reason="the compiled kernel is not built here")
def test_float32_comparisons_round_the_threshold_and_bounds_to_float32():
    """0.1 as a float32 is 0.100000001...: an element equal to float32(0.1) is <= the bound
    0.1 and not above the threshold 0.1, as numpy and torch compare a float32 array."""
    a = np.full(40, np.float32(0.1))
    for path in ["numpy", *PATHS]:
        _, _, counts, _, sig = run(path, a, 0.1, np.array([0.1]))
        assert counts[0] == 40 and sig[:5] == bytes(5), path


def test_unknown_path_is_named():
    with pytest.raises(ValueError, match="grad kernel path: 'sse' is not valid; accepted: "
                                         "auto, avx512, avx2, c, numpy"):
        kernel.set_path("sse")
