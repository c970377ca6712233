"""Interop with the real msprobe 1.0.4 (installed in its own venv): same runs, same numbers."""
import csv
import json
import os
import sys
import textwrap

import numpy as np
import pytest

from probekit.grads.store.msprobe import read_grad_dump
from probekit.grads import GradProbe, compare_grads, open_grads

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _train import make_model, train  # noqa: E402
from msprobe_util import run_msprobe  # noqa: E402

pytestmark = pytest.mark.msprobe

# Several msprobe runs in one process: msprobe keeps a process-wide PrecisionDebugger singleton
# and never removes its global optimizer hook, so both are reset between runs.
MSPROBE_RUNS = textwrap.dedent("""
    import json, sys
    import torch.optim.optimizer as optim_mod
    sys.path.insert(0, "tests")
    from _train import make_model, train
    from msprobe.pytorch import PrecisionDebugger
    from msprobe.core.grad_probe.grad_compare import GradComparator
    losses = {}
    for config_path, lr in json.loads(sys.argv[1]):
        PrecisionDebugger._instance = None
        optim_mod._global_optimizer_pre_hooks.clear()
        debugger = PrecisionDebugger(config_path=config_path)
        model = make_model()
        debugger.monitor(model)
        losses[config_path] = train(model, steps=6, lr=lr)
    optim_mod._global_optimizer_pre_hooks.clear()
    for a, b, out in json.loads(sys.argv[2]):
        GradComparator.compare_distributed(a, b, out)
    print(json.dumps(losses))
""")

MSPROBE_COMPARE = textwrap.dedent("""
    import sys
    from msprobe.core.grad_probe.grad_compare import GradComparator
    GradComparator.compare_distributed(sys.argv[1], sys.argv[2], sys.argv[3])
""")


def msprobe_config(tmp_path, name, level):
    cfg = {"task": "grad_probe", "dump_path": str(tmp_path / name), "rank": [], "step": [],
           "grad_probe": {"grad_level": level, "param_list": [], "bounds": [-0.05, 0, 0.05]}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def probekit_dump(tmp_path, name, level, lr):
    model = make_model()
    with GradProbe(model, grad_level=level, bounds=(-0.05, 0, 0.05), dump_path=str(tmp_path / name)):
        return train(model, steps=6, lr=lr)


def read_similarities(path):
    with open(path, encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.reader(fh))
    return [int(s) for s in rows[0][1:]], {r[0]: [float(x) for x in r[1:]] for r in rows[1:]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interop")
    losses = {}
    plan = [("ms_a", "L2", 0.1), ("ms_b", "L2", 0.6), ("ms_l0", "L0", 0.1)]
    configs = [(msprobe_config(tmp, name, level), lr) for name, level, lr in plan]
    out = run_msprobe(MSPROBE_RUNS, json.dumps(configs),
                      json.dumps([[str(tmp / "ms_a"), str(tmp / "ms_b"), str(tmp / "ms_cmp")]]))
    by_config = json.loads(out.strip().splitlines()[-1])
    for (name, _, _), (cfg, _) in zip(plan, configs):
        losses[name] = by_config[cfg]
    for name, level, lr in [("pk_a", "L2", 0.1), ("pk_b", "L2", 0.6), ("pk_l0", "L0", 0.1)]:
        losses[name] = probekit_dump(tmp, name, level, lr)
    return tmp, losses


def test_same_training_in_both_tools(runs):
    _, losses = runs
    assert losses["ms_a"] == losses["pk_a"] and losses["ms_b"] == losses["pk_b"]


def test_msprobe_dump_reads_as_our_dataset(runs):
    tmp, _ = runs
    theirs = read_grad_dump(str(tmp / "ms_a"), 0)
    ours = open_grads(tmp / "pk_a")
    assert theirs["step"].values.tolist() == ours["step"].values.tolist() == list(range(6))
    assert theirs["param"].values.tolist() == ours["param"].values.tolist()
    assert theirs["shape"].values.tolist() == ours["shape"].values.tolist()
    assert theirs["interval"].values.tolist() == ours["interval"].values.tolist() == [
        "(-inf, -0.05]", "(-0.05, 0]", "(0, 0.05]", "(0.05, inf)"]
    for name in ("max", "min", "dist", "zeros", "direction"):
        assert np.array_equal(theirs[name].values, ours[name].values), name
    # msprobe's norm is computed in float32; ours in float64 accumulation
    assert np.allclose(theirs["norm"].values, ours["norm"].values, rtol=2e-6, atol=0)


def test_md5_matches_msprobe(runs):
    tmp, _ = runs
    theirs = read_grad_dump(str(tmp / "ms_l0"), 0)
    ours = open_grads(tmp / "pk_l0")
    assert theirs["hash"].values.tolist() == ours["hash"].values.tolist()


def test_identical_similarities_to_msprobes_comparator(runs):
    tmp, _ = runs
    steps, theirs = read_similarities(tmp / "ms_cmp" / "rank0" / "similarities.csv")
    for a, b in [("ms_a", "ms_b"), ("pk_a", "pk_b"), ("ms_a", "pk_b"), ("pk_a", "ms_b")]:
        r = compare_grads(tmp / a, tmp / b).sel(rank=0)
        assert r["step"].values.tolist() == steps
        for j, name in enumerate(r["param"].values):
            assert r["similarity"].values[:, j].tolist() == pytest.approx(theirs[str(name)],
                                                                           rel=0, abs=1e-15)
        assert r["total"].values.tolist() == pytest.approx(theirs["summary"], rel=0, abs=1e-15)


def test_msprobe_compares_our_export(runs):
    from probekit.grads.store.export import write_grad_dump

    tmp, _ = runs
    write_grad_dump(str(tmp / "pk_a"), str(tmp / "pk_a_ms"))
    write_grad_dump(str(tmp / "pk_b"), str(tmp / "pk_b_ms"))
    run_msprobe(MSPROBE_COMPARE, str(tmp / "pk_a_ms"), str(tmp / "pk_b_ms"), str(tmp / "cmp2"))
    assert read_similarities(tmp / "cmp2" / "rank0" / "similarities.csv") == read_similarities(
        tmp / "ms_cmp" / "rank0" / "similarities.csv")
