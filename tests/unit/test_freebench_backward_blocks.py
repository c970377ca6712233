"""The backward stage re-runs large calls block by block (``backward._blocked``): the rows equal
those of the whole re-run, the training's gradients are untouched, and inputs whose gradient sums
over the blocks (weights, biases, broadcast inputs) are blocked only in upcast modes."""
import pandas as pd
import pytest
import torch

from probekit.freebench import FreeBench
from probekit.freebench.engine import backward, blocks
from probekit.freebench.judge import judging

F = torch.nn.functional


def _cases():
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).requires_grad_(True)

    x, w, b, z, v, c = r(6, 20, 16), r(24, 16), r(24), r(6, 16, 24), r(16), r(16)
    one = r(1, 20, 16)
    return {
        # name: (inputs, call, blocked in bit_noise too: every input sliced with the output)
        "gelu": ([x], lambda: F.gelu(x), True),
        "softmax over -1": ([x], lambda: torch.softmax(x, -1), True),
        "bmm": ([x, z], lambda: torch.bmm(x, z), True),
        "linear": ([x, w, b], lambda: F.linear(x, w, b), False),
        "layer_norm": ([x, v, c], lambda: F.layer_norm(x, (16,), v, c), False),
        # cut along dim 1, which both inputs have: the broadcast one is sliced too
        "mul broadcast on dim 0": ([one, x], lambda: torch.mul(one, x), True),
    }


@pytest.mark.parametrize("mode", ["improve_precision", "bit_noise"])
@pytest.mark.parametrize("case", list(_cases()))
def test_blocked_backward_rows_equal_the_whole_rerun(tmp_path, monkeypatch, case, mode):
    blocked_calls = []
    real_blocked = backward._BackwardCheck._blocked

    def counting(self, *a):
        blocked_calls.append(self.name)
        return real_blocked(self, *a)

    monkeypatch.setattr(backward._BackwardCheck, "_blocked", counting)
    compared = []   # per run: the comparison values of each input gradient, as floats
    real_defer = judging.Judging.defer

    def spy(self, key, n, name, stage, step, site, in_dtype, triples, values=None, **kw):
        compared.append([[float(v) for v in vals] for vals in values])
        return real_defer(self, key, n, name, stage, step, site, in_dtype, triples,
                          values=values, **kw)

    monkeypatch.setattr(judging.Judging, "defer", spy)

    def run(block):
        monkeypatch.setattr(blocks, "BLOCK", block)
        inputs, call, _ = _cases()[case]
        fb = FreeBench(dump_path=str(tmp_path / f"{block}"), pert_mode=mode,
                       fuzz_stage="backward", thresholds={"bfloat16": 1e-9},
                       list=[case.split()[0]])
        with fb:
            out = call()
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            out.backward(go.to(out.dtype))
        grads = [t.grad for t in inputs]
        # every input gradient's row (a finding, or a hot spot the analysis explained)
        rows = pd.concat([fb.results, fb.hotspots.drop(columns=["count"])])
        return rows.sort_values("output_index").drop(columns=["call_site"]), grads

    whole, g_whole = run(1 << 20)
    assert blocked_calls == []
    blocked, g_blocked = run(300)
    inputs_n = len(_cases()[case][0])
    expect_blocked = mode == "improve_precision" or _cases()[case][2]
    assert len(blocked_calls) == (1 if expect_blocked else 0), blocked_calls
    # the training's gradients: identical
    assert all(torch.equal(a, b) for a, b in zip(g_whole, g_blocked))
    # the comparison values (exact: first check of the site) of every input gradient; a
    # gradient summed over the blocks (upcast modes: in float64, of fp32 partial gradients)
    # moves them by a few fp32 eps of the gradient's scale
    assert len(compared) == 2 and len(compared[0]) == len(compared[1]) == inputs_n
    for a, b in zip(*compared):
        assert len(a) == len(b) == 6      # (+ max|p|: issue 34)
        if _cases()[case][2]:          # every gradient sliced: the very same numbers
            assert a == b
        else:   # a few fp32 eps of the gradient's scale (|g| <= ~40 here): 4.4e-6 per eps
            assert a == pytest.approx(b, rel=0, abs=2e-5)
    if mode != "improve_precision":
        return
    # one row per input gradient (the threshold is tiny), same rows either way
    assert len(whole) == inputs_n, whole
    for col in ("api_name", "output_index", "kind", "dtype", "shape", "stage", "cause"):
        assert whole[col].tolist() == blocked[col].tolist(), col
    assert blocked["max_rel"].tolist() == pytest.approx(whole["max_rel"].tolist(), rel=1e-4,
                                                         abs=1e-6)
    assert blocked["max_abs"].tolist() == pytest.approx(whole["max_abs"].tolist(), rel=1e-4,
                                                         abs=1e-6)
