"""torchrun with gloo: DDP, FSDP2, tensor parallel and HSDP at 2 and 4 ranks; one copy of every
gradient (shards assembled by the reader), rank filter respected, a killed rank tolerated."""
import os
import socket
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from probekit.grads import compare_grads, open_grads, replica_disagreements

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
    """DDP: the gradients are equal on every rank after the all-reduce, so only the group's
    first rank writes; a rank filter keeps msprobe's meaning (the listed ranks write)."""
    out = torchrun(tmp_path / "all")
    assert "rank 0 done steps=4 world=2 checked=0" in out
    assert "rank 1 done steps=0 world=2 checked=0" in out  # no hook: nothing to record
    store = tmp_path / "all" / "grads.zarr"
    assert sorted(os.listdir(store)) == ["rank0", "zarr.json"]
    r0 = open_grads(store)
    assert r0["step"].values.tolist() == [0, 1, 2, 3]
    # stored without DDP's "module." prefix (kept as recorded in an attribute) ...
    assert r0["param"].values.tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert r0.attrs["recorded_params"][0] == "module.0.weight"
    # ... so the DDP run compares with a single-process run on both ranks' data, out of the box
    single_process_run(tmp_path / "single")
    cmp = compare_grads(tmp_path / "single", tmp_path / "all")
    assert cmp["param"].values.tolist() == r0["param"].values.tolist()
    assert float(cmp["similarity"].min()) > 0.97
    single = open_grads(tmp_path / "single")
    np.testing.assert_allclose(r0["norm"].values, single["norm"].values, rtol=1e-5)
    torchrun(tmp_path / "one", "1")
    assert sorted(os.listdir(tmp_path / "one" / "grads.zarr")) == ["rank1", "zarr.json"]
    one = open_grads(tmp_path / "one")
    assert np.array_equal(one["direction"].values, r0["direction"].values)
    # one run each: compared parameter by parameter whatever rank recorded it
    cmp = compare_grads(tmp_path / "all", tmp_path / "one")
    assert cmp["rank"].values.tolist() == [0] and np.all(cmp["similarity"].values == 1.0)


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
    assert sorted(os.listdir(tmp_path / "all" / "grads.zarr")) == ["rank0", "zarr.json"]
    # the same job again into the same folder: not a restart, so both probes replace what the
    # first run left (it ended cleanly), every rank deciding alike (issue 36): the same rows,
    # the same store, nothing left aside
    csv = (tmp_path / "all" / "free_benchmark.csv").read_text().splitlines()
    grads = open_grads(tmp_path / "all")
    listing = sorted(os.listdir(tmp_path / "all"))
    torchrun(tmp_path / "all", "", "freebench")
    again = (tmp_path / "all" / "free_benchmark.csv").read_text().splitlines()
    assert again[0] == csv[0] and sorted(again[1:]) == sorted(csv[1:])
    assert sorted(os.listdir(tmp_path / "all")) == listing == [
        "free_benchmark.csv", "free_benchmark.rank0.run.json", "free_benchmark.rank1.run.json",
        "grads.zarr", "repro"]
    assert sorted(os.listdir(tmp_path / "all" / "grads.zarr")) == ["rank0", "zarr.json"]
    second = open_grads(tmp_path / "all")
    assert second["step"].values.tolist() == [0, 1, 2, 3]
    for name in ("norm", "max", "direction", "dist"):
        assert np.array_equal(second[name].values, grads[name].values), name
    out = torchrun(tmp_path / "one", "1", "freebench")
    assert "rank 0 done steps=0 world=2 checked=0" in out
    rows = pd.read_csv(tmp_path / "one" / "free_benchmark.csv")
    assert rows["rank"].unique().tolist() == [1]
    assert sorted(os.listdir(tmp_path / "one" / "grads.zarr")) == ["rank1", "zarr.json"]


LAYOUTS = os.path.join(os.path.dirname(SCRIPT), "_dist_layouts.py")


def torchrun_layouts(out, nproc, *layouts, check=True):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                          f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                          f"--master_port={free_port()}", LAYOUTS, str(out), *layouts],
                         capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def collectives(stdout):
    """{(rank, layout): (plain, probe)} from _dist_layouts.py's lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("rank ") and " collectives " in line:
            r, layout = line.split()[1:3]
            plain, probe = (int(x.split("=")[1]) for x in line.split()[-2:])
            out[(int(r), layout)] = (plain, probe)
    return out


def assert_like_single(run, ref, exact=True):
    """The assembled run holds the single process's Dataset: same params, shapes, steps,
    statistics (float rounding of the collectives' sums aside) and sign bits."""
    ds = open_grads(run)
    assert ds["param"].values.tolist() == ref["param"].values.tolist()
    assert ds["numel"].values.tolist() == ref["numel"].values.tolist()
    assert ds["shape"].values.tolist() == ref["shape"].values.tolist()
    assert ds["step"].values.tolist() == ref["step"].values.tolist()
    assert bool(ds["present"].all())
    for var in ("max", "min", "norm", "zeros", "dist"):
        np.testing.assert_allclose(ds[var].values, ref[var].values, rtol=1e-5, atol=1e-7)
    assert np.array_equal(ds["direction"].values, ref["direction"].values)
    # the significance threshold is the whole gradient's on every shard: the same bits
    assert np.array_equal(ds["significant"].values, ref["significant"].values)
    cmp = compare_grads(run, ref)
    assert cmp["rank"].values.tolist() == [0]
    assert np.all(cmp["similarity"].values == 1.0)
    return ds


@pytest.fixture(scope="module")
def single_ref(tmp_path_factory):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import _dist_layouts

    path = tmp_path_factory.mktemp("single") / "run"
    _dist_layouts.train_single(path)
    ds = open_grads(path)
    ds.attrs["store"] = str(path / "grads.zarr")
    return ds


@pytest.mark.slow
def test_two_ranks_fsdp2_tp_ddp_record_one_copy_of_shards(tmp_path, single_ref):
    """FSDP2 and tensor parallel: every rank records its own shards (no gather: the probe adds
    no collective), the reader assembles the single process's Dataset; DDP: one rank writes;
    a rank filter keeps msprobe's meaning (every listed rank writes)."""
    res = torchrun_layouts(tmp_path, 2, "fsdp2", "tp", "ddp", "ddp_all")
    counts = collectives(res.stdout)
    assert len(counts) == 8, res.stdout[-2000:]
    for layout in ("fsdp2", "tp"):  # the shards' largest |g|, for the significance threshold
        assert res.stdout.count(f"{layout} amax ok=True") == 2, res.stdout[-2000:]
    for (rank, layout), (plain, probe) in counts.items():
        # sharded: the significance threshold's all-reduce; replicas (DDP's, the TP layers'
        # replicated biases): the replica check's one all-gather
        extra = int(layout in ("fsdp2", "tp")) + int(layout in ("tp", "ddp", "ddp_all"))
        assert probe == plain + extra, (rank, layout, plain, probe)
    assert "replicas" not in open_grads(tmp_path / "fsdp2")  # FSDP2 alone: nothing replicated
    for layout in ("tp", "ddp", "ddp_all"):  # healthy: every replica agrees at every step
        assert replica_disagreements(tmp_path / layout).empty, layout
    tp = open_grads(tmp_path / "tp")
    checked = np.asarray(tp["replicas"].values)  # replicated over TP: the Rowwise biases
    assert [str(p) for p, c in zip(tp["param"].values, checked.T) if c.all()] == [
        "1.0.bias", "3.bias"]
    assert np.all(checked[:, [0, 1, 2, 4, 5, 6]] == 0)  # shards: not replicated, not checked
    assert np.all(open_grads(tmp_path / "ddp")["replicas"].values == 1)
    for layout in ("fsdp2", "tp"):
        store = tmp_path / layout / "grads.zarr"
        assert sorted(os.listdir(store)) == ["rank0", "rank1", "zarr.json"]
        shard = open_grads(tmp_path / layout, rank=1, shards=True)
        assert int(shard["numel"].sum()) < int(single_ref["numel"].sum())  # a shard, not all
        ds = assert_like_single(tmp_path / layout, single_ref)
        assert ds.attrs["assembled_from"] == [0, 1]
    # tensor parallel: RowwiseParallel's bias is replicated: only mesh coordinate 0 records it
    tp1 = open_grads(tmp_path / "tp", rank=1, shards=True)
    assert "1.0.bias" not in tp1["param"].values.tolist()
    assert "1.0.weight" in tp1["param"].values.tolist()  # Shard(1): a column block
    assert sorted(os.listdir(tmp_path / "ddp" / "grads.zarr")) == ["rank0", "zarr.json"]
    assert_like_single(tmp_path / "ddp", single_ref)
    assert sorted(os.listdir(tmp_path / "ddp_all" / "grads.zarr")) == ["rank0", "rank1",
                                                                        "zarr.json"]
    # one copy per replica: DDP's store is what the single process's store is
    assert store_bytes(tmp_path / "ddp" / "grads.zarr") <= 1.15 * store_bytes(
        single_ref.attrs["store"])


@pytest.mark.slow
def test_four_ranks_fsdp2_hsdp_ddp_and_layouts_compare(tmp_path, single_ref):
    """FSDP2 over 4 ranks (one rank holds an empty shard of the 3-element bias), HSDP (2
    replicas x 2 shards: the second replica writes nothing) and DDP line up parameter by
    parameter with each other and with a single process, similarity 1.0."""
    res = torchrun_layouts(tmp_path, 4, "fsdp2", "hsdp", "ddp")
    for layout in ("fsdp2", "hsdp"):
        assert res.stdout.count(f"{layout} amax ok=True") == 4, res.stdout[-2000:]
    for (rank, layout), (plain, probe) in collectives(res.stdout).items():
        # FSDP2 and replica 0 of HSDP: one MAX all-reduce (the significance threshold);
        # HSDP's replicas and DDP's ranks: the replica check's all-gather (HSDP's second
        # replica records nothing but takes part in it)
        extra = (int(layout == "fsdp2" or (layout == "hsdp" and rank < 2))
                 + int(layout in ("hsdp", "ddp")))
        assert probe == plain + extra, (rank, layout, plain, probe)
    for layout in ("hsdp", "ddp"):
        assert replica_disagreements(tmp_path / layout).empty, layout
        assert np.all(open_grads(tmp_path / layout)["replicas"].values == 1), layout
    assert sorted(os.listdir(tmp_path / "fsdp2" / "grads.zarr")) == [
        "rank0", "rank1", "rank2", "rank3", "zarr.json"]
    assert sorted(os.listdir(tmp_path / "hsdp" / "grads.zarr")) == ["rank0", "rank1",
                                                                     "zarr.json"]
    assert sorted(os.listdir(tmp_path / "ddp" / "grads.zarr")) == ["rank0", "zarr.json"]
    empty = open_grads(tmp_path / "fsdp2", rank=3, shards=True)
    assert int(empty["numel"].values[-1]) == 0  # 3 rows over 4 ranks
    for layout in ("fsdp2", "hsdp", "ddp"):
        assert_like_single(tmp_path / layout, single_ref)
    cmp = compare_grads(tmp_path / "fsdp2", tmp_path / "hsdp")
    assert np.all(cmp["similarity"].values == 1.0)
    assert cmp["param"].values.tolist() == single_ref["param"].values.tolist()
    assert store_bytes(tmp_path / "ddp" / "grads.zarr") <= 1.15 * store_bytes(
        single_ref.attrs["store"])  # one copy per replica


@pytest.mark.slow
def test_fsdp2_at_two_and_four_ranks_report_no_divergence(tmp_path):
    """The same attention model trained data-parallel on FSDP2 at 2 and at 4 ranks (each rank
    its slice of the batch): the gradients are the same sums in another order, so the
    comparison reports no divergence by default; msprobe's plain sign similarity parts at a
    key bias, whose gradient is rounding noise."""
    torchrun_layouts(tmp_path / "two", 2, "fsdp2_dp")
    torchrun_layouts(tmp_path / "four", 4, "fsdp2_dp")
    a, b = tmp_path / "two" / "fsdp2_dp", tmp_path / "four" / "fsdp2_dp"
    cmp = compare_grads(a, b, progress=False).isel(rank=0)
    assert int(cmp["first_step"]) == -1, cmp["first_param"].item()
    assert float(cmp["total_significant"].min()) == 1.0
    plain = compare_grads(a, b, noise_aware=False, progress=False).isel(rank=0)
    first = str(plain["first_param"].item())
    assert int(plain["first_step"]) >= 0 and first in ("0.qkv.bias", "1.k.bias"), first
    # the same gradients but for rounding (the key bias is only rounding: norm ~1e-9)
    np.testing.assert_allclose(open_grads(a)["norm"].values, open_grads(b)["norm"].values,
                               rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_a_rank_killed_mid_step_leaves_the_others_steps_readable(tmp_path):
    """FSDP2, 2 ranks: rank 1 dies (SIGKILL) after its backward of step 2; torchrun stops rank
    0. The store opens at the steps both ranks committed, and rank 0's own steps are readable
    as shards."""
    res = torchrun_layouts(tmp_path, 2, "crash", check=False)
    assert res.returncode != 0
    ds = open_grads(tmp_path / "crash")
    r0 = open_grads(tmp_path / "crash", rank=0, shards=True)
    r1 = open_grads(tmp_path / "crash", rank=1, shards=True)
    assert r1["step"].values.tolist() == [0]  # step 1 was still buffered when it died
    # rank 0 committed step 0 at least; what it had buffered is written on torchrun's SIGTERM
    # when the signal reaches Python in time (it may sit in a gloo wait): 0..1 or 0..2
    assert r0["step"].values.tolist() in ([0], [0, 1], [0, 1, 2])
    assert ds["step"].values.tolist() == [0]  # the steps both ranks committed
    assert ds["numel"].values.tolist() == [144, 12, 144, 12, 144, 12, 36, 3]


def store_bytes(path) -> int:
    """Bytes of a store's files, the replica check's arrays aside (a fixed few KB here, which a
    single process does not write: nothing is replicated there)."""
    skip = ("replicas", "replica_rank", "replica_gap")
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files if not any(part in skip for part in
                                         os.path.relpath(root, path).split(os.sep)))


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
    # 3 steps x (4 linear + 3 gelu + mse_loss): every one against the real gradients. FSDP2's
    # own Python calls inside the backward pass (its parameters' re-gather, all_gather_copy_in)
    # are checked too as they compute (issue 34: calls inside a backward pass), exact copies
    got = {tuple(x.split()[1:3]): x.split()[3:] for x in lines}
    assert len(lines) == 4, out.stdout
    for (rank, kind), fields in got.items():
        f = dict(v.split("=") for v in fields)
        assert f["same_loss"] == "True" and f["rows"] == "0" and f["real"] == "24", lines
        assert int(f["checked"]) == 24 if kind == "ddp" else int(f["checked"]) >= 24, lines
