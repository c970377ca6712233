"""msprobe's entry point driving the free benchmark: start/stop/step writes free_benchmark.csv."""
import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

from probekit import PrecisionDebugger
from probekit.freebench import COLUMNS, FreeBench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def loop(debugger, steps=3):
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    x = torch.rand(8) + 1
    for _ in range(steps):
        debugger.start()
        a + b                      # flagged by bit_noise
        torch.exp(x)               # well-conditioned: not flagged
        debugger.stop()
        debugger.step()


def test_start_stop_step_writes_the_csv(tmp_path):
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(tmp_path), pert_mode="bit_noise")
    loop(d)
    assert isinstance(d._session, FreeBench)
    df = d.results
    assert df["api_name"].tolist() == ["Tensor.__add__.0.forward"] * 3
    assert df["step"].tolist() == [0, 1, 2]
    on_disk = pd.read_csv(tmp_path / "free_benchmark.csv")
    assert list(on_disk.columns) == list(COLUMNS)
    assert on_disk["api_name"].tolist() == df["api_name"].tolist()
    assert on_disk["step"].tolist() == [0, 1, 2]
    d.close()
    assert torch._C._len_torch_function_stack() == 0


def test_config_file_and_class_level_calls(tmp_path, msprobe_config_dict):
    cfg = dict(msprobe_config_dict, dump_path=str(tmp_path / "dump"))
    cfg["free_benchmark"] = dict(cfg["free_benchmark"], pert_mode="add_noise", list=["add"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    d = PrecisionDebugger(config_path=str(path))
    loop(PrecisionDebugger, steps=2)         # msprobe users call the methods on the class
    assert d.results["pert_mode"].tolist() == ["add_noise"] * 2
    assert d._session.summary["skipped"] == {"out_of_scope": 2}
    assert (tmp_path / "dump" / "free_benchmark.csv").exists()
    d.close()


def test_cpu_only_run_in_a_fresh_process_writes_the_csv(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from probekit import PrecisionDebugger
        assert not torch.distributed.is_initialized()
        d = PrecisionDebugger(task="free_benchmark", dump_path={str(tmp_path)!r},
                              pert_mode="bit_noise")
        a, b = torch.tensor([-1e4 - 0.01]), torch.tensor([1e4])
        d.start(); a + b; d.stop(); d.step()
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[probekit] Free benchmark: Perturbation is bit_noise of Tensor.__add__.0.forward." \
        in proc.stderr
    df = pd.read_csv(tmp_path / "free_benchmark.csv")
    assert df["api_name"].tolist() == ["Tensor.__add__.0.forward"]
    assert df["kind"].tolist() == ["rel_error"]
