"""Control runs (issue 27): random rounding at the precision under test, the dispatch mode that
computes low-precision operations in the wider dtype, and GradProbe(control=...)."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

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


# -- controls that run wherever the reference runs (issue 37) ---------------------------------
class Recurrent(torch.nn.Module):
    """oneDNN's LSTM (no float64 kernel), a GRU and a tanh RNN (in-place transposes)."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = torch.nn.GRU(16, 8, batch_first=True)
        self.rnn = torch.nn.RNN(8, 8, batch_first=True)

    def forward(self, x):
        return self.rnn(self.gru(self.lstm(x)[0])[0])[0]


def test_fp32_control_runs_the_kernels_without_a_float64_version(caplog):
    """The LSTM/GRU/RNN forward and backward run under an fp32 control (oneDNN off for its
    session: PyTorch's own kernels in float64; restored after) and a bf16 one; the fp32
    control's gradients are the reference's to within fp32 rounding, not equal to them. A
    dynamically quantized linear (fp32 activations only) runs on its fp32 kernel, noted."""
    import logging

    torch.manual_seed(0)
    model = Recurrent()
    x = torch.randn(2, 5, 8, generator=_gen(1))
    model(x).pow(2).mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    mkldnn = torch.backends.mkldnn.enabled
    for spec in ("fp32", "bf16"):
        model.zero_grad()
        with perturb(model, spec) as ctl:
            model(x).float().pow(2).mean().backward()
            fallbacks = dict(ctl.mode.fallbacks)
        assert torch.backends.mkldnn.enabled == mkldnn and not fallbacks
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        if spec == "fp32":
            moved = 0
            for n, p in model.named_parameters():
                assert torch.allclose(p.grad, ref[n], rtol=1e-4, atol=1e-7), n
                moved += not torch.equal(p.grad, ref[n])
            assert moved >= len(ref) - 2
    torch.manual_seed(0)
    lin = torch.ao.nn.quantized.dynamic.Linear(8, 4)
    x = torch.randn(3, 8, generator=_gen(2))
    plain = lin(x)
    with caplog.at_level(logging.WARNING, logger="probekit"):
        with perturb(lin, "fp32") as ctl:
            out = lin(x)
            fallbacks = list(ctl.mode.fallbacks)
    assert fallbacks == ["quantized.linear_dynamic.default"]
    assert "control: quantized.linear_dynamic.default has no float64 kernel" in caplog.text
    # the fp32 kernel's result, rounded at random: within a unit of it, not always equal
    ulp = torch.nextafter(plain.abs(), torch.tensor(float("inf"))) - plain.abs()
    assert ((out - plain).abs() <= ulp).all() and out.dtype == torch.float32


def test_control_result_structure_per_call_not_per_dtypes():
    """Two convolution backwards of the same dtypes, the first without a bias gradient, the
    second with one and an input gradient: the meta run's result structure of the first is
    not the second's (SECNN's fp32 control crashed on it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 2, 1, bias=False))
    x = torch.randn(2, 3, 8, 8, generator=_gen(2), requires_grad=True)
    with perturb(model, "fp32"):
        model(x).sum().backward()
    assert model[0].bias.grad is not None and x.grad is not None


def test_a_copy_to_a_device_keeps_the_dtype_asked_for():
    """``x.to(device="cpu", dtype=torch.float32)`` of a bf16 tensor is ``_to_copy`` with a
    device, which has no meta run (a copy out of meta): its result is float32, the exact
    widening, and draws nothing (it returned bf16, rounded at random, before)."""
    x = torch.randn(64, generator=_gen(3)).to(BF16)
    with RoundingMode(parse_control("bf16")) as mode:
        a = x.to(device="cpu", dtype=torch.float32)
        b = x.to("cpu", torch.float32, copy=True)
        c = x.to(device="cpu")                      # bf16 stays bf16
    assert (a.dtype, b.dtype, c.dtype) == (torch.float32, torch.float32, BF16)
    assert torch.equal(a, x.float()) and torch.equal(b, x.float()) and torch.equal(c, x)
    assert mode.rounded == 0


def test_no_false_step_warning_after_an_error(tmp_path, caplog):
    """A run that fails before its first optimizer step is not said to have stepped outside
    the probe."""
    import logging

    model = Net()
    with caplog.at_level(logging.INFO, logger="probekit"):
        with pytest.raises(RuntimeError, match="boom"):
            with GradProbe(model, dump_path=str(tmp_path / "run"), control="fp32"):
                model(torch.randn(2, 16)).sum().backward()
                raise RuntimeError("boom")
    assert "ran outside the probe" not in caplog.text
    assert "stopped with an error (RuntimeError) before its first optimizer step" in \
        caplog.text


class _Dtypes(TorchDispatchMode):
    """Records (call, result dtype) of the calls named in ``keep``."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.seen = keep, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.keep:
            self.seen.append((name, (out[0] if isinstance(out, tuple) else out).dtype))
        return out


def test_recipe_scope_is_the_step_not_only_forward():
    """The test runs the forward and a cross-entropy on the logits under bf16 autocast (the
    loss in fp32, as autocast's policy has it); ``probe.recipe()`` around the same lines of
    the reference's code gives the control the same dtypes; without it the control's loss is
    computed on bf16 logits, in bf16."""
    keep = ("_log_softmax", "nll_loss_forward", "addmm")
    model = Net().eval()
    x, y = torch.randn(4, 16, generator=_gen(3)), torch.tensor([0, 1, 2, 3])
    with _Dtypes(keep) as test:
        with torch.autocast("cpu", dtype=BF16):
            F.cross_entropy(model(x), y)
    assert ("_log_softmax", torch.float32) in test.seen
    for scoped in (True, False):
        probe = perturb(model, "bf16").start()
        try:
            with _Dtypes(keep) as ctl:     # above the control's mode: the dtypes it is given
                import contextlib

                with probe.recipe() if scoped else contextlib.nullcontext():
                    loss = F.cross_entropy(model(x), y)
        finally:
            probe.stop()
        assert (ctl.seen == test.seen) is scoped, ctl.seen
        assert loss.dtype == (torch.float32 if scoped else BF16)
    assert not torch.is_autocast_enabled("cpu")


def _buckets(q, k, num_buckets=32, max_distance=128):
    """T5's bidirectional relative-position buckets: log of the distance, truncated to long."""
    rel = torch.arange(k, dtype=torch.long)[None, :] - torch.arange(q, dtype=torch.long)[:, None]
    nb = num_buckets // 2
    out = (rel > 0).to(torch.long) * nb
    rel = rel.abs()
    exact = nb // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact)
                     * (nb - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, nb - 1))
    return out + torch.where(rel < exact, rel, large)


class BucketBias(torch.nn.Module):
    """A T5-style relative position bias on a linear map's attention-like mixing."""

    def __init__(self, n=64):
        super().__init__()
        self.bias = torch.nn.Embedding(32, 1)
        self.proj = torch.nn.Linear(8, 8)
        self.n = n

    def forward(self, x):
        b = self.bias(_buckets(self.n, self.n))[..., 0]
        return torch.softmax(b, dim=-1) @ self.proj(x)


def test_fp32_control_keeps_the_reference_buckets():
    """Floats computed from integers alone (T5's log-of-distance, truncated to a bucket) are
    the reference's in an fp32 control, bit for bit, at every call: random rounding moved
    buckets at the exact boundaries (distances 16, 32, 64), at random at each step. What the
    model computes from its weights is still rounded at random."""
    ref = _buckets(128, 128)
    model = BucketBias()
    x = torch.randn(64, 8, generator=_gen(4))
    plain = model(x)
    with perturb(model, "fp32"):
        for _ in range(5):
            assert torch.equal(_buckets(128, 128), ref)
        out = model(x)
    assert not torch.equal(out, plain) and torch.allclose(out, plain, rtol=1e-5, atol=1e-6)


def test_a_genuine_error_under_a_control_is_raised_unnoted(caplog):
    """An error of the user's (shapes that do not match) raises as without the control, and is
    not taken for a missing wide kernel."""
    import logging

    model = Net()
    with caplog.at_level(logging.WARNING, logger="probekit"):
        with perturb(model, "fp32") as ctl:
            with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
                model(torch.randn(2, 15))
            assert not ctl.mode.fallbacks
    assert "has no float64 kernel" not in caplog.text


def _special(dtype, n, gen):
    """Values across the exponent range, with NaN (any payload, either sign), +-inf, +-0,
    +-max, the smallest normal, subnormals of float32 and values beyond float32's range."""
    x = torch.randn(n, generator=gen, dtype=dtype) * torch.exp2(
        torch.randint(-160, 140, (n,), generator=gen)).to(dtype)
    f = torch.finfo(torch.float32)
    k = torch.randint(0, 14, (n,), generator=gen)
    big = 3.5e38 if dtype == torch.float64 else -1e-40
    for i, v in enumerate((math.nan, math.inf, -math.inf, 0.0, -0.0, f.max, -f.max, f.tiny,
                           f.tiny / 3, 1e-45, big, 1.0, 1 + 2 ** -8)):
        x[k == i] = v
    if dtype == torch.float32 and n:
        bits = x.view(torch.int32)
        m = torch.randint(0, 20, (n,), generator=gen) == 0
        payload = torch.randint(0x7F800001, 0x7FFFFFFF, (int(m.sum()),), generator=gen,
                                dtype=torch.int32)
        bits[m] = payload | (torch.randint(0, 2, payload.shape, generator=gen,
                                           dtype=torch.int32) << 31)
    return x


@pytest.mark.parametrize("pair", ["bf16", "fp32"])
def test_compiled_rounding_is_the_torch_form_bit_for_bit(pair):
    """The C passes (``_kernel.c`` ``pk_round_*``, ``pk_mt_draw``) give the torch form's values
    bit for bit, the same result layout, and leave the generator where it does: every kernel
    path, sizes on both sides of ``_FEW``, spreads of every branch, NaN payloads, inf,
    overflow, subnormals, strided and transposed inputs (issue 38)."""
    from probekit.grads.numerics import kernel
    from probekit.grads.record import control

    if kernel.set_path("auto") == "numpy" or kernel.rounding() is None:
        pytest.skip("the compiled kernel is not built here")
    paths = [p for p in ("avx512", "avx2", "c") if kernel.set_path(p) == p]
    kernel.set_path("auto")
    src, dst = ((torch.float32, BF16) if pair == "bf16" else (torch.float64, torch.float32))
    view = torch.int16 if dst == BF16 else torch.int32
    gen = _gen(5)
    try:
        for n in (0, 1, 3, 700, control._FEW - 1, control._FEW, control._FEW + 1):
            for kind in ("randn", "special", "strided", "transposed"):
                if kind == "randn":
                    x = torch.randn(n, generator=gen, dtype=src) * 1e3
                elif kind == "special":
                    x = _special(src, n, gen)
                elif kind == "strided":
                    x = _special(src, 2 * n, gen)[::2]
                else:
                    x = _special(src, n - n % 4, gen).reshape(-1, 4).t()
                for spread in (0.5, 0.25, 0.3, 0.0, 0.75):
                    kernel.set_path("numpy")         # the torch form
                    g = _gen(11)
                    want = round_random(x, dst, g, spread)
                    want_state = g.get_state()
                    for path in paths:
                        kernel.set_path(path)
                        g = _gen(11)
                        got = round_random(x, dst, g, spread)
                        assert got.dtype == want.dtype and got.shape == want.shape
                        assert got.stride() == want.stride(), (n, kind, spread, path)
                        assert torch.equal(got.view(view), want.view(view)), (n, kind, spread,
                                                                              path)
                        assert torch.equal(g.get_state(), want_state), (n, kind, spread, path)
    finally:
        kernel.set_path("auto")


def test_compiled_draws_are_torchs():
    """``_draw`` (``pk_mt_draw`` on the generator's state) gives torch's values and state, for
    int32 and int64 ``random_`` and float64 ``rand``, across the state's twists and after
    other draws."""
    from probekit.grads.numerics import kernel
    from probekit.grads.record.control import _DRAW_C, _draw, _draw_ok

    if kernel.rounding() is None:
        pytest.skip("the compiled kernel is not built here")
    assert _draw_ok(kernel.rounding())
    rng = np.random.default_rng(0)
    for seed in range(6):
        a, b = _gen(seed), _gen(seed)
        for _ in range(10):
            n = int(rng.choice([1, 623, 624, 625, _DRAW_C, 1247, 5000, rng.integers(1, 20000)]))
            dtype = (torch.int32, torch.int64, torch.float64)[int(rng.integers(3))]
            if rng.random() < 0.3:
                torch.rand(7, generator=a), torch.rand(7, generator=b)
            mine = _draw(a, n, dtype)
            theirs = (torch.rand(n, generator=b, dtype=dtype) if dtype == torch.float64 else
                      torch.empty(n, dtype=dtype).random_(generator=b))
            assert torch.equal(mine, theirs)
            assert torch.equal(a.get_state(), b.get_state())


def test_rounding_mode_decisions_kept_across_starts():
    """A session's start()s share the mode's per-call decisions (no meta run again at every
    start: issue 38), and each start draws from a generator seeded afresh, as before."""
    model = torch.nn.Linear(8, 8)
    p = perturb(model, "bf16")
    x = torch.randn(4, 8)
    firsts = []
    for _ in range(2):
        p.start()
        try:
            mode = p.mode
            model(x).float().sum().backward()
        finally:
            p.stop()
        firsts.append((mode._dtypes, model.weight.grad.clone()))
        model.weight.grad = None
    assert firsts[0][0] is firsts[1][0] and firsts[0][0]
    assert torch.equal(firsts[0][1], firsts[1][1])
