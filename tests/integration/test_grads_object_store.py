"""The grad store on a real S3-compatible server (SeaweedFS, started here): recording, every
reader, the comparison and the CLI take s3:// URLs, credentials the fsspec way (AWS_* variables
or storage_options); a killed writer leaves the committed steps readable; a bad URL or a missing
bucket is an error naming it, and nothing lands on the local disk."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xarray as xr

from probekit.grads import GradProbe, GradStoreError, compare_grads, open_grads
from s3_server import S3Server

pytestmark = pytest.mark.slow

TRAIN = textwrap.dedent("""
    import os, signal, sys
    import torch
    from probekit.grads import GradProbe

    def train(path, steps, end="stop", **options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        probe = GradProbe(model, grad_level="L2", dump_path=path, flush_every=2,
                          significance=True, **options).start()
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(16, 8, generator=gen)),
                                         torch.randn(16, 2, generator=gen)).backward()
            opt.step()
        if end == "stop":
            probe.stop()
        elif end == "kill":  # once the writing thread committed what was handed over
            import time
            deadline = time.monotonic() + 60
            while probe._writer.committed < steps - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        # end == "exit": the interpreter ends with the probe open (written at exit)
""")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("seaweedfs")).start()
    server.make_bucket("probekit-runs")
    try:
        yield server
    finally:
        server.stop()


def run_script(code, env, cwd):
    full = {**os.environ, **env, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", TRAIN + "\n" + code], capture_output=True,
                          text=True, env=full, cwd=cwd, timeout=180)


def local_run(path, steps):
    ns = {}
    exec(TRAIN, ns)
    ns["train"](str(path), steps)


def test_record_read_compare_and_cli_on_s3(s3, tmp_path, monkeypatch, capsys):
    from probekit.cli import main

    monkeypatch.chdir(tmp_path)
    for k, v in s3.env.items():  # credentials and endpoint from the AWS_* variables alone
        monkeypatch.setenv(k, v)
    local_run("s3://probekit-runs/a", 5)
    assert os.listdir(tmp_path) == []  # nothing written locally
    local_run(tmp_path / "local", 5)
    local = open_grads(tmp_path / "local")
    lazy = open_grads("s3://probekit-runs/a", chunks="auto")
    xr.testing.assert_identical(lazy.compute().drop_attrs(), local.drop_attrs())
    cmp = compare_grads("s3://probekit-runs/a", tmp_path / "local")
    assert np.all(cmp["similarity"].values == 1.0)
    assert cmp["step"].values.tolist() == [0, 1, 2, 3, 4]
    assert main(["grads", "compare", "s3://probekit-runs/a", str(tmp_path / "local"), "-o",
                 str(tmp_path / "cmp"), "--plots", "none"]) == 0
    assert "5 steps x 4 params compared" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "cmp" / "rank0" / "similarities.csv")
    # the readers with storage_options instead of the variables
    for k in s3.env:
        monkeypatch.delenv(k)
    remote = open_grads("s3://probekit-runs/a", storage_options=s3.options)
    xr.testing.assert_identical(remote.drop_attrs(), local.drop_attrs())
    opts = json.dumps(s3.options)
    assert main(["grads", "summary", "s3://probekit-runs/a", "--storage-options", opts]) == 0
    assert "5 steps (0..4)" in capsys.readouterr().out


def test_writer_killed_or_exiting_without_stop_on_s3(s3, tmp_path):
    """SIGKILL after 5 steps (flush_every=2), once the writing thread committed steps 0-3: step
    4, the newest, was in memory; a process ending without stop(): every step written by the
    exit handler, over S3."""
    res = run_script("train('s3://probekit-runs/killed', 5, end='kill')", s3.env, tmp_path)
    assert res.returncode == -9
    res = run_script("train('s3://probekit-runs/exited', 5, end='exit')", s3.env, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    killed = open_grads("s3://probekit-runs/killed", storage_options=s3.options)
    assert killed["step"].values.tolist() == [0, 1, 2, 3]
    exited = open_grads("s3://probekit-runs/exited", storage_options=s3.options)
    assert exited["step"].values.tolist() == [0, 1, 2, 3, 4]
    xr.testing.assert_identical(killed.drop_attrs(), exited.isel(step=slice(0, 4)).drop_attrs())
    assert os.listdir(tmp_path) == []


def test_bad_url_and_missing_bucket_name_it_and_write_nothing(s3, tmp_path, monkeypatch,
                                                              capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(GradStoreError, match="bucket 'no-such-bucket' does not exist"):
        GradProbe(model, dump_path="s3://no-such-bucket/run").start()
    with pytest.raises(GradStoreError, match="unknown storage protocol 'nosuch'"):
        GradProbe(model, dump_path="nosuch://bucket/run").start()
    with pytest.raises(GradStoreError, match="no-such-bucket"):
        open_grads("s3://no-such-bucket/run")
    with pytest.raises(GradStoreError, match="probekit-runs/never-recorded"):
        compare_grads("s3://probekit-runs/never-recorded", "s3://probekit-runs/never-recorded")
    from probekit.cli import main

    assert main(["grads", "summary", "s3://no-such-bucket/run"]) == 2
    assert "no-such-bucket" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # no ./s3:/... or ./nosuch:/... folders
