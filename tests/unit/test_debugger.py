"""The facade's dispatch, rank filter, class-level calls, seeding, context manager."""
import sys
import types

import pytest
import torch

import probekit
from probekit import PrecisionDebugger
from probekit import debugger as dbg


class Recorder:
    """A feature session that records the calls the facade makes (our own protocol)."""

    def __init__(self, config):
        self.config = config
        self.calls = []
        self.results = "results"

    def start(self, model=None):
        self.calls.append(("start", model))

    def stop(self):
        self.calls.append(("stop",))

    def step(self):
        self.calls.append(("step",))

    def monitor(self, model, optimizer=None):
        self.calls.append(("monitor", model, optimizer))

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def recorder_feature(monkeypatch, tmp_path):
    module = types.ModuleType("probekit_test_feature")
    module.open_session = Recorder
    monkeypatch.setitem(sys.modules, "probekit_test_feature", module)
    for task in ("free_benchmark", "grad_probe"):
        monkeypatch.setitem(dbg.FEATURES, task, "probekit_test_feature:open_session")
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def test_dispatch_start_stop_step(recorder_feature):
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(recorder_feature))
    model = torch.nn.Linear(2, 2)
    d.start(model)
    d.stop()
    d.step()
    session = d._session
    assert session.calls == [("start", model), ("stop",), ("step",)]
    assert d.results == "results"
    d.close()
    assert session.calls[-1] == ("close",)
    with pytest.raises(RuntimeError, match="closed"):
        d.start()


def test_class_level_calls_reach_newest_instance(recorder_feature):
    PrecisionDebugger(task="free_benchmark", dump_path=str(recorder_feature))
    d2 = PrecisionDebugger(task="free_benchmark", dump_path=str(recorder_feature))
    PrecisionDebugger.start()
    PrecisionDebugger.stop()
    PrecisionDebugger.step()
    assert d2._session.calls == [("start", None), ("stop",), ("step",)]
    d2.close()


def test_monitor_only_for_grad_probe(recorder_feature, caplog):
    model = torch.nn.Linear(2, 2)
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(recorder_feature))
    d.monitor(model)
    assert d._session is None
    assert "[probekit] monitor() only applies to task 'grad_probe'" in caplog.text
    g = PrecisionDebugger(task="grad_probe", dump_path=str(recorder_feature))
    g.monitor(model)
    assert g._session.calls == [("monitor", model, None)]
    g.close()


def test_rank_filter_makes_calls_no_ops(recorder_feature, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(recorder_feature), rank=[0])
    assert not d.active
    d.start()
    d.stop()
    d.step()
    assert d._session is None
    monkeypatch.setenv("RANK", "0")
    assert d.active
    d.start()
    assert d._session.calls == [("start", None)]
    d.close()


def test_context_manager_starts_and_closes(recorder_feature):
    with PrecisionDebugger(task="free_benchmark", dump_path=str(recorder_feature)) as d:
        pass
    assert d._session.calls == [("start", None), ("close",)]


def test_config_file_with_overrides(recorder_feature, msprobe_config_dict):
    import json

    path = recorder_feature / "config.json"
    path.write_text(json.dumps(msprobe_config_dict))
    d = PrecisionDebugger(config_path=str(path), dump_path=str(recorder_feature / "out"))
    assert d.task == "free_benchmark"
    assert d.config.dump_path == str(recorder_feature / "out")
    d2 = PrecisionDebugger(str(path), task="grad_probe")
    assert d2.task == "grad_probe" and d2.config.grad_probe.grad_level == "L1"
    d.close()
    d2.close()


def test_missing_feature_raises_not_implemented(monkeypatch, tmp_path):
    monkeypatch.setitem(dbg.FEATURES, "grad_probe", "probekit.no_such_feature:open_session")
    d = PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path))
    with pytest.raises(NotImplementedError, match="the grad_probe feature is not implemented"):
        d.monitor(torch.nn.Linear(1, 1))
    d.close()


def test_seed_applied_at_creation(tmp_path):
    torch.manual_seed(7)
    expected = torch.rand(4)
    PrecisionDebugger(task="free_benchmark", dump_path=str(tmp_path), seed=7).close()
    assert torch.equal(torch.rand(4), expected)


def test_grad_probe_leaves_the_random_streams_alone(tmp_path):
    """msprobe does not apply ``seed`` for the grad probe; an observer must not reseed: the
    python, numpy and torch streams continue exactly as without the debugger."""
    import random

    import numpy as np

    cfg = tmp_path / "config.json"
    cfg.write_text('{"task": "grad_probe", "dump_path": "%s"}' % tmp_path)
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    expected = torch.rand(4), random.random(), np.random.rand()
    torch.set_rng_state(states[0]), random.setstate(states[1]), np.random.set_state(states[2])
    d = PrecisionDebugger(config_path=str(cfg))
    d.monitor(model)
    got = torch.rand(4), random.random(), np.random.rand()
    d.close()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_is_deterministic(tmp_path):
    before = torch.are_deterministic_algorithms_enabled()
    try:
        PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path), is_deterministic=True).close()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_bad_arguments(tmp_path):
    with pytest.raises(probekit.ConfigError, match="task: missing"):
        PrecisionDebugger(dump_path=str(tmp_path))
    with pytest.raises(probekit.ConfigError, match="free_benchmark key: 'pertmode'"):
        PrecisionDebugger(task="free_benchmark", pertmode="bit_noise")


def test_class_call_without_instance(monkeypatch):
    monkeypatch.setattr(PrecisionDebugger, "_newest", None)
    with pytest.raises(RuntimeError, match="no PrecisionDebugger has been created"):
        PrecisionDebugger.start()


def test_summary_of_the_free_benchmark(tmp_path):
    """Issue 21: ``.summary`` beside ``.results``: the counts, one line as a string."""
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(tmp_path), pert_mode="bit_noise")
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    d.start()
    a + b  # cancellation: bit_noise flags it
    d.stop()
    d.step()
    assert d.summary == {"calls": 1, "checked": 1, "skipped": {}, "flagged": 1, "steps": 1,
                         "float_calls": 1, "checked_share": 1.0, "float_skipped": {}}
    assert str(d.summary) == ("1 call seen · 1 checked (100 % of 1 floating-point call) · "
                              "0 skipped · 1 flagged · 1 step")
    assert str(d.summary) in repr(d._session)  # the findings view's own line, not a second one
    d.close()


def test_summary_of_the_grad_probe(tmp_path):
    import os

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    d = PrecisionDebugger(task="grad_probe", dump_path=str(tmp_path), grad_level="L1")
    assert d.summary is None  # before monitor()
    d.monitor(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad()
        model(torch.ones(5, 3)).sum().backward()
        opt.step()
    d.stop()  # nothing for grad_probe (as in msprobe); summary writes the buffered steps
    summary = d.summary
    store = os.path.join(str(tmp_path), "grads.zarr", "rank0")
    n = sum(os.path.getsize(os.path.join(f, x)) for f, _, xs in os.walk(store) for x in xs)
    assert summary == {"steps": 4, "params": 4, "bytes": n, "store": store, "no_grad": 0}
    assert str(summary) == (f"grad_probe: 4 steps x 4 params recorded, {n / 1024:.1f} KiB "
                            f"({n:,} bytes) in {store}")
    d.close()


def test_summary_on_a_rank_the_filter_excludes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(tmp_path), rank=[0])
    assert d.summary is None
    d.close()
