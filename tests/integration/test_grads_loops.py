"""The grad probe on real training loops: wrapped models (torch.compile), several optimizers,
closures (LBFGS), GradScaler's skipped steps, parameters unfrozen during training."""
import os
import sys

import numpy as np
import pytest
import torch

from probekit.grads import GradProbe, compare_grads, open_grads

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _train import make_model, train  # noqa: E402


def test_compiled_model_compares_with_eager(tmp_path):
    eager = make_model()
    with GradProbe(eager, dump_path=str(tmp_path / "eager")):
        train(eager, steps=3)
    compiled = torch.compile(make_model(), backend="eager")
    with GradProbe(compiled, dump_path=str(tmp_path / "compiled")):
        train(compiled, steps=3)
    ds = open_grads(tmp_path / "compiled")
    names = [n for n, _ in eager.named_parameters()]
    assert ds["param"].values.tolist() == names
    assert ds.attrs["recorded_params"] == ["_orig_mod." + n for n in names]
    cmp = compare_grads(tmp_path / "eager", tmp_path / "compiled")
    assert cmp["param"].values.tolist() == names
    assert np.all(cmp["similarity"].values == 1.0)
    assert np.array_equal(ds["max"].values, open_grads(tmp_path / "eager")["max"].values)


def test_param_list_takes_either_name(tmp_path):
    compiled = torch.compile(make_model(), backend="eager")
    with GradProbe(compiled, dump_path=str(tmp_path / "a"), param_list=["0.weight",
                                                                        "_orig_mod.2.bias"]):
        train(compiled, steps=1)
    assert open_grads(tmp_path / "a")["param"].values.tolist() == ["0.weight", "2.bias"]


def test_param_unfrozen_later_is_recorded_from_its_first_gradient(tmp_path):
    model = make_model()
    model[0].weight.requires_grad_(False)
    seen = []

    def unfreeze(step):
        seen.append(model[0].weight.grad)
        if step == 1:
            model[0].weight.requires_grad_(True)

    with GradProbe(model, dump_path=str(tmp_path)):
        train(model, steps=4, on_step=unfreeze)
    ds = open_grads(tmp_path)
    present = ds["present"].sel(param="0.weight").values.tolist()
    assert present == [False, False, True, True]
    assert ds["max"].sel(param="0.weight").values[3] == float(seen[3].max())


def two_part_model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"body": torch.nn.Linear(6, 5), "head": torch.nn.Linear(5, 2)})


def test_two_optimizers_any_order_one_step_per_iteration(tmp_path):
    """A head optimizer stepped every other iteration, called before or after the body's:
    every iteration is one step holding the gradients of that iteration."""
    for order in ("head-first", "body-first"):
        model = two_part_model()
        body = torch.optim.SGD(model["body"].parameters(), lr=0.1)
        head = torch.optim.SGD(model["head"].parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        seen = []
        with GradProbe(model, dump_path=str(tmp_path / order)):
            for it in range(5):
                x = torch.randn(4, 6, generator=gen)
                model.zero_grad()
                model["head"](torch.tanh(model["body"](x))).pow(2).sum().backward()
                seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opts = [head, body] if order == "head-first" else [body, head]
                for opt in opts:
                    if opt is body or it % 2 == 0:
                        opt.step()
        ds = open_grads(tmp_path / order)
        assert ds["step"].values.tolist() == [0, 1, 2, 3, 4], order
        head_present = ds["present"].sel(param="head.weight").values.tolist()
        assert head_present == [True, False, True, False, True], order
        assert bool(ds["present"].sel(param="body.weight").all()), order
        for it in range(5):
            for name in ("body.weight", "head.bias"):
                if name.startswith("head") and it % 2:
                    continue
                assert ds["max"].sel(param=name).values[it] == float(seen[it][name].max()), \
                    (order, it, name)


def test_gan_two_backward_passes_one_step(tmp_path):
    torch.manual_seed(0)
    gen_net, disc = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"g": gen_net, "d": disc})
    opt_g = torch.optim.Adam(gen_net.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    seen = []
    with GradProbe(model, dump_path=str(tmp_path)):
        for _ in range(3):
            z, real = torch.randn(8, 3), torch.randn(8, 4)
            opt_d.zero_grad()
            (disc(real).mean() - disc(gen_net(z).detach()).mean()).backward()
            d_grad = disc.weight.grad.clone()
            opt_d.step()
            opt_g.zero_grad()
            disc(gen_net(z)).mean().backward()  # also accumulates into disc's gradients
            seen.append((d_grad, gen_net.weight.grad.clone()))
            opt_g.step()
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2]
    assert bool(ds["present"].all())
    for it, (d_grad, g_grad) in enumerate(seen):
        assert ds["max"].sel(param="d.weight").values[it] == float(d_grad.max())
        assert ds["max"].sel(param="g.weight").values[it] == float(g_grad.max())


def test_lbfgs_records_the_gradient_its_step_uses(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x, y = torch.randn(16, 5), torch.randn(16, 1)
    first = []

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if len(first) < calls["step"] + 1:
            first.append(model.weight.grad.clone())
        return loss

    calls = {"step": 0}
    with GradProbe(model, dump_path=str(tmp_path)):
        for s in range(3):
            calls["step"] = s
            opt.step(closure)
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2]
    assert bool(ds["present"].all())
    for s in range(3):
        assert ds["max"].sel(param="weight").values[s] == float(first[s].max())
        assert ds["norm"].sel(param="weight").values[s] == pytest.approx(
            float(first[s].double().norm()), rel=1e-6)


def test_grad_scaler_skipped_steps_keep_the_iteration_axis(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    seen = []
    with GradProbe(model, dump_path=str(tmp_path), scaler=scaler):
        for it in range(5):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if it in (1, 2):  # an overflow: GradScaler skips this step
                model[0].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            seen.append(model[4].weight.grad.clone())
            scaler.step(opt)
            scaler.update()
    assert "update" not in vars(scaler)  # the counter is removed by stop()
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2, 3, 4]
    assert ds["present"].any("param").values.tolist() == [True, False, False, True, True]
    for it in (0, 3, 4):
        assert ds["max"].sel(param="4.weight").values[it] == float(seen[it].max())


def test_prefixed_names_of_other_recorders_match(tmp_path):
    """A dump recorded with wrapper prefixes (msprobe on a DDP model: "module.*") compares with
    a plain run by the names without them."""
    model = make_model()
    with GradProbe(model, dump_path=str(tmp_path / "a")):
        train(model, steps=2)
    ds = open_grads(tmp_path / "a")
    prefixed = ds.assign_coords(param=["module." + str(n) for n in ds["param"].values])
    cmp = compare_grads(ds, prefixed)
    assert cmp["param"].values.tolist() == ds["param"].values.tolist()
    assert np.all(cmp["similarity"].values == 1.0)


class TouchingSGD(torch.optim.SGD):
    """Modifies the gradients in place inside its step (as optimizers that clip or rescale
    them do) and calls super().step(): the hooks run twice, for one step."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(1.0)
        return super().step(closure)


def test_optimizer_touching_gradients_in_its_step_keeps_iterations(tmp_path):
    model = two_part_model()
    body = torch.optim.SGD(model["body"].parameters(), lr=0.1)
    head = TouchingSGD(model["head"].parameters(), lr=0.1)
    with GradProbe(model, dump_path=str(tmp_path)):
        for it in range(4):
            model.zero_grad()
            model["head"](torch.tanh(model["body"](torch.ones(2, 6)))).sum().backward()
            if it % 2 == 0:  # head first, every other iteration
                head.step()
            body.step()
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2, 3]
    assert ds["present"].sel(param="head.weight").values.tolist() == [True, False, True, False]
    assert bool(ds["present"].sel(param="body.weight").all())
