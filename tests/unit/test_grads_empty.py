"""Issue 28, point 4: no silent empty recordings. A probe whose monitored parameters have no
gradient at a step, or that no optimizer steps, logs a WARNING naming the problem and its likely
cause; the summary, ``probekit grads summary`` and ``open_grads`` count the parameters that never
had a gradient."""
import logging
import os

import torch

from probekit import cli
from probekit.grads import GradProbe, open_grads

WARN = logging.WARNING


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def train(model, optimizer, steps=3):
    x = torch.ones(5, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(x).square().mean()
        if out.requires_grad:
            out.backward()
        optimizer.step()


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == WARN]


def test_a_frozen_model_is_warned_about_and_counted(tmp_path, caplog, capsys):
    model = mlp().requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="probekit"):
        with GradProbe(model, dump_path=str(tmp_path)) as probe:
            train(model, opt)
    assert warnings(caplog) == [
        "[probekit] grad_probe: none of the 4 monitored parameters stepped by the optimizer has "
        "a gradient at step 0; their statistics are empty (NaN). They are all frozen "
        "(requires_grad=False): unfreeze them, or monitor the trainable ones (param_list)"]
    assert probe.summary["no_grad"] == 4 and probe.summary["steps"] == 3
    assert str(probe.summary).endswith("; 4 of 4 params never had a gradient")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="probekit"):
        ds = open_grads(tmp_path)
    assert ds.attrs["no_grad"] == 4
    assert warnings(caplog) == [
        f"[probekit] grad run {tmp_path}: none of its 4 parameters has a gradient at any of its 3 "
        "steps: the recording is empty (frozen parameters, or a backward pass that did not "
        "reach them)"]
    assert cli.main(["grads", "summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("  4 of 4 params never had a gradient (first: 0.weight, 0.bias, 2.weight, "
                      "...): an empty recording (frozen parameters, or a backward pass that did "
                      "not reach them)")


def test_the_backward_not_reaching_the_model_is_warned_about(tmp_path, caplog):
    """The loss comes from a copy of the model: the monitored parameters get no gradient."""
    model, copy = mlp(), mlp()
    opt = torch.optim.SGD(list(model.parameters()) + list(copy.parameters()), lr=0.1)
    with caplog.at_level(logging.INFO, logger="probekit"):
        with GradProbe(model, dump_path=str(tmp_path)):
            train(copy, opt, steps=2)
    assert warnings(caplog) == [
        "[probekit] grad_probe: none of the 4 monitored parameters stepped by the optimizer has "
        "a gradient at step 0; their statistics are empty (NaN). Likely cause: the backward pass "
        "did not reach them (the loss came from another model or a copy, ran under "
        "torch.no_grad, or backward() ran outside the probe's model), or the gradients were "
        "cleared (zero_grad) before optimizer.step()"]


def test_an_optimizer_over_other_parameters_is_warned_about(tmp_path, caplog, capsys):
    """``model, optimizer = build_model(), build_optimizer()``: the optimizer steps another
    model's parameters; no step is recorded, said at stop(), and after 10 ignored steps."""
    model, other = mlp(0), mlp(1)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="probekit"):
        with GradProbe(model, dump_path=str(tmp_path)) as probe:
            for _ in range(12):
                opt.zero_grad()
                model(torch.ones(5, 4)).sum().backward()
                opt.step()
    assert warnings(caplog) == [
        "[probekit] grad_probe: 10 optimizer steps so far, none over the 4 monitored parameters: "
        "nothing is recorded. Was the optimizer built over other parameters (another model, or a "
        "copy of this one)?",
        "[probekit] grad_probe: no optimizer step over the monitored parameters was seen, so no "
        "step is recorded. 12 step(s) of optimizers owning none of the 4 monitored parameters "
        "were ignored: the optimizer was built over other parameters (another model, or a copy "
        "of this one made after it); build it over this model's parameters or pass it to the "
        "probe"]
    assert probe.summary["steps"] == 0
    assert cli.main(["grads", "summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  no step recorded: no optimizer step over these parameters was seen")


def test_an_explicit_optimizer_over_other_parameters_is_warned_at_start(tmp_path, caplog):
    model, other = mlp(0), mlp(1)
    with caplog.at_level(logging.INFO, logger="probekit"):
        GradProbe(model, torch.optim.SGD(other.parameters(), lr=0.1),
                  dump_path=str(tmp_path)).start().stop()
    assert warnings(caplog)[0] == (
        "[probekit] grad_probe: the optimizer given owns none of the 4 monitored parameters (was "
        "it built over another model or a copy of this one?); the gradients are taken at its "
        "steps all the same")


def test_a_healthy_run_warns_nothing_and_counts_partly_frozen_models(tmp_path, caplog, capsys):
    model = mlp()
    model[0].bias.requires_grad_(False)  # one frozen parameter: counted, not warned about
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with caplog.at_level(logging.INFO, logger="probekit"):
        with GradProbe(model, dump_path=str(tmp_path)) as probe:
            train(model, opt)
        ds = open_grads(tmp_path)
    assert warnings(caplog) == []
    assert probe.summary["no_grad"] == 1 and ds.attrs["no_grad"] == 1
    assert str(probe.summary).endswith("; 1 of 4 params never had a gradient")
    assert cli.main(["grads", "summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  1 of 4 params never had a gradient (first: 0.bias)")
    assert os.path.isdir(tmp_path / "grads.zarr")
