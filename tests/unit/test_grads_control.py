"""Control runs (issue 27): random rounding at the precision under test, the dispatch mode that
computes low-precision operations in the wider dtype, and GradProbe(control=...)."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from probekit.config import ConfigError
from probekit.grads import GradProbe, open_grads
from probekit.grads.record.control import (
    ControlSpec, RoundingMode, paused, parse_control, perturb, round_random)

BF16 = torch.bfloat16


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_round_random_is_stochastic_rounding_at_half_spread():
    ulp = 2.0 ** -7                      # bf16's gap in [1, 2)
    x = torch.full((40_000,), 1.0 + 0.25 * ulp)
    y = round_random(x, BF16, _gen())
    assert y.dtype == BF16
    assert set(y.float().unique().tolist()) == {1.0, 1.0 + ulp}
    up = int((y.float() > 1).sum())
    # P(up) = 1/4: within 5 standard deviations of 10 000
    assert abs(up - 10_000) < 5 * math.sqrt(40_000 * 0.25 * 0.75)
    # unbiased: the mean is x to the same precision
    assert abs(float(y.double().mean()) - (1 + 0.25 * ulp)) < 5 * ulp * math.sqrt(0.1875 / 4e4)
    # the same seed draws the same roundings
    assert torch.equal(y, round_random(x, BF16, _gen()))
    assert not torch.equal(y, round_random(x, BF16, _gen(1)))


def test_round_random_exact_cases():
    ulp = 2.0 ** -7
    exact = torch.tensor([0.0, -0.0, 1.0, -3.5, 2.0 ** -130, float("inf"), float("-inf")])
    assert torch.equal(round_random(exact, BF16, _gen()).float(), exact)
    assert torch.isnan(round_random(torch.tensor([float("nan")]), BF16, _gen())).all()
    # a NaN whose payload is in the lower half only (truncated, it would read as inf)
    nans = torch.tensor([0x7F800001, -0x7FFFFF, 0x7FC00000, -1], dtype=torch.int32)
    assert torch.isnan(round_random(nans.view(torch.float32), BF16, _gen())).all()
    # a large tensor (its bits' form, issue 38): NaN payloads and infs kept, values rounded to
    # their neighbours, at both spreads
    x = torch.full((40_000,), 1.0 + 0.25 * ulp)
    x[::7] = nans.view(torch.float32).repeat(1429)[:len(x[::7])]
    x[3::7] = float("inf")
    x[5::7] = float("-inf")
    for spread in (0.5, 0.25):
        y = round_random(x, BF16, _gen(), spread=spread).float()
        assert torch.isnan(y[::7]).all() and (y[3::7] == float("inf")).all()
        assert (y[5::7] == float("-inf")).all()
        rest = torch.cat([y[1::7], y[2::7], y[4::7], y[6::7]])
        assert set(rest.unique().tolist()) <= {1.0, 1.0 + ulp}
    # fp16 overflows as round-to-nearest does; its largest value stays
    y = round_random(torch.tensor([70000.0, 65504.0, -1e6]), torch.float16, _gen())
    assert y.tolist() == [float("inf"), 65504.0, float("-inf")]
    # spread 1/4: within a quarter unit of the nearest value it is round-to-nearest exactly
    x = torch.full((1000,), 1.0 + 0.2 * ulp)
    assert torch.equal(round_random(x, BF16, _gen(), spread=0.25).float(), torch.ones(1000))
    # at 0.4 units: the other neighbour with probability (0.4 - 1/4) / (1/2) = 0.3
    x = torch.full((40_000,), 1.0 + 0.4 * ulp)
    up = int((round_random(x, BF16, _gen(), spread=0.25).float() > 1).sum())
    assert abs(up - 12_000) < 5 * math.sqrt(40_000 * 0.3 * 0.7)
    # fp32 from float64: the fp32 neighbours of the value
    x = torch.full((1000,), 1.0 + 2.0 ** -25, dtype=torch.float64)
    y = round_random(x, torch.float32, _gen())
    assert set(y.double().unique().tolist()) == {1.0, 1.0 + 2.0 ** -23}
    # a large tensor (its bits' form, issue 38): stochastic at both spreads, both signs; values
    # float32 holds, zeros, and (the general form) its subnormal range, inf, NaN
    u32 = 2.0 ** -23
    for spread, share in ((0.5, 0.25), (0.25, 0.0)):
        x = torch.full((40_000,), 1.0 + 0.25 * u32, dtype=torch.float64)
        x[1::2] *= -1
        y = round_random(x, torch.float32, _gen(), spread=spread).double()
        for v in (y[::2], -y[1::2]):
            assert set(v.unique().tolist()) <= {1.0, 1.0 + u32}
            up = int((v > 1).sum())
            assert abs(up - share * 20_000) <= 5 * math.sqrt(20_000 * 0.25 * 0.75)
        exact = torch.tensor([0.0, -0.0, 1.5, -2.0 ** -126] * 10_000, dtype=torch.float64)
        assert torch.equal(round_random(exact, torch.float32, _gen(), spread=spread).double(),
                           exact)
        odd = torch.tensor([1e-40, float("inf"), float("nan"), 1.0] * 10_000,
                           dtype=torch.float64)
        z = round_random(odd, torch.float32, _gen(), spread=spread).double()
        assert ((z[::4] - 1e-40).abs() <= 2.0 ** -149).all()   # float32's subnormal step
        assert (z[1::4] == float("inf")).all() and torch.isnan(z[2::4]).all()


def test_mode_computes_low_precision_ops_wide_and_rounds_at_random():
    a = torch.randn(64, 256, generator=_gen(2)).to(BF16)
    b = torch.randn(256, 32, generator=_gen(3)).to(BF16)
    wide = a.float() @ b.float()
    lower = wide.to(BF16).float()
    other = torch.nextafter(wide.to(BF16), torch.where(lower < wide, torch.tensor(
        float("inf"), dtype=BF16), torch.tensor(float("-inf"), dtype=BF16))).float()
    spec = ControlSpec(BF16, "none", seed=0)
    with RoundingMode(spec) as mode:
        y = a @ b
        z = a.clone()
        z.add_(a)                                  # in place: rounded into the bf16 tensor
        f = a.float() * 3                          # no bf16 result: untouched
    assert y.dtype == BF16
    yf = y.float()
    assert ((yf == lower) | (yf == other)).all()
    assert (yf == other).any() and (yf == lower).any()   # random, not round-to-nearest
    assert torch.equal(z.float(), 2 * a.float())          # exact: a value bf16 holds
    assert torch.equal(f, a.float() * 3)
    assert mode.rounded >= 2 and _get_current_dispatch_mode() is None
    with RoundingMode(spec):
        with paused():
            plain = a @ b                            # the probe's own calls: not rounded
    assert torch.equal(plain, a @ b)


def test_parse_control():
    assert parse_control("bf16") == ControlSpec(BF16, "autocast", 0)
    assert parse_control("bf16:cast", seed=3) == ControlSpec(BF16, "cast", 3)
    assert parse_control(torch.float32) == ControlSpec(torch.float32, "none", 0)
    assert parse_control("fp16").name == "fp16" and parse_control("bf16:cast").name == "bf16:cast"
    with pytest.raises(ConfigError, match=r"control: 'int8' is not valid; accepted: bf16, fp16"):
        parse_control("int8")
    with pytest.raises(ConfigError, match="control: 'bf16:amp' is not valid"):
        parse_control("bf16:amp")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def _train(control=None, seed=0, steps=3, path=None):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    probe = GradProbe(model, dump_path=str(path), control=control, control_seed=seed) \
        if path else perturb(model, control, seed) if control else None
    if probe is not None:
        probe.start()
    try:
        for _ in range(steps):
            x = torch.randn(8, 16, generator=data)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if probe is not None:
            probe.stop()
    return model, losses, torch.get_rng_state()


def test_control_leaves_the_random_stream_and_is_seeded():
    """Dropout draws the training's stream exactly as the plain run does; the rounding draws
    its own seeded generator: same seed, same run; another seed, another run."""
    m, plain, rng_plain = _train()
    m0, c0, rng0 = _train("bf16", seed=0)
    m0b, _, _ = _train("bf16", seed=0)
    m1, _, rng1 = _train("bf16", seed=1)
    assert torch.equal(rng0, rng_plain) and torch.equal(rng1, rng_plain)
    w, w0, w0b, w1 = (x.fc1.weight.detach() for x in (m, m0, m0b, m1))
    assert torch.equal(w0, w0b) and not torch.equal(w0, w1)
    assert not torch.equal(w0, w) and torch.allclose(w0, w, atol=0.03)  # 3 Adam steps of 0.01
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(c0, plain))


def test_recipes_and_clean_stop():
    import probekit

    model = Net()
    with probekit.perturb(model, BF16):   # autocast around the forward, fp32 parameters
        out = model(torch.randn(2, 16))
        assert out.dtype == BF16 and model.fc1.weight.dtype == torch.float32
    assert _get_current_dispatch_mode() is None
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not torch.is_autocast_enabled("cpu")
    model = Net()
    with perturb(model, "bf16:cast"):     # the model cast, float inputs too
        out = model(torch.randn(2, 16))
    assert out.dtype == BF16 and model.fc1.weight.dtype == BF16
    assert not model._forward_pre_hooks


def test_gradprobe_control_records_it(tmp_path):
    _, losses, _ = _train("bf16:cast", seed=4, path=tmp_path / "ctrl")
    ds = open_grads(tmp_path / "ctrl")
    assert ds.attrs["control"] == "bf16:cast" and ds.attrs["control_seed"] == 4
    assert ds.sizes["step"] == 3 and _get_current_dispatch_mode() is None
    # the same as perturb() around the plain loop: the probe's statistics are not rounded
    _, same, _ = _train("bf16:cast", seed=4)
    assert losses == same
    norms = ds["norm"].values
    assert np.isfinite(norms).all() and (norms > 0).all()


def test_control_from_the_config_as_msprobe_users_run_it(tmp_path):
    """``grad_probe.control`` in config.json: PrecisionDebugger's grad probe records the same
    control as ``GradProbe(control=...)``; a bad value names the accepted ones."""
    import json

    from probekit import PrecisionDebugger

    _, losses, _ = _train("bf16:cast", seed=4, path=tmp_path / "ref")
    cfg = {"task": "grad_probe", "dump_path": str(tmp_path / "dbg"),
           "grad_probe": {"grad_level": "L1", "control": "bf16:cast", "control_seed": 4}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    debugger = PrecisionDebugger(config_path=str(tmp_path / "config.json"))
    debugger.monitor(model)
    same = []
    for _ in range(3):
        x = torch.randn(8, 16, generator=data)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        same.append(loss.item())
    debugger.close()
    assert same == losses
    ds = open_grads(tmp_path / "dbg")
    assert ds.attrs["control"] == "bf16:cast" and ds.attrs["control_seed"] == 4
    assert _get_current_dispatch_mode() is None
    with pytest.raises(ConfigError, match=r"grad_probe\.control.*'bf8'.*bf16, fp16, fp32"):
        GradProbe(Net(), dump_path=str(tmp_path / "bad"), control="bf8")
    # a torch.dtype is stored by its name
    assert GradProbe(Net(), dump_path=str(tmp_path / "d"),
                     control=torch.float16).config.grad_probe.control == "fp16"
