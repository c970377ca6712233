"""The Zarr store (round trip, commit marker, lazy open) and the comparison (exact values)."""
import json
import os

import numpy as np
import pytest
import xarray as xr

from probekit.grads import GradCompareError, GradStoreError, compare_grads, first_divergence, open_grads
from probekit.grads.compare.compare import compare_rank, flags
from probekit.grads.numerics.stats import Layout, StepStats
from probekit.grads.store.store import GradWriter, read_commit


def step_stats(p, nbytes, seed, level="L2", n_int=4):
    rng = np.random.default_rng(seed)
    st = StepStats(present=np.ones(p, bool), max=rng.random(p), min=-rng.random(p),
                   norm=rng.random(p))
    if level != "L0":
        st.direction = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if level == "L2":
        st.zeros = rng.random(p)
        st.dist = rng.random((p, n_int))
    if level == "L0":
        st.hash = rng.integers(0, 256, (p, 16), dtype=np.uint8)
    return st


LAYOUT = Layout(("a.weight", "a.bias", "b"), (130, 3, 64), ((13, 10), (3,), (8, 8)))


def write_run(path, level="L2", steps=range(5), flush_every=2, layout=LAYOUT, seed0=0):
    w = GradWriter(str(path), 0, layout, level, (-1, 0, 1), "md5", flush_every)
    written = []
    for s in steps:
        st = step_stats(len(layout.names), layout.nbytes, seed0 + s, level)
        w.append(s, st)
        written.append(st)
    w.close()
    return written


def test_round_trip_exact(tmp_path):
    written = write_run(tmp_path, steps=[0, 1, 2, 3, 4])
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2, 3, 4]
    assert ds["param"].values.tolist() == ["a.weight", "a.bias", "b"]
    assert ds["numel"].values.tolist() == [130, 3, 64]
    assert ds["shape"].values.tolist() == ["(13, 10)", "(3,)", "(8, 8)"]
    assert ds["offset"].values.tolist() == [0, 24, 32]
    assert ds["interval"].values.tolist() == ["(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)"]
    for k in ("max", "min", "norm", "zeros"):
        assert np.array_equal(ds[k].values, np.stack([getattr(w, k) for w in written]))
    assert np.array_equal(ds["dist"].values, np.stack([w.dist for w in written]))
    assert np.array_equal(ds["direction"].values, np.stack([w.direction for w in written]))
    assert ds.attrs["level"] == "L2" and ds.attrs["bounds"] == [-1, 0, 1]
    assert ds.sizes["byte"] == LAYOUT.nbytes
    assert read_commit(str(tmp_path / "grads.zarr" / "rank0"))["steps"] == 5


def test_l0_hash_as_hex(tmp_path):
    written = write_run(tmp_path, level="L0", steps=[0, 1])
    ds = open_grads(tmp_path / "grads.zarr")
    assert "direction" not in ds and "dist" not in ds
    assert ds["hash"].values[1, 2] == written[1].hash[2].tobytes().hex()
    assert ds.attrs["hash_algorithm"] == "md5"


def test_lazy_open_equals_eager(tmp_path):
    write_run(tmp_path, steps=range(7), flush_every=3)
    eager = open_grads(tmp_path)
    lazy = open_grads(tmp_path, chunks="auto")
    assert type(lazy["direction"].data).__module__.startswith("dask")
    xr.testing.assert_identical(lazy.compute(), eager)


def test_reader_takes_only_committed_steps(tmp_path):
    write_run(tmp_path, steps=range(6), flush_every=2)
    group = tmp_path / "grads.zarr" / "rank0"
    # a writer that died after writing steps it never committed: marker says 4
    (group / "commit.json").write_text(json.dumps({"steps": 4}))
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2, 3]
    assert ds.attrs["committed_steps"] == 4


def test_store_errors(tmp_path):
    with pytest.raises(GradStoreError, match="holds no probekit grad store"):
        open_grads(tmp_path)
    write_run(tmp_path, steps=[0])
    os.remove(tmp_path / "grads.zarr" / "rank0" / "commit.json")
    with pytest.raises(GradStoreError, match="no commit.json; the recording died before"):
        open_grads(tmp_path)


def test_rank_selection(tmp_path):
    for r in (0, 1):
        GradWriter(str(tmp_path), r, LAYOUT, "L1", (-1, 0, 1), "md5", 4).close()
    with pytest.raises(GradStoreError, match=r"holds ranks \[0, 1\]; pass rank="):
        open_grads(tmp_path)
    assert open_grads(tmp_path, rank=1).attrs["rank"] == 1
    with pytest.raises(GradStoreError, match=r"rank: 5 is not valid .* accepted: \[0, 1\]"):
        open_grads(tmp_path, rank=5)


# -- comparison ----------------------------------------------------------------------------
def make_ds(directions, params=("w", "v"), numels=(70, 8), steps=None, present=None, rank=0):
    """A grad Dataset with given per-step sign bits (list of per-param bool arrays)."""
    from probekit.grads.numerics.stats import padded_nbytes

    sizes = [padded_nbytes(n) for n in numels]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rows = []
    for per_param in directions:
        row = np.zeros(sum(sizes), np.uint8)
        for j, bits in enumerate(per_param):
            packed = np.packbits(np.asarray(bits, bool))
            row[offsets[j]:offsets[j] + packed.size] = packed
        rows.append(row)
    s = len(directions)
    p = len(params)
    data = {"direction": (("step", "byte"), np.stack(rows)),
            "max": (("step", "param"), np.zeros((s, p)))}
    if present is not None:
        data["present"] = (("step", "param"), np.asarray(present, bool))
    return xr.Dataset(data, coords={"step": np.asarray(steps if steps is not None else range(s)),
                                    "param": list(params), "numel": ("param", list(numels)),
                                    "offset": ("param", offsets)},
                      attrs={"level": "L1", "rank": rank})


def flips(n, k):
    """n bools, all True except the first k."""
    v = np.ones(n, bool)
    v[:k] = False
    return v


def test_similarity_exact_and_total_weighted():
    a = make_ds([[flips(70, 0), flips(8, 0)]] * 3)
    b = make_ds([[flips(70, 0), flips(8, 0)], [flips(70, 7), flips(8, 2)],
                 [flips(70, 14), flips(8, 8)]])
    r = compare_grads(a, b)
    assert r["similarity"].sel(rank=0).values.tolist() == [[1.0, 1.0], [0.9, 0.75], [0.8, 0.0]]
    assert r["total"].sel(rank=0).values.tolist() == [1.0, 1 - 9 / 78, 1 - 22 / 78]
    assert r["differ"].sel(rank=0).values.tolist() == [[0, 0], [7, 2], [14, 8]]
    # step 1: w drops 0.1 > 0.03, v drops 0.25; step 2 both drop again
    assert r["flag"].sel(rank=0).values.tolist() == [[False, False], [True, True], [True, True]]
    assert r["first_step"].sel(rank=0).item() == 1
    assert r["first_param"].sel(rank=0).item() == "v"
    assert r.attrs["step0_threshold"] == 0.97


def test_flag_rule_boundaries():
    # exactly representable values: a drop equal to the threshold is not a flag
    sim = np.array([[1.0, 0.5], [0.75, 0.5], [0.4375, 0.5]])
    assert flags(sim, 0.75, 0.25).tolist() == [[False, True], [False, False], [True, False]]
    assert flags(np.array([[0.75]]), 0.75, 0.25).tolist() == [[False]]
    assert flags(np.array([[np.nan], [0.5]]), 0.97, 0.03).tolist() == [[False], [False]]


def test_param_order_and_extra_params_and_steps():
    w, v = flips(70, 35), flips(8, 4)
    a = make_ds([[w, v]] * 3, steps=[0, 1, 2])
    b = make_ds([[flips(8, 0), flips(70, 35), flips(5, 0)]] * 2, params=("v", "w", "extra"),
                numels=(8, 70, 5), steps=[1, 2])
    r = compare_grads(a, b).sel(rank=0)
    assert r["step"].values.tolist() == [1, 2]
    assert r["param"].values.tolist() == ["w", "v"]
    assert r["similarity"].values.tolist() == [[1.0, 0.5], [1.0, 0.5]]


def test_missing_gradient_gives_nan_not_a_flag():
    bits = [flips(70, 0), flips(8, 0)]
    a = make_ds([bits, bits], present=[[True, True], [True, False]])
    b = make_ds([bits, bits])
    r = compare_grads(a, b).sel(rank=0)
    assert np.isnan(r["similarity"].values[1, 1])
    assert r["differ"].values[1, 1] == -1
    assert r["total"].values.tolist() == [1.0, 1.0]
    assert not r["flag"].values.any()


def test_compare_errors():
    a = make_ds([[flips(70, 0), flips(8, 0)]], steps=[0])
    with pytest.raises(GradCompareError, match=r"share no step \(first: 0; second: 5\)"):
        compare_grads(a, make_ds([[flips(70, 0), flips(8, 0)]], steps=[5]))
    with pytest.raises(GradCompareError, match="share no parameter"):
        compare_grads(a, make_ds([[flips(70, 0)]], params=("x",), numels=(70,)))
    with pytest.raises(GradCompareError, match=r"shapes differ.*'w': 70 elements in the first run, 72 elements in the second"):
        compare_grads(a, make_ds([[flips(72, 0), flips(8, 0)]], numels=(72, 8)))
    l0 = a.drop_vars("direction").assign_attrs(level="L0")
    with pytest.raises(GradCompareError, match="grad_level 'L0', which keeps no direction"):
        compare_grads(l0, a)
    with pytest.raises(GradCompareError, match="share no rank"):
        compare_grads({0: a, 1: a}, {2: a, 3: a})


def test_one_dataset_each_pairs_whatever_rank_recorded_it():
    """A DDP run written by rank 1, an assembled sharded run, a single process: one Dataset
    each, compared parameter by parameter (labelled with the first run's rank)."""
    a = make_ds([[flips(70, 0), flips(8, 0)]], steps=[0])
    b = make_ds([[flips(70, 7), flips(8, 0)]], steps=[0], rank=1)
    cmp = compare_grads(a, b)
    assert cmp["rank"].values.tolist() == [0]
    assert cmp["similarity"].values.tolist() == [[[0.9, 1.0]]]
    several = compare_grads({0: a, 1: b}, {0: a, 1: b})  # ranks of several: r with r
    assert several["rank"].values.tolist() == [0, 1]
    assert np.all(several["similarity"].values == 1.0)


def test_compare_from_stores_in_blocks(tmp_path):
    """Through Zarr, lazily, with blocks smaller than the run: same as in memory."""
    write_run(tmp_path / "a", level="L1", steps=range(9), flush_every=4)
    write_run(tmp_path / "b", level="L1", steps=range(9), flush_every=3, seed0=100)
    a, b = open_grads(tmp_path / "a"), open_grads(tmp_path / "b")
    whole = compare_rank(a, b)
    blocked = compare_rank(open_grads(tmp_path / "a", chunks="auto"),
                           open_grads(tmp_path / "b", chunks="auto"), block_bytes=100)
    xr.testing.assert_identical(whole, blocked)
    # padding bits are random in this synthetic run, so the expected count covers each
    # parameter's whole padded byte range
    differ = np.zeros((9, 3), np.int64)
    for s in range(9):
        x = np.unpackbits(a["direction"].values[s] ^ b["direction"].values[s])
        for j, (o, nb) in enumerate(zip([0, 24, 32], [24, 8, 8])):
            differ[s, j] = x[o * 8:(o + nb) * 8].sum()
    assert whole["differ"].values.tolist() == differ.tolist()
    assert whole["similarity"].values.tolist() == (1 - differ / np.array([130, 3, 64])).tolist()


def test_first_divergence_total_only():
    r = xr.Dataset({"flag": (("step", "param"), np.zeros((2, 1), bool)),
                    "flag_total": (("step",), np.array([False, True])),
                    "similarity": (("step", "param"), np.ones((2, 1)))},
                   coords={"step": [3, 4], "param": ["w"]})
    assert first_divergence(r) == (4, "")


def test_lazy_direction_indexing(tmp_path):
    """The raw-chunk reader behind ``direction`` answers every kind of xarray selection."""
    written = write_run(tmp_path, level="L1", steps=range(7), flush_every=3)
    full = np.stack([w.direction for w in written])
    ds = open_grads(tmp_path)
    d = ds["direction"]
    assert np.array_equal(d.values, full)
    assert np.array_equal(d.isel(step=4).values, full[4])
    assert np.array_equal(d.isel(step=[5, 1, 6]).values, full[[5, 1, 6]])
    assert np.array_equal(d.isel(step=slice(2, 6), byte=slice(3, 30)).values, full[2:6, 3:30])
    assert np.array_equal(d.isel(byte=7).values, full[:, 7])
    assert np.array_equal(d.isel(step=3, byte=[0, 9, 2]).values, full[3, [0, 9, 2]])
    assert np.array_equal(d.sel(step=[0, 6]).values, full[[0, 6]])


@pytest.mark.parametrize("nbytes_param", [130, 70_000])
def test_raw_written_direction_is_valid_zarr(tmp_path, nbytes_param, monkeypatch):
    """Chunk files written directly read back identically through zarr itself, across flushes
    that end mid-chunk (the last, partial block of a run)."""
    import zarr

    from probekit.grads.store import store

    monkeypatch.setattr(store, "_TARGET_CHUNK_BYTES", 20_000)  # several chunks per row/step
    lay = Layout(("w", "v"), (nbytes_param, 64), ((nbytes_param,), (64,)))
    w = GradWriter(str(tmp_path), 0, lay, "L1", (-1, 0, 1), "md5", 3)
    written = []
    for s in range(7):
        st = step_stats(2, lay.nbytes, s, level="L1")
        written.append(st.direction)
        w.append(s, st)
        if s == 4:
            w.flush()  # a flush that ends inside a chunk of several steps
    w.close()
    group = zarr.open_group(str(tmp_path / "grads.zarr" / "rank0"), mode="r")
    assert np.array_equal(group["direction"][:], np.stack(written))
    assert np.array_equal(open_grads(tmp_path)["direction"].values, np.stack(written))


def test_arrays_written_by_another_zarr_writer_open_the_same(tmp_path):
    """Compressed arrays and a group without the layout attributes go through Zarr itself."""
    import zarr

    write_run(tmp_path, steps=range(5), flush_every=2)
    fast = open_grads(tmp_path)
    group = zarr.open_group(str(tmp_path / "grads.zarr" / "rank0"), mode="a")
    for name in ("max", "present", "param", "shape"):
        data, dims = group[name][...], group[name].metadata.dimension_names
        del group[name]
        arr = group.create_array(name, shape=data.shape, dtype=data.dtype if data.dtype.kind
                                 not in "UT" else str, dimension_names=dims)  # default: zstd
        arr[...] = data
    for key in ("params", "numels", "shapes", "offsets", "intervals"):
        del group.attrs[key]
    slow = open_grads(tmp_path)
    xr.testing.assert_identical(fast.drop_vars("direction"), slow.drop_vars("direction"))


def test_raw_bits_only_while_the_rows_are_as_opened(tmp_path):
    """The comparison reads sign bits straight from the chunk files only while a Dataset holds
    exactly what open_grads read; after any selection it uses the Dataset's own values."""
    from probekit.grads.store.chunks import raw_bits

    write_run(tmp_path / "a", steps=range(6), flush_every=4)
    write_run(tmp_path / "b", steps=range(6), flush_every=4, seed0=9)
    a, b = open_grads(tmp_path / "a"), open_grads(tmp_path / "b")
    assert raw_bits(a) is not None and raw_bits(a).shape == a["direction"].shape
    permuted = a.isel(step=[3, 1, 0, 5, 4, 2])
    assert raw_bits(permuted) is None and raw_bits(a.isel(byte=slice(0, 8))) is None
    assert raw_bits(a.isel(step=slice(None))) is not None
    whole = compare_rank(a, b)
    again = compare_rank(permuted, b).sortby("step")
    assert np.array_equal(whole["differ"].values, again["differ"].values)
