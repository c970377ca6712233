"""The fp32 TinyLM trained under torch.autocast(bfloat16): noise reaches the bf16 compute,
check mode stays bitwise invisible, fix keeps the dtypes the training sees."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from test_freebench_training import TinyLM  # noqa: E402

from probekit.freebench import FreeBench  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def train(steps, fb=None, seed=1):
    torch.manual_seed(seed)
    model = TinyLM(dtype=torch.float32, blocks=("manual",))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    losses, dtypes = [], set()
    for _ in range(steps):
        idx = torch.randint(0, 50, (4, 12))
        tgt = torch.randint(0, 50, (4, 12))
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fb is not None:
                fb.start()
            try:
                logits = model(idx)
                loss = F.cross_entropy(logits.float().reshape(-1, 50), tgt.reshape(-1))
                loss.backward()
            finally:
                if fb is not None:
                    fb.stop()
        dtypes.add(logits.dtype)
        opt.step()
        if fb is not None:
            fb.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], \
        torch.get_rng_state(), dtypes


@pytest.mark.parametrize("options", [dict(pert_mode="bit_noise"),
                                     dict(pert_mode="add_noise", fuzz_stage="backward")],
                         ids=["bit_noise", "add_noise-backward"])
def test_autocast_check_finds_bf16_noise_and_changes_nothing(tmp_path, options):
    ref_losses, ref_params, ref_rng, _ = train(4)
    fb = FreeBench(dump_path=str(tmp_path), **options)
    losses, params, rng, dtypes = train(4, fb)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert torch.equal(rng, ref_rng)
    assert dtypes == {torch.bfloat16}
    s = fb.summary
    assert s["checked"] > 0 and "error" not in s["skipped"], s
    # a healthy model: what bf16 predicts is not a finding (issue 19)
    assert fb.results.empty, fb.results
    if options.get("fuzz_stage") == "backward":
        return
    # the noise does reach the bf16 compute: with a threshold below bf16's rounding every linear
    # is a row (before, the three linears fed fp32 by LayerNorm, which autocast runs in fp32,
    # saw fp32 noise that autocast's cast rounded away: no difference at all)
    fb = FreeBench(dump_path=str(tmp_path / "tiny"), thresholds={"bfloat16": 1e-6}, **options)
    train(1, fb)
    df = fb.results
    linears = set(df.loc[df["api_name"].str.startswith("Functional.linear"), "api_name"])
    assert linears == {f"Functional.linear.{i}.forward" for i in range(5)}, df


def test_autocast_fix_keeps_bf16_outputs(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", handler_type="fix")
    losses, _, _, dtypes = train(2, fb)
    assert dtypes == {torch.bfloat16} and torch.isfinite(losses).all()
    assert fb.summary["checked"] > 0
