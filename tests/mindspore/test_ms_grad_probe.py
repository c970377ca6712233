"""The MindSpore grad probe end to end: msprobe's config.json and calls, levels, filters, the
optimizer given back by stop(), the same store and readers as PyTorch runs (compiled steps:
test_ms_graph.py)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

import probekit  # noqa: E402
from probekit.config import ConfigError  # noqa: E402
from probekit.grads.numerics.stats import padded_nbytes  # noqa: E402
from probekit.mindspore import GradProbe, PrecisionDebugger  # noqa: E402

from ms_models import MLP, data, train  # noqa: E402

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]


def write_config(path, dump_path, **section):
    cfg = {"task": "grad_probe", "dump_path": str(dump_path), "rank": [], "step": [],
           "level": "L1", "seed": 1234, "is_deterministic": False,
           "grad_probe": {"grad_level": "L2", "param_list": [], "bounds": [-0.01, 0, 0.01],
                          **section}}
    step = section.pop("step", None)
    if step is not None:
        cfg["step"] = step
        cfg["grad_probe"].pop("step")
    path.write_text(json.dumps(cfg))
    return str(path)


def new_run(seed=1):
    ms.set_seed(seed)
    net = MLP()
    return net, ms.nn.SGD(net.trainable_params(), learning_rate=0.05)


def test_config_json_monitor_stop_l2(tmp_path):
    net, opt = new_run()
    dump = tmp_path / "dump"
    debugger = PrecisionDebugger(config_path=write_config(tmp_path / "c.json", dump))
    debugger.monitor(opt)
    grads = []
    train(net, opt, data(5), grads)
    debugger.stop()
    ds = probekit.open_grads(dump)
    assert ds.attrs["level"] == "L2" and ds.attrs["format"] == "probekit.grads/1"
    assert ds["step"].values.tolist() == [0, 1, 2, 3, 4]
    assert ds["param"].values.tolist() == NAMES
    assert ds["shape"].values.tolist()[0] == "(16, 6)"
    assert ds["interval"].values.tolist() == ["(-inf, -0.01]", "(-0.01, 0]", "(0, 0.01]",
                                              "(0.01, inf)"]
    offsets = ds["offset"].values
    for s in range(5):
        for j, g in enumerate(grads[s]):
            x = g.reshape(-1)
            assert ds["max"].values[s, j] == x.max() and ds["min"].values[s, j] == x.min()
            assert ds["norm"].values[s, j] == pytest.approx(
                np.sqrt((x.astype(np.float64) ** 2).sum()), rel=2 ** -24)
            le = [np.count_nonzero(x <= b) for b in (-0.01, 0, 0.01)]
            dist = np.array(np.diff(le, prepend=0).tolist() + [x.size - le[-1]]) / x.size
            assert np.array_equal(ds["dist"].values[s, j], dist)
            assert ds["zeros"].values[s, j] == np.count_nonzero(x == 0) / x.size
            bits = ds["direction"].values[s, offsets[j]:offsets[j] + padded_nbytes(x.size)]
            assert np.array_equal(np.unpackbits(bits, count=x.size).astype(bool), x > 0)


def test_levels_l0_l1(tmp_path):
    import hashlib

    for level in ("L0", "L1"):
        net, opt = new_run()
        grads = []
        probe = GradProbe(opt, grad_level=level, dump_path=tmp_path / level).start()
        train(net, opt, data(2), grads)
        probe.stop()
        ds = probekit.open_grads(tmp_path / level)
        assert ds.attrs["level"] == level
        assert ("direction" in ds) == (level == "L1") and "dist" not in ds
        if level == "L0":
            assert ds["hash"].values[1, 2] == hashlib.md5(grads[1][2].tobytes()).hexdigest()


def test_step_param_list_and_rank_filters(tmp_path, monkeypatch):
    net, opt = new_run()
    debugger = PrecisionDebugger(config_path=write_config(
        tmp_path / "c.json", tmp_path / "d", step=[1, 3], param_list=["fc2.weight", "head.bias"]))
    debugger.monitor(opt)
    train(net, opt, data(5))
    debugger.stop()
    ds = probekit.open_grads(tmp_path / "d")
    assert ds["step"].values.tolist() == [1, 3]
    assert ds["param"].values.tolist() == ["fc2.weight", "head.bias"]
    # rank filter: this process (RANK=2) is not selected: nothing recorded, training unchanged
    monkeypatch.setenv("RANK", "2")
    net, opt = new_run()
    other = PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path / "r"), rank=[0, 1])
    assert not other.active
    other.monitor(opt)
    train(net, opt, data(2))
    other.stop()
    assert not (tmp_path / "r").exists()


def test_bad_param_list_names_key_value_and_accepted(tmp_path):
    net, opt = new_run()
    with pytest.raises(ConfigError, match=r"grad_probe.param_list: \['fc9.weight'\] not found.*"
                                          r"e\.g\. fc1\.weight"):
        GradProbe(opt, param_list=["fc9.weight"], dump_path=tmp_path)
    with pytest.raises(TypeError, match="optimizer: MLP is not valid"):
        GradProbe(net, dump_path=tmp_path)
    with pytest.raises(ConfigError, match="grad_probe.grad_point: 'backward' is not valid for "
                                          "MindSpore; accepted: 'step'") as err:
        GradProbe(opt, grad_point="backward", dump_path=tmp_path)
    assert (err.value.key, err.value.accepted) == ("grad_probe.grad_point", "step")
    with pytest.raises(ConfigError, match="task: 'free_benchmark' is not valid for probekit's "
                                          "MindSpore PrecisionDebugger; accepted: grad_probe"):
        PrecisionDebugger(task="free_benchmark", dump_path=str(tmp_path))


def test_stop_removes_the_hook_and_training_is_unchanged(tmp_path):
    batches = data(4)
    net_a, opt_a = new_run(7)
    probe = GradProbe(opt_a, grad_level="L2", dump_path=tmp_path / "a").start()
    train(net_a, opt_a, batches[:2])
    probe.stop()
    assert "construct" not in opt_a.__dict__  # the optimizer's own construct again
    train(net_a, opt_a, batches[2:])  # after stop(): not seen
    assert probe.steps_seen == 2 and not probe.active
    assert probekit.open_grads(tmp_path / "a")["step"].values.tolist() == [0, 1]
    net_b, opt_b = new_run(7)
    train(net_b, opt_b, batches)  # the same training without the probe
    for pa, pb in zip(net_a.trainable_params(), net_b.trainable_params()):
        assert np.array_equal(pa.asnumpy(), pb.asnumpy())


def test_same_readers_compare_and_msprobe_export(tmp_path):
    runs = []
    for name in ("a", "b"):
        net, opt = new_run(3)
        probe = GradProbe(opt, grad_level="L2", dump_path=tmp_path / name).start()
        train(net, opt, data(3))
        probe.stop()
        runs.append(tmp_path / name)
    res = probekit.compare_grads(*runs)
    assert np.asarray(res["similarity"].values).min() == 1.0
    probekit.GradComparator.compare_distributed(*runs, str(tmp_path / "cmp"), plots="summary")
    csv = (tmp_path / "cmp" / "rank0" / "similarities.csv").read_text(encoding="utf-8-sig")
    assert csv.splitlines()[1].startswith("fc1.weight,1.0,1.0,1.0")
    assert (tmp_path / "cmp" / "rank0" / "similarities_picture" /
            "summary_similarities.png").stat().st_size > 1000
    # msprobe's layout, written by the CLI and read back: the same statistics and signs
    out = subprocess.run([sys.executable, "-m", "probekit.cli", "grads", "export", str(runs[0]),
                          "--to", "msprobe", str(tmp_path / "ms_dump")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "ms_dump" / "rank0").iterdir())[:3] == [
        "grad_summary_0.csv", "grad_summary_1.csv", "grad_summary_2.csv"]
    assert (tmp_path / "ms_dump" / "rank0" / "step2" / "head.weight.npy").is_file()
    back = probekit.open_grads(tmp_path / "ms_dump")
    mine = probekit.open_grads(runs[0])
    for k in ("max", "min", "norm", "dist", "zeros", "direction"):
        assert np.array_equal(back[k].values, mine[k].values), k


def test_debugger_leaves_the_random_streams_alone(tmp_path):
    import random

    ms.set_seed(7)
    np.random.seed(3)
    random.seed(5)
    before = (np.random.get_state()[1].copy(), random.getstate())
    PrecisionDebugger(config_path=write_config(tmp_path / "c.json", tmp_path / "d")).close()
    assert ms.get_seed() == 7                              # not the config's 1234
    assert np.array_equal(np.random.get_state()[1], before[0])
    assert random.getstate() == before[1]


def test_stop_logs_the_one_line_summary_and_the_debugger_has_it(tmp_path, caplog):
    """Issue 21: the same summary as PyTorch's GradProbe (grads/summary.py)."""
    import logging
    import os

    net, opt = new_run()
    debugger = PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path), grad_level="L1")
    assert debugger.summary is None  # before monitor()
    debugger.monitor(opt)
    with caplog.at_level(logging.INFO, logger="probekit"):
        train(net, opt, data(3))
        debugger.stop()
    store = os.path.join(str(tmp_path), "grads.zarr", "rank0")
    n = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs)
    assert debugger.summary == {"steps": 3, "params": 6, "bytes": n, "store": store}
    line = f"grad_probe: 3 steps x 6 params recorded, {n / 1024:.1f} KiB ({n:,} bytes) in {store}"
    assert str(debugger.probe.summary) == line
    assert [r.getMessage() for r in caplog.records if "recorded," in r.getMessage()] == [
        "[probekit] " + line]
    debugger.close()
