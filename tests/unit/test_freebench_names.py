"""API naming and classification as the TorchFunctionMode sees real torch calls."""
import logging

import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench, names


@pytest.fixture
def fb(tmp_path):
    # no_change in check mode: every checkable call is re-run, nothing is ever flagged on CPU
    bench = FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    yield bench
    bench.close()


def counts_of(fb, fn):
    with fb:
        fn()
    counts = fb.api_counts
    fb.step()
    return counts


X = torch.randn(4, 8)
W = torch.randn(8, 8)
B = torch.randn(8)
Q = torch.randn(1, 2, 4, 8)


@pytest.mark.parametrize("call, key", [
    (lambda: F.linear(X, W, B), "Functional.linear"),
    (lambda: F.gelu(X), "Functional.gelu"),
    (lambda: F.relu(X), "Functional.relu"),
    (lambda: F.layer_norm(X, (8,)), "Functional.layer_norm"),
    (lambda: F.softmax(X, -1), "Functional.softmax"),
    (lambda: F.scaled_dot_product_attention(Q, Q, Q), "Functional.scaled_dot_product_attention"),
    (lambda: torch.matmul(X, W), "Torch.matmul"),
    (lambda: torch.softmax(X, -1), "Torch.softmax"),
    (lambda: torch.relu(X), "Torch.relu"),
    (lambda: torch.einsum("ij,jk->ik", X, W), "Torch.einsum"),
    (lambda: X.softmax(-1), "Tensor.softmax"),
    (lambda: X.sum(), "Tensor.sum"),
    (lambda: X.pow(3), "Tensor.pow"),
    (lambda: X.add(X), "Tensor.add"),
    (lambda: X @ W, "Tensor.__matmul__"),
    (lambda: X + X, "Tensor.__add__"),
    (lambda: X - 1, "Tensor.__sub__"),
    (lambda: X * 2, "Tensor.__mul__"),
    (lambda: X / 2, "Tensor.__truediv__"),
    (lambda: X ** 2, "Tensor.__pow__"),
    (lambda: 1 - X, "Tensor.__rsub__"),
    (lambda: 2 / X, "Tensor.__rdiv__"),
    (lambda: -X, "Tensor.__neg__"),
    (lambda: X > 0, "Tensor.__gt__"),
])
def test_user_level_names(fb, call, key):
    # exactly one API call is seen: the one the user wrote, not the ones it makes internally
    assert counts_of(fb, call) == {key: 1}


def test_relu_imported_from_torch_is_seen(fb):
    from torch import relu

    assert counts_of(fb, lambda: relu(X)) == {"Torch.relu": 1}


def test_module_forward_is_seen_as_functional(fb):
    lin = torch.nn.Linear(8, 8)
    ln = torch.nn.LayerNorm(8)
    assert counts_of(fb, lambda: ln(lin(X))) == {"Functional.linear": 1, "Functional.layer_norm": 1}


def test_counters_per_api_within_a_step_and_reset_on_step(fb):
    def fn():
        for _ in range(3):
            torch.matmul(X, W)
        X.sum()

    assert counts_of(fb, fn) == {"Torch.matmul": 3, "Tensor.sum": 1}
    assert fb.summary["steps"] == 1
    assert counts_of(fb, lambda: torch.matmul(X, W)) == {"Torch.matmul": 1}
    assert fb.summary["steps"] == 2


def test_property_access_is_not_a_call(fb):
    with fb:
        X.shape, X.dtype, X.T, X.requires_grad
    assert fb.summary["calls"] == 0 and fb.api_counts == {}


def test_call_and_check_counts(fb):
    with fb:
        y = torch.matmul(X, W)   # checked
        y.t()                    # view: skipped
        y.add_(1)                # in-place: checked on copies (state.py)
        y.zero_()                # an in-place fill: exact
        torch.zeros(3)           # creation: skipped
    s = fb.summary
    assert s["calls"] == 5
    assert s["checked"] == 2
    assert s["skipped"] == {"view": 1, "copy": 1, "creation": 1}
    # the floating-point calls (torch.zeros has no input): 2 of 4 checked
    assert s["float_calls"] == 4 and s["checked_share"] == 0.5
    assert s["float_skipped"] == {"view": 1, "copy": 1}


@pytest.mark.parametrize("call, reason", [
    (lambda x: x.copy_(x), "copy"),
    (lambda x: x.fill_(2), "copy"),
    (lambda x: x.uniform_(), "creation"),                     # a random fill
    (lambda x: x.masked_fill_(x > 0, 1.0), "copy"),
    (lambda x: x.t_(), "view"),
    (lambda x: x[0].__setitem__(0, 1.0), "copy"),
    (lambda x: F.dropout(x, 0.5, training=False), "copy"),   # eval: the identity
    (lambda x: F.dropout(x, 0.0), "copy"),
    (lambda x: torch.dropout(x, 0.5, False), "copy"),
    (lambda x: F.alpha_dropout(x, 0.5), "copy"),              # training=False by default
    (lambda x: torch.rand_like(x), "creation"),               # no dependence on x's values
    (lambda x: torch.bernoulli(x, 0.3), "creation"),
    (lambda x: x.t(), "view"),
    (lambda x: x.view(-1), "view"),
    (lambda x: x.reshape(2, 16), "view"),
    (lambda x: x.flatten(), "view"),
    (lambda x: x[0], "view"),
    (lambda x: x.transpose(0, 1), "view"),
    (lambda x: x.detach(), "view"),
    (lambda x: x.contiguous(), "view"),
    (lambda x: x.clone(), "copy"),
    (lambda x: torch.cat([x, x]), "copy"),
    (lambda x: x.to(torch.float64), "conversion"),
    (lambda x: x.float(), "conversion"),
    (lambda x: x.size(), "metadata"),
    (lambda x: x.dim(), "metadata"),
    (lambda x: torch.zeros_like(x), "creation"),
    (lambda x: x.new_zeros(3), "creation"),
    (lambda x: torch._foreach_add([x], 1), "private"),
    (lambda x: torch.index_put(x, (torch.tensor([0, 0]),), x[:2]), "copy"),
    (lambda x: x.index_put_((torch.tensor([0, 0]),), torch.ones(2, 8)), "copy"),
])
def test_never_rerun_reasons(fb, call, reason):
    x = torch.randn(4, 8)
    with fb:
        call(x)
    s = fb.summary
    assert s["checked"] == 0
    assert s["skipped"].get(reason) == 1, s


def test_no_float_input_is_one_summary_line_per_session(fb, caplog):
    # issue 34: integer-only calls (indexing, masks, positions) were one WARNING per API (450
    # lines across nine models); now one INFO line at the end of the first block that had them
    i = torch.arange(6)
    with caplog.at_level(logging.INFO, logger="probekit"):
        for _ in range(2):
            with fb:
                i + i
                i * i
                i + i
            fb.step()
    msgs = [r for r in caplog.records if "floating-point tensor input" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in msgs] == [(
        "INFO", "[probekit] Free benchmark: 3 call(s) of 2 API(s) had no floating-point tensor "
        "input and are not checked (Tensor.__add__ 2, Tensor.__mul__ 1); "
        "summary['skipped']['no_float_input'] counts them.")]
    assert not any(r.levelname == "WARNING" for r in caplog.records)
    assert fb.summary["skipped"] == {"no_float_input": 6}


def test_skip_reason_logged_once_per_api(fb, caplog):
    x = torch.randn(3)
    with caplog.at_level(logging.INFO, logger="probekit"):
        for _ in range(3):
            with fb:
                x.t()
                x.t()
            fb.step()
    msgs = [r.getMessage() for r in caplog.records if "Tensor.t" in r.getMessage()]
    assert msgs == ["[probekit] Free benchmark: For Tensor.t.0.forward, a view/metadata-only call "
                    "is exact (a perturbation would pass through unchanged). Cancel perturbation."]


def test_classify_static_tables():
    assert names.classify(torch.Tensor.add_).skip is None          # checked (state.py)
    assert names.classify(torch.Tensor.add_).inplace
    assert names.classify(torch.matmul).key == "Torch.matmul"
    assert names.classify(torch.matmul).skip is None
    assert names.classify(F.linear).key == "Functional.linear"
    assert names.classify(F.layer_norm).key == "Functional.layer_norm"
    assert names.classify(torch.Tensor.sum).key == "Tensor.sum"
    assert names.classify(torch.Tensor.backward).skip == "metadata"
    assert names.classify(len).skip == "other"
    assert names.classify(F.relu).inplace_pos == 1
    assert names.classify(F.gelu).inplace_pos is None
    assert names.static_skip("zero_") == "copy"
    assert names.static_skip("normal_") == "creation"
    assert names.static_skip("squeeze_") == "view"
    assert names.static_skip("_foreach_add_") == "private"
    assert names.static_skip("__iadd__") is None
    assert names.static_skip("relu_") is None
    assert names.static_skip("__add__") is None
    assert names.static_skip("_softmax") == "private"


def test_call_site_is_the_users_line(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    a = torch.tensor([1e4 + 0.01])
    b = torch.tensor([-1e4])
    with fb:
        line = __import__("inspect").currentframe().f_lineno + 1
        a + b
    assert fb.results["call_site"].tolist() == [f"test_freebench_names.py:{line}"]


def test_unhashable_callable_is_classified_not_crashed():
    class Unhashable:
        __hash__ = None
        __name__ = "odd"
        __module__ = "somewhere"

        def __call__(self, *a):
            return 0

    c = names.Classifier()
    assert c(Unhashable()).skip == "other"
    assert c(torch.matmul) is c(torch.matmul)


# -- arguments are read by name (the signature), not by hard-coded positions ----------------------
def test_multi_head_attention_forward_dropout_read_from_its_real_positions():
    """``nn.MultiheadAttention`` passes ``dropout_p`` at position 10 and ``training`` by keyword
    (torch 2.13: positions 10 and 13 of ``F.multi_head_attention_forward``); names.py once read
    positions 13 and 19, so it never saw the dropout and re-ran the call on a fresh mask."""
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.2)
    s = torch.randn(4, 1, 8)
    info = names.classify(F.multi_head_attention_forward)
    assert info.params["dropout_p"] == (10, names.MISSING)
    assert info.params["training"] == (13, True)
    args = (s, s, s, 8, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.2,
            mha.out_proj.weight, mha.out_proj.bias)
    # it draws (and is replayed, rng.py) with dropout in training; otherwise a plain call
    assert isinstance(names.random_draw(info, args, {"training": True}), names.Draw)
    assert isinstance(names.random_draw(info, args, {}), names.Draw)     # training=True default
    assert names.random_draw(info, args, {"training": False}) is None
    assert names.random_draw(info, args + (False,), {}) is None          # training positional
    assert isinstance(names.random_draw(info, args + (True,), {}), names.Draw)
    assert names.random_draw(info, args[:10] + (0.0,) + args[11:], {"training": True}) is None
    assert names.dynamic_skip(info, args, {"training": True}) is None


def test_transformer_encoder_layer_with_default_dropout_changes_nothing(tmp_path):
    """The audit's reproducer: a TransformerEncoderLayer (dropout 0.1) under improve_precision
    re-ran its multi-head attention on a fresh dropout mask: a finding at ~5e5x the threshold,
    and the output and the RNG state changed."""
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    x = torch.randn(2, 8, 32)

    def run(fb):
        torch.manual_seed(7)
        if fb is None:
            y = enc(x)
        else:
            with fb:
                y = enc(x)
        return y, torch.get_rng_state(), torch.rand(4)

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision")
    got, ref = run(fb), run(None)
    assert fb.results.empty, fb.results[["api_name", "ratio"]]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # the attention and the three dropouts are checked on the replayed stream (rng.py)
    cov = fb.coverage.set_index("api_name")
    for site in ("Functional.multi_head_attention_forward.0", "Functional.dropout.0",
                 "Functional.dropout.1", "Functional.dropout.2"):
        assert cov.loc[site, "checked"] == 1 and cov.loc[site, "reason"] == ""
    assert "random" not in fb.summary["skipped"]


def test_parameters_from_aten_schemas_for_builtins():
    """Builtins have no Python signature: their positions and defaults come from the ATen
    schemas (``self`` first, as a method's arguments arrive); keyword-only ones have none."""
    M = names.MISSING
    assert names.parameters(torch.Tensor.index_put, "index_put") == {
        "self": (0, M), "indices": (1, M), "values": (2, M), "accumulate": (3, False)}
    assert names.parameters(torch.dropout, "dropout") == {
        "input": (0, M), "p": (1, M), "train": (2, M)}
    sdpa = names.parameters(F.scaled_dot_product_attention, "scaled_dot_product_attention")
    assert sdpa["dropout_p"] == (4, 0.0) and sdpa["scale"] == (None, None)
    scatter = names.parameters(torch.Tensor.scatter, "scatter")
    assert scatter["reduce"] == (None, M) and scatter["src"] == (3, M)
    assert names.parameters(F.dropout, "dropout") == {
        "input": (0, M), "p": (1, 0.5), "training": (2, True), "inplace": (3, False)}


XB = torch.randn(4, 8, 16, 16)
IDX = torch.zeros(1, 8, 16, 16, dtype=torch.long)


@pytest.mark.parametrize("call, key, expect", [
    (lambda: torch.batch_norm(XB, None, None, torch.zeros(8), torch.ones(8), True, 0.1, 1e-5,
                              False), "Torch.batch_norm", "checked"),
    (lambda: F.batch_norm(XB, torch.zeros(8), torch.ones(8), training=True),
     "Functional.batch_norm", "checked"),
    (lambda: torch.embedding_bag(torch.randn(5, 3), torch.tensor([0, 1, 2]), torch.tensor([0]),
                                 False, 2), "Torch.embedding_bag", "copy"),    # mode=2: max
    (lambda: F.embedding_bag(torch.tensor([0, 1, 2]), torch.randn(5, 3), torch.tensor([0]),
                             mode="max"), "Functional.embedding_bag", "copy"),
    (lambda: torch.index_put(XB, (torch.tensor([0, 0]),), XB[:2], accumulate=True),
     "Torch.index_put", "checked"),
    (lambda: XB.scatter_reduce(0, IDX, XB[:1], "sum"), "Tensor.scatter_reduce", "checked"),
    (lambda: XB.scatter_reduce(0, IDX, XB[:1], "amax"), "Tensor.scatter_reduce", "copy"),
    (lambda: XB.scatter(0, IDX, XB[:1]), "Tensor.scatter", "copy"),
])
def test_argument_rules_read_positional_and_keyword_arguments_by_name(tmp_path, call, key,
                                                                      expect):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", list=[key.split(".")[1]])
    with fb:
        call()
    s = fb.summary
    skipped = {k: v for k, v in s["skipped"].items() if k != "out_of_scope"}  # building inputs
    if expect == "checked":
        assert s["checked"] == 1 and skipped == {}, s
    else:
        assert s["checked"] == 0 and skipped == {expect: 1}, s
