"""The free benchmark on a training loop: every mode runs, and check mode changes nothing."""
import sys
import os

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fb_models import make  # noqa: E402

from probekit.freebench import FreeBench  # noqa: E402

@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ALL_MODES = [
    dict(pert_mode="improve_precision"),
    dict(pert_mode="bit_noise"),
    dict(pert_mode="add_noise"),
    dict(pert_mode="change_value"),
    dict(pert_mode="no_change"),
    dict(pert_mode="to_cpu", fuzz_device="cpu"),
    dict(pert_mode="improve_precision", handler_type="fix"),
    dict(pert_mode="to_cpu", fuzz_device="cpu", handler_type="fix"),
    dict(pert_mode="improve_precision", fuzz_stage="backward"),
    dict(pert_mode="bit_noise", fuzz_stage="backward"),
    dict(pert_mode="add_noise", fuzz_stage="backward"),
    dict(pert_mode="change_value", fuzz_stage="backward"),
    dict(pert_mode="no_change", fuzz_stage="backward"),
    dict(pert_mode="bit_noise", if_preheat=True, preheat_step=1, max_sample=2),
]


@pytest.mark.parametrize("options", ALL_MODES, ids=lambda o: "-".join(map(str, o.values())))
def test_transformer_block_trains_under_every_mode(tmp_path, options):
    model, opt, step = make()
    fb = FreeBench(dump_path=str(tmp_path), **options)
    losses = []
    for _ in range(3):
        with fb:
            losses.append(step())
        fb.step()
    s = fb.summary
    assert all(torch.isfinite(x) for x in losses)
    assert s["steps"] == 3 and s["calls"] > 0 and s["checked"] > 0
    assert "error" not in s["skipped"], s
    df = fb.results
    assert set(df["stage"]) <= {options.get("fuzz_stage", "forward")}
    assert df["dtype"].notna().all() and df["shape"].notna().all()
    assert (df["output_index"] >= 0).all()
    if options.get("handler_type") == "fix":
        assert df.empty


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def train(n, dtype, fb=None):
    model, _, step = make(seed=1, dtype=dtype, blocks=("manual",), adam=False)
    losses = []
    for _ in range(n):
        if fb is None:
            losses.append(step())
        else:
            with fb:
                losses.append(step())
            fb.step()
    return torch.stack(losses), snapshot(model), torch.get_rng_state()


_BASELINES = {}


def baseline(dtype):
    if dtype not in _BASELINES:
        _BASELINES[dtype] = train(20, dtype)
    return _BASELINES[dtype]


@pytest.mark.parametrize("dtype, options", [
    (torch.float32, dict(pert_mode="bit_noise")),
    (torch.float32, dict(pert_mode="improve_precision")),
    (torch.float32, dict(pert_mode="change_value")),
    (torch.float32, dict(pert_mode="add_noise", fuzz_stage="backward")),
    (torch.float32, dict(pert_mode="improve_precision", fuzz_stage="backward")),
    (torch.bfloat16, dict(pert_mode="bit_noise")),
    (torch.bfloat16, dict(pert_mode="no_change", fuzz_stage="backward")),
], ids=lambda o: "-".join(map(str, o.values())) if isinstance(o, dict) else str(o)[6:])
def test_check_mode_is_bitwise_invisible(tmp_path, dtype, options):
    """20 training steps (dropout on, so the RNG is in play) with and without the probe:
    losses, parameters and the global RNG state are bitwise equal."""
    ref_losses, ref_params, ref_rng = baseline(dtype)
    fb = FreeBench(dump_path=str(tmp_path), **options)
    losses, params, rng = train(20, dtype, fb)
    assert fb.summary["checked"] > 0 and fb.summary["steps"] == 20
    assert "error" not in fb.summary["skipped"]
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert torch.equal(rng, ref_rng)
