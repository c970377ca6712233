"""The fused chunk kernel: every compiled path (AVX-512, AVX2, portable C) gives the numpy
twin's bits and counts exactly, and sums of squares equal up to the order of float64 additions;
edge values (NaN, Inf, -0.0, subnormals, tails that are not a whole byte or vector) included."""
import numpy as np
import pytest

from probekit.grads.numerics import kernel


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


def one_read(path, a, hint, bounds, cand=None):
    """``kernel.chunk`` on ``path`` (threshold 1e-3 x scale, bits and counts on): its result
    and the sign and significance bytes it wrote."""
    kernel.set_path(path)
    try:
        k = -(-a.size // 8)
        signs, sig = np.zeros(k, np.uint8), np.zeros(k, np.uint8)
        res = kernel.chunk(a, 1e-3, hint, signs, sig, bounds, True, cand)
    finally:
        kernel.set_path("auto")
    return res, signs.tobytes(), sig.tobytes()


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


@pytest.mark.skipif(not PATHS, reason="the compiled kernel is not built here")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [5, 16, 33, 4099, 1 << 18])
def test_one_chunk_in_one_read_equals_numpy(n, dtype):
    """kernel.chunk (the one-read entry: with a previous scale as hint, AVX-512 does it all in
    one loop) against the numpy twin: statistics, counts of every bound, the bits against the
    provisional threshold and the listed elements near it, exactly."""
    a = edge_array(n, dtype, n + 1)
    a[np.isinf(a) | (np.abs(a) > 1e30)] = 3.0  # (an Inf: the largest finite |x| takes its own
    # pass, tested above; float max: the threshold would list nothing)
    bounds = np.array([-1.0, -0.1, 0.0, 0.1, 0.5, 1.0])
    amax = float(np.nanmax(np.abs(a)))
    for hint in (0.0, 2 * amax):  # no hint: the two loops; a hint above the chunk's own max
        hint = float(np.float32(hint)) if dtype == np.float32 else hint
        want = None
        for path in ["numpy", *PATHS]:
            cand = np.zeros(64, np.int32)
            res, signs, sig = one_read(path, a, hint, bounds, cand)
            got = (res[0], res[1], res[2], res[4], res[5], res[6].tolist(), res[7],
                   sorted(cand[:min(res[7], 64)].tolist()), signs, sig)
            if want is None:
                want = got
                total = res[3]
                assert res[4] == pytest.approx(1e-3 * max(amax, hint), rel=1e-15), (hint, res)
                assert res[7] > 0 or n < 1000, (hint, res)  # the list is exercised
            else:
                assert got == want, (path, hint)
                assert (np.isnan(res[3]) and np.isnan(total)) or res[3] == pytest.approx(
                    total, rel=1e-14, abs=0), (path, hint)


@pytest.mark.skipif(not PATHS, reason="the compiled kernel is not built here")
def test_one_read_largest_finite_magnitude_with_an_inf_or_only_nans():
    a = np.arange(1, 101, dtype=np.float32)
    a[7], a[50] = np.inf, -5000.0
    nan = np.full(40, np.nan, np.float32)
    for x, want in ((a, 5000.0), (nan, 0.0)):
        for path in ["numpy", *PATHS]:
            kernel.set_path(path)
            try:
                res = kernel.chunk(x, 1e-3, 1.0, None, None, np.zeros(0), False, None)
            finally:
                kernel.set_path("auto")
            assert res[2] == want, (path, res)
            assert res[5] == (40 if x is nan else 0), (path, res)


@pytest.mark.skipif(not PATHS, reason="the compiled kernel is not built here")
@pytest.mark.parametrize("n", [40, 1000, 4099, 1 << 18])
def test_one_read_counts_bounds_far_from_the_hint_exactly(n):
    """The one loop compares only the bounds within 4 hints of 0; a bound beyond is counted from
    the max and min found, or, where the values outgrew the hint, by a loop of its own: the
    counts equal the numpy twin's with the hint far below the values, NaNs and zeros among
    them, and bounds on both sides of them and inside them."""
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float32)
    a[::13] = np.nan
    a[5::17] = 0.0
    a[3] = -0.0
    bounds = np.array([-100.0, -3.5, -1.0, -0.1, -1e-3, 0.0, 1e-3, 0.1, 1.0, 2.0, 100.0])
    for hint in (1e-4, 0.01, 0.3, 1e6):
        want = None
        for path in ["numpy", *PATHS]:
            res, signs, sig = one_read(path, a, hint, bounds)
            got = (res[0], res[1], res[2], res[5], res[6].tolist(), signs,
                   sig if hint > 10 else None)  # (below the chunk's largest |x|
            # the one loop's provisional threshold is the hint's, as designed: mended later)
            if want is None:
                want = got
            else:
                assert got == want, (path, hint)


@pytest.mark.skipif(not PATHS, reason="the compiled kernel is not built here")
def test_chunk_many_and_fix_many_equal_a_call_per_chunk():
    """The batched entries (one call per step, chunks given by address) give what chunk and fix
    give chunk by chunk: float32 and float64 chunks, with and without bits, list and counts."""
    rng = np.random.default_rng(7)
    arrays = [edge_array(n, dt, n) for n, dt in ((1000, np.float32), (4099, np.float64),
                                                  (17, np.float32), (1 << 18, np.float32),
                                                  (64, np.float64))]
    for a in arrays:
        a[np.isinf(a) | (np.abs(a) > 1e30)] = 2.0
    bounds = np.array([-1.0, 0.0, 0.25, 1.0])
    units = [1e-3, 1e-2, 0.0, 1e-3, 1e-3]
    hints = [0.0, 5.0, 1.0, 0.5, 3.0]
    bits = [True, True, False, True, True]
    cap = 32
    for path in PATHS:
        for want_counts in (False, True):
            kernel.set_path(path)
            try:
                ref, mine = [], []
                m = len(arrays)
                bufs = [(np.zeros(-(-a.size // 8), np.uint8), np.zeros(-(-a.size // 8), np.uint8))
                        if b else (None, None) for a, b in zip(arrays, bits)]
                cands = [np.zeros(cap, np.int32) if b else None for b in bits]
                for a, u, h, (s, g), c in zip(arrays, units, hints, bufs, cands):
                    r = kernel.chunk(a, u, h, s, g, bounds, want_counts, c)
                    ref.append((r, None if s is None else (s.tobytes(), g.tobytes()),
                                None if c is None else c[:min(r[7], cap)].tolist()))
                bufs2 = [(np.zeros_like(s), np.zeros_like(g)) if s is not None else (None, None)
                         for s, g in bufs]
                cand2 = np.zeros((m, cap), np.int32)
                addr = np.array([(kernel._ptr(a), kernel._ptr(s) or 0, kernel._ptr(g) or 0,
                                  kernel._ptr(cand2[i]) if b else 0)
                                 for i, (a, (s, g), b) in enumerate(zip(arrays, bufs2, bits))],
                                np.int64)
                out, ints = np.zeros((m, 5)), np.zeros((m, 2), np.int64)
                counts = np.zeros((m, len(bounds) + 2), np.int64)
                assert kernel.chunk_many(
                    addr, np.array([a.size for a in arrays], np.int64),
                    np.array([a.dtype == np.float64 for a in arrays], np.int32),
                    np.array(units), np.array(hints), bounds, want_counts,
                    np.array([cap if b else 0 for b in bits], np.int32), out, ints, counts)
                for i, (s, g) in enumerate(bufs2):
                    r = (*out[i].tolist(), int(ints[i, 0]),
                         counts[i] if want_counts else None, int(ints[i, 1]))
                    mine.append((r, None if s is None else (s.tobytes(), g.tobytes()),
                                 None if not bits[i] else cand2[i, :min(r[7], cap)].tolist()))
                for (r1, b1, c1), (r2, b2, c2) in zip(ref, mine):
                    assert repr(r1[:6]) == repr(r2[:6]) and r1[7] == r2[7], path  # NaN sums
                    assert b1 == b2 and c1 == c2, path
                    assert (r1[6] is None) == (r2[6] is None), path
                    if want_counts:
                        assert r1[6].tolist() == r2[6].tolist(), path
                # fix_many: the listed elements of each chunk with bits against a new threshold
                fixes = [i for i in range(m) if bits[i] and ref[i][2]]
                assert fixes, "some elements are listed"
                thr = [hints[i] * units[i] * 1.5 + 1e-9 for i in fixes]
                for i, t in zip(fixes, thr):
                    kernel.fix(arrays[i], np.array(ref[i][2], np.int32), t, bufs[i][1])
                lists = [np.array(ref[i][2], np.int32) for i in fixes]
                assert kernel.fix_many(
                    np.array([(kernel._ptr(arrays[i]), kernel._ptr(c), kernel._ptr(bufs2[i][1]))
                              for i, c in zip(fixes, lists)], np.int64),
                    np.array([c.size for c in lists], np.int64), np.array(thr),
                    np.array([arrays[i].dtype == np.float64 for i in fixes], np.int32))
                for i in fixes:
                    assert bufs[i][1].tobytes() == bufs2[i][1].tobytes(), path
            finally:
                kernel.set_path("auto")
    kernel.set_path("numpy")
    try:
        assert not kernel.chunk_many(*[None] * 11) and not kernel.fix_many(None, None, None,
                                                                            None)
    finally:
        kernel.set_path("auto")
