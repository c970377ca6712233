"""What a comparison's verdict reads of each run (``sources.load_stats``, ``verdict._stats``):
straight from a store's chunk files the same values ``load_runs`` gives, and pipeline stages
read as one run over the steps they all hold."""
import warnings

import numpy as np
import pytest
import torch
import xarray as xr

from probekit.grads import GradProbe, compare_grads
from probekit.grads.compare.verdict import _nanmedian1, _stats
from probekit.grads.store.sources import load_runs, load_stats, stat_table


def _record(path, control=None, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model[2].bias.requires_grad_(False)          # never a gradient: present is False
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with GradProbe(model, dump_path=str(path), control=control):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
    return str(path)


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for r in a:
        x, y = a[r], b[r]
        assert x["param"] == y["param"]
        for k in ("step", "norm", "max", "min", "present"):
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k], equal_nan=True), k
        assert x["attrs"].get("control") == y["attrs"].get("control")


def test_a_store_is_read_straight_as_load_runs_reads_it(tmp_path):
    path = _record(tmp_path / "run", control="bf16")
    fast = load_stats(path)
    slow = {r: stat_table(ds) for r, ds in load_runs(path).items()}
    _same(fast, slow)
    t = fast[0]
    assert t["step"].tolist() == [0, 1, 2, 3]
    assert t["param"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert t["present"][:, 3].tolist() == [False] * 4 and t["present"][:, :3].all()
    assert t["attrs"]["control"] == "bf16" and t["attrs"]["rank"] == 0
    assert (t["max"][:, :3] >= t["min"][:, :3]).all() and (t["norm"][:, :3] > 0).all()
    assert np.isnan(t["norm"][:, 3]).all()
    # handed over as Datasets, or as tables: the same tables; tables pass through as they are
    _same(load_stats(load_runs(path)), slow)
    assert load_stats(fast) is fast


def test_a_verdict_from_the_store_equals_one_from_its_datasets(tmp_path):
    ref = _record(tmp_path / "ref")
    test = _record(tmp_path / "test")
    ctrl = _record(tmp_path / "ctrl", control="bf16")
    from_stores = compare_grads(ref, test, control=ctrl, progress=False)
    from_datasets = compare_grads(*(load_runs(x) for x in (ref, test)),
                                  control=load_runs(ctrl), progress=False)
    for k in ("flag", "excess", "norm_ratio", "norm_dev", "norm_allowed", "range_dev",
              "similarity_band", "controlled"):
        assert np.array_equal(from_stores[k].values, from_datasets[k].values, equal_nan=True), k
    assert from_stores.attrs["control"] == "bf16"
    assert str(from_stores).splitlines()[0] == str(from_datasets).splitlines()[0]


def _table(params, steps, norm, rank):
    norm = np.asarray(norm, np.float64)
    return {"step": np.asarray(steps, np.int64), "param": list(params), "norm": norm,
            "max": norm * 2, "min": -norm, "present": None, "attrs": {"rank": rank}}


def test_pipeline_stages_are_one_run_over_the_steps_they_all_hold():
    # stage 0 holds a and b at steps 0-3, stage 1 holds c at steps 1-3: rank 0 compared over
    # all three takes c from stage 1, and only at the steps both stages hold
    s0 = _table(["a", "b"], [0, 1, 2, 3], [[1, 2], [3, 4], [5, 6], [7, 8]], 0)
    s1 = _table(["c"], [1, 2, 3], [[10], [20], [30]], 1)
    result = xr.Dataset(coords={"rank": [0, 1], "step": [0, 1, 2, 3],
                                "param": ["a", "b", "c"]})
    got = _stats({0: s0, 1: s1}, result)
    nan = np.nan
    assert np.array_equal(got["norm"][0], [[nan, nan, nan], [3, 4, 10], [5, 6, 20],
                                           [7, 8, 30]], equal_nan=True)
    assert np.array_equal(got["range"][0], 3 * got["norm"][0], equal_nan=True)
    # rank 1 over the same parameters: its own c; a and b from stage 0, steps 1-3 again
    assert np.array_equal(got["norm"][1], got["norm"][0], equal_nan=True)
    # one table pairs with every rank; a missing rank stays NaN
    one = _stats({0: s0}, result.sel(param=["a", "b"]))
    assert np.array_equal(one["norm"][1], s0["norm"])
    only = _stats({0: s0, 5: s1}, result.sel(rank=[1], param=["a"]))
    assert np.isnan(only["norm"]).all()


def test_nanmedian_over_steps_is_numpys_bit_for_bit():
    rng = np.random.default_rng(0)
    for _ in range(200):
        shape = tuple(int(x) for x in rng.integers(1, 12, 3))
        x = np.abs(rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape))
        u = rng.random(shape)
        x[u < 0.4 * rng.random()] = np.nan
        x[u > 0.97] = np.inf
        x[(u > 0.9) & (u < 0.93)] = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")    # numpy's all-NaN slice warning
            want = np.nanmedian(x, axis=1, keepdims=True)
        assert _nanmedian1(x).tobytes() == want.tobytes()
    assert np.isnan(_nanmedian1(np.full((1, 3, 2), np.nan))).all()
    assert _nanmedian1(np.array([[[1.0], [np.nan], [4.0], [2.0]]])).item() == 2.0
    assert _nanmedian1(np.array([[[1.0], [3.0], [np.nan], [8.0], [2.0]]])).item() == 2.5


def test_the_comparison_takes_the_statistics_from_the_groups_it_opened(tmp_path, monkeypatch):
    from probekit.grads.compare.compare import plan_stages
    from probekit.grads.compare.engine import Session
    from probekit.grads.compare.opening import store_of
    from probekit.grads.store import sources

    runs = [_record(tmp_path / n, control="bf16" if n == "ctrl" else None)
            for n in ("ref", "test", "ctrl")]
    with Session(progress=False) as session:
        handles, tables = plan_stages([store_of(p) for p in runs], session=session, stats=True)
    assert len(handles) == 2 and len(tables) == 3
    for path, table in zip(runs, tables):
        _same(table, load_stats(path))
    read = []
    real = sources._plain_stats
    monkeypatch.setattr(sources, "_plain_stats", lambda *a: read.append(a) or real(*a))
    cmp = compare_grads(runs[0], runs[1], control=runs[2], progress=False)
    assert read == [] and cmp.attrs["control"] == "bf16"
    # one store against the reference (the other run handed over as Datasets, whose tables
    # come from them): no joint graph, the two stores' statistics read straight
    compare_grads(runs[0], runs[1], control=load_runs(runs[2]), progress=False)
    assert len(read) == 2
    compare_grads(runs[0], load_runs(runs[1]), control=runs[2], progress=False)
    assert len(read) == 4
