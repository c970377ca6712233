"""The comparison as a dask graph: local threads by default, a dask.distributed LocalCluster
through ``client=`` or ``scheduler=`` (worker processes read the stores themselves), the CLI's
``--scheduler``; progress on stderr. Same numbers everywhere."""
import os
import sys

import numpy as np
import pytest
import xarray as xr

from probekit.grads import compare_grads
from probekit.grads.numerics.stats import Layout, StepStats
from probekit.grads.store.store import GradWriter

pytestmark = pytest.mark.slow

LAYOUT = Layout(("a.weight", "a.bias", "b"), (1300, 3, 640), ((130, 10), (3,), (64, 10)))


def write_runs(path, ranks, steps, seed):
    for r in range(ranks):
        w = GradWriter(str(path), r, LAYOUT, "L1", (-1, 0, 1), "md5", 4, significance=True)
        for s in range(steps):
            rng = np.random.default_rng([seed, r, s] if s < 3 else [0, r, s])  # 3+: same runs
            p = len(LAYOUT.names)
            w.append(s, StepStats(present=np.ones(p, bool), max=rng.random(p),
                                  min=-rng.random(p), norm=rng.random(p),
                                  direction=rng.integers(0, 256, LAYOUT.nbytes, np.uint8),
                                  significant=rng.integers(0, 256, LAYOUT.nbytes, np.uint8)))
        w.close()


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as lc, Client(lc) as client:
        yield lc, client


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    write_runs(base / "a", 6, 7, seed=1)
    write_runs(base / "b", 6, 7, seed=2)
    return base


def test_local_cluster_client_and_address_give_the_local_result(runs, cluster, capsys):
    lc, client = cluster
    local = compare_grads(runs / "a", runs / "b", task_bytes=LAYOUT.nbytes * 2)
    assert local["rank"].values.tolist() == list(range(6))
    assert local["step"].values.tolist() == list(range(7))
    assert np.all(local["similarity"].values[:, 3:] == 1.0)  # the runs agree from step 3
    # random bits before: about half equal (the 3-element bias: any share of 3)
    assert np.all(local["similarity"].values[:, :3, [0, 2]] < 0.6)
    on_client = compare_grads(runs / "a", runs / "b", task_bytes=LAYOUT.nbytes * 2,
                              client=client, progress=True)
    xr.testing.assert_identical(on_client, local)
    err = capsys.readouterr().err
    assert "[probekit] compare: " in err and "tasks" in err
    # the whole comparison ran on the workers: 2 tasks listing the runs' segments, 2 opening
    # their rank groups (a batch each), the plan, 2 taking each run's statistics from the
    # groups opened (the NaN/Inf check), then 6 rank pairs x 4 chunks of 2 steps
    assert err.rstrip().split("\r")[-1].startswith("[probekit] compare: 31/31 tasks")
    by_address = compare_grads(runs / "a", runs / "b", scheduler=lc.scheduler_address,
                               progress=False)
    xr.testing.assert_identical(by_address, local)
    assert capsys.readouterr().err == ""


def test_a_comparison_with_a_control_on_the_cluster(runs, cluster, tmp_path):
    """With a control, the plans of the test and the control are made in one stage and counted
    in one, the reference's bits read once for both (``counting.count_many``), on the workers
    too: the result is the local one."""
    write_runs(tmp_path / "c", 6, 7, seed=3)
    local = compare_grads(runs / "a", runs / "b", control=tmp_path / "c", progress=False)
    assert local.attrs["calibrated"] == 1 and local["rank"].values.tolist() == list(range(6))
    on_client = compare_grads(runs / "a", runs / "b", control=tmp_path / "c", progress=False,
                              client=cluster[1])
    xr.testing.assert_identical(on_client, local)


def test_sharded_runs_on_the_cluster(tmp_path, cluster):
    """Assembled sharded runs travel to worker processes (their bit readers pickle)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
    from test_grads_assemble import write_sharded, write_single

    write_sharded(tmp_path / "sharded", {0: 3, 1: 3, 2: 3, 3: 3})
    write_single(tmp_path / "single", 3)
    cmp = compare_grads(tmp_path / "sharded", tmp_path / "single", client=cluster[1])
    assert np.all(cmp["similarity"].values == 1.0)
    xr.testing.assert_identical(cmp, compare_grads(tmp_path / "sharded", tmp_path / "single"))


def test_cli_scheduler(runs, cluster, tmp_path, capsys):
    from probekit.cli import main

    lc, _ = cluster
    assert main(["grads", "compare", str(runs / "a"), str(runs / "b"), "-o",
                 str(tmp_path / "cmp"), "--plots", "none", "--scheduler",
                 lc.scheduler_address]) == 0
    assert "rank 5: 7 steps x 3 params compared" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "cmp")) == [f"rank{r}" for r in range(6)]
    assert main(["grads", "compare", str(runs / "a"), str(runs / "b"), "-o",
                 str(tmp_path / "cmp2"), "--scheduler", "tcp://127.0.0.1:9"]) == 2
    assert "scheduler: 'tcp://127.0.0.1:9' cannot be reached" in capsys.readouterr().err
