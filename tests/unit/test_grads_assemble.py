"""Shard groups (as ranks record them under DTensor sharding) assembled into full parameters:
exactly the Dataset one process records from the whole gradients; URL stores (memory://,
file://) read and written like folders."""
import numpy as np
import pytest
import torch
import xarray as xr

from probekit.grads import compare_grads, open_grads
from probekit.grads.numerics.stats import Layout, compute
from probekit.grads.store.store import GradWriter

BOUNDS = (-1, 0, 1)
#: name -> (global shape, [(rank, offset, local shape)]) ; None offset = a whole parameter
PARAMS = {
    "w": ((7, 10), [(0, (0, 0), (3, 10)), (1, (3, 0), (3, 10)), (2, (6, 0), (1, 10))]),
    "col": ((4, 6), [(0, (0, 0), (4, 3)), (1, (0, 3), (4, 3))]),   # Shard(1): column blocks
    "bias": ((3,), [(0, (0,), (1,)), (1, (1,), (1,)), (2, (2,), (1,)), (3, (3,), (0,))]),
    "whole": ((5,), [(0, None, (5,)), (1, None, (5,))]),           # recorded twice: one kept
}


def grads_at(step):
    gen = torch.Generator().manual_seed(step)
    out = {}
    for name, (shape, _) in PARAMS.items():
        g = torch.randn(*shape, generator=gen)
        g[torch.rand(*shape, generator=gen) < 0.2] = 0.0
        out[name] = g
    if step == 2:
        out["w"][5, 4] = float("nan")  # in rank 1's shard
    return out


def place(shape, offset, local):
    return None if offset is None else {
        "global_shape": list(shape), "offset": list(offset), "local_shape": list(local),
        "mesh_shape": [4], "mesh_coord": [0], "mesh_dims": [], "placements": ["S(0)"]}


def write_sharded(path, steps_per_rank, level="L2", significance=True, url=None):
    ranks = sorted({r for _, parts in PARAMS.values() for r, _, _ in parts})
    for r in ranks:
        entries = [(n, shape, off, local) for n, (shape, parts) in PARAMS.items()
                   for rr, off, local in parts if rr == r]
        layout = Layout(tuple(e[0] for e in entries),
                        tuple(int(np.prod(e[3], dtype=np.int64)) for e in entries),
                        tuple(tuple(e[3]) for e in entries))
        w = GradWriter(url or str(path), r, layout, level, BOUNDS, "md5", 2,
                       attrs={"placement": [place(e[1], e[2], e[3]) for e in entries]},
                       significance=significance)
        for step in range(steps_per_rank[r]):
            full = grads_at(step)
            local = []
            for name, shape, off, lshape in entries:
                g = full[name]
                if off is not None:
                    g = g[tuple(slice(o, o + s) for o, s in zip(off, lshape))]
                local.append(g.contiguous())
            w.append(step, compute(local, layout, level, BOUNDS, "md5", None, significance))
        w.close()


def write_single(path, steps, level="L2", significance=True):
    layout = Layout(tuple(PARAMS), tuple(int(np.prod(s)) for s, _ in PARAMS.values()),
                    tuple(s for s, _ in PARAMS.values()))
    w = GradWriter(str(path), 0, layout, level, BOUNDS, "md5", 2, significance=significance)
    for step in range(steps):
        full = grads_at(step)
        w.append(step, compute([full[n] for n in PARAMS], layout, level, BOUNDS, "md5", None,
                               significance))
    w.close()


def test_shards_assemble_into_the_single_process_dataset(tmp_path):
    write_sharded(tmp_path / "sharded", {0: 4, 1: 4, 2: 4, 3: 4})
    write_single(tmp_path / "single", 4)
    ds, ref = open_grads(tmp_path / "sharded"), open_grads(tmp_path / "single")
    assert ds.attrs["assembled_from"] == [0, 1, 2, 3] and ds.attrs["rank"] == 0
    for name in ("step", "param", "numel", "shape", "offset", "interval"):
        assert ds[name].values.tolist() == ref[name].values.tolist(), name
    for var in ("present", "max", "min", "zeros", "dist", "direction"):
        np.testing.assert_array_equal(ds[var].values, ref[var].values, err_msg=var)
    # norms: each shard's float32-accumulated sum of squares, summed in float64 (as the chunks
    # of one process's gradient are): float32 rounding apart, the float64 norm
    exact = np.array([[np.linalg.norm(grads_at(s)[n].double().numpy()) for n in PARAMS]
                      for s in range(4)])
    np.testing.assert_allclose(ds["norm"].values, exact, rtol=1e-6)
    np.testing.assert_allclose(ds["norm"].values, ref["norm"].values, rtol=1e-6)
    assert np.isnan(ds["max"].values[2, 0]) and np.isnan(ds["norm"].values[2, 0])  # the NaN
    assert ds["dist"].values[2, 0].sum() == pytest.approx(69 / 70)  # NaN in no interval
    # significance: each shard's own rounding level (max over its chunk, as in one process)
    assert ds["significant"].shape == ref["significant"].shape
    cmp = compare_grads(tmp_path / "sharded", tmp_path / "single")
    assert cmp["rank"].values.tolist() == [0]
    assert np.all(cmp["similarity"].values == 1.0)
    # blocks of one step (the assembly reads a block of steps at a time): same result
    from probekit.grads.compare.compare import compare_rank
    blocked = compare_rank(ds, ref, block_bytes=1)
    np.testing.assert_array_equal(blocked["differ"].values, cmp["differ"].values[0])
    # each rank's shards as recorded
    r1 = open_grads(tmp_path / "sharded", rank=1, shards=True)
    assert r1["param"].values.tolist() == ["w", "col", "bias", "whole"]
    assert r1["numel"].values.tolist() == [30, 12, 1, 5]
    with pytest.raises(Exception, match=r"accepted: \[0\] \(shards=True"):
        open_grads(tmp_path / "sharded", rank=1)


def test_steps_are_those_every_shard_holder_committed(tmp_path):
    write_sharded(tmp_path / "run", {0: 5, 1: 3, 2: 5, 3: 5})  # rank 1 died after 3 steps
    ds = open_grads(tmp_path / "run")
    assert ds["step"].values.tolist() == [0, 1, 2]
    assert open_grads(tmp_path / "run", rank=0, shards=True)["step"].values.tolist() == [
        0, 1, 2, 3, 4]
    write_single(tmp_path / "single", 3)
    np.testing.assert_array_equal(ds["direction"].values,
                                  open_grads(tmp_path / "single")["direction"].values)


def test_l0_hash_per_shard(tmp_path):
    write_sharded(tmp_path / "sharded", {0: 2, 1: 2, 2: 2, 3: 2}, level="L0")
    write_single(tmp_path / "single", 2, level="L0")
    ds, ref = open_grads(tmp_path / "sharded"), open_grads(tmp_path / "single")
    assert ds.attrs["hash_per_shard"] == ["w", "col", "bias"]
    assert ds["hash"].values[:, 3].tolist() == ref["hash"].values[:, 3].tolist()  # one piece
    assert ds["hash"].values[0, 0] != ref["hash"].values[0, 0]
    again = open_grads(tmp_path / "sharded")  # deterministic: same sharding, same digest
    assert ds["hash"].values.tolist() == again["hash"].values.tolist()
    np.testing.assert_array_equal(ds["max"].values, ref["max"].values)


def test_missing_shards_leave_the_ranks_as_recorded(tmp_path):
    """A rank filter that recorded rank 1 alone: nothing is whole, rank 1's shards are read."""
    write_sharded(tmp_path / "run", {0: 2, 1: 2, 2: 2, 3: 2})
    import shutil

    for r in (0, 2, 3):
        shutil.rmtree(tmp_path / "run" / "grads.zarr" / f"rank{r}")
    ds = open_grads(tmp_path / "run")
    assert ds.attrs["rank"] == 1 and ds["numel"].values.tolist() == [30, 12, 1, 5]


def test_memory_and_file_urls(tmp_path):
    import fsspec

    write_single(tmp_path / "single", 3)
    ref = open_grads(tmp_path / "single")
    mem = fsspec.filesystem("memory")
    mem.rm("/probekit-test", recursive=True) if mem.exists("/probekit-test") else None
    write_sharded(None, {0: 3, 1: 3, 2: 3, 3: 3}, url="memory://probekit-test/sharded")
    ds = open_grads("memory://probekit-test/sharded")
    np.testing.assert_array_equal(ds["direction"].values, ref["direction"].values)
    np.testing.assert_array_equal(ds["max"].values, ref["max"].values)
    lazy = open_grads("memory://probekit-test/sharded", rank=2, shards=True, chunks="auto")
    eager = open_grads("memory://probekit-test/sharded", rank=2, shards=True)
    xr.testing.assert_identical(lazy.compute(), eager)
    url = "file://" + str(tmp_path / "single")
    xr.testing.assert_identical(open_grads(url), ref)
    cmp = compare_grads("memory://probekit-test/sharded", url)
    assert np.all(cmp["similarity"].values == 1.0)
    assert not (tmp_path / "memory:").exists()
