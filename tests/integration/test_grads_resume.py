"""Restarts under torchrun (gloo, CPU): an FSDP2 job killed at 4 ranks and resumed from its
checkpoint at 2 ranks (or at 4 again) continues the same store, and reads as the store of the
job that was never interrupted; SIGKILL at any moment of a resumed run leaves exactly the
committed steps."""
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import xarray as xr

from probekit.grads.store import assemble
from probekit.grads import compare_grads, open_grads
from probekit.grads.store.restarts import segments
from probekit.grads.numerics.stats import Layout, compute

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "_resume_dist.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, dump, ckpt, mode):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run",
                           f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                           f"--master_port={free_port()}", SCRIPT, str(dump), str(ckpt), mode],
                          capture_output=True, text=True, env=env, timeout=300)


def assert_same_run(path, ref, monkeypatch):
    ds, want = open_grads(path), open_grads(ref)
    assert ds["step"].values.tolist() == want["step"].values.tolist() == list(range(6))
    assert ds["param"].values.tolist() == want["param"].values.tolist()
    for var in ("max", "min", "norm", "zeros", "dist"):  # the collectives' rounding aside
        np.testing.assert_allclose(ds[var].values, want[var].values, rtol=1e-5, atol=1e-7)
    for var in ("present", "direction", "significant"):
        assert np.array_equal(ds[var].values, want[var].values), var
    assembled = compare_grads(ds, want, progress=False)
    # the stores compared shard by shard, segment by segment: nothing assembled, same result
    with monkeypatch.context() as m:
        m.setattr(assemble, "assemble_runs", _refuse)
        cmp = compare_grads(path, ref, progress=False)
    xr.testing.assert_identical(cmp, assembled)
    cmp = cmp.isel(rank=0)
    assert np.all(cmp["similarity"].values == 1.0) and int(cmp["first_step"]) == -1
    return ds


def _refuse(*args, **kwargs):
    raise AssertionError("a parameter was assembled")


@pytest.mark.slow
def test_fsdp2_killed_at_4_ranks_resumes_at_2_or_4_into_the_same_store(tmp_path,
                                                                       monkeypatch):
    ckpt = tmp_path / "ckpt"
    res = torchrun(4, tmp_path / "ref", tmp_path / "ckpt_ref", "full")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    res = torchrun(4, tmp_path / "run", ckpt, "killed")  # checkpoint at 3, killed at 5
    assert res.returncode != 0
    killed = open_grads(tmp_path / "run")
    assert killed["step"].values.tolist() == [0, 1, 2, 3, 4]  # 3, 4: past the checkpoint
    shutil.copytree(tmp_path / "run", tmp_path / "same")

    res = torchrun(2, tmp_path / "run", ckpt, "resume")  # elastic: 2 ranks from step 3
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "this run records from step 3 (the step count of AdamW's state); steps 3..4 " \
           "recorded before are superseded" in res.stderr
    segs = segments(tmp_path / "run")
    assert [(s.first_step, s.last_step, s.ranks, s.sharded) for s in segs] == [
        (0, 2, [0, 1, 2, 3], True), (3, 5, [0, 1], True)]
    assert os.path.basename(segs[1].folder).startswith("layout-")
    # no "holds ranks [0, 1, 2, 3]"
    ds = assert_same_run(tmp_path / "run", tmp_path / "ref", monkeypatch)
    assert ds.attrs["rank"] == 0

    res = torchrun(4, tmp_path / "same", ckpt, "resume")  # the same layout: the same groups
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "same" / "grads.zarr")) == [
        "rank0", "rank1", "rank2", "rank3", "zarr.json"]
    assert [(s.first_step, s.last_step) for s in segments(tmp_path / "same")] == [(0, 5)]
    assert_same_run(tmp_path / "same", tmp_path / "ref", monkeypatch)


SHAPES = [(300, 400), (1000,), (64, 64, 5)]

# As in test_grads_crash: a server forks one recorder per request; each resumes a copy of a
# store holding steps 0..11 of another run ("old", seed 5000) at step 6, until killed.
SERVER = textwrap.dedent("""
    import os, signal, sys, torch
    torch.set_num_threads(1)
    import zarr
    from probekit.grads import GradProbe
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    SHAPES = %r
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    def grads(seed, step):
        gen = torch.Generator().manual_seed(seed + step)
        return [torch.randn(s, generator=gen) for s in SHAPES]
    def record(path, seed, first, steps, **kw):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        model = torch.nn.ParameterList(params)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        probe = GradProbe(model, optimizer=opt, grad_level="L2", dump_path=path, flush_every=3,
                          start_step=first, **kw)
        probe.start()
        return probe, params, opt
    if sys.argv[1] == "base":
        probe, params, opt = record(sys.argv[2], 5000, 0, 12)
        for step in range(12):
            for p, g in zip(params, grads(5000, step)):
                p.grad = g
            opt.step()
        probe.stop()
        sys.exit(0)
    for line in sys.stdin:
        path = line.strip()
        pid = os.fork()
        if pid == 0:
            probe, params, opt = record(path, 1000, 6, None)
            print("started", os.getpid(), flush=True)
            step = 6
            while True:
                for p, g in zip(params, grads(1000, step)):
                    p.grad = g
                opt.step()
                step += 1
        print("forked", pid, flush=True)
""") % (SHAPES,)


def expected(seed, step):
    gen = torch.Generator().manual_seed(seed + step)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    lay = Layout(("0", "1", "2"), tuple(int(np.prod(s)) for s in SHAPES), tuple(SHAPES))
    return compute(grads, lay, "L2", (-1, 0, 1))


@pytest.mark.slow
def test_sigkill_at_any_moment_of_a_resumed_run(tmp_path):
    """Each trial copies a store of steps 0..11 and resumes it at step 6, killed at a random
    moment: the store holds 0..11 of the old run (killed before the resumed run's first
    commit), or 0..5 of the old run and 6..n of the new one, every value exact."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    base = tmp_path / "base"
    subprocess.run([sys.executable, "-c", SERVER, "base", str(base)], env=env, check=True,
                   timeout=120)
    server = subprocess.Popen([sys.executable, "-c", SERVER, "serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    rng = random.Random(11)
    outcomes = []
    try:
        for trial in range(12):
            path = tmp_path / f"run{trial}"
            shutil.copytree(base, path)
            server.stdin.write(f"{path}\n")
            server.stdin.flush()
            lines = [server.stdout.readline().split() for _ in range(2)]
            child = int(next(x for x in lines if x[0] == "started")[1])
            time.sleep(rng.uniform(0.05, 0.8))
            os.kill(child, signal.SIGKILL)
            time.sleep(0.05)
            steps = open_grads(path)["step"].values.tolist()
            ds = open_grads(path)
            # 0..11 is the old run whole, or the resumed one that reached step 11 (its writes
            # are fast enough for that within the window): step 6 tells them apart
            if steps == list(range(12)) and np.array_equal(ds["max"].values[6],
                                                           expected(5000, 6).max):
                outcomes.append(-1)
                owners = [5000] * 12
            else:
                assert steps == list(range(len(steps))) and len(steps) >= 6, (trial, steps)
                outcomes.append(len(steps) - 6)
                owners = [5000] * 6 + [1000] * (len(steps) - 6)
            for i, (s, seed) in enumerate(zip(steps, owners)):
                exp = expected(seed, s)
                for name in ("max", "norm", "dist", "direction", "significant"):
                    assert np.array_equal(ds[name].values[i], getattr(exp, name)), (trial, s)
    finally:
        server.kill()
        server.wait()
    assert len(set(outcomes)) >= 3, outcomes  # the kills landed at different moments
