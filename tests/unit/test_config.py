import dataclasses
import json

import pytest

from probekit.config import (DEFAULT_THRESHOLDS, Config, ConfigError, FreeBenchmarkConfig,
                             GradProbeConfig, load_config, make_config)


def write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_spec_defaults():
    fb = FreeBenchmarkConfig()
    assert (fb.scope, fb.api_list, fb.fuzz_device, fb.pert_mode, fb.handler_type, fb.fuzz_level,
            fb.fuzz_stage, fb.if_preheat, fb.preheat_step, fb.max_sample) == (
        (), (), "npu", "improve_precision", "check", "L1", "forward", False, 15, 20)
    assert dict(fb.thresholds) == {}    # every threshold from the compute dtype's roundoff
    gp = GradProbeConfig()
    assert (gp.grad_level, gp.param_list, gp.bounds, gp.hash) == ("L1", (), (-1, 0, 1), "md5")
    assert gp.grad_point == "step"  # the gradients optimizer.step() is handed (after clipping)
    cfg = Config(task="grad_probe")
    assert (cfg.dump_path, cfg.rank, cfg.step, cfg.level, cfg.seed, cfg.is_deterministic) == (
        "./dump_path", (), (), "L1", 1234, False)
    assert cfg.section is cfg.grad_probe


@pytest.mark.parametrize("task", ["free_benchmark", "grad_probe"])
def test_msprobe_config_loads_unchanged(tmp_path, msprobe_config_dict, task):
    msprobe_config_dict["task"] = task
    cfg = load_config(write(tmp_path, msprobe_config_dict))
    assert cfg.task == task
    assert cfg.free_benchmark == FreeBenchmarkConfig()
    assert cfg.grad_probe == GradProbeConfig()


def test_minimal_grad_probe_config_from_spec(tmp_path):
    data = {"task": "grad_probe", "dump_path": "./dump_path", "rank": [], "step": [],
            "grad_probe": {"grad_level": "L2", "param_list": ["fc.weight"], "bounds": [-10, 0, 10]}}
    cfg = load_config(write(tmp_path, data))
    assert cfg.grad_probe == GradProbeConfig(grad_level="L2", param_list=("fc.weight",),
                                             bounds=(-10, 0, 10))


def test_bom_and_values(tmp_path, msprobe_config_dict):
    msprobe_config_dict["free_benchmark"].update(pert_mode="to_cpu", fuzz_device="cpu",
                                                 handler_type="fix", list=["relu", "matmul"])
    msprobe_config_dict.update(rank=[0, 3], step=[1, 2], seed=7, is_deterministic=True)
    path = tmp_path / "c.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(msprobe_config_dict).encode())
    cfg = load_config(path)
    fb = cfg.free_benchmark
    assert (fb.pert_mode, fb.fuzz_device, fb.handler_type, fb.api_list) == (
        "to_cpu", "cpu", "fix", ("relu", "matmul"))
    assert (cfg.rank, cfg.step, cfg.seed, cfg.is_deterministic) == ((0, 3), (1, 2), 7, True)


def test_json_round_trip_identical(tmp_path):
    cfg = make_config("free_benchmark", dump_path=str(tmp_path / "d"), rank=[1], step=[0, 4],
                      pert_mode="bit_noise", scope=["Torch.matmul.0.forward"], if_preheat=True,
                      preheat_step=3, max_sample=5, thresholds={"bfloat16": 0.01}, seed=9)
    again = Config.from_dict(json.loads(cfg.to_json()))
    assert again == cfg
    path = tmp_path / "cfg.json"
    cfg.to_json(path)
    assert load_config(path) == cfg
    gp = make_config("grad_probe", grad_level="L2", bounds=[-0.5, 0.25], param_list=["a.b"],
                     hash="xxh3", flush_every=10)
    assert Config.from_dict(json.loads(gp.to_json())) == gp


def test_kwargs_build_same_objects(tmp_path, msprobe_config_dict):
    msprobe_config_dict["free_benchmark"]["pert_mode"] = "add_noise"
    from_file = load_config(write(tmp_path, msprobe_config_dict))
    from_kwargs = make_config("free_benchmark", dump_path="./dump_path", pert_mode="add_noise")
    assert from_file == from_kwargs
    assert make_config("free_benchmark", api_list=["relu"]).free_benchmark.api_list == ("relu",)
    assert make_config("free_benchmark", free_benchmark={"list": ["relu"]}) == make_config(
        "free_benchmark", list=["relu"])


def test_frozen():
    cfg = make_config("free_benchmark")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.task = "grad_probe"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.free_benchmark.pert_mode = "bit_noise"
    with pytest.raises(TypeError, match="read-only"):
        cfg.free_benchmark.thresholds["float16"] = 1.0
    assert cfg.free_benchmark.thresholds == DEFAULT_THRESHOLDS


def test_replace_revalidates():
    cfg = make_config("free_benchmark")
    assert cfg.replace(pert_mode="bit_noise").free_benchmark.pert_mode == "bit_noise"
    with pytest.raises(ConfigError, match="pert_mode: 'nope'"):
        cfg.replace(pert_mode="nope")
    with pytest.raises(ConfigError, match="grad_level"):
        dataclasses.replace(GradProbeConfig(), grad_level="L3")


def test_threshold_for():
    fb = FreeBenchmarkConfig(thresholds={"float16": 0.01})
    assert fb.threshold_for("float16") == 0.01
    assert fb.threshold_for("bfloat16") is None and fb.threshold_for("float64") is None
    fb = FreeBenchmarkConfig(thresholds={"other": 1e-9})
    assert fb.threshold_for("float64") == 1e-9 and fb.threshold_for("float16") == 1e-9


BAD = [
    # (kwargs for make_config, exact fragment of the message)
    ({"task": "dump"}, "task: 'dump' is not valid; accepted: free_benchmark, grad_probe"),
    ({"task": "statistics"}, "task: 'statistics' is an msprobe task probekit does not implement"),
    ({"task": "free_benchmark", "pert_mode": "noise"},
     "free_benchmark.pert_mode: 'noise' is not valid; accepted: improve_precision, bit_noise, "
     "add_noise, change_value, no_change, to_cpu"),
    ({"task": "free_benchmark", "handler_type": "repair"},
     "free_benchmark.handler_type: 'repair' is not valid; accepted: check, fix"),
    ({"task": "free_benchmark", "fuzz_stage": "both"},
     "free_benchmark.fuzz_stage: 'both' is not valid; accepted: forward, backward"),
    ({"task": "free_benchmark", "fuzz_device": "gpu"},
     "free_benchmark.fuzz_device: 'gpu' is not valid; accepted: npu, cpu"),
    ({"task": "free_benchmark", "fuzz_level": "L2"},
     "free_benchmark.fuzz_level: 'L2' is not valid; accepted: L1"),
    ({"task": "free_benchmark", "pert_mode": "to_cpu"},
     "free_benchmark.fuzz_device: 'npu' is not valid with pert_mode 'to_cpu'; accepted: 'cpu'"),
    ({"task": "free_benchmark", "fuzz_device": "cpu"},
     "free_benchmark.pert_mode: 'improve_precision' is not valid with fuzz_device 'cpu'"),
    ({"task": "free_benchmark", "handler_type": "fix", "pert_mode": "bit_noise"},
     "free_benchmark.pert_mode: 'bit_noise' is not valid with handler_type 'fix'; accepted: "
     "improve_precision, to_cpu"),
    ({"task": "free_benchmark", "handler_type": "fix", "if_preheat": True},
     "free_benchmark.if_preheat: True is not valid with handler_type 'fix'"),
    ({"task": "free_benchmark", "scope": ["Torch.matmul.0.forward"], "list": ["relu"]},
     "free_benchmark.scope ['Torch.matmul.0.forward'] and free_benchmark.list ['relu'] were both"),
    ({"task": "free_benchmark", "preheat_step": 0},
     "free_benchmark.preheat_step: 0 is not valid; accepted: an integer > 0"),
    ({"task": "free_benchmark", "max_sample": -2},
     "free_benchmark.max_sample: -2 is not valid; accepted: an integer > 0"),
    ({"task": "free_benchmark", "if_preheat": "yes"},
     "free_benchmark.if_preheat: 'yes' is not valid; accepted: true or false"),
    ({"task": "free_benchmark", "scope": "Torch.matmul.0.forward"},
     "free_benchmark.scope: 'Torch.matmul.0.forward' is not valid; accepted: a list of strings"),
    ({"task": "free_benchmark", "thresholds": {"float8": 0.1}},
     "free_benchmark.thresholds key: 'float8' is not valid"),
    ({"task": "free_benchmark", "thresholds": {"float16": 0}},
     "free_benchmark.thresholds.float16: 0 is not valid; accepted: a finite number > 0"),
    ({"task": "free_benchmark", "colour": "red"}, "free_benchmark key: 'colour' is not valid"),
    ({"task": "grad_probe", "grad_level": "L3"},
     "grad_probe.grad_level: 'L3' is not valid; accepted: L0, L1, L2"),
    ({"task": "grad_probe", "bounds": [1, 0]},
     "grad_probe.bounds: [1, 0] is not valid; accepted: numbers in strictly ascending order"),
    ({"task": "grad_probe", "bounds": [0, 0]}, "numbers in strictly ascending order"),
    ({"task": "grad_probe", "bounds": [-1, "0", 1]},
     "grad_probe.bounds: [-1, '0', 1] is not valid; accepted: finite numbers only ('0' is not one)"),
    ({"task": "grad_probe", "bounds": [True]}, "finite numbers only (True is not one)"),
    ({"task": "grad_probe", "bounds": []}, "grad_probe.bounds: [] is not valid"),
    ({"task": "grad_probe", "param_list": "fc.weight"}, "grad_probe.param_list: 'fc.weight'"),
    ({"task": "grad_probe", "hash": "sha1"},
     "grad_probe.hash: 'sha1' is not valid; accepted: md5, xxh3"),
    ({"task": "grad_probe", "grad_point": "before_clip"},
     "grad_probe.grad_point: 'before_clip' is not valid; accepted: step, backward"),
    ({"task": "grad_probe", "rank": [0, -1]},
     "rank: -1 is not valid; accepted: integers >= 0 in the list"),
    ({"task": "grad_probe", "step": [-3]},
     "step: -3 is not valid; accepted: integers >= 0 in the list"),
    ({"task": "grad_probe", "step": 3},
     "step: 3 is not valid; accepted: a list of integers >= 0 (empty = all)"),
    ({"task": "grad_probe", "rank": [True]}, "rank: True is not valid"),
    ({"task": "grad_probe", "level": "L9"}, "level: 'L9' is not valid; accepted: L0, L1, L2, mix"),
    ({"task": "grad_probe", "seed": "1"}, "seed: '1' is not valid"),
    ({"task": "grad_probe", "is_deterministic": 1}, "is_deterministic: 1 is not valid"),
    ({"task": "grad_probe", "enable_dataloader": True}, "enable_dataloader: True is not valid"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:40] for _, m in BAD])
def test_invalid_values_named(kwargs, message):
    with pytest.raises(ConfigError) as info:
        make_config(**kwargs)
    assert message in str(info.value)


def test_invalid_in_file_is_named(tmp_path, msprobe_config_dict):
    msprobe_config_dict["free_benchmark"]["pert_mode"] = "upcast"
    with pytest.raises(ConfigError, match="free_benchmark.pert_mode: 'upcast' is not valid"):
        load_config(write(tmp_path, msprobe_config_dict))
    msprobe_config_dict["free_benchmark"]["pert_mode"] = "bit_noise"
    msprobe_config_dict["verbose"] = True
    with pytest.raises(ConfigError, match="key: 'verbose' is not valid; accepted: acl_config"):
        load_config(write(tmp_path, msprobe_config_dict))


def test_dump_path_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"dump_path: '.*afile' is not valid; accepted: a folder"):
        make_config("grad_probe", dump_path=str(f))
    assert make_config("grad_probe", dump_path=str(tmp_path)).dump_path == str(tmp_path)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config_path: '.*missing.json' is not valid"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{task: 1")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[]")
    with pytest.raises(ConfigError, match="is not valid; accepted: a JSON object"):
        load_config(arr)
    notask = tmp_path / "notask.json"
    notask.write_text("{}")
    with pytest.raises(ConfigError, match="task: missing"):
        load_config(notask)


# -- one coercion function, errors as attributes ---------------------------------------------
def test_config_for_every_form(tmp_path):
    from probekit.config import config_for

    d = str(tmp_path)
    base = make_config("grad_probe", dump_path=d, grad_level="L2")
    assert config_for("grad_probe") == make_config("grad_probe")
    assert config_for("grad_probe", base) is base
    assert config_for("grad_probe", base, bounds=[0]).grad_probe.bounds == (0,)
    assert config_for("grad_probe", GradProbeConfig(grad_level="L0")).grad_probe.grad_level == "L0"
    assert config_for("grad_probe", {"dump_path": d, "grad_probe": {"grad_level": "L2"}}) == base
    path = tmp_path / "c.json"
    base.to_json(path)
    assert config_for("grad_probe", str(path)) == base
    switched = config_for("free_benchmark", str(path), pert_mode="bit_noise")
    assert (switched.task, switched.dump_path) == ("free_benchmark", d)
    assert switched.free_benchmark.pert_mode == "bit_noise"
    assert switched.grad_probe == base.grad_probe          # the other section is kept
    with pytest.raises(ConfigError) as err:
        config_for("grad_probe", FreeBenchmarkConfig())
    assert err.value.key == "config" and "GradProbeConfig" in err.value.accepted
    with pytest.raises(ConfigError) as err:
        config_for("grad_probe", 42)
    assert (err.value.key, err.value.value) == ("config", 42)
    with pytest.raises(ConfigError) as err:
        config_for("statistics")
    assert (err.value.key, err.value.value) == ("task", "statistics")


@pytest.mark.parametrize("kwargs, key, field, value", [
    ({"pert_mode": "bogus"}, "free_benchmark.pert_mode", "pert_mode", "bogus"),
    ({"thresholds": {"float16": -1}}, "free_benchmark.thresholds.float16", "thresholds", -1),
    ({"thresholds": {"fp8": 1e-3}}, "free_benchmark.thresholds key", "thresholds", "fp8"),
    ({"rank": [-1]}, "rank", "rank", -1),
    ({"handler_type": "fix", "pert_mode": "bit_noise"}, "free_benchmark.pert_mode", "pert_mode",
     "bit_noise"),
])
def test_config_error_attributes(kwargs, key, field, value):
    from probekit import ProbekitError

    with pytest.raises(ConfigError) as err:
        make_config("free_benchmark", **kwargs)
    exc = err.value
    assert (exc.key, exc.field, exc.value) == (key, field, value)
    assert exc.accepted and str(exc).startswith(f"{key}: ") and f"accepted: {exc.accepted}" \
        in str(exc)
    assert isinstance(exc, ProbekitError) and isinstance(exc, ValueError)


def test_one_error_base():
    import probekit
    from probekit import errors

    for name in ("ConfigError", "GradStoreError", "GradCompareError", "MsprobeDumpError",
                 "UnsafePathError"):
        cls = getattr(probekit, name)
        assert cls is getattr(errors, name) and issubclass(cls, probekit.ProbekitError)
        assert issubclass(cls, ValueError)
    from probekit.grads.store.msprobe import MsprobeDumpError
    from probekit.grads import GradCompareError, GradStoreError

    assert (GradStoreError, GradCompareError, MsprobeDumpError) == \
        (errors.GradStoreError, errors.GradCompareError, errors.MsprobeDumpError)


def test_config_error_key_from_a_standard_message():
    assert ConfigError("free_benchmark.module: 'x' is not a module; accepted: ...").field == "module"
    assert ConfigError("grad_probe.bounds key: 'x' ...").key == "grad_probe.bounds key"
    assert ConfigError("no key in this sentence").key is None


def test_old_msprobe_import_path_warns_and_works():
    import importlib
    import sys

    sys.modules.pop("probekit.compat.msprobe", None)
    with pytest.warns(DeprecationWarning, match="moved to probekit.grads.store.msprobe"):
        old = importlib.import_module("probekit.compat.msprobe")
    from probekit.grads.store import export, msprobe

    assert old.read_grad_dump is msprobe.read_grad_dump
    assert old.write_grad_dump is export.write_grad_dump


def test_grad_point_key(tmp_path, msprobe_config_dict):
    """grad_probe.grad_point: a probekit key in msprobe's section; msprobe's own keys work with
    or without it, it round-trips, and a bad value is named with the accepted ones."""
    msprobe_config_dict["task"] = "grad_probe"
    assert load_config(write(tmp_path, msprobe_config_dict)).grad_probe.grad_point == "step"
    msprobe_config_dict["grad_probe"].update(grad_level="L2", grad_point="backward")
    cfg = load_config(write(tmp_path, msprobe_config_dict))
    assert cfg.grad_probe == GradProbeConfig(grad_level="L2", grad_point="backward")
    assert cfg.to_dict()["grad_probe"]["grad_point"] == "backward"
    assert Config.from_dict(json.loads(cfg.to_json())) == cfg
    assert make_config("grad_probe", grad_point="backward").grad_probe.grad_point == "backward"
    msprobe_config_dict["grad_probe"]["grad_point"] = "pre_step"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, msprobe_config_dict))
    assert (err.value.key, err.value.value, err.value.accepted) == (
        "grad_probe.grad_point", "pre_step", "step, backward")
    with pytest.raises(ConfigError, match="grad_probe.grad_point: 1 is not valid"):
        dataclasses.replace(cfg.grad_probe, grad_point=1)
