"""Config panels: set values, call the apply handler directly (ipywidgets swallows exceptions in
button callbacks), invalid input shown in the panel and never applied."""
import dataclasses
import json

import ipywidgets as w
import pytest
from IPython.core.interactiveshell import InteractiveShell

from probekit.config import (FUZZ_STAGES, GRAD_POINTS, PERT_MODES, Config, ConfigError,
                             FreeBenchmarkConfig, GradProbeConfig, make_config)
from probekit.notebook import FreeBenchPanel, GradProbePanel
from probekit.notebook import magics


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    magics.unregister(ip)
    yield ip
    magics.unregister(ip)


def test_controls_cover_every_config_field():
    fb = FreeBenchPanel(use_for_magic=False)
    json_names = {"api_list": "list"}
    expected = {json_names.get(f.name, f.name) for f in dataclasses.fields(FreeBenchmarkConfig)}
    assert set(fb.controls) == expected | {"dump_path", "rank", "step"}
    gp = GradProbePanel()
    assert set(gp.controls) == {f.name for f in dataclasses.fields(GradProbeConfig)} | {
        "dump_path", "rank", "step"}
    # control kinds come from the field values: dropdowns carry the config's own enumerations
    assert isinstance(fb.controls["pert_mode"], w.Dropdown)
    assert fb.controls["pert_mode"].options == PERT_MODES
    assert fb.controls["fuzz_stage"].options == FUZZ_STAGES
    assert isinstance(fb.controls["scope"], w.TagsInput)
    assert isinstance(fb.controls["if_preheat"], w.Checkbox)
    assert isinstance(fb.controls["preheat_step"], w.IntText)
    assert set(fb.controls["thresholds"]) == {"float16", "bfloat16", "float32", "other"}
    assert isinstance(gp.controls["param_list"], w.TagsInput)
    assert gp.controls["bounds"].value == "-1, 0, 1"


def test_defaults_are_the_config_defaults():
    assert FreeBenchPanel(use_for_magic=False).config == make_config("free_benchmark")
    assert GradProbePanel().config == make_config("grad_probe")


def test_set_values_and_apply_returns_frozen_config(tmp_path):
    seen = []
    panel = FreeBenchPanel(use_for_magic=False, on_apply=seen.append)
    panel.controls["pert_mode"].value = "bit_noise"
    panel.controls["fuzz_stage"].value = "backward"
    panel.controls["list"].value = ["matmul", "softmax"]
    panel.controls["thresholds"]["float16"].value = 0.001
    panel.controls["if_preheat"].value = True
    panel.controls["preheat_step"].value = 3
    panel.controls["dump_path"].value = str(tmp_path)
    panel.controls["rank"].value = "0, 2"
    assert panel.error == ""
    assert "not applied yet" in panel.status.value
    cfg = panel.apply()                       # what the Apply button's on_click calls
    assert isinstance(cfg, Config) and panel.applied is cfg and seen == [cfg]
    fb = cfg.free_benchmark
    assert (fb.pert_mode, fb.fuzz_stage, fb.api_list, fb.if_preheat, fb.preheat_step) == (
        "bit_noise", "backward", ("matmul", "softmax"), True, 3)
    assert dict(fb.thresholds) == {"float16": 0.001}   # 0 in a field: from the dtype's roundoff
    assert (cfg.dump_path, cfg.rank) == (str(tmp_path), (0, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dump_path = "x"
    assert "✓ Applied: " in panel.status.value and "pert_mode=&#x27;bit_noise&#x27;" in (
        panel.status.value)
    assert json.loads(panel.preview.value.split(">", 1)[1].rsplit("<", 1)[0].replace(
        "&quot;", '"'))["free_benchmark"]["list"] == ["matmul", "softmax"]
    # the button really is wired to apply
    panel.controls["pert_mode"].value = "add_noise"
    panel.apply_button.click()
    assert panel.applied.free_benchmark.pert_mode == "add_noise"


@pytest.mark.parametrize("key, value, message", [
    ("pert_mode", "to_cpu", "free_benchmark.fuzz_device: 'npu' is not valid with pert_mode "
                            "'to_cpu'; accepted: 'cpu'"),
    ("handler_type", "fix", None),     # with bit_noise: fix needs improve_precision / to_cpu
    ("preheat_step", 0, "free_benchmark.preheat_step: 0 is not valid; accepted: an integer > 0"),
    ("max_sample", -3, "free_benchmark.max_sample: -3 is not valid; accepted: an integer > 0"),
    ("budget", "fast", "free_benchmark.budget: 'fast' is not valid; accepted: a number > 0"),
    ("budget", "-1", "free_benchmark.budget: -1.0 is not valid; accepted: a finite number > 0"),
    ("rank", "0, x", "rank: '0, x' is not valid; accepted: integers >= 0 separated by commas"),
    ("step", "-1", "step: -1 is not valid; accepted: integers >= 0 in the list"),
    ("dump_path", "", "dump_path: '' is not valid; accepted: a non-empty path string"),
])
def test_invalid_input_is_shown_and_never_applied(key, value, message):
    panel = FreeBenchPanel(use_for_magic=False)
    panel.controls["pert_mode"].value = "bit_noise"
    first = panel.apply()
    panel.controls[key].value = value
    if message is None:
        message = ("free_benchmark.pert_mode: 'bit_noise' is not valid with handler_type 'fix'; "
                   "accepted: improve_precision, to_cpu")
    assert panel.error.startswith(message)
    assert "✗ " in panel.status.value and "probekit-error" in panel.status.value
    expected_key = {"handler_type": "pert_mode", "pert_mode": "fuzz_device"}.get(key, key)
    assert panel.error_key == expected_key
    assert panel.controls[expected_key].layout.border == "2px solid #d32f2f"
    assert panel.apply_button.disabled
    assert panel.apply() is None and panel.applied is first
    with pytest.raises(ConfigError):
        panel.config
    # fixing the value clears the message and the outline
    panel.controls[key].value = {"pert_mode": "bit_noise", "handler_type": "check",
                                 "preheat_step": 15, "max_sample": 20, "rank": "", "budget": "",
                                 "step": "", "dump_path": "./dump_path"}[key]
    assert panel.error == "" and not panel.apply_button.disabled
    assert panel.controls[expected_key].layout.border == ""


def test_thresholds_validation_marks_the_threshold_inputs():
    panel = FreeBenchPanel(use_for_magic=False)
    panel.set(thresholds={"bfloat16": -1.0})
    assert panel.error == ("free_benchmark.thresholds.bfloat16: -1.0 is not valid; accepted: a "
                           "finite number > 0")
    assert panel.error_key == "thresholds"
    assert all(c.layout.border for c in panel.controls["thresholds"].values())


def test_scope_and_list_together_are_rejected():
    panel = FreeBenchPanel(use_for_magic=False)
    panel.set(scope=["Torch.matmul.0.forward"], list=["relu"])
    assert "were both given; accepted: one of them (or neither)" in panel.error
    assert panel.error_key == "scope"


def test_grad_probe_panel_bounds_and_levels():
    panel = GradProbePanel()
    panel.set(grad_level="L2", bounds="-0.5, 0, 0.5", param_list=["fc.weight"], flush_every=10)
    cfg = panel.apply()
    assert cfg.task == "grad_probe"
    assert (cfg.grad_probe.grad_level, cfg.grad_probe.bounds, cfg.grad_probe.param_list,
            cfg.grad_probe.flush_every) == ("L2", (-0.5, 0, 0.5), ("fc.weight",), 10)
    panel.set(bounds="1, 0")
    assert panel.error == ("grad_probe.bounds: [1, 0] is not valid; accepted: numbers in strictly "
                           "ascending order")
    panel.set(bounds="a, b")
    assert panel.error.startswith("grad_probe.bounds: 'a, b' is not valid; accepted: numbers")
    assert panel.error_key == "bounds" and panel.applied is cfg


def test_grad_probe_panel_grad_point_dropdown():
    panel = GradProbePanel()
    control = panel.controls["grad_point"]
    assert isinstance(control, w.Dropdown)
    assert control.options == GRAD_POINTS == ("step", "backward")
    assert control.value == "step"
    panel.set(grad_point="backward")
    cfg = panel.apply()
    assert cfg.grad_probe.grad_point == "backward"
    assert "Applied: grad_point=&#x27;backward&#x27;" in panel.status.value
    assert GradProbePanel(cfg).controls["grad_point"].value == "backward"


def test_panel_starts_from_a_config_keeping_uncontrolled_keys(tmp_path):
    cfg = make_config("free_benchmark", pert_mode="add_noise", seed=7, dump_path=str(tmp_path))
    path = tmp_path / "config.json"
    cfg.to_json(path)
    for source in (cfg, str(path)):
        panel = FreeBenchPanel(source, use_for_magic=False)
        assert panel.controls["pert_mode"].value == "add_noise"
        assert panel.config == cfg                     # seed kept though it has no control
    panel = FreeBenchPanel(FreeBenchmarkConfig(pert_mode="change_value"), use_for_magic=False)
    assert panel.config.free_benchmark.pert_mode == "change_value"
    panel = GradProbePanel(cfg)                           # other task: its section, same top keys
    assert panel.config.task == "grad_probe" and panel.config.seed == 7


def test_set_rejects_unknown_key():
    with pytest.raises(KeyError, match="'nope' is not a control of this panel; accepted: "):
        FreeBenchPanel(use_for_magic=False).set(nope=1)


def test_apply_makes_magic_defaults(shell):
    panel = FreeBenchPanel()
    panel.set(pert_mode="bit_noise", list=["matmul"])
    cfg = panel.apply()
    assert magics.get_defaults(shell) is cfg
    assert panel.magic_defaults_set
    assert "Applied (now the %%freebench defaults)" in panel.status.value
    # a new panel starts from the current magic defaults
    assert FreeBenchPanel().config == cfg
    # use_for_magic=False leaves them alone
    other = FreeBenchPanel(use_for_magic=False)
    other.set(pert_mode="add_noise")
    other.apply()
    assert magics.get_defaults(shell) is cfg


def test_panel_renders_as_widget():
    panel = FreeBenchPanel(use_for_magic=False)
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert repr(panel) == "FreeBenchPanel(valid)"


def test_module_control_feeds_the_config():
    panel = FreeBenchPanel(use_for_magic=False)
    assert isinstance(panel.controls["module"], w.TagsInput)
    panel.set(module=["blocks.1", "head"], list=["matmul"])
    assert panel.config.free_benchmark.module == ("blocks.1", "head")
    assert panel.config.free_benchmark.api_list == ("matmul",)


def test_budget_control_empty_means_no_budget():
    panel = FreeBenchPanel(use_for_magic=False)
    assert panel.controls["budget"].value == "" and panel.config.free_benchmark.budget is None
    panel.controls["budget"].value = "0.2"
    assert panel.error == "" and panel.config.free_benchmark.budget == 0.2


def test_tied_groups_as_text():
    """``grad_probe.tied`` edited as text: names by commas, groups by semicolons."""
    gp = GradProbePanel()
    assert gp.controls["tied"].value == "" and gp.controls["check_replicas"].value is True
    gp.controls["tied"].value = "embed.weight, head.weight; final_norm.weight"
    assert gp.values()["tied"] == [["embed.weight", "head.weight"], ["final_norm.weight"]]
    assert gp.config.grad_probe.tied == (("embed.weight", "head.weight"),
                                         ("final_norm.weight",))
