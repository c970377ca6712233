"""Issue 21, point 4: a finished GradProbe logs one line (steps, parameters, bytes, where the
store is), also its ``summary``; the debugger's ``summary`` for both tasks (test_debugger.py)."""
import logging
import os

import torch

from probekit.grads import GradProbe
from probekit.grads.record.summary import ProbeSummary, human_bytes


def group_bytes(folder) -> int:
    """Bytes of every file under ``folder`` (the oracle for the summary's byte count)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
               for f in files)


def train(model, steps=3):
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_stop_logs_the_one_line_summary(tmp_path, caplog):
    probe = GradProbe(mlp(), grad_level="L2", dump_path=str(tmp_path), step=[0, 2])
    with caplog.at_level(logging.INFO, logger="probekit"):
        with probe:
            train(probe.model, steps=3)
    store = os.path.join(str(tmp_path), "grads.zarr", "rank0")
    n = group_bytes(store)
    assert 1024 <= n < 1 << 20
    assert probe.summary == {"steps": 2, "params": 4, "bytes": n, "store": store, "no_grad": 0}
    line = f"grad_probe: 2 steps x 4 params recorded, {n / 1024:.1f} KiB ({n:,} bytes) in {store}"
    assert str(probe.summary) == line
    assert [r.getMessage() for r in caplog.records if "recorded," in r.getMessage()] == [
        "[probekit] " + line]
    probe.stop()  # stopped already: nothing more is logged
    assert sum("recorded," in r.getMessage() for r in caplog.records) == 1


def test_summary_while_recording_counts_the_steps_written(tmp_path):
    probe = GradProbe(mlp(), dump_path=str(tmp_path), flush_every=100).start()
    try:
        train(probe.model, steps=2)
        assert probe.summary["steps"] == 0  # buffered, not written yet
        probe.flush()
        assert probe.summary["steps"] == 2
    finally:
        probe.stop()


def test_a_rank_that_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    probe = GradProbe(mlp(), dump_path=str(tmp_path), rank=[0]).start()
    probe.stop()
    assert probe.summary == {"steps": 0, "params": 4, "bytes": 0, "store": None}
    assert str(probe.summary) == "grad_probe: nothing recorded on this rank (4 params monitored)"


def test_text():
    assert [human_bytes(n) for n in (0, 1023, 1024, 20051, 3 << 30)] == [
        "0 bytes", "1023 bytes", "1.0 KiB", "19.6 KiB", "3.0 GiB"]
    one = ProbeSummary(steps=1, params=1, bytes=512, store="s3://b/run/grads.zarr/rank0")
    assert str(one) == ("grad_probe: 1 step x 1 param recorded, 512 bytes in "
                        "s3://b/run/grads.zarr/rank0")


def test_bytes_of_a_store_behind_a_url():
    """A store on an fsspec filesystem (``memory://``): its objects' sizes, its URL."""
    import uuid

    import fsspec

    url = f"memory://summary-{uuid.uuid4().hex}/run"
    with GradProbe(mlp(), dump_path=url) as probe:
        train(probe.model, steps=2)
    fs = fsspec.filesystem("memory")
    group = url[len("memory://"):] + "/grads.zarr/rank0"
    n = sum(v["size"] for v in fs.find(group, detail=True).values())
    assert n > 0
    assert probe.summary == {"steps": 2, "params": 4, "bytes": n,
                             "store": f"memory:///{group}", "no_grad": 0}
    fs.rm(url[len("memory://"):], recursive=True)
