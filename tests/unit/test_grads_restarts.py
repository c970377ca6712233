"""A grad store over restarts: a resumed run continues the rank groups of its layout and
supersedes what earlier runs recorded from its start on; a run at another layout (world size)
records into a layout folder of the same store; the readers take each step from the segment the
rule gives it (``restarts.py``), old stores read as before."""
import json
import os

import numpy as np
import pytest
import torch

from probekit.grads import GradProbe, compare_grads, open_grads
from probekit.grads.store.restarts import plan_run, segments
from probekit.grads.numerics.stats import Layout, compute
from probekit.grads.store.live import LIVE
from probekit.grads.store.store import GradStoreError, GradWriter

SHAPES = [(6, 5), (7,)]
LAYOUT = Layout(("w", "b"), (30, 7), ((6, 5), (7,)))


def stats(seed, step, layout=LAYOUT, level="L2"):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    grads = [torch.randn(s, generator=gen) for s in layout.shapes]
    return compute(grads, layout, level, (-1, 0, 1), "md5", None, True)


def record(path, seed, steps, *, start=None, overwrite=False, flush_every=2, commit=True,
           layout=LAYOUT, rank=0, attrs=None, key=None, time_=None):
    """One run: steps ``steps`` with values of ``seed``; ``commit=False`` drops what a killed
    process had not committed (the writer is abandoned, not closed)."""
    w = GradWriter(str(path), rank, layout, "L2", (-1, 0, 1), "md5", flush_every,
                   significance=True, overwrite=overwrite, attrs=attrs, layout_key=key)
    steps = list(steps)
    first = steps[0] if start is None else start
    run = {"run": f"run{seed}", "time": time_ if time_ is not None else 1000.0 + seed,
           "start": first, "from": None if overwrite else first, "scope": "job"}
    w.begin(run)
    for s in steps:
        w.append(s, stats(seed, s, layout))
    if commit:
        w.close()
    else:  # a SIGKILL: what was handed over and committed stays; the rest is lost
        from probekit.grads.store.live import LIVE

        LIVE.wait(w, None)
        LIVE.remove(w)
    return w


def assert_values(ds, expected):
    """``expected``: [(step, seed)] in order."""
    assert ds["step"].values.tolist() == [s for s, _ in expected]
    for i, (s, seed) in enumerate(expected):
        ref = stats(seed, s)
        for name in ("max", "min", "norm", "dist", "direction", "significant"):
            assert np.array_equal(ds[name].values[i], getattr(ref, name)), (s, seed, name)


def test_a_resumed_run_continues_the_same_groups_and_supersedes_from_its_start(tmp_path):
    record(tmp_path, 1, range(8))  # steps 0..7, a checkpoint at 5
    record(tmp_path, 2, range(5, 10))  # resumed from the checkpoint: 5..9
    assert sorted(os.listdir(tmp_path / "grads.zarr")) == ["rank0", "zarr.json"]
    assert_values(open_grads(tmp_path), [(s, 1) for s in range(5)] + [(s, 2) for s in
                                                                      range(5, 10)])
    commit = json.loads((tmp_path / "grads.zarr" / "rank0" / "commit.json").read_text())
    assert [(r["run"], r["rows"], r["steps"]) for r in commit["runs"]] == [
        ("run1", [0, 5], [0, 4]), ("run2", [5, 10], [5, 9])]
    segs = segments(tmp_path)
    assert [(s.first_step, s.last_step, s.ranks) for s in segs] == [(0, 9, [0])]


def test_steps_a_killed_run_wrote_past_the_checkpoint_are_gone_even_if_not_recorded_again(
        tmp_path):
    record(tmp_path, 1, range(8))
    record(tmp_path, 2, range(5, 7), flush_every=1, commit=False)  # died after step 6
    ds = open_grads(tmp_path)
    # 7 of the first run is superseded (from 5 on); 6 was handed over but never committed
    assert ds["step"].values.tolist() in ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    assert_values(ds, [(s, 1) for s in range(5)] + [(s, 2) for s in
                                                    ds["step"].values.tolist()[5:]])


def test_a_run_that_died_before_its_first_commit_leaves_the_store_as_it_was(tmp_path):
    record(tmp_path, 1, range(8))
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L2", (-1, 0, 1), "md5", 2, significance=True)
    # created (as start() does) and killed before any step: nothing changes
    from probekit.grads.store.live import LIVE

    LIVE.remove(w)
    assert_values(open_grads(tmp_path), [(s, 1) for s in range(8)])


def place(offset, local, mesh):
    return {"global_shape": [6, 5], "offset": [offset, 0], "local_shape": [local, 5],
            "mesh_shape": [mesh], "mesh_coord": [0], "mesh_dims": [], "placements": ["S(0)"]}


def record_sharded(path, seed, steps, world, time_):
    """The weight ``w`` sharded by rows over ``world`` ranks, the bias whole on rank 0."""
    rows = [6 // world + (r < 6 % world) for r in range(world)]
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])
    for r in range(world):
        names = ("w", "b") if r == 0 else ("w",)
        lay = Layout(names, (rows[r] * 5, 7)[:len(names)], ((rows[r], 5), (7,))[:len(names)])
        attrs = {"placement": [place(int(offsets[r]), rows[r], world)] + [None] * (r == 0)}
        w = GradWriter(str(path), r, lay, "L2", (-1, 0, 1), "md5", 2, significance=True,
                       attrs=attrs, layout_key=f"world{world}")
        w.begin({"run": f"run{seed}", "time": time_, "start": steps[0], "from": steps[0],
                 "scope": "job"})
        for s in steps:
            gen = torch.Generator().manual_seed(seed * 1000 + s)
            full = [torch.randn(sh, generator=gen) for sh in LAYOUT.shapes]
            local = [full[0][offsets[r]:offsets[r] + rows[r]].contiguous()] + full[1:][:r == 0]
            # the significance scale of a shard is the whole gradient's (as amax_reducer gives)
            whole = torch.tensor([float(g.abs().max()) for g in full][:len(names)],
                                 dtype=torch.float64)
            st = compute(local, lay, "L2", (-1, 0, 1), "md5", None, True, lambda _: whole)
            w.append(s, st)
        w.close()


def test_an_elastic_restart_at_another_world_size_reads_as_one_run(tmp_path):
    """4 ranks record 0..7; the job resumes at 2 ranks from its checkpoint at step 5: the
    store's segments are 0..4 at 4 ranks (root) and 5..9 at 2 (a layout folder); open_grads
    assembles each and joins them, equal to one process's recording; compare works."""
    record_sharded(tmp_path / "run", 1, list(range(8)), 4, 1000.0)
    record_sharded(tmp_path / "run", 2, list(range(5, 10)), 2, 2000.0)
    record(tmp_path / "single", 1, range(5), flush_every=3)
    record(tmp_path / "single", 2, range(5, 10), flush_every=3)
    segs = segments(tmp_path / "run")
    assert [(s.first_step, s.last_step, s.ranks, s.sharded) for s in segs] == [
        (0, 4, [0, 1, 2, 3], True), (5, 9, [0, 1], True)]
    assert segs[0].folder.endswith("grads.zarr")
    assert os.path.basename(segs[1].folder) == "layout-world2"
    assert segs[1].placements[1] == [place(3, 3, 2)]
    ds, ref = open_grads(tmp_path / "run"), open_grads(tmp_path / "single")
    assert ds["step"].values.tolist() == list(range(10))
    for name in ("present", "max", "min", "zeros", "dist", "direction", "significant"):
        assert np.array_equal(ds[name].values, ref[name].values), name
    np.testing.assert_allclose(ds["norm"].values, ref["norm"].values, rtol=1e-15)
    assert json.loads(ds.attrs["segments"]) == [
        {"first_step": 0, "last_step": 4, "ranks": [0, 1, 2, 3]},
        {"first_step": 5, "last_step": 9, "ranks": [0, 1]}]
    cmp = compare_grads(tmp_path / "run", tmp_path / "single", progress=False)
    assert np.all(cmp["similarity"].values == 1.0)
    # one segment alone, and each rank's shards over all segments where they agree
    assert open_grads(tmp_path / "run", segment=1)["step"].values.tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(GradStoreError, match="segments record different parameters or shards"):
        open_grads(tmp_path / "run", rank=1, shards=True)
    assert open_grads(tmp_path / "run", rank=3, shards=True)["step"].values.tolist() == [
        0, 1, 2, 3, 4]


def test_a_later_rollback_supersedes_a_newer_layout(tmp_path):
    """Runs are ordered by when they began: 4 ranks 0..7, 2 ranks from 5 to 9, then 4 ranks
    again from a checkpoint at 3: 0..2 of the first, then the third (the second is gone)."""
    record_sharded(tmp_path, 1, list(range(8)), 4, 1000.0)
    record_sharded(tmp_path, 2, list(range(5, 10)), 2, 2000.0)
    record_sharded(tmp_path, 3, list(range(3, 6)), 4, 3000.0)
    assert [(s.first_step, s.last_step, s.ranks) for s in segments(tmp_path)] == [
        (0, 5, [0, 1, 2, 3])]
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == list(range(6))
    ref = {s: stats(1 if s < 3 else 3, s) for s in range(6)}
    assert np.array_equal(ds["direction"].values, np.stack([ref[s].direction for s in range(6)]))


def test_old_stores_read_and_continue_into_a_layout_folder(tmp_path):
    """A store written before runs were recorded (no ``runs``, no layout key) reads as before;
    a new run into it records into a layout folder and supersedes from its start."""
    record(tmp_path, 1, range(6))
    store = tmp_path / "grads.zarr"
    root = json.loads((store / "zarr.json").read_text())
    del root["attributes"]["layout_key"]
    (store / "zarr.json").write_text(json.dumps(root))
    group = json.loads((store / "rank0" / "zarr.json").read_text())
    del group["attributes"]["layout_key"]
    (store / "rank0" / "zarr.json").write_text(json.dumps(group))
    (store / "rank0" / "commit.json").write_text(json.dumps(
        {"steps": 6, "format": "probekit.grads/1", "last_step": 5}))
    assert_values(open_grads(tmp_path), [(s, 1) for s in range(6)])
    record(tmp_path, 2, range(4, 8))
    assert sorted(os.listdir(store))[0].startswith("layout-")
    assert_values(open_grads(tmp_path), [(s, 1) for s in range(4)] + [(s, 2) for s in
                                                                      range(4, 8)])


def test_a_store_of_segments_is_valid_zarr(tmp_path):
    import xarray as xr
    import zarr

    record_sharded(tmp_path, 1, list(range(4)), 4, 1000.0)
    record_sharded(tmp_path, 2, list(range(2, 6)), 2, 2000.0)
    root = zarr.open_group(str(tmp_path / "grads.zarr"), mode="r")
    assert sorted(root.group_keys()) == ["layout-world2", "rank0", "rank1", "rank2", "rank3"]
    ds = xr.open_zarr(str(tmp_path / "grads.zarr" / "layout-world2" / "rank1"),
                      consolidated=False)
    assert ds["step"].values.tolist() == [2, 3, 4, 5]
    assert ds["direction"].shape[0] == 4


# -- the probe's side: where a run starts, and what it may replace ---------------------------
def train(path, opt_cls, steps, model=None, opt=None, **options):
    torch.manual_seed(0)
    model = model or torch.nn.Linear(4, 3)
    opt = opt or opt_cls(model.parameters(), lr=0.1)
    probe = GradProbe(model, optimizer=opt, dump_path=str(path), flush_every=2, **options)
    probe.start()
    try:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    finally:
        probe.stop()
    return model, opt


def test_the_probe_takes_its_first_step_from_the_optimizer_or_start_step(tmp_path, caplog):
    model, opt = train(tmp_path, torch.optim.AdamW, 6)
    for st in opt.state.values():  # a checkpoint of step 4 loaded into the optimizer
        st["step"] = torch.tensor(4.0)
    with caplog.at_level("INFO", logger="probekit"):
        train(tmp_path, None, 3, model, opt)   # a restart: the optimizer's state says so
    assert open_grads(tmp_path)["step"].values.tolist() == list(range(7))
    assert ("holds steps 0..5; this run (a restart: AdamW's state is at step 4 (resumed)) "
            "records from step 4") in caplog.text
    assert "steps 4..5 recorded before are superseded" in caplog.text
    train(tmp_path, torch.optim.SGD, 2, start_step=9)
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 10]


def test_a_new_store_numbers_steps_from_the_start_of_the_recording(tmp_path):
    model, opt = train(tmp_path / "warmup", torch.optim.Adam, 3)  # the optimizer is at step 3
    train(tmp_path / "new", None, 2, model, opt)
    assert open_grads(tmp_path / "new")["step"].values.tolist() == [0, 1]  # msprobe's numbering


def _values(path):
    ds = open_grads(path)
    return ds["step"].values.tolist(), ds["norm"].values.copy()


def test_a_run_that_is_not_a_restart_replaces_a_store_that_ended_cleanly(tmp_path, caplog):
    """Run the same thing twice: the second run replaces the first (one line says so), so the
    store, its files and its values are the first run's (issue 36)."""
    train(tmp_path, torch.optim.SGD, 3)
    steps, norms = _values(tmp_path)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    with caplog.at_level("INFO", logger="probekit"):
        train(tmp_path, torch.optim.SGD, 3)          # the same run again: not a restart
    assert ("held steps 0..2 of a run that ended cleanly; this run is not a restart, so it "
            "replaces them (resume=True continues a store)") in caplog.text
    again, norms2 = _values(tmp_path)
    assert again == steps == [0, 1, 2] and np.array_equal(norms, norms2)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == files
    train(tmp_path, torch.optim.Adam, 2)             # a fresh Adam (step 0): replaces too
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1]


def test_resume_continues_a_store(tmp_path, caplog):
    train(tmp_path, torch.optim.SGD, 3)
    with caplog.at_level("INFO", logger="probekit"):
        train(tmp_path, torch.optim.SGD, 2, resume=True)  # SGD keeps no step count
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1, 2, 3, 4]
    assert "pass start_step= to say where the checkpoint resumes" in caplog.text
    with pytest.raises(GradStoreError, match=r"holds steps 0\.\.4, and this run starts at step "
                                             r"0 .*Pass overwrite=True"):
        train(tmp_path, torch.optim.Adam, 2, resume=True)  # a fresh optimizer: step 0
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1, 2, 3, 4]  # untouched
    with pytest.raises(GradStoreError, match="would replace every one"):
        plan_run(str(tmp_path), start=0)
    assert plan_run(str(tmp_path), start=1)["from"] == 1


def test_a_crashed_run_is_not_replaced_silently(tmp_path, monkeypatch):
    """A run that ended on an exception is crash evidence: a run that is not a restart is
    refused, naming resume=True and overwrite=True; either then works."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        with GradProbe(model, optimizer=opt, dump_path=str(tmp_path), flush_every=1):
            for step in range(3):
                opt.zero_grad()
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
            raise RuntimeError("boom")
    commit = json.loads((tmp_path / "grads.zarr" / "rank0" / "commit.json").read_text())
    assert commit["runs"][-1]["closed"] is False
    with pytest.raises(GradStoreError, match=r"holds steps 0\.\.2, and its last run \(begun "
                       r".*\) did not end cleanly: it crashed, was killed, or is still running"
                       r".*Pass resume=True to continue that recording, overwrite=True to "
                       r"replace it"):
        train(tmp_path, torch.optim.SGD, 2)
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1, 2]    # untouched
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")                # an elastic restart
    train(tmp_path, torch.optim.SGD, 1)
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1, 2, 3]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    train(tmp_path, torch.optim.SGD, 2)           # that restart ended cleanly: replaced
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1]


def test_a_cell_run_again_replaces_the_recording_its_unstopped_probe_left_open(tmp_path,
                                                                             caplog):
    """A notebook cell run twice, its probe started and never stopped (msprobe's loop records
    until ``close()``): the second run is a re-run, not a crash. The first probe is stopped (its
    hooks gone, its steps written, its run ended cleanly) and the second replaces its recording,
    value for value; a probe into another store is left running."""
    def cell(path, steps=3):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = GradProbe(model, optimizer=opt, dump_path=str(path)).start()
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        return probe, opt

    other, _ = cell(tmp_path / "other")
    first, opt1 = cell(tmp_path / "run")
    steps, norms = _values(tmp_path / "run")
    with caplog.at_level("INFO", logger="probekit"):
        second, _ = cell(tmp_path / "run")
    assert "a probe of this process was still recording into" in caplog.text
    assert "held steps 0..2 of a run that ended cleanly" in caplog.text
    assert not first.active and second.active and other.active
    again, norms2 = _values(tmp_path / "run")
    assert again == steps == [0, 1, 2] and np.array_equal(norms, norms2)
    opt1.step()                                  # the first probe's optimizer: no hook left
    assert _values(tmp_path / "run")[0] == [0, 1, 2]
    second.stop()
    other.stop()


def test_overwrite_replaces_a_crashed_store(tmp_path):
    record(tmp_path, 1, range(4), commit=False)    # killed: never closed
    with pytest.raises(GradStoreError, match="did not end cleanly"):
        train(tmp_path, torch.optim.SGD, 2)
    train(tmp_path, torch.optim.SGD, 2, overwrite=True)
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["grads.zarr"]     # nothing left aside


def test_a_replacement_is_seen_whole_or_not_at_all(tmp_path):
    """Until the replacing run commits its first step the old store is what readers read (it
    waits aside); a replacing run that dies before that leaves it, and the next run puts it
    back; once the replacement commits, the old store is deleted."""
    from probekit.grads.store.live import LIVE
    from probekit.grads.store.restarts import ASIDE

    record(tmp_path, 1, range(4))                  # a clean run (closed)
    before = open_grads(tmp_path)["step"].values.tolist()
    run = plan_run(str(tmp_path), rank=0)          # not a restart: replace
    assert run["from"] == 0 and run["replaced"] == [0, 3] and run["by"] == 0
    assert (tmp_path / ASIDE).is_dir() and not (tmp_path / "grads.zarr").exists()
    assert open_grads(tmp_path)["step"].values.tolist() == before     # the old store, aside
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L2", (-1, 0, 1), "md5", 2, significance=True)
    w.begin(run)
    w.append(0, stats(2, 0))                       # handed over, not committed: killed
    LIVE.wait(w, None)
    LIVE.remove(w)
    assert_values(open_grads(tmp_path), [(s, 1) for s in range(4)])   # still the old one
    assert (tmp_path / ASIDE).is_dir()
    run = plan_run(str(tmp_path), rank=0, restart=True, why_restart="resume=True")
    assert run["start"] == 4 and not (tmp_path / ASIDE).exists()     # put back, continued
    assert_values(open_grads(tmp_path), [(s, 1) for s in range(4)])
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L2", (-1, 0, 1), "md5", 1, significance=True)
    w.begin(plan_run(str(tmp_path), rank=0))       # replaces again, and commits this time
    assert (tmp_path / ASIDE).is_dir()
    w.append(0, stats(3, 0))
    w.append(1, stats(3, 1))
    w.close()
    assert not (tmp_path / ASIDE).exists()
    assert_values(open_grads(tmp_path), [(0, 3), (1, 3)])
    commit = json.loads((tmp_path / "grads.zarr" / "rank0" / "commit.json").read_text())
    assert len(commit["runs"]) == 1 and commit["runs"][0]["closed"] is True


def test_overwrite_at_another_layout_removes_this_ranks_older_groups(tmp_path):
    record(tmp_path, 1, range(4))
    lay = Layout(("w",), (30,), ((6, 5),))
    w = GradWriter(str(tmp_path), 0, lay, "L2", (-1, 0, 1), "md5", 2, significance=True,
                   overwrite=True)
    w.append(0, stats(2, 0, lay))
    w.close()
    store = tmp_path / "grads.zarr"
    assert not (store / "rank0").exists()  # superseded, then removed
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0] and ds["param"].values.tolist() == ["w"]


def test_continuing_a_group_of_another_layout_is_refused(tmp_path):
    record(tmp_path, 1, range(3), key="k")
    other = Layout(("w", "b"), (30, 6), ((6, 5), (6,)))
    w = GradWriter(str(tmp_path), 0, other, "L2", (-1, 0, 1), "md5", 2, significance=True,
                   layout_key="k")
    with pytest.raises(GradStoreError, match=r"another layout \(differs in: params|numels"):
        w.begin({"run": "r2", "time": 5000.0, "start": 3, "from": 3, "scope": "job"})
    # a refused writer is no longer live: no SIGTERM handler or timer kept for it
    assert id(w) not in LIVE.writers
    w.close(clean=False)  # and closing it after is harmless
    # nothing of the refused run reached the store: the old run's 3 steps as they were
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1, 2]


def test_the_options_are_validated():
    from probekit.config import ConfigError, make_config

    cfg = make_config("grad_probe", start_step=7, overwrite=True, durable=True)
    assert (cfg.grad_probe.start_step, cfg.grad_probe.overwrite, cfg.grad_probe.durable) == (
        7, True, True)
    with pytest.raises(ConfigError, match=r"grad_probe\.start_step.*-1.*an integer >= 0"):
        make_config("grad_probe", start_step=-1)
    with pytest.raises(ConfigError, match=r"grad_probe\.durable"):
        make_config("grad_probe", durable="yes")
    assert make_config("grad_probe", resume=True).grad_probe.resume is True
    with pytest.raises(ConfigError, match=r"grad_probe\.resume and grad_probe\.overwrite: both"):
        make_config("grad_probe", resume=True, overwrite=True)
