"""Code nobody here wrote: tiny GPT-2 and LLaMA (Hugging Face transformers, random weights)
trained a few steps in fp32 and bf16 under every probe mode."""
import os
import sys

import numpy as np
import pytest
import torch

import probekit

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _hf_models import build, train  # noqa: E402

pytest.importorskip("transformers")

MODELS = ["gpt2", "llama"]
DTYPES = [torch.float32, torch.bfloat16]
CHECK_MODES = [
    {"pert_mode": "improve_precision"}, {"pert_mode": "bit_noise"}, {"pert_mode": "add_noise"},
    {"pert_mode": "change_value"}, {"pert_mode": "no_change"},
    {"pert_mode": "to_cpu", "fuzz_device": "cpu"},
    {"pert_mode": "improve_precision", "fuzz_stage": "backward"},
    {"pert_mode": "bit_noise", "fuzz_stage": "backward"},
]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons need the same reduction order
    yield
    torch.set_num_threads(before)


def ids(options):
    return "-".join(str(v) for v in options.values())


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_check_modes_leave_training_bit_identical(tmp_path, kind, dtype):
    plain = train(build(kind, dtype))
    rng_after_plain = torch.get_rng_state()
    for options in CHECK_MODES:
        model = build(kind, dtype)
        fb = probekit.FreeBench(dump_path=str(tmp_path / ids(options)), **options)
        losses = train(model, probe=fb)
        assert losses == plain, options
        assert torch.equal(torch.get_rng_state(), rng_after_plain), options
        summary = fb.summary
        assert summary["steps"] == 3 and summary["checked"] > 20, (options, summary)
        assert summary["calls"] > summary["checked"]
        assert set(fb.results.columns[:9]) == {"rank", "pert_mode", "stage", "step", "api_name",
                                               "max_rel", "dtype", "shape", "output_index"}
        assert os.path.isfile(tmp_path / ids(options) / "free_benchmark.csv")
        if not fb.results.empty:
            assert set(fb.results["stage"]) == {options.get("fuzz_stage", "forward")}
            assert fb.results["api_name"].str.match(r"^(Torch|Tensor|Functional)\.").all()


@pytest.mark.parametrize("kind", MODELS)
def test_no_change_finds_no_nondeterminism_on_cpu(tmp_path, kind):
    fb = probekit.FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    train(build(kind, torch.bfloat16), probe=fb)
    assert fb.results.empty, fb.results[["api_name", "max_rel"]].head()


@pytest.mark.parametrize("kind", MODELS)
def test_fix_mode_trains_and_changes_bf16_numbers(tmp_path, kind):
    plain = train(build(kind, torch.bfloat16))
    fb = probekit.FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision",
                            handler_type="fix")
    fixed = train(build(kind, torch.bfloat16), probe=fb)
    assert all(np.isfinite(fixed)) and fb.summary["checked"] > 20
    assert fixed != plain  # the upcast results replaced the bf16 ones
    assert abs(fixed[0] - plain[0]) < 0.05 * abs(plain[0])


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_grad_probe_levels(tmp_path, kind, level):
    plain = train(build(kind, torch.bfloat16))  # build() seeds the RNG dropout then draws from
    model = build(kind, torch.bfloat16)
    with probekit.GradProbe(model, grad_level=level, dump_path=str(tmp_path)):
        losses = train(model)
    assert losses == plain
    ds = probekit.open_grads(tmp_path)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert ds["param"].values.tolist() == names
    assert ds["step"].values.tolist() == [0, 1, 2]
    assert np.isfinite(ds["norm"].values).all() and (ds["norm"].values > 0).all()
    if level == "L2":
        assert np.allclose(ds["dist"].sum("interval").values, 1.0)
    if level != "L0":
        cmp = probekit.compare_grads(tmp_path, tmp_path)
        assert np.all(cmp["similarity"].values == 1.0)
