"""What ``probekit freebench repro`` writes agrees with the script it writes (issue 36, point 4):
``REPORT.md``'s numbers are measured as the script measures them (the recorded run's thread
count: a CPU reduction's order depends on it), and the header names only what the finding's row
holds (an empty CSV cell is not "module nan")."""
import re

import pytest
import torch
import torch.nn.functional as F

from probekit.cli import main
from probekit.freebench import FreeBench
from probekit.freebench.repro import folder as repro
from probekit.freebench.report.cli import load

ROWS, D = 4096, 64


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """CPU bf16 layer_norm backward, recorded on one thread (its bias gradient sums 4096 rows in
    bf16: the order, so the error, depends on the threads)."""
    path = tmp_path_factory.mktemp("ln")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, D, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(D, generator=g)).bfloat16().requires_grad_()
    gy = torch.randn(ROWS, D, generator=g).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with FreeBench(dump_path=str(path), pert_mode="improve_precision",
                       fuzz_stage="backward", list=["layer_norm"]):
            F.layer_norm(x, (D,), w, b).backward(gy)
    finally:
        torch.set_num_threads(threads)
    return path


def test_the_report_measures_as_the_script_does(dump, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)            # the CLI's process runs on more threads than recorded
    try:
        done = repro.for_row(str(dump), 0, tmp_path / "r", results=load(str(dump)), check=True)
    finally:
        torch.set_num_threads(threads)
    code, out = done.check
    assert code == 1, out
    line = [s for s in out.splitlines() if s.startswith("result: ")][-1]
    import json

    fresh = {int(k): v for k, v in json.loads(line[len("result: "):]).items()}
    assert fresh.keys() == done.results.keys()
    for i, r in done.results.items():
        for key in ("max_error", "accuracy", "error", "moved", "lost"):
            assert r[key] == fresh[i][key], (i, key)
    report = (tmp_path / "r" / "REPORT.md").read_text()
    for r in fresh.values():
        assert f"max error {r['max_error']:.4g}" in report


def test_the_header_names_no_empty_cell(dump, tmp_path, capsys):
    assert main(["freebench", "repro", str(dump), "0", "-o", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "repro.py").read_text()
    head = text.split('"""')[1]
    assert re.search(r"module\s+nan", head) is None and "nan." not in head
    assert re.search(r"step 0, rank 0\.\n", head), head[:400]
