"""Compiled MindSpore training recorded: an @ms.jit train step with the optimizer inside,
GRAPH_MODE with a TrainOneStepCell, GRAPH_MODE with the optimizer called on its own, record the
same values as PyNative for the same training, into the same store; filters, L0 MD5, exit
without stop(), and what is still refused (GraphModeError naming it)."""
import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

import probekit  # noqa: E402
from probekit.grads.numerics.stats import padded_nbytes  # noqa: E402
from probekit.mindspore import GradProbe, GraphModeError, PrecisionDebugger  # noqa: E402

from ms_models import MLP, MODES, data, graph_mode, make_step, run_steps, train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUNDS = [-0.01, 0, 0.01]
STEPS = 4
KEYS = ("present", "max", "min", "zeros", "dist", "direction", "significant")


def new_run(seed=1, lr=0.05, adam=False):
    ms.set_seed(seed)
    net = MLP()
    opt = (ms.nn.Adam(net.trainable_params(), learning_rate=0.01) if adam
           else ms.nn.SGD(net.trainable_params(), learning_rate=lr))
    return net, opt


def record(mode, dump, batches, where="auto", adam=False, **options):
    """Train in ``mode`` with a probe on; the losses (the probe is stopped after)."""
    net, opt = new_run(adam=adam)
    with graph_mode(mode):
        probe = GradProbe(opt, dump_path=dump, where=where, **options).start()
        try:
            losses = run_steps(make_step(mode, net, opt), batches)
        finally:
            probe.stop()
    assert probe.steps_seen == len(batches)
    return losses


def numpy_expected(grads):
    """Per step and parameter, the statistics numpy gives for these gradients."""
    out = []
    for step in grads:
        rows = []
        for g in step:
            x = g.reshape(-1)
            le = [np.count_nonzero(x <= np.float32(b)) for b in BOUNDS]
            big = np.abs(x) > np.float32(2.0 ** -23) * np.abs(x).max()
            rows.append({"max": x.max(), "min": x.min(),
                         "norm": np.sqrt((x.astype(np.float64) ** 2).sum()),
                         "dist": np.array(np.diff(le, prepend=0).tolist() + [x.size - le[-1]])
                         / x.size,
                         "zeros": np.count_nonzero(x == 0) / x.size,
                         "signs": x > 0, "big": big})
        out.append(rows)
    return out


def test_pynative_jit_and_graph_mode_record_the_same_values(tmp_path):
    batches = data(STEPS, seed=2)
    # the reference: PyNative, the gradients kept, recomputed with numpy
    net, opt = new_run()
    grads = []
    probe = GradProbe(opt, grad_level="L2", bounds=BOUNDS, significance=True,
                      dump_path=tmp_path / "reference").start()
    train(net, opt, batches, grads)
    probe.stop()
    ref = probekit.open_grads(tmp_path / "reference")
    offsets = ref["offset"].values
    for s, rows in enumerate(numpy_expected(grads)):
        for j, want in enumerate(rows):
            n = want["signs"].size
            assert ref["max"].values[s, j] == want["max"]
            assert ref["min"].values[s, j] == want["min"]
            assert ref["norm"].values[s, j] == pytest.approx(want["norm"], rel=2 ** -24)
            assert np.array_equal(ref["dist"].values[s, j], want["dist"])
            assert ref["zeros"].values[s, j] == want["zeros"]
            span = slice(offsets[j], offsets[j] + padded_nbytes(n))
            assert np.array_equal(np.unpackbits(ref["direction"].values[s, span], count=n),
                                  want["signs"])
            assert np.array_equal(np.unpackbits(ref["significant"].values[s, span], count=n),
                                  want["big"])
    # the same training without a probe: the probe changes nothing
    net, opt = new_run()
    plain = run_steps(make_step("pynative", net, opt), batches)
    for mode in MODES:
        losses = record(mode, tmp_path / mode, batches, grad_level="L2", bounds=BOUNDS,
                        significance=True)
        assert losses == plain, mode
        ds = probekit.open_grads(tmp_path / mode)
        assert ds["step"].values.tolist() == list(range(STEPS))
        assert ds["param"].values.tolist() == ref["param"].values.tolist()
        for k in KEYS:
            assert np.array_equal(ds[k].values, ref[k].values), (mode, k)
        assert np.array_equal(ds["norm"].values, ref["norm"].values), mode


def test_in_graph_statistics_equal_the_host_path(tmp_path):
    """where="device": the statistics computed by MindSpore ops inside the training graph
    (the path for Ascend/GPU, run here on the CPU) equal the host path's."""
    batches = data(3, seed=5)
    runs = [("jit", "L2", True), ("graph_cell", "L1", False), ("jit", "L0", False)]
    for mode, level, sig in runs:
        for where in ("host", "device"):
            losses = record(mode, tmp_path / f"{mode}{level}{where}", batches, where=where,
                            adam=True, grad_level=level, bounds=BOUNDS, significance=sig)
        a, b = (probekit.open_grads(tmp_path / f"{mode}{level}{w}") for w in ("host", "device"))
        for k in (*KEYS, "hash"):
            assert (k in a) == (k in b), k
            if k in a:
                assert np.array_equal(a[k].values, b[k].values), (mode, level, k)
        assert np.allclose(a["norm"].values, b["norm"].values, rtol=2 ** -24, atol=0)
        assert ("significant" in a) == sig and ("hash" in a) == (level == "L0")
    assert len(losses) == 3


@pytest.mark.parametrize("sink", [False, True])
def test_model_train_in_graph_mode(tmp_path, sink):
    """mindspore.train.Model.train (GRAPH_MODE, 2 epochs of a dataset; on the CPU also with
    dataset_sink_mode): every step recorded, the values of a PyNative run of the same batches."""
    import mindspore.dataset as msds

    batches = data(4, seed=12)
    record("pynative", tmp_path / "ref", batches * 2, grad_level="L1")
    net, opt = new_run()
    dset = msds.GeneratorDataset(lambda: iter(batches), ["x", "y"], shuffle=False)
    with graph_mode("graph_model"):
        probe = GradProbe(opt, grad_level="L1", dump_path=tmp_path / "model").start()
        ms.train.Model(net, ms.nn.MSELoss(), opt).train(2, dset, dataset_sink_mode=sink)
        probe.stop()
    ref, got = probekit.open_grads(tmp_path / "ref"), probekit.open_grads(tmp_path / "model")
    assert got["step"].values.tolist() == list(range(8))
    for k in ("max", "min", "norm", "direction"):
        assert np.array_equal(got[k].values, ref[k].values), k


def test_graph_mode_set_after_monitor(tmp_path):
    batches = data(3, seed=4)
    net, opt = new_run()
    dbg = PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path / "late"), grad_level="L2")
    dbg.monitor(opt)  # PyNative here
    with graph_mode("graph_cell"):
        run_steps(make_step("graph_cell", net, opt), batches)
    dbg.stop()
    assert probekit.open_grads(tmp_path / "late")["step"].values.tolist() == [0, 1, 2]


def test_l0_md5_in_a_compiled_step(tmp_path):
    batches = data(2, seed=6)
    net, opt = new_run()
    grads = []
    train(net, opt, batches, grads)  # the gradients of this training, in PyNative
    record("jit", tmp_path / "l0", batches, grad_level="L0")
    ds = probekit.open_grads(tmp_path / "l0")
    assert ds.attrs["hash_algorithm"] == "md5"
    for s in range(2):
        for j, g in enumerate(grads[s]):
            assert ds["hash"].values[s, j] == hashlib.md5(g.tobytes()).hexdigest()


def test_step_param_and_rank_filters_in_graph_mode(tmp_path, monkeypatch):
    batches = data(5, seed=7)
    record("graph_cell", tmp_path / "f", batches, grad_level="L1", step=[1, 3],
           param_list=["fc2.weight", "head.bias"])
    ds = probekit.open_grads(tmp_path / "f")
    assert ds["step"].values.tolist() == [1, 3]
    assert ds["param"].values.tolist() == ["fc2.weight", "head.bias"]
    record("jit", tmp_path / "all", batches, grad_level="L1")
    full = probekit.open_grads(tmp_path / "all")
    for k in ("max", "norm"):
        assert np.array_equal(ds[k].values, full[k].sel(step=[1, 3],
                                                        param=["fc2.weight", "head.bias"]).values)
    monkeypatch.setenv("RANK", "2")  # not in the rank filter: nothing recorded or installed
    net, opt = new_run()
    with graph_mode("graph_cell"):
        dbg = PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path / "r"), rank=[0, 1])
        dbg.monitor(opt)
        run_steps(make_step("graph_cell", net, opt), batches[:2])
        dbg.stop()
    assert not (tmp_path / "r").exists() and "construct" not in opt.__dict__


def test_a_second_probe_reuses_the_compiled_step(tmp_path):
    """A graph compiled with a probe keeps its tap: the next probe on that optimizer records
    through it (steps counted from its start), and nothing is recorded in between."""
    batches = data(6, seed=8)
    net, opt = new_run()
    step = make_step("jit", net, opt)
    first = GradProbe(opt, grad_level="L1", dump_path=tmp_path / "a").start()
    run_steps(step, batches[:2])
    first.stop()
    run_steps(step, batches[2:3])  # no probe: dropped by the tap
    second = GradProbe(opt, grad_level="L2", bounds=BOUNDS, dump_path=tmp_path / "b").start()
    run_steps(step, batches[3:])
    second.stop()
    assert probekit.open_grads(tmp_path / "a")["step"].values.tolist() == [0, 1]
    b = probekit.open_grads(tmp_path / "b")
    assert b["step"].values.tolist() == [0, 1, 2] and b.attrs["level"] == "L2"
    assert first.steps_seen == 2 and second.steps_seen == 3


def test_step_compiled_before_monitor_is_named(tmp_path):
    batches = data(3, seed=9)
    net, opt = new_run()
    step = make_step("jit", net, opt)
    run_steps(step, batches[:1])  # compiled without the probe
    probe = GradProbe(opt, dump_path=tmp_path / "late").start()
    run_steps(step, batches[1:])
    with pytest.raises(GraphModeError, match=r"ran 2 step\(s\) that probekit did not see.*"
                                             r"compiled before monitor\(\).*Call monitor\(\) "
                                             r"before the first call"):
        probe.stop()
    assert probekit.open_grads(tmp_path / "late").sizes["step"] == 0  # written, empty


def test_an_optimizer_that_cannot_be_tapped_is_refused_by_name(tmp_path):
    class TwoArgs(ms.nn.Optimizer):
        def __init__(self, params):
            super().__init__(0.1, params)

        def construct(self, gradients, scale):
            return gradients

    net = MLP()
    with pytest.raises(GraphModeError, match=r"TwoArgs cannot be monitored: its construct "
                                             r"takes \(gradients, scale\)"):
        GradProbe(TwoArgs(net.trainable_params()), dump_path=tmp_path).start()


class PlainSGD(ms.nn.Optimizer):
    """An optimizer whose construct is not @jit: PyNative runs it, and the tap, as Python."""

    def __init__(self, params, lr):
        super().__init__(lr, params)
        self.lr_value = lr

    def construct(self, gradients):
        for p, g in zip(self.parameters, gradients):
            ms.ops.assign(p, p - self.lr_value * g)
        return True


def test_an_uncompiled_optimizer_in_pynative_and_in_a_jit_step(tmp_path):
    batches = data(3, seed=10)
    stores = []
    for mode in ("pynative", "jit"):
        ms.set_seed(1)
        net = MLP()
        opt = PlainSGD(net.trainable_params(), 0.05)
        probe = GradProbe(opt, grad_level="L2", bounds=BOUNDS, significance=True,
                          dump_path=tmp_path / mode).start()
        run_steps(make_step(mode, net, opt), batches)
        probe.stop()
        stores.append(probekit.open_grads(tmp_path / mode))
    for k in KEYS:
        assert np.array_equal(stores[0][k].values, stores[1][k].values), k
    assert stores[0].sizes["step"] == 3


RECORDER = textwrap.dedent("""
    import sys, numpy as np, mindspore as ms
    sys.path.insert(0, sys.argv[2])
    from ms_models import MLP, data, graph_mode, make_step, run_steps
    from probekit.mindspore import GradProbe, PrecisionDebugger
    mode, how = sys.argv[3], sys.argv[4]
    ms.set_seed(1)
    net = MLP()
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=0.05)
    options = dict(task="grad_probe", dump_path=sys.argv[1], grad_level="L1", flush_every=4)
    if how == "debugger":
        PrecisionDebugger(**options).monitor(opt)
    else:
        options.pop("task")
        GradProbe(opt, **options).start()
    with graph_mode(mode):
        step = make_step(mode, net, opt)
        for x, y in data(7, seed=3):
            loss = step(ms.Tensor(x), ms.Tensor(y))  # never waited for (PyNative: queued)
    # no stop(): the exit handlers wait for the queued steps and write them
""")


@pytest.mark.parametrize("mode,how", [("graph_cell", "debugger"), ("jit", "probe")])
def test_exit_without_stop_keeps_every_step(tmp_path, mode, how):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RECORDER, str(tmp_path / "d"),
                          os.path.dirname(os.path.abspath(__file__)), mode, how],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ds = probekit.open_grads(tmp_path / "d")
    assert ds["step"].values.tolist() == list(range(7))  # 7: not a multiple of flush_every
    assert np.isfinite(ds["norm"].values).all() and (ds["norm"].values > 0).all()


def test_sliced_parameters_are_refused_by_name(tmp_path):
    net, opt = new_run()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        with pytest.raises(GraphModeError, match="parallel_mode='semi_auto_parallel' \\(parameters "
                                                 "sliced by the compiler\\) is not supported.*"
                                                 "Record with parallel_mode 'stand_alone'"):
            GradProbe(opt, dump_path=tmp_path).start()
    finally:
        ms.reset_auto_parallel_context()
    assert "construct" not in opt.__dict__ and not (tmp_path / "grads.zarr").exists()
