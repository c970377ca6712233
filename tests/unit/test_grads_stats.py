"""Exact statistics on small tensors, chunk boundaries, dtypes, accuracy and edge cases."""
import hashlib
import os

import numpy as np
import pytest
import torch

from probekit.grads.numerics import stats
from probekit.grads.numerics.stats import CHUNK, Layout, compute, interval_labels, padded_nbytes

BOUNDS = (-1, 0, 1)


def layout_of(*tensors):
    return Layout(tuple(f"p{i}" for i in range(len(tensors))), tuple(t.numel() for t in tensors),
                  tuple(tuple(t.shape) for t in tensors))


def test_interval_labels_like_msprobe():
    assert interval_labels((-1, 0, 1)) == ["(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)"]
    assert interval_labels((-0.5, 2.5)) == ["(-inf, -0.5]", "(-0.5, 2.5]", "(2.5, inf)"]
    assert interval_labels((0,)) == ["(-inf, 0]", "(0, inf)"]


def test_padded_nbytes_and_offsets():
    assert [padded_nbytes(n) for n in (0, 1, 64, 65, 128)] == [0, 8, 8, 16, 16]
    lay = Layout(("a", "b", "c"), (6, 70, 1), ((2, 3), (70,), ()))
    assert lay.offsets.tolist() == [0, 8, 24]
    assert lay.nbytes == 32


def test_exact_values_small_tensor_l2():
    g = torch.tensor([[0.5, -2.0, 0.0], [3.0, -0.25, 1.0]])
    out = compute([g], layout_of(g), "L2", BOUNDS)
    assert out.max.tolist() == [3.0] and out.min.tolist() == [-2.0]
    assert out.norm[0] == np.sqrt(0.25 + 4 + 9 + 0.0625 + 1)
    assert out.dist.tolist() == [[1 / 6, 2 / 6, 2 / 6, 1 / 6]]
    assert out.zeros.tolist() == [1 / 6]
    # grad > 0: 1 0 0 1 0 1 -> 0b10010100, padded to 8 bytes
    assert out.direction.tolist() == [0b10010100, 0, 0, 0, 0, 0, 0, 0]
    assert out.present.tolist() == [True] and out.hash is None


def test_exact_values_several_params_and_missing_grad():
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([-1.0] * 65)
    c = torch.tensor([0.0])
    lay = layout_of(a, b, c)
    out = compute([a, None, b.neg()], Layout(lay.names, (2, 65, 65), ((2,), (65,), (65,))), "L1",
                  BOUNDS)
    assert out.present.tolist() == [True, False, True]
    assert np.isnan(out.max[1]) and np.isnan(out.norm[1])
    assert out.max[2] == 1.0 and out.norm[2] == np.sqrt(65)
    # a: 11000000 then 7 pad bytes; b (absent): 16 zero bytes; -b: 65 ones -> 8 x 0xff + 0x80
    assert out.direction.tolist() == [0b11000000] + [0] * 7 + [0] * 16 + [255] * 8 + [128] + [0] * 7
    del c


def test_l0_hash_is_msprobe_md5_of_float32_bytes():
    g = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    out = compute([g], layout_of(g), "L0", BOUNDS, "md5")
    assert out.hash[0].tobytes().hex() == hashlib.md5(g.numpy().tobytes()).hexdigest()
    bf = g.to(torch.bfloat16)
    out = compute([bf], layout_of(bf), "L0", BOUNDS, "md5")
    assert out.hash[0].tobytes().hex() == hashlib.md5(bf.float().numpy().tobytes()).hexdigest()
    assert out.direction is None and out.dist is None


def test_xxh3_digest():
    xxhash = pytest.importorskip("xxhash")
    g = torch.arange(10, dtype=torch.float32)
    out = compute([g], layout_of(g), "L0", BOUNDS, "xxh3")
    assert out.hash[0].tobytes() == xxhash.xxh3_128(g.numpy().tobytes()).digest()


def test_hash_over_chunks_equals_whole():
    g = torch.randn(CHUNK + 777, generator=torch.Generator().manual_seed(2))
    out = compute([g], layout_of(g), "L0", BOUNDS, "md5")
    assert out.hash[0].tobytes().hex() == hashlib.md5(g.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_chunked_equals_whole_tensor_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(2 * CHUNK + 13, generator=gen) * 2).to(dtype)
    g[5] = 0.0
    g[CHUNK + 1] = 0.0
    out = compute([g], layout_of(g), "L2", (-1.5, 0, 0.25, 3))
    ref = g.double().numpy()
    assert out.max[0] == ref.max() and out.min[0] == ref.min()
    assert abs(out.norm[0] - np.sqrt(np.dot(ref, ref))) / np.sqrt(np.dot(ref, ref)) < 1e-6
    n = ref.size
    le = [np.count_nonzero(ref <= b) for b in (-1.5, 0, 0.25, 3)]
    expected = np.array([le[0], le[1] - le[0], le[2] - le[1], le[3] - le[2], n - le[3]]) / n
    assert out.dist[0].tolist() == expected.tolist()
    assert out.zeros[0] == np.count_nonzero(ref == 0) / n
    packed = np.packbits(ref > 0)
    assert out.direction[:packed.size].tolist() == packed.tolist()
    assert not out.direction[packed.size:].any()


def test_bounds_outside_chunk_range_are_exact():
    # all values inside (-1, 1): the shortcut paths for bounds outside [min, max) and for 0
    g = torch.tensor([0.5, -0.5, 0.0, 0.25, -0.125])
    out = compute([g], layout_of(g), "L2", (-1, 0, 1))
    assert out.dist.tolist() == [[0.0, 3 / 5, 2 / 5, 0.0]]
    pos = torch.tensor([0.5, 2.0])
    out = compute([pos], layout_of(pos), "L2", (-1, 0, 1))
    assert out.dist.tolist() == [[0.0, 0.0, 0.5, 0.5]] and out.zeros.tolist() == [0.0]


def test_nan_in_no_interval_and_propagates_to_max():
    g = torch.tensor([float("nan"), 1.0, -1.0])
    out = compute([g], layout_of(g), "L2", BOUNDS)
    assert np.isnan(out.max[0]) and np.isnan(out.min[0]) and np.isnan(out.norm[0])
    assert out.dist.tolist() == [[1 / 3, 0.0, 1 / 3, 0.0]]
    assert out.direction[0] == 0b01000000


def test_norm_accuracy_30m_elements():
    g = torch.rand(30_000_000, generator=torch.Generator().manual_seed(4)) * 1e-3 + 1e-3
    out = compute([g], layout_of(g), "L1", BOUNDS)
    ref = np.sqrt(np.dot(g.double().numpy(), g.double().numpy()))
    assert abs(out.norm[0] - ref) / ref <= 1e-6
    fp32_norm = float(torch.linalg.vector_norm(g))
    assert abs(fp32_norm - ref) / ref > abs(out.norm[0] - ref) / ref


def test_half_precision_without_overflow():
    h = torch.full((1000,), 60000.0, dtype=torch.float16)
    out = compute([h], layout_of(h), "L1", BOUNDS)
    assert not torch.isfinite(torch.linalg.vector_norm(h))  # fp16 overflows
    assert out.norm[0] == pytest.approx(60000.0 * np.sqrt(1000), rel=1e-6)
    b = torch.full((100,), 1e30, dtype=torch.bfloat16)
    out = compute([b], layout_of(b), "L1", BOUNDS)
    val = float(b[0].float())
    assert out.norm[0] == pytest.approx(val * 10, rel=1e-6) and out.max[0] == val


def test_tiny_values_do_not_underflow():
    g = torch.full((16,), 1e-30)
    out = compute([g], layout_of(g), "L1", BOUNDS)
    assert out.norm[0] == pytest.approx(float(g[0]) * 4, rel=1e-6)


def test_device_path_matches_cpu_path():
    """The accelerator code path (whole-tensor torch ops, packing on device) run on CPU tensors:
    the same values as the CPU path, significance bits included (a module's gradients share
    their largest |g|: "m.weight" and "m.bias")."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(1000, generator=gen), torch.randn(7, 3, generator=gen).to(torch.bfloat16),
             torch.tensor([0.0, -0.0, 2.0]), torch.randn(40, generator=gen) * 1e-7]
    lay = Layout(("a", "b", "m.weight", "m.bias"), tuple(g.numel() for g in grads),
                 tuple(tuple(g.shape) for g in grads))
    cpu = compute(grads, lay, "L2", BOUNDS)
    dev = compute(grads, lay, "L2", BOUNDS, _device_path=True)
    assert dev.max.tolist() == cpu.max.tolist() and dev.min.tolist() == cpu.min.tolist()
    assert np.allclose(dev.norm, cpu.norm, rtol=1e-6, atol=0)
    assert dev.dist.tolist() == cpu.dist.tolist() and dev.zeros.tolist() == cpu.zeros.tolist()
    assert dev.direction.tolist() == cpu.direction.tolist()
    assert dev.significant.tolist() == cpu.significant.tolist()
    bias = np.unpackbits(cpu.significant[lay.offsets[3]:lay.offsets[3] + 5], count=40)
    assert bias.sum() == 0  # next to the weight's 2.0: below 8 * eps32 * 2.0 = 1.9e-6
    assert np.abs(grads[3].numpy()).max() < 8 * 2 ** -23 * 2.0


def test_size_mismatch_is_an_error():
    g = torch.ones(3)
    lay = Layout(("w",), (4,), ((4,),))
    with pytest.raises(ValueError, match="gradient of 'w' has 3 elements; the recording started with 4"):
        compute([g], lay, "L1", BOUNDS)


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_threaded_split_equals_single_thread(monkeypatch, level):
    """A step split across threads gives exactly the single-thread statistics."""
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(3 * CHUNK + 5, generator=gen), torch.randn(77, generator=gen),
             torch.randn(CHUNK + 9, generator=gen).to(torch.bfloat16), None,
             torch.randn(2 * CHUNK, generator=gen).double()]
    grads[0][CHUNK + 3] = float("nan")
    lay = Layout(tuple("abcde"), (3 * CHUNK + 5, 77, CHUNK + 9, 4, 2 * CHUNK),
                 ((3 * CHUNK + 5,), (77,), (CHUNK + 9,), (4,), (2 * CHUNK,)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = compute(grads, lay, level, (-1, 0, 0.5))
        torch.set_num_threads(3)
        monkeypatch.setattr(stats, "_PARALLEL_MIN", 0)
        work = stats.Workspace()                 # the probe's: its pool runs the split
        split = compute(grads, lay, level, (-1, 0, 0.5), scratch=work)
    finally:
        workers = stats._workers(10)
        torch.set_num_threads(before)
    assert workers == min(3, os.cpu_count())  # the split really ran on 3 threads
    pool = work.pool
    assert pool is not None and len(pool._threads) >= 1
    work.close()                             # a stopped probe leaves no thread behind
    assert work.pool is None and all(not t.is_alive() for t in pool._threads)
    for name in ("present", "max", "min", "norm", "hash", "zeros", "dist", "direction"):
        a, b = getattr(single, name), getattr(split, name)
        assert (a is None and b is None) or np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), name




def test_significance_bits():
    """|g| > SIGNIFICANCE[bits] * eps(dtype) * max|g|: exact bits for float32 and bfloat16."""
    eps32 = float(torch.finfo(torch.float32).eps)
    assert stats.SIGNIFICANCE == {16: 1.0, 32: 8.0, 64: 8.0}
    g = torch.tensor([1.0, -1e-3, 10 * eps32, -20 * eps32, 0.0, -2.0, 1e-30, 17 * eps32])
    lay = layout_of(g)
    out = compute([g], lay, "L1", BOUNDS)
    # max|g| = 2: threshold 8 * eps32 * 2 = 16 eps32
    assert np.unpackbits(out.significant[:1]).tolist() == [1, 1, 0, 1, 0, 1, 0, 1]
    assert out.significant[1:].tolist() == [255] * 7  # padding to 64 bits: ones
    assert np.unpackbits(out.direction[:1]).tolist() == [1, 0, 1, 0, 0, 0, 1, 1]
    b = torch.tensor([1.0, 0.03, -0.03, 0.005], dtype=torch.bfloat16)  # threshold 1/128
    out = compute([b], layout_of(b), "L1", BOUNDS)
    assert np.unpackbits(out.significant[:1]).tolist()[:4] == [1, 1, 1, 0]
    # fp32 gradients computed under bf16 autocast: bfloat16's threshold
    f = b.float()
    out = compute([f], layout_of(f), "L1", BOUNDS, compute_dtype=torch.bfloat16)
    assert np.unpackbits(out.significant[:1]).tolist()[:4] == [1, 1, 1, 0]
    out = compute([f], layout_of(f), "L1", BOUNDS)
    assert np.unpackbits(out.significant[:1]).tolist()[:4] == [1, 1, 1, 1]


def test_significance_scale_is_the_modules():
    """A module's gradients share one scale: a key bias whose gradient is rounding noise of
    its weight's scale has no significant element, though each is large next to its own max;
    a parameter alone in its module keeps its own scale."""
    w = torch.tensor([0.5, -1.0, 0.25, 0.75])
    noise = torch.tensor([3e-7, -2e-7, 1e-7])  # < 8 * eps32 * 1.0 = 9.5e-7
    alone = noise.clone()
    lay = Layout(("attn.key.weight", "attn.key.bias", "other.bias"), (4, 3, 3),
                 ((4,), (3,), (3,)))
    out = compute([w, noise, alone], lay, "L1", BOUNDS)
    assert lay.modules.tolist() == [0, 0, 1]
    # parameters of the root module (no dot) are each alone
    assert Layout(("cls", "pos", "a.w", "a.b", "b"), (1,) * 5, ((1,),) * 5).modules.tolist() == [
        0, 1, 2, 2, 3]
    bits = [np.unpackbits(out.significant[o:o + 1], count=n).tolist()
            for o, n in zip(lay.offsets, lay.numels)]
    assert bits == [[1, 1, 1, 1], [0, 0, 0], [1, 1, 1]]
