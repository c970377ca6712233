"""probekit.triage on two real recorded runs (fp32 vs a bf16 block with a planted ill-conditioned
op): the divergence, the suspect modules, the planted call found in its module and nothing listed
in the clean blocks; the model, grads, optimizer and RNG left exactly as they were."""
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import probekit
from probekit.config import ConfigError
from probekit.triaging import TriageReport, widen

from _triage_model import batch, make_model, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("triage")
    train(torch.float32, root / "fp32")
    model, opt = train(torch.bfloat16, root / "bf16")
    return str(root / "fp32"), str(root / "bf16"), model, opt


def stepper(model, opt=None):
    def step():
        x, y = batch(torch.Generator().manual_seed(7))
        loss = F.mse_loss(model(x + torch.randn(1)), y)     # draws from the global RNG too
        loss.backward()
        if opt is not None:
            opt.step()
    return step


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [b.detach().clone() for b in model.buffers()],
            [(id(p.grad), None if p.grad is None else p.grad.clone()) for p in model.parameters()],
            [m.training for m in model.modules()], repr(opt.state_dict()),
            torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())


def assert_same(a, b):
    params, buffers, grads, training, opt, rng, py, npy = a
    assert all(torch.equal(x, y) for x, y in zip(params, b[0]))
    assert all(torch.equal(x, y) for x, y in zip(buffers, b[1]))
    for (i, g), (j, h) in zip(grads, b[2]):
        assert i == j and ((g is None and h is None) or torch.equal(g, h))
    assert training == b[3] and opt == b[4]
    assert torch.equal(rng, b[5]) and py == b[6] and np.array_equal(npy, b[7])


def test_planted_op_found_in_its_module_and_clean_blocks_clean(runs):
    fp32, bf16, model, opt = runs
    report = probekit.triage(model, stepper(model), fp32, bf16)
    assert isinstance(report, TriageReport)
    assert report.divergence == {"rank": 0, "step": 0, "param": "blocks.2.fc1.weight",
                                 "similarity": report.divergence["similarity"]}
    assert report.divergence["similarity"] < 0.97
    assert list(report.suspects["module"]) == ["blocks.2", "blocks.0", "blocks.1"]
    assert report.suspects.loc[0, "owners"] == ("blocks.2.fc1", "blocks.2.fc2")
    assert [(r["pert_mode"], r["stage"]) for r in report.runs] == [
        ("improve_precision", "forward"), ("improve_precision", "backward"),
        ("add_noise", "forward"), ("add_noise", "backward")]
    f = report.findings
    assert set(f["suspect"]) == {"blocks.2"}                 # nothing in the clean blocks
    assert list(report.suspects["findings"]) == [len(f), 0, 0]
    top = f.iloc[0]
    assert (top["api_name"], top["module"], top["kind"], top["pert_modes"]) == (
        "Tensor.__sub__.0.forward", "blocks.2.norm", "rel_error", "add_noise")
    # one bf16 ulp of E[x^2] (8 at 1600) moves the variance by half its own scale: sqrt(u) is
    # 1/16, so ratio 8
    assert top["call_site"] == "_triage_model.py:19" and top["ratio"] >= 8
    assert list(f["ratio"]) == sorted(f["ratio"], reverse=True)
    text = str(report)
    assert text.startswith("Triage: runs diverge first at step 0, parameter 'blocks.2.fc1.weight'")
    assert "1. blocks.2 (flagged at step 0" in text
    assert "Tensor.__sub__.0.forward [add_noise]" in text
    assert "2. blocks.0 (flagged at step 0" in text and ": no flagged call\n" in text + "\n"
    # the first suspect may sit after where the divergence starts: the flagged modules before
    # it in the forward pass are named, nearest first (here the defect is in the first one)
    assert report.walk_back.startswith("blocks.2.fc1 departs most at step 0, but a wrong "
                                       "forward output changes the gradients")
    assert "earlier in the forward pass: blocks.2.norm" not in report.walk_back
    assert report.walk_back in text
    page = report._repr_html_().replace("<wbr>", "")  # names wrap at their dots
    assert "<code>blocks.2.fc1.weight</code>" in page and "Tensor.__sub__.0.forward" in page
    assert page.count("<tr>") == 2 + 3 + len(f)          # two header rows


def test_model_grads_optimizer_and_rng_left_as_they_were(runs):
    fp32, bf16, model, opt = runs
    stepper(model)()                         # grads present: they must survive with their values
    torch.manual_seed(11), random.seed(3), np.random.seed(4)
    opt_m = torch.optim.Adam(model.parameters(), lr=1e-3)
    stepper(model, opt_m)()                  # Adam has state now
    model.eval()
    before = snapshot(model, opt_m)
    report = probekit.triage(model, stepper(model, opt_m), fp32, bf16, optimizer=opt_m, top=1,
                             stages="forward")
    assert [r["stage"] for r in report.runs] == ["forward", "forward"]
    assert_same(before, snapshot(model, opt_m))
    for p in model.parameters():             # and without grads (set_to_none)
        p.grad = None
    before = snapshot(model, opt_m)
    probekit.triage(model, stepper(model), comparison=report.comparison, top=1,
                    pert_modes="add_noise", stages="backward")
    assert_same(before, snapshot(model, opt_m))
    model.train()


def test_no_divergence_and_bad_arguments(runs, tmp_path):
    fp32, bf16, model, opt = runs
    report = probekit.triage(model, stepper(model), fp32, fp32)
    assert report.divergence["step"] == -1 and report.runs == [] and report.findings.empty
    assert str(report) == ("Triage: the runs do not diverge (no parameter flagged); nothing "
                           "to check.")
    with pytest.raises(ConfigError, match=r"top: 0 is not valid; accepted: an integer >= 1"):
        probekit.triage(model, stepper(model), fp32, bf16, top=0)
    with pytest.raises(ConfigError, match=r"stages: 'sideways' is not valid; accepted: forward, "
                       "backward"):
        probekit.triage(model, stepper(model), fp32, bf16, stages=["sideways"])
    with pytest.raises(ConfigError, match=r"pert_modes: 'to_cpu' is not valid"):
        probekit.triage(model, stepper(model), fp32, bf16, pert_modes=["to_cpu"])
    with pytest.raises(TypeError, match="step_fn: 3 is not valid"):
        probekit.triage(model, 3, fp32, bf16)
    with pytest.raises(TypeError, match="two grad-probe runs are needed"):
        probekit.triage(model, stepper(model), fp32)


def test_widen():
    assert widen("transformer.h.2.attn.c_attn", 1) == "transformer.h.2.attn"
    assert widen("transformer.h.2.attn.c_attn", 2) == "transformer.h.2"
    assert widen("head", 1) == "head" and widen("a.b", 0) == "a.b"


def test_plot(runs, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    fp32, bf16, model, opt = runs
    report = probekit.triage(model, stepper(model), fp32, bf16, top=2)
    ax = report.plot().axes[0]
    bars = [p for p in ax.patches if str(p.get_gid()).startswith("triage:")]
    assert len(bars) == len(report.findings)
    assert bars[0].get_gid() == "triage:Tensor.__sub__.0.forward"
    assert bars[0].get_facecolor()[:3] == matplotlib.colors.to_rgb("#d62728")
    ax.figure.savefig(tmp_path / "triage.png", dpi=80)
    assert (tmp_path / "triage.png").stat().st_size > 5000


def test_step_fn_error_propagates_with_everything_restored(runs, tmp_path):
    fp32, bf16, model, opt = runs
    before = snapshot(model, opt)
    calls = []

    def failing():
        calls.append(1)
        stepper(model)()
        raise RuntimeError("user code failed")

    with pytest.raises(RuntimeError, match="user code failed"):
        probekit.triage(model, failing, fp32, bf16, dump_path=str(tmp_path))
    assert calls == [1]
    assert_same(before, snapshot(model, opt))
    assert torch._C._len_torch_function_stack() == 0
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    assert (tmp_path / "free_benchmark.csv").exists()      # dump_path given: the CSV is kept


def test_perturbations_fit_the_dtype():
    from probekit.triaging import pert_modes_for

    model = make_model(torch.bfloat16)
    assert pert_modes_for(model, ["blocks.2"]) == ("improve_precision", "add_noise")
    assert pert_modes_for(model, ["blocks.1"]) == ("improve_precision", "add_noise")
    model.blocks[1].double()
    assert pert_modes_for(model, ["blocks.1"]) == ("add_noise",)
    assert pert_modes_for(model, ["blocks.1", "blocks.2"]) == ("improve_precision", "add_noise")
