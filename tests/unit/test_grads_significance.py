"""Significance bits in the store: all-ones chunks are the fill value and are not written."""
import os

import numpy as np
import torch

from probekit.grads import open_grads
from probekit.grads.numerics.stats import Layout, compute
from probekit.grads.store.store import GradWriter


def test_all_ones_chunks_not_written_and_read_back(tmp_path):
    lay = Layout(("a", "b"), (10, 3), ((10,), (3,)))
    w = GradWriter(str(tmp_path), 0, lay, "L1", (-1, 0, 1), "md5", 4, significance=True)
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(10, generator=gen) + 5, torch.randn(3, generator=gen) + 5]
    noisy = [torch.tensor([1.0] + [1e-12] * 9), torch.ones(3)]
    for step, grads in enumerate([dense, dense, noisy]):
        w.append(step, compute(grads, lay, "L1", (-1, 0, 1)))
    w.close()
    ds = open_grads(tmp_path)
    sig = ds["significant"].values
    assert sig.shape == (3, lay.nbytes)
    assert sig[0].tolist() == [255] * 16 and sig[1].tolist() == [255] * 16
    assert sig[2].tolist() == [0b10000000, 0b00111111] + [255] * 14
    path = tmp_path / "grads.zarr" / "rank0" / "significant" / "c"
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path)
                   for f in fs)
    assert files == ["0/0"]  # 4 steps per chunk; written because step 2 is not all ones
    np.testing.assert_array_equal(ds["direction"].values[2, :2], [255, 192])


def test_dense_gradients_write_no_significance_chunk(tmp_path):
    lay = Layout(("a",), (100,), ((100,),))
    w = GradWriter(str(tmp_path), 0, lay, "L2", (-1, 0, 1), "md5", 2, significance=True)
    for step in range(5):
        w.append(step, compute([torch.arange(1.0, 101.0)], lay, "L2", (-1, 0, 1)))
    w.close()
    chunks = tmp_path / "grads.zarr" / "rank0" / "significant" / "c"
    assert [f for _, _, fs in os.walk(chunks) for f in fs] == []
    assert (open_grads(tmp_path)["significant"].values == 255).all()


def test_significance_is_on_by_default_and_can_be_turned_off(tmp_path):
    from probekit.grads import GradProbe

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, options in (("on", {}), ("off", {"significance": False})):
        with GradProbe(model, optimizer=opt, dump_path=str(tmp_path / name), **options):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
    on, off = open_grads(tmp_path / "on"), open_grads(tmp_path / "off")
    assert "significant" in on and "significant" not in off
    # weight gradient: ones (row 1) and ones (row 2) -> every element significant; bias: 1, 1
    assert on["significant"].values[0].tolist() == [255] * 16
    assert np.array_equal(on["direction"].values, off["direction"].values)


def test_threshold_is_the_whole_gradients_not_a_chunks():
    """A chunk of tiny values inside a gradient with large ones: its elements are below the
    gradient's rounding level (eps * the largest finite |g| of the whole gradient), so none is
    significant, though each is large next to its own chunk's maximum; NaN and Inf set no
    threshold."""
    from probekit.grads.numerics.stats import CHUNK

    g = torch.full((2 * CHUNK + 10,), 1e-9)
    g[CHUNK:] = 1.0
    g[5] = 2 ** -19  # above 8 * eps32 * 1.0 = 2**-20
    g[CHUNK + 1] = float("nan")
    g[CHUNK + 2] = float("inf")
    lay = Layout(("w",), (g.numel(),), ((g.numel(),),))
    for path in ("numpy", "auto"):
        from probekit.grads.numerics import kernel

        kernel.set_path(path)
        try:
            out = compute([g], lay, "L1", (-1, 0, 1))
        finally:
            kernel.set_path("auto")
        bits = np.unpackbits(out.significant, count=g.numel())
        assert bits[:CHUNK].sum() == 1 and bits[5] == 1, path
        assert bits[CHUNK:].sum() == CHUNK + 10 - 1, path  # all but the NaN
        assert bits[CHUNK + 1] == 0 and bits[CHUNK + 2] == 1, path


def _reference_bits(grads, lay):
    """|g| > SIGNIFICANCE[bits] * eps * (the module's largest finite |g|), element by element."""
    from probekit.grads.numerics.stats import significance_unit

    amax = [float(g.abs()[torch.isfinite(g)].max()) for g in grads]
    scale = [max(a for a, m in zip(amax, lay.modules) if m == mod) for mod in lay.modules]
    out = []
    for g, sc in zip(grads, scale):
        thr = np.float32(significance_unit(g.dtype) * sc)
        out.append((np.abs(g.float().numpy()) > thr).astype(np.uint8))
    return out


def test_significance_bits_exact_whatever_the_provisional_threshold():
    """A chunk's bits are first packed against a provisional threshold (its own largest |g|,
    or the module's scale at the previous step) and mended once the module's scale is known:
    listed elements near the threshold set again (a chunk whose maximum is a little below the
    weight's), the chunk read again (a bias far below its weight's scale; a bf16 gradient,
    whose threshold sits among its values); each step's bits equal the definition, in every
    kernel path, with the probe's workspace carrying the scales from step to step."""
    from probekit.grads.numerics import kernel
    from probekit.grads.numerics.stats import CHUNK, Workspace

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2 * CHUNK + 100, generator=gen)
    w[CHUNK:] *= 0.7  # the second chunk's max is below the first's: its threshold moves up
    unit = 8 * 2 ** -23
    top = float(w[:CHUNK].abs().max())
    w[CHUNK + 10:CHUNK + 20] = torch.linspace(0.5, 2.0, 10) * unit * top  # near the threshold
    b = torch.randn(40, generator=gen) * 1e-6  # the bias: its own max far below the module's
    h = (torch.randn(5000, generator=gen) * 0.1).to(torch.bfloat16)
    h2 = (torch.randn(300, generator=gen) * 3).to(torch.bfloat16)
    grads = [w, b, h, h2]
    lay = Layout(("m.weight", "m.bias", "n.weight", "n.bias"), tuple(g.numel() for g in grads),
                 tuple(tuple(g.shape) for g in grads))
    want = _reference_bits(grads, lay)
    for path in ("numpy", "auto"):
        kernel.set_path(path)
        work = Workspace()
        try:
            for step in range(3):  # step 0: no previous scale; then the previous step's
                scaled = [g * (1.0 + 0.5 * step) for g in grads]  # the scales move each step
                out = compute(scaled, lay, "L1", (-1, 0, 1), scratch=work)
                ref = _reference_bits(scaled, lay)
                for i, (o, n) in enumerate(zip(lay.offsets, lay.numels)):
                    got = np.unpackbits(out.significant[o:o + -(-n // 8)], count=n)
                    assert np.array_equal(got, ref[i]), (path, step, lay.names[i])
        finally:
            work.close()
            kernel.set_path("auto")
    assert want[1].sum() == 0 and want[0][CHUNK + 10:CHUNK + 20].tolist() == [0] * 4 + [1] * 6
