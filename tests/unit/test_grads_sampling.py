"""Sampled sign bits (grad_probe.sample, sampling.py): the sample is a function of (global
shape, global index), the same in every layout; statistics stay exact; the intervals."""
import itertools
import math

import numpy as np
import pytest
import torch
import xarray as xr

import sharded_stores as S
from probekit import ConfigError, make_config
from probekit.grads import compare_grads, open_grads
from probekit.grads.numerics import sampling
from probekit.grads.numerics.stats import Layout, compute


def test_the_sample_is_stratified_and_fixed_by_shape():
    shape, k = (37, 29), 100
    g = sampling.chosen(shape, k, np.arange(k))
    n = math.prod(shape)
    lo = (np.arange(k) * n) // k
    hi = (np.arange(1, k + 1) * n) // k
    assert np.all((g >= lo) & (g < hi))  # one element in each stratum
    assert np.array_equal(g, sampling.chosen(shape, k, np.arange(k)))  # no random stream
    assert not np.array_equal(g, sampling.chosen((29, 37), k, np.arange(k)))  # seeded by shape
    assert sampling.sample_size(n, k) == k and sampling.sample_size(50, k) == 50
    assert np.array_equal(sampling.chosen((50,), k, np.arange(50)), np.arange(50))  # all
    # pinned: a change of the hash would change which elements every store records, so
    # stores written before and after would no longer compare
    assert sampling.chosen((1000,), 10, np.arange(10)).tolist() == [
        94, 174, 201, 393, 461, 562, 633, 736, 853, 983]


def test_samples_in_any_box_are_the_global_samples_inside_it():
    rng = np.random.default_rng(0)
    for _ in range(300):
        shape = tuple(int(x) for x in rng.integers(1, 9, rng.integers(1, 4)))
        n = math.prod(shape)
        k = int(rng.integers(1, n + 3))
        glob = sampling.chosen(shape, k, np.arange(sampling.sample_size(n, k)))
        off = [int(rng.integers(0, s)) for s in shape]
        ext = [int(rng.integers(0, s - o + 1)) for s, o in zip(shape, off)]
        box = [int(np.ravel_multi_index(b, shape)) for b in
               itertools.product(*[range(o, o + e) for o, e in zip(off, ext)])]
        where = {g: p for p, g in enumerate(box)}
        want = [(i, where[int(g)]) for i, g in enumerate(glob) if int(g) in where]
        i, pos = sampling.samples_in_box(shape, k, off, ext)
        assert list(zip(i.tolist(), pos.tolist())) == want
        run = sampling.sample_run(shape, k, off, ext)
        if run is not None:
            assert list(range(run[0], run[0] + run[1])) == [w[0] for w in want]


@pytest.mark.parametrize("device_path", [False, True])
def test_compute_records_the_sampled_elements_bits(device_path):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(40, 30, generator=gen), torch.randn(7, generator=gen),
             torch.randn(300, generator=gen).to(torch.bfloat16)]
    grads[0][3, 4] = float("nan")
    k = 50
    pos = [sampling.chosen(tuple(g.shape), k, np.arange(k)) if g.numel() > k else None
           for g in grads]
    layout = Layout(("a.w", "a.b", "c"), tuple(g.numel() for g in grads),
                    tuple(tuple(g.shape) for g in grads),
                    tuple(k if p is not None else g.numel() for p, g in zip(pos, grads)))
    full_layout = Layout(layout.names, layout.numels, layout.shapes)
    got = compute(grads, layout, "L2", (-1, 0, 1), sample=pos, _device_path=device_path)
    full = compute(grads, full_layout, "L2", (-1, 0, 1), _device_path=device_path)
    for name in ("max", "min", "norm", "zeros", "dist", "present"):
        np.testing.assert_array_equal(getattr(got, name), getattr(full, name), err_msg=name)
    for j, p in enumerate(pos):
        n = layout.bits[j]
        o, fo = layout.offsets[j], full_layout.offsets[j]
        for var in ("direction", "significant"):
            bits = np.unpackbits(getattr(got, var)[o:o + (n + 7) // 8])[:n]
            every = np.unpackbits(getattr(full, var)[fo:fo + (grads[j].numel() + 7) // 8])
            want = every[:grads[j].numel()] if p is None else every[p]
            np.testing.assert_array_equal(bits, want, err_msg=f"{var} {j}")
        pad = np.unpackbits(got.significant[o:o + 8 * -(-n // 64)])[n:]
        assert pad.all()  # padding bits of the significance are ones


def test_sample_config_key():
    assert make_config("grad_probe", sample=65536).grad_probe.sample == 65536
    assert make_config("grad_probe").grad_probe.sample == 0
    with pytest.raises(ConfigError, match=r"grad_probe.sample: -1 is not valid.*integer >= 0"):
        make_config("grad_probe", sample=-1)


def test_wilson_interval():
    low, high = sampling.wilson(50, 100, 10**12)  # practically an infinite population
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    low2, high2 = sampling.wilson(50, 100, 200)  # half the population: narrower
    assert low < low2 < 0.5 < high2 < high
    assert sampling.wilson(37, 100, 100) == (0.37, 0.37)  # the whole population: exact
    low, high = sampling.wilson(100, 100, 10**6)  # all equal in the sample: not certain
    assert low == pytest.approx(0.963, abs=1e-3) and high == 1.0
    assert np.isnan(sampling.wilson(0, 0, 10)[0])


PARAMS = {"emb": (130, 6), "w": (70, 10), "conv": (60, 3, 2, 2), "b": (5,), "s": ()}
LAYOUTS = {"single": S.single(PARAMS), "fsdp3": S.fsdp(PARAMS, 3),
           "tp2": S.tensor_parallel(PARAMS, 2), "mesh2x2": S.mesh2d(PARAMS, 2, 2)}


def test_every_layout_records_the_same_sample(tmp_path):
    """Shards record their part of the whole parameter's sample: every layout's comparison is
    the single process's, range by range (FSDP2) or assembled (column blocks); a run that
    recorded every element is sampled to meet a sampled one."""
    for name, layout in LAYOUTS.items():
        S.write(tmp_path / f"{name}_a", PARAMS, layout, 3, seed=0, sample=50)
        S.write(tmp_path / f"{name}_b", PARAMS, layout, 3, seed=1, noise=0.4, sample=50)
    S.write(tmp_path / "full_b", PARAMS, S.single(PARAMS), 3, seed=1, noise=0.4)
    ref = compare_grads(tmp_path / "single_a", tmp_path / "single_b", progress=False)
    assert ref["sampled"].values.tolist() == [50, 50, 50, 5, 1]
    assert ref.attrs["sample"] == 50 and ref.attrs["confidence"] == 0.95
    assert 0.5 < float(ref["similarity"].min()) < 1.0
    lo, hi = ref["similarity_low"].values, ref["similarity_high"].values
    assert np.all(lo[..., :3] < hi[..., :3]) and np.array_equal(lo[..., 3:], hi[..., 3:])
    for first, second in itertools.product(LAYOUTS, LAYOUTS):
        got = compare_grads(tmp_path / f"{first}_a", tmp_path / f"{second}_b", progress=False)
        xr.testing.assert_identical(got, ref)
    xr.testing.assert_identical(
        compare_grads(tmp_path / "fsdp3_a", tmp_path / "full_b", progress=False), ref)
    S.write(tmp_path / "other_k", PARAMS, S.single(PARAMS), 3, sample=40)
    with pytest.raises(Exception, match="sampled their sign bits differently.*50 vs 40"):
        compare_grads(tmp_path / "single_a", tmp_path / "other_k", progress=False)
    ds = open_grads(tmp_path / "fsdp3_a")  # assembled: the whole sample of each parameter
    assert ds["nbits"].values.tolist() == [50, 50, 50, 5, 1]
    assert ds["numel"].values.tolist() == [780, 700, 720, 5, 1]


def test_sampled_runs_refuse_what_needs_every_element(tmp_path):
    """msprobe's layout (a sign per element) and a transposed weight (its sample was chosen in
    the other layout) cannot be made from a sample: errors naming why."""
    from probekit.errors import MsprobeDumpError
    from probekit.grads.store.msprobe import write_rank
    from probekit.mindspore.align import AlignError, align_rank

    params = {"w": (30, 20), "b": (20,)}
    S.write(tmp_path / "s", params, S.single(params), 2, sample=64)
    ds = open_grads(tmp_path / "s")
    with pytest.raises(MsprobeDumpError, match="grad_probe.sample 64.*every element's"):
        write_rank(ds, str(tmp_path / "out"))
    ported = ds.assign_coords(shape=("param", ["(20, 30)", "(20,)"]))
    with pytest.raises(AlignError, match=r"\['w'\]: transposed, and the run recorded a sample"):
        align_rank(ds, ported)


def test_a_store_holds_one_sample_across_restarts(tmp_path):
    """A restart continues a sampled store only with the same ``grad_probe.sample``: another
    sample (or every element) is refused, whether its groups would continue the store's
    (``sample`` is a layout attribute of a group) or go to a layout folder of their own (a
    restart at another world size: ``plan_run`` reads the store's segments); ``overwrite=True``
    replaces the recording."""
    from probekit.grads import GradProbe, GradStoreError
    from probekit.grads.store.restarts import plan_run

    def run(sample, start=None, overwrite=False, steps=3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = GradProbe(model, optimizer=opt, grad_level="L1", dump_path=str(tmp_path),
                          sample=sample, start_step=start, overwrite=overwrite).start()
        try:
            for _ in range(steps):
                opt.zero_grad()
                model(torch.randn(4, 8)).square().sum().backward()
                opt.step()
        finally:
            probe.stop()

    run(16)
    run(16, start=3)  # the same sample: continued
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == list(range(6)) and ds.attrs["sample"] == 16
    assert ds["nbits"].values.tolist() == [16, 6, 12, 2]
    for other in (32, 0):
        with pytest.raises(GradStoreError, match="differs in: sample|one store holds one sample"):
            run(other, start=6)
    assert open_grads(tmp_path)["step"].values.tolist() == list(range(6))  # untouched
    # a restart at another world size records into a layout folder of its own: plan_run
    # refuses it before a step is recorded
    with pytest.raises(GradStoreError, match=r"holds steps 0\.\.5 recorded with "
                                             r"grad_probe\.sample 16, and this run records "
                                             r"grad_probe\.sample 32: one store holds one"):
        plan_run(str(tmp_path), start=6, sample=32)
    with pytest.raises(GradStoreError, match="every element's bits"):
        plan_run(str(tmp_path), start=6, sample=0)
    assert plan_run(str(tmp_path), start=6, sample=16)["start"] == 6
    # overwrite: another sample is accepted (the store waits aside until a step is committed)
    assert plan_run(str(tmp_path), sample=32, overwrite=True)["start"] == 0
    run(32, overwrite=True, steps=2)  # replaced, as asked
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1] and ds.attrs["sample"] == 32
