"""The free benchmark's C passes (``perturb/fused.py``, issue 38 point 3) against the torch
formulas they replace: the same bits on every path the kernel has (portable C, AVX2, AVX-512),
and the formulas wherever they do not apply."""
import ctypes
import math

import pytest
import torch

from probekit.freebench.judge import metric
from probekit.freebench.perturb import fused, perturb
from probekit.freebench.perturb.host import host_value

pytestmark = [pytest.mark.skipif(not fused.KERNELS, reason="the C kernel is not built"),
              pytest.mark.usefixtures("one_thread")]

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


@pytest.fixture(params=[0, 1, 2], ids=["c", "avx2", "avx512"])
def path(request):
    lib = fused._lib
    lib.pk_set_path.argtypes = [ctypes.c_int32]
    lib.pk_set_path.restype = ctypes.c_int32
    got = lib.pk_set_path(request.param)
    if got != request.param:
        lib.pk_set_path(2)
        pytest.skip("this CPU lacks the path")
    yield got
    lib.pk_set_path(2)


def formulas(t):
    """``perturb.bit_noise`` by the torch formulas."""
    kernels = dict(fused.KERNELS)
    fused.KERNELS.clear()
    try:
        return perturb.bit_noise(t)
    finally:
        fused.KERNELS.update(kernels)


def samples(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * \
        torch.pow(10.0, torch.randint(-40, 38, shape, generator=g).double())
    x = x.to(dtype)
    fi = torch.finfo(dtype)
    flat = x.view(-1)
    for i, v in enumerate([fi.max, -fi.max, fi.smallest_normal, -fi.smallest_normal, fi.tiny / 4,
                           0.0, -0.0, fi.max / 2]):
        if i < flat.numel():
            flat[(7 * i) % flat.numel()] = v
    return x


def test_bit_noise_of_every_bfloat16_value(path):
    """Every finite bfloat16 value, at both checkerboard parities, in rows of several widths."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    for shape in [(every.numel(),), (2, every.numel() // 2), (every.numel() // 3, 3),
                  (7, 3, every.numel() // 21)]:
        x = every[:math.prod(shape)].reshape(shape)
        for t in (x, torch.roll(x.flatten(), 1).reshape(shape)):
            got = fused.bit_noise(t, perturb._noise_consts(t)[1])
            want = formulas(t)
            assert got is not None
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), shape
            assert got.stride() == want.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(), (1,), (64,), (3, 5, 7), (2, 1, 33), (4, 64, 256)])
def test_bit_noise_and_comparison_bit_for_bit(path, dtype, shape):
    """Samples over the whole exponent range with +-max, subnormals and signed zeros:
    ``bit_noise`` the same bits as the formulas; the comparison the same values as
    ``metric._fast`` (``aminmax(p - o)``, ``aminmax(o)``) read on the host."""
    x = samples(dtype, shape, seed=len(shape) + 17 * (dtype == torch.float32))
    got = fused.bit_noise(x, perturb._noise_consts(x)[1])
    want = formulas(x)
    assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))
    assert got.stride() == want.stride()
    others = [want, x.clone(), -x, (x.double() * 1.001).to(dtype),
              torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)]
    for p in others:
        d = torch.sub(p, x)
        read = fused.compare(x, p)
        if not (torch.isfinite(d).all() and torch.isfinite(p).all()):
            assert read is None   # an overflowing difference: the formulas (inconclusive)
            continue
        assert read == [host_value(v) for v in metric._fast(x, p, None)]


def test_the_formulas_run_where_the_kernel_does_not_apply():
    """NaN/Inf inputs (a NaN's payload, an inconclusive comparison: the formulas' own), other
    dtypes, non-contiguous tensors, mixed dtypes, an input needing a gradient: None."""
    f = perturb._noise_consts(torch.ones(1, dtype=torch.bfloat16))[1]
    x = torch.randn(6, 10).to(torch.bfloat16)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[2, 3] = bad
        assert fused.bit_noise(y, f) is None
        assert fused.compare(y, x) is None and fused.compare(x, y) is None
        assert torch.equal(perturb.bit_noise(y).view(torch.int16),
                           formulas(y).view(torch.int16))
    assert fused.bit_noise(x.t(), f) is None and fused.compare(x.t(), x.t()) is None
    assert fused.bit_noise(x.half(), f) is None and fused.compare(x.half(), x.half()) is None
    assert fused.compare(x, x.float()) is None
    assert fused.bit_noise(torch.empty(0, dtype=torch.bfloat16), f) is None
    w = x.float().requires_grad_(True)
    assert fused.bit_noise(w, 1 - 2.0 ** -24) is None
    with torch.no_grad():
        assert fused.bit_noise(w, 1 - 2.0 ** -24) is not None
    big = torch.full((8,), 3e38)
    assert fused.compare(-big, big) is None   # p - o overflows to +Inf


def test_large_tensors_left_to_torch_threads():
    """Beyond one torch thread's grain the formulas run while torch has several threads (its
    kernels split the tensor); on one thread the pass does."""
    x = torch.randn(fused.GRAIN + 1).to(torch.bfloat16)
    f = perturb._noise_consts(x)[1]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert fused.bit_noise(x, f) is None and fused.compare(x, x) is None
        assert fused.bit_noise(x[:fused.GRAIN], f) is not None
        torch.set_num_threads(1)
        assert fused.bit_noise(x, f) is not None and fused.compare(x, x) is not None
    finally:
        torch.set_num_threads(n)


def test_compare_in_two_threads_keeps_each_threads_results():
    """ctypes releases the GIL during a kernel call: two threads' comparisons at once each read
    their own four results (one buffer per thread), never the other's."""
    import threading

    g = torch.Generator().manual_seed(5)
    cases = []
    for k in range(2):
        o = torch.randn(16384, generator=g) * (k + 1)
        p = o + torch.randn(16384, generator=g) * 1e-3 * (k + 1)
        cases.append((o, p, fused.compare(o, p)))
    wrong = []

    def work(o, p, want):
        for _ in range(3000):
            got = fused.compare(o, p)
            if got != want:
                wrong.append(got)
                return

    threads = [threading.Thread(target=work, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cases[0][2] != cases[1][2] and wrong == []
