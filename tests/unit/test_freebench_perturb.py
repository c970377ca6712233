"""Perturbations: exact values per dtype, inputs and RNG untouched, the registry."""
import math

import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import names
from probekit.freebench.perturb import perturb

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def sample(dtype):
    # values well inside every dtype's normal range, both signs, a zero, a tiny subnormal-ish one
    return torch.tensor([[1.0, -2.5, 0.0, 3.75], [-0.125, 7.0, 1e-30, -96.0]]).to(dtype)


def ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs(), torch.tensor(float("inf"), dtype=x.dtype)) - x.abs()


@pytest.mark.parametrize("dtype", FLOATS)
def test_bit_noise_moves_one_ulp_alternately_above_the_floor(dtype):
    x = sample(dtype)
    before = x.clone()
    rng = torch.get_rng_state()
    y = perturb.bit_noise(x)
    assert torch.equal(x, before)                         # input untouched
    assert torch.equal(torch.get_rng_state(), rng)        # no RNG consumed
    assert y.dtype == dtype and y.shape == x.shape
    tiny = torch.finfo(dtype).smallest_normal
    big = x.abs() > tiny
    # every element above the floor moved by exactly one ulp: towards zero where row + column is
    # even, away from zero where it is odd (a checkerboard); the others (0, values below the
    # smallest normal) are unchanged
    even = checkerboard(x)
    assert bool(((y.abs() < x.abs()) == even)[big].all())
    step = (y.double() - x.double()).abs()
    assert torch.equal(step[big], torch.minimum(ulp(x).double(), ulp(y).double())[big])
    assert torch.equal(y[~big], x[~big])


def checkerboard(x):
    """True where (row of the flattened leading dims + column) is even."""
    d = x.shape[-1] if x.dim() else 1
    r = x.numel() // d
    return ((torch.arange(r).view(-1, 1) + torch.arange(d)) % 2 == 0).reshape(x.shape)


def test_bit_noise_exact_values_bf16():
    x = torch.tensor([1.0, -1.0, 258.0, 256.0], dtype=torch.bfloat16)
    assert perturb.bit_noise(x).tolist() == [0.99609375, -1.0078125, 256.0, 258.0]
    assert perturb.bit_noise(torch.tensor(1.0, dtype=torch.bfloat16)).item() == 0.99609375


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_noise_moves_one_ulp_towards_inf(dtype):
    x = sample(dtype)
    before = x.clone()
    rng = torch.get_rng_state()
    y = perturb.add_noise(x)
    assert torch.equal(x, before)
    assert torch.equal(torch.get_rng_state(), rng)
    big = x.abs() > torch.finfo(dtype).smallest_normal
    expected = torch.where(big, torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype)), x)
    assert torch.equal(y, expected)
    assert bool((y > x)[big].all())


def test_add_noise_does_not_round_away_in_fp16():
    # msprobe added a constant 1e-6-ish value: 1.0 + that is still 1.0 in fp16
    x = torch.ones(4, dtype=torch.float16)
    assert (x + 1e-6).tolist() == x.tolist()
    assert perturb.add_noise(x).tolist() == [1.0009765625] * 4


def test_noise_leaves_inf_nan_and_zeros_alone():
    for dtype in FLOATS:
        fi = torch.finfo(dtype)
        x = torch.tensor([float("inf"), -float("inf"), float("nan"), fi.max, 0.0, -0.0],
                         dtype=dtype)
        for fn in (perturb.bit_noise, perturb.add_noise):
            y = fn(x)
            assert y[:2].tolist() == x[:2].tolist() and bool(y[2].isnan())
            assert y[4:].tolist() == [0.0, 0.0] and torch.signbit(y[4:]).tolist() == [False, True]
        # max's next value up (add_noise; bit_noise at an odd position: away from zero) is Inf,
        # which the input did not have: max stays (issue 34, class O: a mask's finfo.min became
        # -inf and the re-run a NaN/Inf mismatch of the perturbation's own making)
        assert perturb.add_noise(x)[3].item() == fi.max
        assert perturb.bit_noise(x)[3].item() == fi.max
        assert perturb.bit_noise(-x)[3].item() == -fi.max
        assert perturb.bit_noise(x[3:4])[0].item() < fi.max   # even position: towards zero


@pytest.mark.parametrize("kernel", ["formulas", "fused"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_bit_noise_on_the_cpu_is_the_fixed_formula_bit_for_bit(dtype, kernel, monkeypatch):
    """On the CPU, ``bit_noise`` keeps max finite only where an ``aminmax`` of the input says it
    may hold +-max (issue 38: a 16-bit ``isinf`` and ``where`` cost 7x a product there): the
    same bits as ``where(isinf(t * m / d), t, t * m / d)`` on every input, with and without
    +-max, +-Inf, NaN, signed zeros and subnormals; and one ATen operator fewer than that
    formula where nothing can overflow. ``fused``: bfloat16 and float32 in one pass in C
    (``fused.py``; an input holding NaN or +-Inf by the formulas), the same bits, one
    ``empty_like``."""
    from torch.profiler import ProfilerActivity, profile

    from probekit.freebench.perturb import fused

    if kernel == "formulas":
        monkeypatch.setattr(fused, "KERNELS", {})
    elif dtype not in fused.KERNELS:
        pytest.skip("no C kernel for this dtype (or not built)")
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 37, generator=g, dtype=torch.float64) * 8
    specials = [fi.max, -fi.max, float("inf"), -float("inf"), float("nan"), 0.0, -0.0,
                fi.tiny, -fi.tiny, fi.tiny / 4, fi.max / 2]
    cases = [base.to(dtype), (base * 1e-3).to(dtype)]
    for i, v in enumerate(specials):
        x = base.clone()
        x.view(-1)[(7 * i) % x.numel()] = v
        x.view(-1)[(7 * i + 20) % x.numel()] = v    # at both checkerboard parities
        cases.append(x.to(dtype))
    cases.append(torch.tensor(specials, dtype=torch.float64).to(dtype))
    cases.append(base.to(dtype).expand(3, 6, 37))    # a stride-0 input

    def formula(t):
        m, d = perturb._checker(t)
        out = torch.mul(t, m, out=torch.empty_like(t)).div_(d)
        return torch.where(torch.isinf(out), t, out)

    bits = perturb._INT_VIEW[dtype]
    for x in cases:
        assert torch.equal(perturb.bit_noise(x).view(bits), formula(x).view(bits)), x
    x = cases[0]
    perturb.bit_noise(x.clone())   # the checkerboard cached
    fresh = x.clone()              # a tensor whose extremes were never read (``host.noted``)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        perturb.bit_noise(fresh)
    names = [e.name for e in prof.events() if e.cpu_parent is None]
    want = ["aten::mul", "aten::div_", "aten::aminmax"] if kernel == "formulas" else \
        ["aten::empty_like"]
    assert names == want, names


@pytest.mark.parametrize("dtype", FLOATS)
def test_bit_noise_reads_a_tensors_extremes_once_while_it_is_unchanged(dtype, monkeypatch):
    """Issue 38, third pass: the ``aminmax`` that tells ``bit_noise`` whether its input may hold
    +-max is read once per tensor while its version counter stands still (``host.noted``; a
    forward check's comparison notes its output's, ``Verdicts.stats``): no kernel the next time,
    the same bits; an in-place write (here one that puts +-max in) is read again, and +-max is
    kept finite as before. (The torch formulas: the C kernel, ``fused.py``, reads no extremes.)"""
    from torch.profiler import ProfilerActivity, profile

    from probekit.freebench.perturb import fused, host

    monkeypatch.setattr(fused, "KERNELS", {})

    fi = torch.finfo(dtype)
    x = (torch.randn(5, 33, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
         * 4).to(dtype)
    bits = perturb._INT_VIEW[dtype]
    first = perturb.bit_noise(x)
    assert host.noted(x) is not None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        again = perturb.bit_noise(x)
    names = [e.name for e in prof.events() if e.cpu_parent is None]
    assert names == ["aten::mul", "aten::div_"], names
    assert torch.equal(first.view(bits), again.view(bits))
    x[0, 1] = fi.max      # odd (row + column): moved away from zero, would overflow
    x[1, 0] = -fi.max
    assert host.noted(x) is None          # its version moved
    y = perturb.bit_noise(x)
    assert torch.isfinite(y).all() and y[0, 1] == fi.max and y[1, 0] == -fi.max
    z = perturb.bit_noise(x)              # noted now: +-max known, kept finite again
    assert torch.equal(y.view(bits), z.view(bits))
    # a view of the same memory is another tensor: read for itself
    assert host.noted(x.view(-1)) is None


@pytest.mark.parametrize("dtype", FLOATS)
def test_change_value_swaps_first_and_last_of_last_dim(dtype):
    x = sample(dtype)
    before = x.clone()
    y = perturb.change_value(x)
    assert torch.equal(x, before)
    assert torch.equal(y, x[:, [3, 1, 2, 0]])
    assert torch.equal(perturb.swap_last(y), x)


@pytest.mark.parametrize("x", [torch.tensor(3.0), torch.tensor([3.0]), torch.ones(4, 1)])
def test_change_value_cancels_small_inputs(x):
    with pytest.raises(perturb.Cancel):
        perturb.change_value(x)


@pytest.mark.parametrize("dtype, target", [(torch.float16, torch.float32),
                                           (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float64)])
def test_improve_precision_upcasts(dtype, target):
    x = sample(dtype)
    call = perturb.Call(names.classify(torch.matmul), (x, x.t()), {})
    p = perturb.apply("improve_precision", call)
    assert [a.dtype for a in p.args] == [target, target]
    assert p.in_dtype == target
    assert torch.equal(p.args[0].to(dtype), x)            # upcasting is exact
    assert x.dtype == dtype


def test_improve_precision_mixed_and_float64():
    h, f = torch.ones(2, dtype=torch.bfloat16), torch.ones(2)
    call = perturb.Call(names.classify(torch.add), (h, f), {})
    assert [a.dtype for a in perturb.apply("improve_precision", call).args] == [torch.float64] * 2
    d = torch.ones(2, dtype=torch.float64)
    with pytest.raises(perturb.Cancel, match="already float64"):
        perturb.apply("improve_precision", perturb.Call(names.classify(torch.add), (d, d), {}))


@pytest.mark.parametrize("dtype", FLOATS)
def test_to_cpu_copies_and_upcasts_low_precision(dtype):
    x = sample(dtype)
    y = perturb.to_cpu(x)
    assert y.device.type == "cpu"
    assert y.dtype == (torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    assert y.data_ptr() != x.data_ptr()
    assert torch.equal(y.to(dtype), x)


@pytest.mark.parametrize("dtype", FLOATS)
def test_no_change_is_an_exact_copy(dtype):
    x = sample(dtype)
    y = perturb.no_change(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("mode", ["bit_noise", "add_noise", "no_change"])
def test_noise_modes_perturb_only_the_first_float_input(mode):
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    call = perturb.Call(names.classify(torch.add), (a, b), {"alpha": 1})
    p = perturb.apply(mode, call)
    assert p.args[1] is b and p.kwargs == {"alpha": 1}
    assert p.args[0] is not a
    assert p.in_dtype == torch.float32


def test_apply_walks_lists_and_kwargs():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    call = perturb.Call(names.classify(torch.stack), ([a, b],), {"dim": 0})
    p = perturb.apply("improve_precision", call)
    assert isinstance(p.args[0], list) and [t.dtype for t in p.args[0]] == [torch.float64] * 2
    assert p.kwargs == {"dim": 0}
    assert p.replaced == {0: p.args[0][0], 1: p.args[0][1]}
    idx = torch.tensor([0, 1])
    with pytest.raises(perturb.Cancel, match="no floating-point"):
        perturb.apply("bit_noise", perturb.Call(names.classify(torch.add), (idx, idx), {}))


def test_flatten_roundtrip():
    t = torch.ones(1)
    args = (t, [t, 2, (3, t)], {"k": t})
    kwargs = {"dim": -1, "x": [t]}
    leaves, spec = perturb.flatten(args, kwargs)
    assert len(leaves) == 8
    a2, k2 = perturb.unflatten(leaves, spec)
    assert a2 == args and k2 == kwargs
    assert isinstance(a2[1], list) and isinstance(a2[1][2], tuple)


def test_change_value_rules():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    # element-wise: output swapped back, so an exact op is unchanged
    p = perturb.apply("change_value", perturb.Call(names.classify(torch.exp), (x,), {}))
    assert torch.equal(p.post(torch.exp(p.args[0])), torch.exp(x))
    # reduction over the last dim: order-invariant, nothing to swap back
    p = perturb.apply("change_value", perturb.Call(names.classify(torch.sum), (x, -1), {}))
    assert p.post is None
    # reduction over another dim: the swapped dim survives, swapped back
    p = perturb.apply("change_value", perturb.Call(names.classify(torch.sum), (x,), {"dim": 0}))
    assert torch.equal(p.post(torch.sum(p.args[0], dim=0)), torch.sum(x, dim=0))
    # two tensors / an order-dependent API: cancelled with a reason
    for func, args in [(torch.matmul, (x, x.t())), (torch.add, (x, x)), (F.layer_norm, (x, (3,)))]:
        with pytest.raises(perturb.Cancel, match="element order"):
            perturb.apply("change_value", perturb.Call(names.classify(func), args, {}))


def test_registry_rejects_duplicates():
    assert set(perturb.PERTURBATIONS) == {"improve_precision", "bit_noise", "add_noise",
                                          "change_value", "no_change", "to_cpu",
                                          "combined"}
    with pytest.raises(ValueError, match="registered twice"):
        perturb.perturbation("bit_noise")(lambda call, leaves: None)


@pytest.mark.parametrize("mode", sorted(perturb.PERTURBATIONS))
@pytest.mark.parametrize("dtype", FLOATS)
def test_every_mode_leaves_inputs_and_rng_alone(mode, dtype):
    x = sample(dtype)
    w = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    before_x, before_w = x.clone(), w.detach().clone()
    rng = torch.get_rng_state()
    call = perturb.Call(names.classify(torch.exp), (x,), {})
    if mode in ("improve_precision", "combined") and dtype == torch.float64:
        with pytest.raises(perturb.Cancel):
            perturb.apply(mode, call)
    else:
        p = perturb.apply(mode, call)
        assert p.args[0] is not x
        changed = not torch.equal(p.args[0].to(dtype), x) or p.args[0].dtype != dtype \
            or p.args[0].data_ptr() != x.data_ptr()
        assert changed
    perturb.apply("improve_precision" if dtype != torch.float64 else "no_change",
                  perturb.Call(names.classify(torch.mul), (w, x), {}))
    assert torch.equal(x, before_x) and torch.equal(w.detach(), before_w)
    assert torch.equal(torch.get_rng_state(), rng)


def test_every_mode_has_traits_and_a_perturbation():
    from probekit import config
    from probekit.freebench.judge import handlers
    from probekit.freebench.perturb import modes

    assert set(perturb.PERTURBATIONS) == set(modes.MODES)
    assert config.PERT_MODES == modes.PERT_MODES == tuple(modes.MODES)
    assert modes.FIX_PERT_MODES == ("improve_precision", "to_cpu")
    assert [m for m, t in modes.MODES.items() if t.noise] == ["bit_noise", "add_noise"]
    # the threshold rule reads the traits: exact -> 0, upcast -> c u (c = 2, plus the call's
    # accumulation term), the others -> sqrt(u)
    fb = config.FreeBenchmarkConfig()
    assert handlers.threshold(fb, "no_change", torch.float32) == 0.0
    assert handlers.threshold(fb, "bit_noise", torch.float16) == 2.0 ** -5.5
    assert handlers.threshold(fb, "improve_precision", torch.float16) == 2 * 2.0 ** -11
    with pytest.raises(ValueError, match="no entry in modes.MODES"):
        perturb.perturbation("made_up")(lambda call, leaves: (leaves, None, None))
    with pytest.raises(ValueError, match="registered twice"):
        modes.register(modes.Mode("bit_noise"))


def test_import_probekit_config_loads_no_torch():
    import subprocess
    import sys

    code = ("import sys, probekit, probekit.config; "
            "print(probekit.config.PERT_MODES[0], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["improve_precision", "False"]
def test_flatten_fast_path_for_positional_leaves():
    t = torch.ones(1)
    leaves, spec = perturb.flatten((t, 2, None), {})
    assert leaves == [t, 2, None] and leaves[0] is t
    assert perturb.unflatten([t, 3, None], spec) == ((t, 3, None), {})
    # a container or a keyword argument takes the general path
    assert perturb.flatten((t, [t]), {})[1] != spec and perturb.flatten((t,), {"dim": 0})[1] != spec


def every_16_bit_value(dtype):
    """All 65536 bit patterns: normals of both signs across every exponent boundary,
    subnormals, zeros, +-max, the values just below max, Inf and NaN."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


#: positive normal values of each 16-bit dtype (exponents 1..max-1, every mantissa)
NORMALS = {torch.float16: 30 * 1024, torch.bfloat16: 254 * 128}
#: the CPU kernel paths the exhaustive tests run on (``ATEN_CPU_CAPABILITY``); the noise must
#: be the same bits on each
CAPABILITIES = ["default", "avx2"]


def above_smallest_normal(x):
    """The finite elements with |x| > smallest normal (NaN fails the comparisons)."""
    a = x.abs()
    return (a > torch.finfo(x.dtype).smallest_normal) & (a <= torch.finfo(x.dtype).max)


def same_bits(y, e):
    """Equal bit patterns (so +0 and -0 differ), any NaN equal to any NaN (payloads may change)."""
    return bool(((y.view(torch.int16) == e.view(torch.int16)) | (y.isnan() & e.isnan())).all())


def _exhaustive(dtype):
    """(input, bit_noise expected, add_noise expected) over every 16-bit pattern, laid out as
    rows of 256 (so both directions of bit_noise see every value)."""
    x = every_16_bit_value(dtype)
    keep = above_smallest_normal(x)
    up = torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype))
    away = torch.nextafter(x, torch.where(x > 0, float("inf"), -float("inf")).to(dtype))
    towards = torch.nextafter(x, torch.zeros_like(x))
    return x, keep, up, away, towards


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_noise_is_exact_on_every_16_bit_value(dtype):
    x, keep, up, _, _ = _exhaustive(dtype)
    assert int(keep.sum()) == 2 * NORMALS[dtype] - 2          # all normals but +-smallest
    sn = torch.finfo(dtype).smallest_normal
    for layout in (x, x.view(256, 256), x.view(-1, 1), x.view(16, 16, 256), x.view(256, 256).t()):
        flat = layout.reshape(-1)                              # logical order
        xk, kk, aw, to = _exhaustive_of(flat)
        even = checkerboard(layout).reshape(-1)
        y = perturb.bit_noise(layout).reshape(-1)
        expected = torch.where(kk, torch.where(even, to, aw), xk)
        expected = torch.where((xk.abs() == sn) & ~even, aw, expected)   # towards zero: a tie
        expected = torch.where(expected.isinf() & xk.isfinite(), xk, expected)  # max stays
        assert same_bits(y, expected)
    a = perturb.add_noise(x)
    expected = torch.where(keep | (x == sn), up, x)
    expected = torch.where(expected.isinf() & x.isfinite(), x, expected)        # max stays
    assert same_bits(a, expected)
    moved = keep & (x != torch.finfo(dtype).max)
    assert bool((a[moved] > x[moved]).all())


def _exhaustive_of(flat):
    """(values, above the smallest normal, one ulp away from zero, one ulp towards zero)."""
    keep = above_smallest_normal(flat)
    away = torch.nextafter(flat, torch.where(flat > 0, float("inf"), -float("inf")).to(flat.dtype))
    return flat, keep, away, torch.nextafter(flat, torch.zeros_like(flat))


def test_noise_is_the_same_on_every_cpu_kernel_path():
    import os
    import subprocess
    import sys

    code = ("import torch, hashlib; from probekit.freebench.perturb import perturb\n"
            "x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)\n"
            "h = hashlib.sha256()\n"
            "for dt in (torch.float16, torch.bfloat16):\n"
            "    v = x.view(dt).reshape(256, 256)\n"
            "    for f in (perturb.bit_noise, perturb.add_noise):\n"
            "        r = f(v)\n"
            "        r = torch.where(r.isnan(), torch.zeros_like(r), r)  # NaN payloads may vary\n"
            "        h.update(r.view(torch.int16).numpy().tobytes())\n"
            "g = torch.Generator().manual_seed(0)\n"
            "bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (8192,), generator=g, dtype=torch.int64)\n"
            "for y in (bits.to(torch.int32).view(torch.float32), bits.view(torch.float64)):\n"
            "    for f in (perturb.bit_noise, perturb.add_noise):\n"
            "        h.update(f(y).nan_to_num(0.0).numpy().tobytes())\n"
            "print(torch.backends.cpu.get_cpu_capability(), h.hexdigest())")
    digests = set()
    for cap in CAPABILITIES:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "ATEN_CPU_CAPABILITY": cap})
        seen_cap, digest = out.stdout.split()
        assert seen_cap.lower() == cap
        digests.add(digest)
    assert len(digests) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_noise_is_nextafter_at_the_edges(dtype):
    fi = torch.finfo(dtype)
    below_max = torch.nextafter(torch.tensor(fi.max, dtype=dtype), torch.tensor(0.0, dtype=dtype))
    vals = [fi.smallest_normal, -fi.smallest_normal, fi.smallest_normal / 2, 0.0, -0.0, 1.0, -1.0,
            2.0, -2.0, 3.5, -1e-30, 1e30, float(below_max), -float(below_max), fi.max, -fi.max,
            float("inf"), -float("inf"), float("nan")]
    x = torch.tensor(vals, dtype=dtype)
    a = x.abs()
    keep = ((a > fi.smallest_normal) & (a < fi.max)) | (x == fi.smallest_normal) | \
        (x == -fi.max)          # +max stays: its next value up is Inf
    expected = torch.where(keep, torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype)), x)
    itype = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    y = perturb.add_noise(x)
    assert bool(((y.view(itype) == expected.view(itype)) | (y.isnan() & expected.isnan())).all())


def test_flip_last_bit_keeps_equal_values_equal():
    # the cause analysis' nudge: one ulp by each element's own bits
    x = torch.tensor([3.0, 3.0, 5.0, 0.0, float("inf")])
    y = perturb.flip_last_bit(x)
    assert y[0] == y[1] and (y[:3] != x[:3]).all() and y[3] == 0.0 and y[4] == math.inf


@pytest.mark.parametrize("make", [lambda: torch.randn(4, 1, 8).expand(4, 6, 8),
                                  lambda: torch.randn(1, 8).expand(6, 8),
                                  lambda: torch.randn(4, 1).expand(4, 6),
                                  lambda: torch.randn(8, 6).t(),
                                  lambda: torch.randn(8, 12)[:, ::2].t(),
                                  lambda: torch.randn(3, 4, 5, 6).to(
                                      memory_format=torch.channels_last)])
def test_every_perturbation_keeps_the_layout_a_kernel_allocates_for_its_input(make):
    # issue 34, defect C: a kernel that allocates empty_like(input) (a dropout's mask, drawn in
    # memory order) must see the perturbed input laid out as the original: bit_noise of an
    # expanded tensor came out with another dim order (4x6x8 with stride 0: strides (48, 1, 6))
    x = make()
    want = torch.empty_like(x).stride()
    for fn in (perturb.bit_noise, perturb.add_noise, perturb.flip_last_bit, perturb.no_change,
               lambda t: perturb.improve_precision(t, torch.float64)):
        assert fn(x).stride() == want, fn


def test_bit_noise_of_an_expanded_input_replays_a_dropout_mask_on_the_same_elements(tmp_path):
    # the forward check of a dropout on an expanded tensor: with the mask on the same elements
    # the one-ulp nudge moves each kept element by one ulp (no hot spot); with the layout changed
    # the replayed mask landed on other elements (hot spots of 16x and 4,096x)
    from probekit.freebench import FreeBench

    x = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(0)).expand(4, 8, 64)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    torch.manual_seed(1)
    with fb:
        torch.nn.functional.dropout(x, 0.5, training=True)
    assert fb.summary["checked"] == 1 and fb.summary["replayed"] == 1
    assert fb.results.empty and fb.hotspots.empty, fb.hotspots


def test_a_masks_finfo_min_under_bit_noise_is_no_finding(tmp_path):
    """Masked logits hold fp32's finfo.min (a causal mask: gpt_oss, deepseek_v4, longformer).
    ``x - max(x)`` is exact on them; bit_noise nudged finfo.min one ulp away from zero, to -inf,
    and the re-run's -inf against the original's finite values was a NaN/Inf row of the
    perturbation's own making (issue 34, class O: 39 rows). finfo.min now stays: no row."""
    from probekit import FreeBench
    x = torch.randn(2, 4, 16, 17, generator=torch.Generator().manual_seed(0))
    x[..., :8] = torch.finfo(torch.float32).min
    assert perturb.bit_noise(x).isinf().sum().item() == 0
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        y = x - x.max(dim=-1, keepdim=True).values
    assert y.isfinite().all() and fb.summary["checked"] == 2
    assert fb.results.empty, fb.results


def test_a_mask_product_nudged_past_max_is_no_finding(tmp_path):
    """Longformer builds its sliding-window mask as ``einsum(ones, float_mask)``, the mask
    holding finfo.min: the result is finfo.min exactly, and bit_noise's ``1 / (1 - u)`` nudge of
    the ones moves it to ``(1 + 2u) finfo.min``, which fp32 rounds to -inf. That Inf is the
    range's edge, not a property of the call (issue 34, class O: 12 rows in LED and Longformer
    once finfo.min itself stayed finite): the comparison counts it as no move."""
    from probekit import FreeBench
    lo = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 8, 1)
    mask[:, 5:] = lo
    ones = torch.ones_like(mask)
    assert torch.einsum("bxd,byd->bxy", perturb.bit_noise(ones), mask).isinf().any()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        torch.einsum("bxd,byd->bxy", ones, mask)
    assert fb.summary["checked"] == 1 and fb.results.empty, fb.results
