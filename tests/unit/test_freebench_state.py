"""Accumulating calls and calls that write state (running statistics, in-place accumulation).

They are classified by what they compute with their actual arguments, checked on clones of the
state they write, and the training's tensors are written exactly once, by the real call.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench

fp16 = torch.float16
N, BINS = 20_000, 4


def gen():
    return torch.Generator().manual_seed(0)


def data():
    g = gen()
    idx = torch.randint(0, BINS, (N,), generator=g)
    vals = torch.rand(N, generator=g).to(fp16)
    return idx, vals


def probe(tmp_path, fn, mode="improve_precision", **extra):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, **extra)
    with fb:
        out = fn()
    return fb, out


def expected_max_rel(o, p, magnitude=None):
    """The metric recomputed in float64: against the call's sum of magnitudes (``magnitude``,
    the call on absolute values), else against the output tensor's largest magnitude."""
    o, p = o.double(), p.double()
    if magnitude is not None:
        return ((p - o).abs() / magnitude.double()).max().item()
    return ((p - o).abs().max() / o.abs().max()).item()


def test_index_put_accumulate_fp16_is_checked_and_flagged(tmp_path):
    # pytorch/pytorch#156173 (and intel/torch-xpu-ops#1751): index_put with accumulate=True in
    # fp16 sums in fp16; 20000 values in [0, 1) into 4 bins stall at 2048 (spacing 2 there)
    idx, vals = data()
    t = torch.zeros(BINS, dtype=fp16)
    fb, out = probe(tmp_path, lambda: torch.index_put(t, (idx,), vals, accumulate=True))
    assert out.tolist() == [2048.0] * BINS
    df = fb.results
    assert df["api_name"].tolist() == ["Torch.index_put.0.forward"]
    assert df["kind"].tolist() == ["rel_error"]
    # the re-run computes in fp32; the value is that of an fp32 (and, closely, fp64) recomputation
    p32 = torch.zeros(BINS).index_put((idx,), vals.float(), accumulate=True)
    p64 = torch.zeros(BINS, dtype=torch.float64).index_put((idx,), vals.double(), accumulate=True)
    # judged per bin against the data-aware bound (issue 34): u_fp16 |p| + K u_fp32 (|p| / 2 +
    # (pi / 8) sqrt(Q)), K the terms landing in the bin (its values and its initial 0), Q the
    # sum of their squares
    K = torch.zeros(BINS).index_put((idx,), torch.ones(N), accumulate=True) + 1
    for ref in (p32, p64.float()):
        q = torch.zeros(BINS).index_put((idx,), vals.float() ** 2, accumulate=True)
        e = ref.abs() * 2.0 ** -11 + K * 2.0 ** -24 * (ref.abs() / 2 + math.pi / 8 * q.sqrt())
        assert df["max_rel"].iloc[0] == pytest.approx(
            ((ref.double() - out.double()).abs() / e.double()).max().item(), rel=1e-5)
    # the fp16 sums stall at 2048 where fp32 accumulation gives about 5000: far beyond it
    assert df["threshold"].iloc[0] == 2 and df["ratio"].iloc[0] > 50
    assert df["cause"].tolist() == ["inaccurate"]


def test_index_put_without_accumulate_is_an_exact_copy(tmp_path):
    idx, vals = data()
    t = torch.zeros(BINS, dtype=fp16)
    fb, _ = probe(tmp_path, lambda: (torch.index_put(t, (idx,), vals),
                                     t.clone().index_put_((idx,), vals)))
    assert fb.summary["checked"] == 0
    assert fb.summary["skipped"] == {"copy": 3}  # the clone, index_put, index_put_


def _family():
    idx, vals = data()
    z = lambda: torch.zeros(BINS, dtype=fp16)  # noqa: E731
    w = torch.rand(BINS, 1, generator=gen()).to(fp16)
    bags = torch.zeros(1, dtype=torch.long)
    # (name, call, flagged?): on torch 2.13 CPU index_add/index_put/put accumulate fp16 in fp16
    # (the sums stall at 2048), while scatter_add/scatter_reduce/embedding_bag accumulate in fp32
    # and bincount returns fp64 (its upcast re-run would sum fp32 weights in fp32: cancelled)
    return [
        ("index_add", lambda: torch.index_add(z(), 0, idx, vals), True),
        ("index_add_", lambda: z().index_add_(0, idx, vals), True),
        ("index_put_accumulate_", lambda: z().index_put_((idx,), vals, accumulate=True), True),
        ("put_accumulate_", lambda: z().put_(idx, vals, accumulate=True), True),
        ("scatter_add", lambda: torch.scatter_add(z(), 0, idx, vals), False),
        ("scatter_add_", lambda: z().scatter_add_(0, idx, vals), False),
        ("scatter_reduce_sum", lambda: torch.scatter_reduce(z(), 0, idx, vals, "sum"), False),
        ("scatter_reduce_mean_", lambda: z().scatter_reduce_(0, idx, vals, "mean"), False),
        ("embedding_bag_sum", lambda: F.embedding_bag(idx, w, bags, mode="sum"), False),
        ("bincount_weights", lambda: torch.bincount(idx, weights=vals), False),
    ]


FAMILY = _family()


@pytest.mark.parametrize("name, fn, flagged", FAMILY, ids=[c[0] for c in FAMILY])
def test_accumulating_family_checked_and_flagged_where_inaccurate(tmp_path, name, fn, flagged):
    plain = fn()
    fb, out = probe(tmp_path, fn)
    assert torch.equal(out, plain)   # the call's own result is untouched
    s = fb.summary
    assert s["checked"] + s["skipped"].get("cancelled", 0) == 1, s
    df = fb.results
    assert len(df) == int(flagged), df
    if flagged:   # 2048 where fp32 gives 2300-2500: 0.1-0.2 of sum |values|, >10x 16 u of fp16
        assert df["ratio"].iloc[0] > 10 and df["cause"].iloc[0] == "inaccurate", df


EXACT = [
    ("scatter", lambda idx, vals: torch.zeros(BINS, dtype=fp16).scatter(0, idx, vals)),
    ("scatter_reduce_amax",
     lambda idx, vals: torch.scatter_reduce(torch.zeros(BINS, dtype=fp16), 0, idx, vals, "amax")),
    ("index_reduce_amin",
     lambda idx, vals: torch.zeros(BINS, dtype=fp16).index_reduce(0, idx, vals, "amin")),
    ("embedding_bag_max",
     lambda idx, vals: F.embedding_bag(idx, torch.ones(BINS, 2), torch.tensor([0]), mode="max")),
    ("embedding", lambda idx, vals: F.embedding(idx, torch.ones(BINS, 2))),
]


@pytest.mark.parametrize("name, fn", EXACT, ids=[c[0] for c in EXACT])
@pytest.mark.filterwarnings("ignore:index_reduce")
def test_selecting_variants_are_exact_copies(tmp_path, name, fn):
    idx, vals = data()
    fb, _ = probe(tmp_path, lambda: fn(idx, vals), mode="no_change")
    assert fb.summary["checked"] == 0
    assert fb.summary["skipped"].get("copy", 0) >= 1, fb.summary


def _constant_channels():
    # pytorch/pytorch#5410: batch norm of channels that are constant across the batch must give
    # 0; with offsets of ~1e5 the fp32 result is up to ~0.95 instead
    g = gen()
    c = (torch.rand(5, generator=g) * 2 - 1) * 1e5
    return c[None, :, None, None].repeat(4, 1, 6, 6).float()


def test_training_batch_norm_checked_on_cloned_statistics(tmp_path):
    x = _constant_channels()
    rm, rv = torch.zeros(5), torch.ones(5)
    rm0, rv0 = rm.clone(), rv.clone()
    fb, out = probe(tmp_path, lambda: F.batch_norm(x, rm, rv, training=True))
    df = fb.results
    # the vectorised (AVX2, AVX-512) kernels get it wrong; the plain one (default) gives 0
    assert df["api_name"].tolist() == (["Functional.batch_norm.0.forward"]
                                       if out.abs().max() > 0 else [])
    # float64 recomputation: every output is 0 up to 1e-9; the fp32 one is not
    p64 = F.batch_norm(x.double(), rm0.double(), rv0.double(), training=True)
    assert p64.abs().max().item() < 1e-8
    if len(df):
        assert df["max_rel"].iloc[0] == pytest.approx(expected_max_rel(out, p64), rel=1e-6)
    # the running statistics were updated once, exactly as without the probe
    rm1, rv1 = rm0.clone(), rv0.clone()
    F.batch_norm(x, rm1, rv1, training=True)
    assert torch.equal(rm, rm1) and torch.equal(rv, rv1)


def test_batch_norm_module_training_state_bitwise_unchanged(tmp_path):
    x = _constant_channels()
    torch.manual_seed(0)
    a, b = torch.nn.BatchNorm2d(5), torch.nn.BatchNorm2d(5)
    b.load_state_dict(a.state_dict())
    ya = a(x)
    fb, yb = probe(tmp_path, lambda: b(x), mode="bit_noise")
    assert torch.equal(ya, yb)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert fb.summary["checked"] == 1


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_embedding_max_norm_checked_and_weight_renormed_once(tmp_path, stage):
    g = gen()
    idx = torch.tensor([0, 1, 1, 3])
    w0 = torch.randn(5, 3, generator=g) * 4
    wa = w0.clone().requires_grad_(True)
    F.embedding(idx, wa, max_norm=1.0).sum().backward()
    wb = w0.clone().requires_grad_(True)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", fuzz_stage=stage,
                   list=["embedding"])
    with fb:
        F.embedding(idx, wb, max_norm=1.0).sum().backward()
    assert torch.equal(wa, wb) and torch.equal(wa.grad, wb.grad)
    assert fb.summary["checked"] == 1, fb.summary
    assert fb.results.empty


def test_backward_stage_batch_norm_training(tmp_path):
    x = _constant_channels().requires_grad_(True)
    rm, rv = torch.zeros(5), torch.ones(5)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", fuzz_stage="backward",
                   list=["batch_norm"])
    with fb:
        (F.batch_norm(x, rm, rv, training=True) * torch.arange(4.0).view(4, 1, 1, 1)).sum() \
            .backward()
    rm1, rv1 = torch.zeros(5), torch.ones(5)
    F.batch_norm(x.detach(), rm1, rv1, training=True)
    assert torch.equal(rm, rm1) and torch.equal(rv, rv1)
    assert fb.summary["checked"] == 1, fb.summary


def test_fix_leaves_state_writing_calls_alone(tmp_path):
    idx, vals = data()
    x = _constant_channels()
    rm, rv = torch.zeros(5), torch.ones(5)
    fb, (acc, y) = probe(tmp_path, lambda: (
        torch.zeros(BINS, dtype=fp16).index_add_(0, idx, vals),
        F.batch_norm(x, rm, rv, training=True)), handler_type="fix")
    assert acc.tolist() == [2048.0] * BINS   # not replaced: index_add_ must write self
    assert torch.equal(y, F.batch_norm(x, torch.zeros(5), torch.ones(5), training=True))
    assert fb.summary["skipped"] == {"inplace": 1, "side_effect": 1, "creation": 1}


# -- in-place calls: the original on the real tensor, the re-runs out of place on its clone -------
#: in-place calls as models make them: (name, call on a tensor, API name in the results)
INPLACE = [
    ("ReLU(inplace)", lambda x: torch.nn.ReLU(inplace=True)(x), "Functional.relu.0"),
    ("SiLU(inplace)", lambda x: torch.nn.SiLU(inplace=True)(x), "Functional.silu.0"),
    ("hardswish(inplace)", lambda x: F.hardswish(x, True), "Functional.hardswish.0"),
    ("relu_", lambda x: torch.relu_(x), "Torch.relu_.0"),
    ("F.elu_", lambda x: F.elu_(x), "Functional.elu_.0"),
    ("x += y", lambda x: _iadd(x), "Tensor.__iadd__.0"),
    ("mul_", lambda x: x.mul_(1.7), "Tensor.mul_.0"),
    ("addcmul_", lambda x: x.addcmul_(x.detach(), x.detach(), value=0.1), "Tensor.addcmul_.0"),
    ("sigmoid_", lambda x: x.sigmoid_(), "Tensor.sigmoid_.0"),
]


def _iadd(x):
    x += x.detach() * 0.5
    return x


def _inplace_run(fn, probe=None, grad=True):
    """``fn`` on a non-leaf activation (a view of a bigger tensor, as a slice of a conv output
    is) inside a small graph; returns the tensors, their version counters and the gradient."""
    g = gen()
    w = torch.randn(6, 8, generator=g).requires_grad_(grad)
    base = w * 1.5                      # a non-leaf
    x = base[1:5]                       # a view: the write goes into base
    with probe if probe is not None else torch.enable_grad():
        y = fn(x)
        loss = (y * torch.arange(8.0)).sum() + base.square().sum()
        if grad:
            loss.backward()
    return y.detach().clone(), base.detach().clone(), (x._version, base._version), \
        (w.grad if grad else None)


@pytest.mark.parametrize("name, fn, api", INPLACE, ids=[c[0] for c in INPLACE])
@pytest.mark.parametrize("mode, stage", [("improve_precision", "forward"),
                                         ("bit_noise", "forward"), ("no_change", "forward"),
                                         ("improve_precision", "backward"),
                                         ("bit_noise", "backward")])
def test_inplace_call_is_checked_and_the_training_unchanged(tmp_path, name, fn, api, mode, stage):
    """The in-place call runs on the real tensor (a view of a non-leaf, inside an autograd graph);
    its re-runs run the out-of-place form on a clone of the input taken just before it. Outputs,
    the written base tensor, the version counters and the gradients are those of a run without
    the probe, bit for bit; the call is checked (forward: its output; backward: the gradients
    of its inputs) and a healthy one gives no finding."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage=stage)
    got, ref = _inplace_run(fn, fb), _inplace_run(fn)
    for a, b in zip(got, ref):
        assert a == b if isinstance(a, tuple) else torch.equal(a, b)
    cov = fb.coverage.set_index("api_name")
    assert cov.loc[api, "checked"] == 1, fb.coverage
    assert fb.results.empty, fb.results[["api_name", "output_index", "ratio", "cause"]]
    assert "inplace" not in fb.summary["skipped"] and "error" not in fb.summary["skipped"]


@pytest.mark.parametrize("mode", ["improve_precision", "bit_noise", "no_change"])
def test_out_calls_are_checked(tmp_path, mode):
    """``out=`` (autograd refuses it, so no gradients): the real call writes the ``out`` tensor,
    the re-run drops ``out``; an ``out`` that is also an input is cloned before the call."""
    def fn(probe):
        x = torch.randn(4, 8, generator=gen())
        o = torch.empty(4, 8)
        with probe if probe is not None else torch.no_grad():
            a = torch.mul(x, 3.0, out=o)
            b = torch.add(x, o, out=x)            # out aliases an input
        return a, b, o, x, (o._version, x._version)

    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode)
    got, ref = fn(fb), fn(None)
    assert got[4] == ref[4]
    assert all(torch.equal(a, b) for a, b in zip(got[:4], ref[:4]))
    assert fb.summary["checked"] == 2 and fb.results.empty, fb.summary


@pytest.mark.parametrize("mode", ["no_change", "bit_noise", "improve_precision"])
def test_inplace_and_out_keep_the_dtype_they_write(tmp_path, mode):
    """``x_bf16.add_(y_fp32)`` is bf16 and ``torch.mul(a, b, out=c_fp16)`` fp16, where their
    out-of-place forms are fp32: the re-run's result is cast to the dtype the call writes, so
    no_change sees no difference."""
    def fn(probe):
        g = gen()
        x = torch.randn(8, 8, generator=g).to(torch.bfloat16)
        y = torch.randn(8, 8, generator=g)
        c = torch.empty(8, 8, dtype=fp16)
        with probe if probe is not None else torch.no_grad():
            x.add_(y)
            torch.mul(y, 3.0, out=c)
        return x, c

    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode)
    got, ref = fn(fb), fn(None)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert fb.summary["checked"] == 2 and fb.results.empty, fb.results


def test_inplace_fp16_overflow_is_found(tmp_path):
    """A planted defect inside an in-place call: fp16 activations near 20000 multiplied by 4 in
    place overflow to inf; the float32 re-run (out of place, on the clone of the input) keeps
    them finite."""
    x = (torch.rand(64, 64, generator=gen()) * 1000 + 20000).to(fp16)
    fb, out = probe(tmp_path, lambda: x.mul_(4.0))
    assert torch.isinf(out).all() and out is x
    df = fb.results
    assert df[["api_name", "kind", "cause"]].to_dict("records") == [
        {"api_name": "Tensor.mul_.0.forward", "kind": "nan_inf", "cause": "inaccurate"}]


def test_inplace_on_a_leaf_under_no_grad_and_inplace_dropout(tmp_path):
    """Outside optimizer.step(): an in-place update of a parameter under no_grad (an EMA, a
    weight scaling) and an in-place dropout in training (a random and in-place call: replayed on
    the saved stream) are checked; the parameter, its version and the stream are unchanged."""
    def fn(probe):
        w = torch.nn.Parameter(torch.randn(4, 8, generator=gen()))
        h = torch.randn(4, 8, generator=gen()) + 1
        torch.manual_seed(5)
        with probe if probe is not None else torch.enable_grad():
            with torch.no_grad():
                w.mul_(0.999).add_(h, alpha=0.001)
            d = F.dropout(h, 0.3, training=True, inplace=True)
        return w.detach().clone(), w._version, d, h._version, torch.get_rng_state()

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    got, ref = fn(fb), fn(None)
    assert all(a == b if isinstance(a, int) else torch.equal(a, b) for a, b in zip(got, ref))
    s = fb.summary
    assert s["checked"] == 3 and s["replayed"] == 1 and fb.results.empty, s


def test_optimizer_inplace_updates_are_skipped_and_counted(tmp_path):
    """optimizer.step()'s in-place updates under no_grad are not checked (one rounding per
    element; a parameter-sized clone each): in a step that is intercepted (calls follow it
    before fb.step(): their names count its calls) skipped as ``optimizer``, counted among the
    floating-point calls."""
    w = torch.nn.Parameter(torch.randn(8, 8, generator=gen()))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, foreach=False)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision")
    fb.step()   # the steps are fb.step()'s, and a call follows the optimizer's: intercepted
    with fb:
        (w @ w).sum().backward()
        opt.step()
        w.detach().mul(2)
    s = fb.summary
    assert s["checked"] == 3                      # matmul, sum and mul
    assert s["float_skipped"]["optimizer"] == s["skipped"]["optimizer"] >= 1
    assert s["float_calls"] == 3 + sum(s["float_skipped"].values())


def test_fix_leaves_inplace_calls_alone(tmp_path):
    x = torch.randn(4, 8, generator=gen())
    y = x.clone()
    fb, out = probe(tmp_path, lambda: (torch.relu_(y), F.silu(y, inplace=True)),
                    handler_type="fix")
    assert torch.equal(y, F.silu(torch.relu(x)))
    assert fb.summary["skipped"] == {"inplace": 2} and fb.summary["checked"] == 0
