"""Issue 21, point 3: a grad comparison names the parameters found in one run only (result,
CSV, log, CLI lines) and the CLI exits 1 when more than half of a run is unmatched."""
import csv
import logging

import numpy as np
import torch

from probekit.cli import main
from probekit.grads import GradComparator, GradProbe, compare_grads
from probekit.grads.compare.compare import compare_rank
from test_grads_store_compare import flips, make_ds

STEPS = 3


class Renamed(torch.nn.Module):
    """Three layers like ``layers(3)`` but under other module paths, except the first."""

    def __init__(self):
        super().__init__()
        self.add_module("0", torch.nn.Linear(4, 8))
        self.mid = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(getattr(self, "0")(x)))))


def layers(n):
    """``n`` linear layers, 4 -> 8 -> 8 -> 3: the first two layers' shapes are the same in a
    2-layer and a 3-layer model (names 0.*, 2.*, 4.*)."""
    sizes = (4, 8, 8, 3)
    mods = []
    for i in range(n):
        mods += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def record(path, model):
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradProbe(model, grad_level="L1", dump_path=str(path)):
        for _ in range(STEPS):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return str(path)


def test_two_layer_against_three_layer_names_the_two_left_out(tmp_path, caplog):
    two, three = record(tmp_path / "two", layers(2)), record(tmp_path / "three", layers(3))
    with caplog.at_level(logging.WARNING, logger="probekit"):
        res = compare_grads(two, three).sel(rank=0)
    assert res["param"].values.tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert res["only_in_first"].values.tolist() == []
    assert res["only_in_second"].values.tolist() == ["4.weight", "4.bias"]
    assert int(res["n_only_in_first"]) == 0 and int(res["n_only_in_second"]) == 2
    assert int(res["n_params_first"]) == 4 and int(res["n_params_second"]) == 6
    assert [r.getMessage() for r in caplog.records] == [
        "[probekit] rank 0: 2 parameters in one run only, not compared: second run only "
        "(2 of 6): 4.weight, 4.bias"]


def test_compare_distributed_writes_the_unmatched_csv(tmp_path):
    two, three = record(tmp_path / "two", layers(2)), record(tmp_path / "three", layers(3))
    out = tmp_path / "cmp"
    GradComparator.compare_distributed(three, two, str(out), plots="none")
    with open(out / "rank0" / "unmatched_params.csv", encoding="utf-8", newline="") as fh:
        assert list(csv.reader(fh)) == [["run", "param"], ["first", "4.weight"],
                                        ["first", "4.bias"]]
    # every parameter matched: no file, and an earlier one is removed
    GradComparator.compare_distributed(three, three, str(out), plots="none")
    assert sorted(p.name for p in (out / "rank0").iterdir()) == ["similarities.csv"]


def test_cli_names_them_and_exits_0_when_at_most_half_is_unmatched(tmp_path, capsys):
    two, three = record(tmp_path / "two", layers(2)), record(tmp_path / "three", layers(3))
    code = main(["grads", "compare", two, three, "-o", str(tmp_path / "cmp"), "--plots", "none"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert lines[0].startswith(f"rank 0: {STEPS} steps x 4 params compared; total similarity ")
    assert lines[2].startswith("rank 0: uncalibrated: ")     # the verdict (no control run)
    assert lines[3:] == [f"written to {tmp_path / 'cmp'}",
                         "rank 0: 2 parameters in one run only, not compared: second run only "
                         "(2 of 6): 4.weight, 4.bias"]


def test_cli_exits_1_when_more_than_half_is_unmatched_unless_allowed(tmp_path, capsys):
    three, renamed = record(tmp_path / "three", layers(3)), record(tmp_path / "ren", Renamed())
    args = ["grads", "compare", three, renamed, "-o", str(tmp_path / "cmp"), "--plots", "none"]
    assert main(args) == 1
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith(f"rank 0: {STEPS} steps x 2 params compared")
    assert out.out.splitlines()[-1] == (
        "rank 0: 8 parameters in one run only, not compared: first run only (4 of 6): 2.weight, "
        "2.bias, 4.weight, 4.bias; second run only (4 of 6): mid.weight, mid.bias, out.weight, "
        "out.bias")
    assert out.err == (
        "probekit: error: rank 0: 4 of the first run's 6 parameters; rank 0: 4 of the second "
        "run's 6 parameters have no counterpart in the other run (more than half), so the "
        "comparison covers too little of it; --allow-unmatched accepts this\n")
    assert (tmp_path / "cmp" / "rank0" / "unmatched_params.csv").is_file()  # written anyway
    assert main([*args, "--allow-unmatched"]) == 0
    assert capsys.readouterr().err == ""


def test_unmatched_names_survive_the_per_rank_concat():
    w, v = flips(70, 0), flips(8, 0)
    a = make_ds([[w, v]], rank=0)
    b = make_ds([[v, w, flips(5, 0)]], params=("v", "w", "extra"), numels=(8, 70, 5), rank=0)
    # a step before the comparison may have left parameters out (mindspore.align): counted too
    c = make_ds([[w]], params=("w",), numels=(70,)).assign_attrs(left_out=["x.gamma", "y.beta"])
    res = compare_grads({0: a, 1: b, 2: a}, {0: b, 1: a, 2: c})
    assert res["only_in_first"].values.tolist() == [[""], ["extra"], ["v"]]
    assert res["only_in_second"].values.tolist() == [["extra", ""], ["", ""],
                                                     ["x.gamma", "y.beta"]]
    assert res["n_only_in_first"].values.tolist() == [0, 1, 1]
    assert res["n_only_in_second"].values.tolist() == [1, 0, 2]
    assert res["n_params_first"].values.tolist() == [2, 3, 2]
    assert res["n_params_second"].values.tolist() == [3, 2, 3]
    one = compare_rank(a, b)  # one rank, no rank dimension
    assert one["only_in_second"].values.tolist() == ["extra"]
    assert int(one["n_only_in_first"]) == 0


def test_names_as_each_run_holds_them():
    """Matched without wrapper prefixes, reported as recorded (an msprobe dump of a DDP run)."""
    w, v = flips(70, 0), flips(8, 0)
    a = make_ds([[w, v]], params=("module.w", "module.v"))
    b = make_ds([[w, flips(5, 0)]], params=("w", "z"), numels=(70, 5))
    res = compare_grads(a, b).sel(rank=0)
    assert res["param"].values.tolist() == ["w"]
    assert res["only_in_first"].values.tolist() == ["module.v"]
    assert res["only_in_second"].values.tolist() == ["z"]
    assert np.asarray(res["similarity"].values).tolist() == [[1.0]]
