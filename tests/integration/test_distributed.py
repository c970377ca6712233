"""torchrun --nproc_per_node=2 with gloo and DDP: per-rank outputs, rank filter respected."""
import os
import socket
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from probekit.grads import compare_grads, open_grads

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_ddp_train.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(dump_path, ranks="", *extra):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={free_port()}", SCRIPT,
                          str(dump_path), ranks, *extra],
                         capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_grad_probe_under_torchrun(tmp_path):
    out = torchrun(tmp_path / "all")
    assert "rank 0 done steps=4 world=2 checked=0" in out
    assert "rank 1 done steps=4 world=2 checked=0" in out
    store = tmp_path / "all" / "grads.zarr"
    assert sorted(os.listdir(store)) == ["rank0", "rank1", "zarr.json"]
    r0, r1 = open_grads(store, rank=0), open_grads(store, rank=1)
    assert r0["step"].values.tolist() == r1["step"].values.tolist() == [0, 1, 2, 3]
    # stored without DDP's "module." prefix (kept as recorded in an attribute) ...
    assert r0["param"].values.tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert r0.attrs["recorded_params"][0] == "module.0.weight"
    # DDP all-reduces gradients: both ranks hold the same gradients at every step
    assert np.array_equal(r0["direction"].values, r1["direction"].values)
    assert np.array_equal(r0["max"].values, r1["max"].values)
    cmp = compare_grads(tmp_path / "all", tmp_path / "all")
    assert cmp["rank"].values.tolist() == [0, 1]
    assert np.all(cmp["similarity"].values == 1.0)
    # ... so the DDP run compares with a single-process run on both ranks' data, out of the box
    single_process_run(tmp_path / "single")
    cmp = compare_grads(tmp_path / "single", {0: r0})
    assert cmp["param"].values.tolist() == r0["param"].values.tolist()
    assert float(cmp["similarity"].min()) > 0.97
    single = open_grads(tmp_path / "single")
    np.testing.assert_allclose(r0["norm"].values, single["norm"].values, rtol=1e-5)
    torchrun(tmp_path / "one", "1")
    assert sorted(os.listdir(tmp_path / "one" / "grads.zarr")) == ["rank1", "zarr.json"]


def single_process_run(dump_path):
    """_ddp_train.py's model and both ranks' data in one process (DDP averages the gradients
    of the two halves; the mean loss over the whole batch gives the same gradient)."""
    import torch

    from probekit.grads import GradProbe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = []
    for rank in (0, 1):
        gen = torch.Generator().manual_seed(100 + rank)
        data.append((torch.randn(32, 8, generator=gen), torch.randn(32, 2, generator=gen)))
    x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    with GradProbe(model, grad_level="L2", dump_path=str(dump_path)):
        for _ in range(4):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.mark.slow
def test_both_probes_under_torchrun(tmp_path):
    out = torchrun(tmp_path / "all", "", "freebench")
    for r in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"rank {r} done"))
        assert int(line.split("checked=")[1]) > 10
    rows = pd.read_csv(tmp_path / "all" / "free_benchmark.csv")
    assert sorted(rows["rank"].unique().tolist()) == [0, 1]
    assert sorted(rows["step"].unique().tolist()) == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "all" / "grads.zarr")) == ["rank0", "rank1", "zarr.json"]
    out = torchrun(tmp_path / "one", "1", "freebench")
    assert "rank 0 done steps=0 world=2 checked=0" in out
    rows = pd.read_csv(tmp_path / "one" / "free_benchmark.csv")
    assert rows["rank"].unique().tolist() == [1]
    assert sorted(os.listdir(tmp_path / "one" / "grads.zarr")) == ["rank1", "zarr.json"]


@pytest.mark.slow
def test_fsdp2_runs_record_full_parameters_and_compare(tmp_path):
    """FSDP2's DTensor gradients: full-parameter statistics on every rank, two FSDP2 runs
    compare, and an FSDP2 run compares with a single-process run of the same model."""
    import torch

    sys.path.insert(0, os.path.dirname(SCRIPT))
    import _fsdp2_train

    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                          _fsdp2_train.__file__, str(tmp_path / "a"), str(tmp_path / "b"),
                          str(tmp_path / "c")],
                         capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    single = _fsdp2_train.make_model()
    names = [n for n, _ in single.named_parameters()]
    _fsdp2_train.train(single, str(tmp_path / "single"))
    ref = open_grads(tmp_path / "single")
    for rank in (0, 1):
        ds = open_grads(tmp_path / "a", rank=rank)
        assert ds["param"].values.tolist() == names
        assert ds["numel"].values.tolist() == ref["numel"].values.tolist()
        assert ds["step"].values.tolist() == [0, 1, 2] and bool(ds["present"].all())
        for var in ("max", "min", "norm"):
            np.testing.assert_allclose(ds[var].values, ref[var].values, rtol=1e-5, atol=1e-8)
    cmp = compare_grads(tmp_path / "a", tmp_path / "b")
    assert cmp["rank"].values.tolist() == [0, 1]
    assert np.all(cmp["similarity"].values == 1.0)
    cmp = compare_grads(tmp_path / "single", {0: open_grads(tmp_path / "a", rank=0)})
    assert float(cmp["similarity"].min()) > 0.97
    # rank filter [1]: rank 0 joined the gathers (no hang) and wrote nothing
    assert sorted(os.listdir(tmp_path / "c" / "grads.zarr")) == ["rank1", "zarr.json"]
    c1, a1 = open_grads(tmp_path / "c", rank=1), open_grads(tmp_path / "a", rank=1)
    assert np.array_equal(c1["max"].values, a1["max"].values)
    assert np.array_equal(c1["direction"].values, a1["direction"].values)
    assert torch.distributed.is_available()


@pytest.mark.slow
def test_backward_stage_under_ddp_and_fsdp2(tmp_path):
    """fuzz_stage backward with DDP's and FSDP2's gradient hooks around: the training is
    untouched (losses bit for bit), every watched call is checked against the gradient the real
    backward gave its inputs, and the healthy fp32 model gives no findings."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    script = os.path.join(os.path.dirname(SCRIPT), "_bwd_dist_train.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={free_port()}", script,
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = sorted(x for x in out.stdout.splitlines() if x.startswith("rank "))
    # 3 steps x (4 linear + 3 gelu + mse_loss): every one against the real gradients
    assert lines == [f"rank {r} {kind} same_loss=True checked=24 rows=0 real=24"
                     for r in (0, 1) for kind in ("ddp", "fsdp2")], out.stdout
