"""Module scope of the free benchmark: only calls made inside the named modules are checked
(nested submodules, a module called twice, the backward stage), the ``module`` column, the
intersection with scope/list, clear errors, hooks removed on stop, training unchanged."""
import csv

import pandas as pd

import pytest
import torch
from torch import nn

from probekit.config import ConfigError, make_config
from probekit.freebench import COLUMNS, FreeBench
from probekit.freebench.report.results import MSPROBE_COLUMNS


def cancel(h):
    """fp32 catastrophic cancellation: add_noise/bit_noise flag the subtraction every time."""
    return (h + 30000.0) - 30000.0   # one ulp of 30000 is 8x sqrt(u) of an O(1) result


class Inner(nn.Module):
    def __init__(self, planted):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.planted = planted

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return cancel(h) if self.planted else h


class Block(nn.Module):
    def __init__(self, planted=False):
        super().__init__()
        self.inner = Inner(planted)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x + self.inner(x) * self.scale


class Net(nn.Module):
    def __init__(self, planted=(1,)):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(i in planted) for i in range(3)])
        self.shared = Block(planted=True)   # called twice per forward
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = self.shared(self.shared(x))
        return cancel(self.head(x))


X = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def run(tmp_path, module=None, stage="forward", **options):
    model = Net()
    if module is not None:
        options["module"] = module
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="add_noise", fuzz_stage=stage,
                   model=model, **options)
    with fb:
        model(X).sum().backward()
    return fb


def flagged(fb):
    df = fb.results
    return sorted(zip(df["api_name"], df["module"], df["stage"]))


def test_scope_to_one_module_nested_submodules_included(tmp_path):
    fb = run(tmp_path, "blocks.1")
    assert flagged(fb) == [("Tensor.__sub__.0.forward", "blocks.1.inner", "forward")]
    # blocks.1 makes 6 calls (linear, tanh, add, sub, mul, residual add); outside it: blocks 0
    # and 2 (4 each), shared (6, twice), head (linear, add, sub), sum, backward
    assert fb.summary["checked"] == 6
    assert fb.summary["skipped"] == {"out_of_module": 8 + 12 + 3 + 2}
    assert fb.summary["calls"] == 6 + 25


def test_clean_module_flags_nothing(tmp_path):
    fb = run(tmp_path, ["blocks.0", "blocks.2"])
    assert flagged(fb) == [] and fb.summary["checked"] == 8


def test_module_called_twice_per_step(tmp_path):
    fb = run(tmp_path, "shared")
    # the shared block's subtraction is checked at both calls (numbered as in an unscoped run:
    # blocks.1 made Tensor.__sub__.0); head's subtraction (.3) is outside
    assert flagged(fb) == [("Tensor.__sub__.1.forward", "shared.inner", "forward"),
                           ("Tensor.__sub__.2.forward", "shared.inner", "forward")]
    assert fb.summary["checked"] == 12


def test_innermost_module_named_and_plural_spelling(tmp_path):
    fb = run(tmp_path, modules=["blocks.1.inner.fc", "head"])
    assert fb.config.free_benchmark.module == ("blocks.1.inner.fc", "head")
    assert flagged(fb) == []            # head's subtraction runs after head's forward returned
    assert fb.summary["checked"] == 2   # blocks.1.inner.fc's linear and head's linear
    with pytest.raises(ConfigError, match="both as module= and modules="):
        FreeBench(dump_path=str(tmp_path), module="head", modules=["head"])


def test_backward_stage_checks_the_modules_calls(tmp_path):
    model = Net()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", fuzz_stage="backward",
                   model=model, module="blocks.2",
                   thresholds={"float32": 1e-9})   # so that every checked gradient is a finding
    with fb:
        model(X).sum().backward()
    df = pd.concat([fb.results, fb.hotspots])   # the analysis finds no kernel to blame
    assert set(df["stage"]) == {"backward"}
    assert set(df["module"]) == {"blocks.2", "blocks.2.inner", "blocks.2.inner.fc"}
    # the residual add's gradient is exact: checked, not flagged
    assert sorted(set(df["api_name"])) == ["Functional.linear.2.backward",
                                          "Tensor.__mul__.2.backward", "Torch.tanh.2.backward"]
    assert fb.summary["checked"] == 4
    assert fb.summary["skipped"] == {"out_of_module": 27}


def test_intersection_with_scope_and_list(tmp_path):
    fb = run(tmp_path, ["blocks.1", "shared"], list=["__sub__"])
    assert [a for a, _, _ in flagged(fb)] == ["Tensor.__sub__.0.forward",
                                              "Tensor.__sub__.1.forward",
                                              "Tensor.__sub__.2.forward"]
    assert fb.summary["checked"] == 3
    fb = run(tmp_path, "shared", scope=["Tensor.__sub__.0.forward", "Tensor.__sub__.2"])
    assert flagged(fb) == [("Tensor.__sub__.2.forward", "shared.inner", "forward")]
    assert fb.summary["checked"] == 1


def test_module_column_after_msprobe_columns_in_frame_and_csv(tmp_path):
    fb = run(tmp_path, "blocks.1")
    assert COLUMNS[:9] == MSPROBE_COLUMNS and "module" in COLUMNS[9:]
    assert list(fb.results.columns) == list(COLUMNS)
    with open(fb.csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["module"] for r in rows] == ["blocks.1.inner"]
    # without module scope the column is empty
    fb = FreeBench(dump_path=str(tmp_path / "plain"), pert_mode="add_noise")
    with fb:
        cancel(torch.ones(3))
    assert list(fb.results["module"]) == [""]


def test_unknown_module_names_close_names(tmp_path):
    with pytest.raises(ConfigError, match=r"free_benchmark\.module: 'blocks\.1\.iner' is not a "
                       r"module of this Net; accepted: close names: 'blocks\.1\.inner'"):
        FreeBench(dump_path=str(tmp_path), model=Net(), module="blocks.1.iner")
    fb = FreeBench(dump_path=str(tmp_path), module="blocks.7")
    with pytest.raises(ConfigError, match="needs the model"):
        fb.start()
    with pytest.raises(ConfigError, match=r"'blocks\.7' is not a module of this Net; accepted: "
                       r"close names: 'blocks\.2', 'blocks\.1', 'blocks\.0', 'blocks', "):
        fb.start(Net())
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(ConfigError, match=r"free_benchmark\.module: 1 is not valid; "
                       "accepted: a list of strings"):
        make_config("free_benchmark", module=1)
    assert make_config("free_benchmark", module="a.b").free_benchmark.module == ("a.b",)


def test_hooks_removed_on_stop_even_after_an_error(tmp_path):
    model = Net()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="add_noise", model=model, module="blocks")
    with pytest.raises(RuntimeError, match="boom"):
        with fb:
            model(X)
            raise RuntimeError("boom")
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    assert hooks == 0 and fb._engine.modules is None
    assert torch._C._len_torch_function_stack() == 0


def test_check_mode_leaves_training_unchanged(tmp_path):
    def train(probe):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(5)
        fb = FreeBench(dump_path=str(tmp_path), pert_mode="add_noise", fuzz_stage="backward",
                       model=model, module=["blocks.1", "shared"])
        losses = []
        for _ in range(3):
            if probe:
                fb.start()
            loss = model(X + torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            fb.stop()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()], \
            torch.get_rng_state()

    plain, probed = train(False), train(True)
    assert torch.equal(plain[0], probed[0]) and torch.equal(plain[2], probed[2])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], probed[1]))


def test_config_json_key_and_precision_debugger(tmp_path):
    from probekit import PrecisionDebugger
    from probekit.config import Config

    cfg = make_config("free_benchmark", dump_path=str(tmp_path), pert_mode="add_noise",
                      module=["blocks.1"])
    assert cfg.to_dict()["free_benchmark"]["module"] == ["blocks.1"]
    assert Config.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "config.json"
    cfg.to_json(path)
    model = Net()
    debugger = PrecisionDebugger(config_path=str(path))
    debugger.start(model)
    model(X)
    debugger.stop()
    df = debugger.results
    assert sorted(zip(df["api_name"], df["module"])) == [("Tensor.__sub__.0.forward",
                                                          "blocks.1.inner")]
