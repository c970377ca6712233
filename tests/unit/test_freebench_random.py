"""Random calls are checked on a replayed random stream (probekit/freebench/engine/rng.py).

A call that draws from a generator -- dropout and friends, attention with dropout, ``rrelu`` in
training, ``gumbel_softmax``, ``bernoulli``, ``normal`` -- is re-run with the generator states
saved just before the real call, so the re-run draws the real call's mask; afterwards the
training's stream is exactly where the real call left it. ``no_change`` (threshold 0) proves the
replay: any other mask is a finding. Calls whose draws cannot be replayed are skipped as
``random`` and listed in ``fb.coverage`` with the reason.
"""
import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench, names
from probekit.freebench.engine import rng

fp16, bf16 = torch.float16, torch.bfloat16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


X = torch.randn(4, 8, 16, 16, generator=gen())
Q, K, V = (torch.randn(2, 4, 16, 8, generator=gen(i)) for i in (1, 2, 3))
MHA = torch.nn.MultiheadAttention(32, 4, dropout=0.2, batch_first=True)
S = torch.randn(2, 8, 32, generator=gen(4))

#: (name, call) of random calls: each draws from the default CPU generator
RANDOM_CALLS = [
    ("dropout", lambda: F.dropout(X, 0.3)),
    ("dropout2d", lambda: F.dropout2d(X, 0.3)),
    ("alpha_dropout", lambda: F.alpha_dropout(X, 0.3, training=True)),
    ("feature_alpha_dropout", lambda: F.feature_alpha_dropout(X, 0.3, training=True)),
    ("torch.dropout", lambda: torch.dropout(X, 0.3, True)),
    ("native_dropout", lambda: torch.native_dropout(X, 0.3, True)),
    ("rrelu", lambda: F.rrelu(X, training=True)),
    ("gumbel_softmax", lambda: F.gumbel_softmax(X, tau=0.5)),
    ("sdpa", lambda: F.scaled_dot_product_attention(Q, K, V, dropout_p=0.3)),
    ("sdpa_causal", lambda: F.scaled_dot_product_attention(Q, K, V, dropout_p=0.3,
                                                           is_causal=True)),
    ("mha", lambda: MHA(S, S, S, need_weights=False)),
    ("mha_weights", lambda: MHA(S, S, S)),      # the softmax-then-dropout path
    ("bernoulli", lambda: torch.bernoulli(torch.sigmoid(X))),
    ("normal", lambda: torch.normal(X, X.abs() + 0.1)),
]


def run(tmp_path, mode, fn, **extra):
    """``fn`` under the probe, seeded: (probe, output, RNG state after, the next draw)."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, **extra)
    torch.manual_seed(7)
    with fb:
        out = fn()
    return fb, out, torch.get_rng_state(), torch.rand(4)


def plain(fn):
    torch.manual_seed(7)
    out = fn()
    return out, torch.get_rng_state(), torch.rand(4)


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    return a is None and b is None or torch.equal(a, b)


@pytest.mark.parametrize("name, fn", RANDOM_CALLS, ids=[c[0] for c in RANDOM_CALLS])
def test_no_change_rerun_draws_the_real_calls_mask_and_leaves_the_stream(tmp_path, name, fn):
    """no_change flags any difference: a re-run drawing another mask would be a finding."""
    MHA.train()
    fb, out, state, nxt = run(tmp_path, "no_change", fn)
    ref_out, ref_state, ref_next = plain(fn)
    s = fb.summary
    assert s["checked"] >= 1 and "random" not in s["skipped"] and s["replayed"] == 1, s
    assert fb.results.empty
    assert same(out, ref_out)
    assert torch.equal(state, ref_state) and torch.equal(nxt, ref_next)


@pytest.mark.parametrize("name, fn", RANDOM_CALLS, ids=[c[0] for c in RANDOM_CALLS])
@pytest.mark.parametrize("mode", ["bit_noise", "add_noise", "improve_precision"])
def test_healthy_random_calls_give_no_findings(tmp_path, name, fn, mode):
    MHA.train()
    fb, out, state, nxt = run(tmp_path, mode, fn)
    ref_out, ref_state, ref_next = plain(fn)
    assert fb.results.empty, fb.results[["api_name", "ratio", "cause"]]
    assert same(out, ref_out) and torch.equal(state, ref_state) and torch.equal(nxt, ref_next)
    s = fb.summary
    if mode == "improve_precision" and name in ("bernoulli", "normal"):
        assert s["skipped"]["random"] == 1      # their draws depend on the dtype
    else:
        assert "random" not in s["skipped"] and s["checked"] >= 1, s


@pytest.mark.parametrize("mode", ["no_change", "bit_noise", "improve_precision"])
def test_backward_rerun_uses_the_forward_calls_mask(tmp_path, mode):
    """In the backward pass the re-run replays the forward call's stream: the input gradient of
    a dropout (real gradients read off the graph) and of SDPA(x, x, x) (one tensor passed three
    times: the reference is recomputed, replayed too) match the real ones; the training's
    gradients and stream are those of a run without the probe."""
    def fn(x):
        a = F.dropout(x, 0.4)
        b = F.scaled_dot_product_attention(x, x, x, dropout_p=0.3)
        c = F.rrelu(x, training=True)
        (a * 1.5 + b + c).square().sum().backward()
        return a, b, c

    def once(probe):
        x = X[:2, :2].clone().requires_grad_(True)
        torch.manual_seed(11)
        if probe is None:
            out = fn(x)
        else:
            with probe:
                out = fn(x)
        return out, x.grad, torch.get_rng_state(), torch.rand(3)

    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage="backward")
    got, ref = once(fb), once(None)
    assert fb.results.empty, fb.results[["api_name", "output_index", "ratio", "cause"]]
    cov = fb.coverage.set_index("api_name")
    for site in ("Functional.dropout.0", "Functional.scaled_dot_product_attention.0",
                 "Functional.rrelu.0"):
        assert cov.loc[site, "checked"] == 1 and cov.loc[site, "reason"] == ""
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert torch.equal(got[1], ref[1])
    assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3])
    assert fb._engine.handles == []


def test_large_random_output_is_rerun_whole_not_in_blocks(tmp_path):
    """A dropout with more than 2^19 output elements would be re-run block by block; a block
    would draw the start of the stream, so a random call is re-run whole."""
    x = torch.randn(1 << 20, generator=gen())
    fb, out, state, nxt = run(tmp_path, "no_change", lambda: F.dropout(x, 0.5))
    ref_out, ref_state, _ = plain(lambda: F.dropout(x, 0.5))
    assert fb.summary["checked"] == 1 and fb.results.empty
    assert torch.equal(out, ref_out) and torch.equal(state, ref_state)


def test_explicit_generator_is_replayed_and_left_as_the_real_call_left_it(tmp_path):
    p = torch.sigmoid(X)

    def draws(probe):
        g = torch.Generator().manual_seed(5)
        torch.manual_seed(0)
        if probe is None:
            out = (torch.bernoulli(p, generator=g), torch.normal(X, 1.0, generator=g))
        else:
            with probe:
                out = (torch.bernoulli(p, generator=g), torch.normal(X, 1.0, generator=g))
        return out, g.get_state(), torch.get_rng_state()

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    got, ref = draws(fb), draws(None)
    assert fb.summary["checked"] == 2 and fb.results.empty
    assert same(got[0], ref[0])
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


def test_fix_of_a_dropout_draws_the_mask_the_real_call_would(tmp_path):
    """fix replaces the dropout by its float64 run: the same mask, and the stream advanced by
    exactly the real call's draws (also under autocast, where fix first runs the call once to
    learn the caller's dtype: that run is replayed)."""
    for autocast in (False, True):
        def fn():
            with torch.autocast("cpu", dtype=bf16, enabled=autocast):
                return F.dropout(X, 0.3)

        fb, out, state, nxt = run(tmp_path / str(autocast), "improve_precision", fn,
                                  handler_type="fix")
        ref_out, ref_state, ref_next = plain(fn)
        assert fb.summary["checked"] == 1
        assert out.dtype == ref_out.dtype == torch.float32
        assert torch.equal(out == 0, ref_out == 0)          # the same mask
        assert (out - ref_out).abs().max().item() <= 2 ** -23 * ref_out.abs().max().item()
        assert torch.equal(state, ref_state) and torch.equal(nxt, ref_next)


# -- what cannot be replayed: skipped, logged, listed in fb.coverage ------------------------------
def test_unreplayable_random_calls_are_skipped_and_shown_in_coverage(tmp_path, caplog):
    def fn():
        torch.bernoulli(torch.sigmoid(X))     # improve_precision: draws depend on the dtype
        torch.normal(X, 1.0)
        F.dropout(X, 0.3)                     # dtype-free: replayed
        torch.poisson(X.abs())                # the number of draws depends on the values

    with caplog.at_level(logging.INFO, logger="probekit"):
        fb, _, state, nxt = run(tmp_path, "improve_precision", fn)
    _, ref_state, ref_next = plain(fn)
    assert torch.equal(state, ref_state) and torch.equal(nxt, ref_next)
    assert fb.summary["skipped"]["random"] == 3 and fb.summary["replayed"] == 1
    cov = fb.coverage
    assert list(cov.columns) == ["api_name", "calls", "checked", "reason"]
    rows = {r.api_name: (r.calls, r.checked, r.reason) for r in cov.itertuples()}
    assert rows["Functional.dropout.0"] == (1, 1, "")
    assert rows["Torch.bernoulli.0"] == (1, 0, "random: " + rng.WHY["dtype"])
    assert rows["Torch.normal.0"] == (1, 0, "random: " + rng.WHY["dtype"])
    assert rows["Torch.poisson.0"] == (1, 0, "random: " + rng.WHY["values"])
    msgs = [r.getMessage() for r in caplog.records if "Torch.poisson" in r.getMessage()]
    assert msgs == ["[probekit] Free benchmark: For Torch.poisson.0.forward, a random call "
                    "whose draws cannot be replayed: its number of draws depends on the input "
                    "values, so a re-run on perturbed inputs falls out of step with the real "
                    "call's random stream. Cancel perturbation."]


def test_skipped_random_site_counts_every_call(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    for _ in range(3):
        with fb:
            torch.poisson(X.abs())
            torch.poisson(X.abs())
        fb.step()
    cov = fb.coverage
    assert cov["api_name"].tolist() == ["Tensor.abs.0", "Torch.poisson.0", "Tensor.abs.1",
                                        "Torch.poisson.1"]                 # in call order
    assert cov["calls"].tolist() == [3, 3, 3, 3] and cov["checked"].tolist() == [3, 0, 3, 0]
    assert cov["reason"].tolist() == ["", "random: " + rng.WHY["values"], "",
                                      "random: " + rng.WHY["values"]]
    assert fb.summary["skipped"] == {"random": 6}


def test_replay_plan_per_mode_and_device():
    """``rng.plan``: which generators a call draws from, or why it cannot be replayed."""
    x = torch.ones(2)
    d = names.Draw("dropout")
    r = rng.plan(d, [x, 0.3], "bit_noise")
    assert isinstance(r, rng.Replay) and r.gens == [torch.default_generator]
    assert isinstance(rng.plan(d, [x], "improve_precision"), rng.Replay)
    assert rng.plan(names.Draw("bernoulli"), [x], "improve_precision") == "dtype"
    assert rng.plan(names.Draw("bernoulli"), [x], "to_cpu") == "dtype"
    assert isinstance(rng.plan(names.Draw("bernoulli"), [x], "bit_noise"), rng.Replay)
    assert rng.plan(names.Draw("poisson"), [x], "bit_noise") == "values"
    assert isinstance(rng.plan(names.Draw("poisson"), [x], "no_change"), rng.Replay)
    g = torch.Generator()
    r = rng.plan(names.Draw("normal", g), [x], "add_noise")
    assert r.gens == [torch.default_generator, g]
    assert rng.plan(d, [torch.ones(2, device="meta")], "bit_noise") == "generator"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_is_replayed_where_the_dtype_is_kept(tmp_path):
    x = torch.randn(64, 64, device="cuda")
    d = names.Draw("dropout")
    assert rng.plan(d, [x], "improve_precision") == "cuda_upcast"
    assert rng.plan(names.Draw("scaled_dot_product_attention"), [x], "bit_noise") == \
        "cuda_attention"
    r = rng.plan(d, [x], "no_change")
    assert r.gens == [torch.default_generator, torch.cuda.default_generators[x.device.index]]

    def fn():
        return F.dropout(x, 0.3)

    fb, out, _, _ = run(tmp_path, "no_change", fn)
    state = torch.cuda.get_rng_state()
    torch.manual_seed(7)
    ref = fn()
    assert fb.results.empty and fb.summary["checked"] == 1
    assert torch.equal(out, ref) and torch.equal(state, torch.cuda.get_rng_state())


# -- the CPU kernels behind names.DTYPE_FREE draw the same numbers in every dtype ----------------
X5 = torch.randn(2, 4, 3, 8, 8, generator=gen(5))
DTYPE_FREE_CALLS = {
    "dropout": lambda x: F.dropout(x, 0.3),
    "dropout1d": lambda x: F.dropout1d(x[0, :, 0], 0.3),
    "dropout2d": lambda x: F.dropout2d(x[0], 0.3),
    "dropout3d": lambda x: F.dropout3d(x, 0.3),
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.3, training=True),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x, 0.3, training=True),
    "feature_dropout": lambda x: torch.feature_dropout(x, 0.3, True),
    "native_dropout": lambda x: torch.native_dropout(x, 0.3, True)[0],
    "rrelu": lambda x: F.rrelu(x, training=True),
    "gumbel_softmax": lambda x: F.gumbel_softmax(x, tau=0.5),
    "scaled_dot_product_attention":
        lambda x: F.scaled_dot_product_attention(x[0], x[1], x[1], dropout_p=0.3),
    "multi_head_attention_forward": lambda x: _mha(x),
    # the in-place forms draw through the same kernels
    "dropout_": lambda x: torch.dropout_(x.clone(), 0.3, True),
    "alpha_dropout_": lambda x: torch.alpha_dropout_(x.clone(), 0.3, True),
    "feature_alpha_dropout_": lambda x: torch.feature_alpha_dropout_(x.clone(), 0.3, True),
    "feature_dropout_": lambda x: torch.feature_dropout_(x.clone(), 0.3, True),
    "rrelu_": lambda x: torch.rrelu_(x.clone(), training=True),
}


def _mha(x):
    m = torch.nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
    m.to(x.dtype).train()
    s = x.reshape(-1, 16, 8)
    return m(s, s, s)[0]


#: the dtype an upcast re-run computes in, per input dtype (improve_precision, to_cpu)
UPCASTS = [(torch.float32, torch.float64), (bf16, torch.float32), (fp16, torch.float32)]


def test_dtype_free_table_lists_every_case():
    assert set(DTYPE_FREE_CALLS) == names.DTYPE_FREE


@pytest.mark.parametrize("low, high", UPCASTS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", sorted(DTYPE_FREE_CALLS))
def test_dtype_free_apis_draw_the_same_numbers_in_the_upcast_dtype(name, low, high):
    """The same seed gives the same draws in the call's dtype and the upcast one: the outputs
    differ by the low dtype's rounding only (a different mask would differ by O(1))."""
    fn = DTYPE_FREE_CALLS[name]
    outs = []
    for dt in (low, high):
        torch.manual_seed(3)
        try:
            outs.append(fn(X5.to(dt)).double())
        except (RuntimeError, NotImplementedError) as exc:   # rrelu has no fp16 CPU kernel
            assert "not implemented" in str(exc)
            pytest.skip(f"{name} has no {dt} CPU kernel")
    a, b = outs
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= 16 * torch.finfo(low).eps / 2


@pytest.mark.parametrize("name, fn", [
    ("bernoulli", lambda x: torch.bernoulli(torch.full_like(x, 0.5))),
    ("normal", lambda x: torch.normal(torch.zeros_like(x), 1.0)),
])
def test_dtype_dependent_apis_really_draw_other_numbers_upcast(name, fn):
    """Why bernoulli and normal are not in DTYPE_FREE: float32 and float64 draw differently."""
    assert name not in names.DTYPE_FREE
    outs = []
    for dt in (torch.float32, torch.float64):
        torch.manual_seed(3)
        outs.append(fn(X5.to(dt)).double())
    assert (outs[0] - outs[1]).abs().max().item() > 0.5


# -- a planted bug inside a random call is still caught -------------------------------------------
def test_fp16_dropout_that_overflows_is_caught(tmp_path):
    """fp16 activations near 40000 through dropout(p=0.5): the kept ones are scaled past
    fp16's maximum (65504) to inf; the float32 re-run on the same mask keeps them finite."""
    x = (torch.rand(64, 64, generator=gen()) * 20000 + 30000).to(fp16)
    fb, _, _, _ = run(tmp_path, "improve_precision", lambda: F.dropout(x, 0.5))
    df = fb.results
    assert df[["api_name", "kind", "cause"]].to_dict("records") == [
        {"api_name": "Functional.dropout.0.forward", "kind": "nan_inf", "cause": "inaccurate"}]


@pytest.mark.parametrize("mode", ["bit_noise", "add_noise"])
def test_bf16_attention_with_dropout_and_huge_logits_is_caught(tmp_path, mode):
    """nn.MultiheadAttention (dropout 0.1, training) in bf16: inputs scaled by 300 make logits
    whose bf16 spacing is larger than their differences (softmax of them keeps no correct
    digit): flagged ill-conditioned by the sensitivity modes; the same layer on unit-scale
    inputs is silent."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True).to(bf16).train()
    x = torch.randn(2, 8, 32, generator=gen())
    for scale, expect in ((1.0, []), (300.0, ["ill-conditioned"])):
        xs = (x * scale).to(bf16)
        fb, _, state, _ = run(tmp_path / str(scale), mode,
                              lambda: mha(xs, xs, xs, need_weights=False))
        _, ref_state, _ = plain(lambda: mha(xs, xs, xs, need_weights=False))
        df = fb.results
        assert df["cause"].tolist() == expect, df
        assert set(df["api_name"]) <= {"Functional.multi_head_attention_forward.0.forward"}
        assert torch.equal(state, ref_state)


@pytest.mark.parametrize("mode", ["bit_noise", "improve_precision"])
def test_fp16_gumbel_softmax_of_large_logits_is_caught(tmp_path, mode):
    """gumbel_softmax of fp16 logits near 1000 (spacing 0.5 there, differences O(1)): the
    replayed Gumbel noise leaves only the ill-conditioning; logits near 0 are silent."""
    z = torch.randn(8, 64, generator=gen())
    for offset, expect in ((0.0, []), (1000.0, ["ill-conditioned"])):
        logits = (z + offset).to(fp16)
        fb, _, _, _ = run(tmp_path / str(offset), mode, lambda: F.gumbel_softmax(logits))
        assert fb.results["cause"].tolist() == expect


@pytest.mark.parametrize("mode, stage, checked, skipped", [
    ("bit_noise", "forward", True, {}),
    ("no_change", "backward", True, {}),
    ("bit_noise", "backward", False, {"selection": 1}),   # its gradient goes where it picks
    ("improve_precision", "forward", False, {"random": 1}),   # its draws depend on the dtype
])
def test_fractional_max_pool_with_indices(tmp_path, mode, stage, checked, skipped):
    """Fractional max pooling draws its pooling regions (in the input's dtype)."""
    x0 = torch.randn(2, 3, 16, 16, generator=gen())

    def run(probe):
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(1)
        with probe if probe is not None else torch.enable_grad():
            y, idx = F.fractional_max_pool2d(x, 2, output_ratio=(0.5, 0.5),
                                             return_indices=True)
            y.square().sum().backward()
        return y, idx, x.grad, torch.get_rng_state()

    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage=stage,
                   list=["fractional_max_pool2d"])
    got, ref = run(fb), run(None)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    s = fb.summary
    assert fb.results.empty
    assert {k: v for k, v in s["skipped"].items() if k != "out_of_scope"} == skipped, s
    assert s["checked"] == (1 if checked else 0) and s.get("replayed", 0) == (1 if checked else 0)


# -- random calls nobody listed: found by watching the generators (rng.observe) --------------------
def rnn(kind, layers=3, p=0.4, dtype=torch.float32):
    torch.manual_seed(0)
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
    return cls(8, 8, num_layers=layers, dropout=p, batch_first=True).to(dtype)


RNN_X = torch.randn(2, 5, 8, generator=gen(9))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("mode", ["no_change", "bit_noise", "improve_precision"])
def test_rnn_dropout_drawn_inside_the_call_is_found_and_replayed(tmp_path, kind, mode):
    """``torch.lstm`` / ``torch.gru`` / ``torch.rnn_tanh`` draw their dropout masks between
    layers inside the one call; no rule lists them. The first call's generators moved, so the
    call is replayed: no_change proves the re-run drew the same masks (any other mask is a
    finding; under no_grad, as the re-runs run: the CPU kernels of these APIs with autograd
    recording differ in the last bit), and the stream is where the real call left it."""
    m = rnn(kind).train()

    def fn():
        with torch.no_grad() if mode == "no_change" else contextlib.nullcontext():
            return m(RNN_X)[0]

    fb, out, state, nxt = run(tmp_path, mode, fn)
    ref_out, ref_state, ref_next = plain(fn)
    assert fb.results.empty, fb.results[["api_name", "ratio", "cause"]]
    assert torch.equal(out, ref_out)
    assert torch.equal(state, ref_state) and torch.equal(nxt, ref_next)
    s = fb.summary
    assert s["replayed"] == 1 and "random" not in s["skipped"] and "cancelled" not in s["skipped"]
    api = {"lstm": "Torch.lstm.0", "gru": "Torch.gru.0", "rnn": "Torch.rnn_tanh.0"}[kind]
    cov = fb.coverage.set_index("api_name")
    assert cov.loc[api, "checked"] == 1


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("mode", ["no_change", "improve_precision"])
def test_rnn_dropout_backward_rerun_replays_the_forward_masks(tmp_path, kind, mode):
    m = rnn(kind).train()

    def once(probe):
        x = RNN_X.clone().requires_grad_(True)
        torch.manual_seed(11)
        with probe if probe is not None else torch.enable_grad():
            y = m(x)[0]
            y.square().sum().backward()
        return y, x.grad, torch.get_rng_state(), torch.rand(3)

    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage="backward")
    got = once(fb)
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    ref = once(None)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters()))
    assert fb.results.empty, fb.results[["api_name", "output_index", "ratio", "cause"]]
    assert fb.summary["replayed"] == 1 and fb.summary["checked"] >= 1


def test_whether_a_call_draws_is_learned_once_per_signature(tmp_path):
    """The generators are compared at the first call of a signature only: the training flag
    and whether the dropout probability is 0 are part of it, the values are not. A call in eval
    (``train=False``: no draw) is a plain call; the same module in training draws again."""
    m = rnn("lstm")
    m0 = rnn("lstm", p=0.0)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", list=["lstm"])

    def calls():
        outs = []
        for module, training in ((m, True), (m, True), (m, False), (m0, True), (m, True)):
            module.train(training)
            outs.append(module(RNN_X * (1 + len(outs)))[0])
        return outs

    torch.manual_seed(3)
    with fb, torch.no_grad():   # no_grad: the kernels the re-runs use (see above)
        got = calls()
    state = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.no_grad():
        ref = calls()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(state, torch.get_rng_state())
    assert fb.results.empty and fb.summary["checked"] == 5
    assert fb.summary["replayed"] == 3                  # the three calls in training with p > 0
    assert sorted(fb._engine.draws.values()) == [False, False, True]   # three signatures


def test_unlisted_random_api_whose_draws_depend_on_the_dtype_is_skipped(tmp_path, monkeypatch):
    """An API nobody listed that draws other numbers in float64 than in float32 (``normal``, its
    rule removed from the table): its improve_precision re-run does not end where the real call
    ended, so that check is cancelled and the signature is skipped from then on as ``random``
    (reason ``draws``) -- never compared on other numbers; the stream is untouched."""
    monkeypatch.delitem(names.RANDOM_RULES, "normal")

    def fn():
        return [torch.normal(X, 1.0) for _ in range(3)]

    fb, out, state, nxt = run(tmp_path, "improve_precision", fn)
    ref_out, ref_state, ref_next = plain(fn)
    assert all(torch.equal(a, b) for a, b in zip(out, ref_out))
    assert torch.equal(state, ref_state) and torch.equal(nxt, ref_next)
    assert fb.results.empty
    s = fb.summary
    assert s["skipped"]["cancelled"] == 1 and s["skipped"]["random"] == 2, s
    rows = {r.api_name: (r.calls, r.checked, r.reason) for r in fb.coverage.itertuples()}
    assert rows["Torch.normal.2"] == (1, 0, "random: " + rng.WHY["draws"])
    # bit_noise keeps the dtype: the same number of draws, replayed and checked
    fb2, out2, state2, _ = run(tmp_path / "b", "bit_noise", fn)
    assert fb2.summary["replayed"] == 3 and fb2.results.empty
    assert all(torch.equal(a, b) for a, b in zip(out2, ref_out)) and torch.equal(state2, ref_state)


def test_unlisted_random_api_with_an_explicit_generator(tmp_path, monkeypatch):
    monkeypatch.delitem(names.RANDOM_RULES, "bernoulli")
    p = torch.sigmoid(X)

    def draws(probe):
        g = torch.Generator().manual_seed(5)
        torch.manual_seed(0)
        with probe if probe is not None else torch.no_grad():
            out = [torch.bernoulli(p, generator=g) for _ in range(2)]
        return out, g.get_state(), torch.get_rng_state()

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    got, ref = draws(fb), draws(None)
    assert fb.summary["replayed"] == 2 and fb.results.empty
    assert same(tuple(got[0]), tuple(ref[0]))
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


def test_fix_of_an_unlisted_random_call_runs_the_original(tmp_path):
    """fix replaces only the random APIs known to draw the same numbers in every dtype: an
    LSTM with dropout (found by observation) keeps its original run and its draws."""
    m = rnn("lstm").train()
    fn = lambda: m(RNN_X)[0]                                        # noqa: E731
    fb, out, state, nxt = run(tmp_path, "improve_precision", fn, handler_type="fix")
    ref_out, ref_state, ref_next = plain(fn)
    assert torch.equal(out, ref_out)
    assert torch.equal(state, ref_state) and torch.equal(nxt, ref_next)
    assert fb.summary["skipped"]["random"] == 1 and fb.summary["checked"] == 0
    fb, out, state, nxt = run(tmp_path / "2", "improve_precision", lambda: [fn(), fn()],
                              handler_type="fix")
    assert fb.summary["skipped"]["random"] == 2 and torch.equal(state, plain(
        lambda: [fn(), fn()])[1])


def test_signature_of_a_call():
    x, c = torch.ones(2), torch.ones(2, dtype=torch.float64)
    sig = rng.signature
    assert sig("Torch.lstm", [x, c, 0.3, True, 2, None, "a"]) == \
        ("Torch.lstm", True, True, 2, None, "a")
    assert sig("Torch.lstm", [x, 0.0, False]) == ("Torch.lstm", False, False)
    assert sig("Torch.lstm", [x, 0.3]) == sig("Torch.lstm", [c * 5, 0.9])
    assert sig("Torch.add", [x, torch.float16]) == ("Torch.add", torch.float16)
    assert sig("Torch.normal", [x, torch.Generator()]) == ("Torch.normal", torch.Generator)
    assert rng.generators([x, torch.ones(1, device="meta")]) == "generator"
    g = torch.Generator()
    assert rng.generators([x], g) == [torch.default_generator, g]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lstm_dropout_is_found_and_replayed(tmp_path):
    m = rnn("lstm").cuda().train()
    x = RNN_X.cuda()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    torch.manual_seed(7)
    with fb:
        out = m(x)[0]
    state = torch.cuda.get_rng_state()
    torch.manual_seed(7)
    ref = m(x)[0]
    assert torch.equal(out, ref) and torch.equal(state, torch.cuda.get_rng_state())
    assert fb.results.empty and fb.summary["replayed"] == 1


def test_generator_moved_by_someone_else_is_not_taken_for_a_draw(tmp_path):
    """The generators moved across a call's first run for another reason than the call (here
    a function mode the user entered before the probe draws whenever tanh runs, as another
    thread could): the verified re-run draws nothing, so the call is learned as a plain one and
    its check stands; the user's draws happen as without the probe."""
    from torch.overrides import TorchFunctionMode

    class Drawing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "tanh":
                torch.rand(1)
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, generator=gen())

    def run(probe):
        torch.manual_seed(2)
        with Drawing():
            with probe if probe is not None else torch.no_grad():
                out = [torch.tanh(x), torch.tanh(x)]
        return out, torch.get_rng_state()

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", list=["tanh"])
    got, ref = run(fb), run(None)
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert torch.equal(got[1], ref[1])
    s = fb.summary
    assert s["checked"] == 2 and fb.results.empty and "cancelled" not in s["skipped"], s
    assert list(fb._engine.draws.values()) == [False] and "replayed" not in s
