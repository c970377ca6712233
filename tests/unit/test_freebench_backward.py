"""fuzz_stage "backward": input gradients checked by recomputation, real gradients untouched."""
import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench


def bench(tmp_path, mode="bit_noise", **kw):
    return FreeBench(dump_path=str(tmp_path), pert_mode=mode, fuzz_stage="backward", **kw)


def exp_case():
    # d exp(x)/dx = exp(x): with x near 50 in bf16 one ulp (0.25) moves it by 28 %
    return torch.tensor([50.0, 51.0, 52.0], dtype=torch.bfloat16, requires_grad=True)


def test_flags_the_input_gradient_and_keeps_the_real_one(tmp_path):
    x = exp_case()
    ref = torch.autograd.grad(torch.exp(x).float().sum(), x)[0]
    fb = bench(tmp_path)
    with fb:
        y = torch.exp(x)
        y.float().sum().backward()
    assert torch.equal(x.grad, ref)
    df = fb.results
    assert df["api_name"].tolist() == ["Torch.exp.0.backward"]
    r = df.iloc[0]
    assert (r["stage"], r["output_index"], r["dtype"], r["shape"], r["kind"]) == (
        "backward", 0, "torch.bfloat16", "(3,)", "rel_error")
    assert r["max_rel"] > 0.2
    assert fb.summary["checked"] == 2                         # exp and the (exact) sum


def test_scale_invariant(tmp_path):
    """Judged relative to each input gradient's scale: the same check for loss and 1024*loss."""
    found = []
    for scale in (1.0, 1024.0, 2.0 ** -20):
        x = exp_case()
        fb = bench(tmp_path / str(scale))
        with fb:
            (torch.exp(x).float().sum() * scale).backward()
        found.append(fb.results["max_rel"].tolist())
    assert found[0] == found[1] == found[2] and len(found[0]) == 1


def test_output_index_is_the_input_position(tmp_path, monkeypatch):
    from probekit.freebench.engine import intercept

    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    fb = bench(tmp_path, "no_change")
    seen = []
    real = intercept.Engine.record

    def spy(self, key, name, items, *a, **k):
        seen.append((name, [i for i, _, _, _ in items]))
        return real(self, key, name, items, *a, **k)

    monkeypatch.setattr(intercept.Engine, "record", spy)
    with fb:
        F.linear(x, w, b).sum().backward()
    # hooks fire in backward order: the sum first, then the linear with its 3 inputs
    assert seen == [("Tensor.sum.0.backward", [0]), ("Functional.linear.0.backward", [0, 1, 2])]
    assert fb.results.empty                                   # deterministic on CPU


def test_inplace_change_before_backward_cancels(tmp_path):
    x = (exp_case() * 1)                                       # non-leaf input
    fb = bench(tmp_path)
    with fb:
        y = torch.exp(x)
        with torch.no_grad():
            x.add_(1)                                          # exp saved its output, not x
        y.float().sum().backward()
    assert fb.summary["skipped"].get("cancelled") == 1
    assert fb.results.empty


def test_no_grad_calls_and_backward_outside_are_not_checked(tmp_path):
    x = exp_case()
    fb = bench(tmp_path)
    with fb:
        with torch.no_grad():
            torch.exp(x)
        y = torch.exp(x)
    y.float().sum().backward()                                 # after stop(): hooks are gone
    s = fb.summary
    assert s["checked"] == 0 and s["skipped"]["no_grad"] == 1
    assert x.grad is not None


@pytest.mark.parametrize("mode", ["improve_precision", "add_noise", "change_value", "no_change"])
def test_modes_run_on_multi_output_api(tmp_path, mode):
    x = torch.randn(4, 6, requires_grad=True)
    fb = bench(tmp_path, mode)
    with fb:
        v, i = torch.max(x, dim=-1)
        v.sum().backward()
    s = fb.summary
    assert s["checked"] + s["skipped"].get("cancelled", 0) >= 1
    assert "error" not in s["skipped"]
