"""The backward check's reference is the gradient the real backward gave each input of the call
(``realgrad``): read off the training's own graph, not recomputed."""
import os
import sys

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench
from probekit.freebench.engine import realgrad

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from test_freebench_training import make  # noqa: E402

bf16 = torch.bfloat16


def gen():
    return torch.Generator().manual_seed(0)


def test_collector_reads_exactly_this_calls_input_gradients():
    # x feeds the linear and a second consumer: x.grad is the sum, the linear's share is what
    # the call handed x; W and b are used by the linear only
    x = torch.randn(2, 3, 8, generator=gen()).to(bf16).requires_grad_(True)
    h = x * 1.5                                   # a non-leaf input
    w = torch.randn(5, 8, generator=gen()).to(bf16).requires_grad_(True)
    b = torch.randn(5, generator=gen()).to(bf16).requires_grad_(True)
    leaves = [h, w, b]
    mark = realgrad.marker()
    y = F.linear(h, w, b)
    edges = realgrad.plan(y, leaves, [0, 1, 2], mark)
    assert edges is not None
    assert sorted(pos for pairs in edges.values() for _, pos, _ in pairs) == [0, 1, 2]
    got = {}
    handles = [node.register_hook(hook)
               for node, hook in realgrad.Collector(edges, got.update).hooks()]
    g = torch.randn(2, 3, 5, generator=gen()).to(bf16)
    want = torch.autograd.grad(F.linear(h, w, b), [h, w, b], g, retain_graph=True)
    ((y * g.float()).sum() + (h.float() ** 2).sum()).backward()
    for hd in handles:
        hd.remove()
    assert sorted(got) == [0, 1, 2]
    for i in range(3):
        assert got[i].dtype == bf16 and torch.equal(got[i], want[i]), i
    assert torch.equal(got[1], w.grad) and torch.equal(got[2], b.grad)
    # the real x.grad also holds the second consumer's share; the collected one does not
    assert not torch.equal(got[0] * 1.5, x.grad)


def test_plan_declines_where_the_real_gradient_is_not_the_calls_own():
    x = torch.randn(4, 4, generator=gen()).requires_grad_(True)
    # one tensor in two places: its two shares could not be told apart
    mark = realgrad.marker()
    assert realgrad.plan(x * x, [x, x], [0, 1], mark) is None
    # the output is an input (a contiguous tensor's .contiguous() is itself)
    h = x * 2
    mark = realgrad.marker()
    assert realgrad.plan(h.contiguous(), [h], [0], mark) is None
    # more nodes than MAX_NODES
    mark = realgrad.marker()
    y = x
    for _ in range(realgrad.MAX_NODES + 1):
        y = y + 1
    assert realgrad.plan(y, [x], [0], mark) is None
    # a single node: its one edge to the leaf x
    mark = realgrad.marker()
    e = realgrad.plan(torch.exp(x), [x], [0], mark)
    assert [(node.name(), pairs) for node, pairs in e.items()] == [("ExpBackward0", [(0, 0, None)])]


def test_the_upstream_gradient_is_the_one_the_call_received_after_user_hooks(tmp_path):
    # a user hook on the output triples its gradient: the real input gradient is 3 g exp(x); the
    # perturbed re-run must use the same 3 g, or every call would be flagged at 200 %
    x = torch.linspace(-2, 2, 64).requires_grad_(True)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision",
                   fuzz_stage="backward", list=["exp"])
    with fb:
        y = torch.exp(x)
        y.register_hook(lambda g: g * 3)
        y.sum().backward()
    assert fb.summary["checked"] == 1
    assert fb.results.empty, fb.results
    assert torch.equal(x.grad, 3 * torch.exp(x.detach()))


@pytest.mark.parametrize("mode", ["improve_precision", "bit_noise"])
def test_real_reference_gives_the_recomputed_references_findings(tmp_path, monkeypatch, mode):
    # on the CPU the recomputed reference equals the real gradient bit for bit, so both ways
    # must report the same rows with the same values (and the training is untouched by either)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for way in ("real", "recomputed"):
            if way == "recomputed":
                monkeypatch.setattr(realgrad, "plan", lambda *a: None)
            _, _, step = make(seed=0, dtype=bf16)
            # a threshold below bf16's rounding: every gradient that moves is a row
            fb = FreeBench(dump_path=str(tmp_path / way), pert_mode=mode, fuzz_stage="backward",
                           thresholds={"bfloat16": 1e-6})
            losses = []
            for _ in range(2):
                with fb:
                    losses.append(step())
                fb.step()
            df = pd.concat([fb.results, fb.hotspots.drop(columns=["count"])]).sort_values(
                ["step", "api_name", "output_index"])
            out[way] = (losses, fb.summary["checked"],
                        df[["step", "api_name", "output_index", "max_rel", "max_abs",
                            "kind", "cause"]].reset_index(drop=True))
    finally:
        torch.set_num_threads(n)
    (l1, c1, d1), (l2, c2, d2) = out["real"], out["recomputed"]
    assert [float(v) for v in l1] == [float(v) for v in l2]
    assert c1 == c2 and c1 > 40
    assert len(d1) > 0
    assert d1.equals(d2), (d1, d2)


def test_a_parameter_cast_once_by_autocast_hands_each_call_its_own_gradient(tmp_path):
    # issue 34, defect A: under CPU autocast a leaf used by two calls is cast to bf16 once (the
    # cast is cached); one ToCopyBackward0 node hands W the sum of both calls' gradients. The
    # first call's reference was that sum (two rows at about 66,958x), the second found no edge
    lin = torch.nn.Linear(64, 64)
    g = gen()
    x1, x2 = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    got = []
    marks = []
    with torch.autocast("cpu", dtype=bf16):
        ys = []
        for x in (x1, x2):
            mark = realgrad.marker()
            y = F.linear(x, lin.weight, lin.bias)
            edges = realgrad.plan(y, [x, lin.weight, lin.bias], [1, 2], mark)
            assert edges is not None and sorted(p for prs in edges.values()
                                                for _, p, _ in prs) == [1, 2]
            got.append({})
            for node, hook in realgrad.Collector(edges, got[-1].update).hooks():
                marks.append(node.register_hook(hook))
            ys.append(y)
    gy = [torch.randn(32, 64, generator=g).to(bf16) for _ in ys]
    own = [torch.autograd.grad(y, [lin.weight, lin.bias], gy_, retain_graph=True)
           for y, gy_ in zip(ys, gy)]
    sum(((y * gy_).float().sum() for y, gy_ in zip(ys, gy))).backward()
    for h in marks:
        h.remove()
    for k in range(2):
        assert got[k][1].dtype == torch.float32
        assert torch.equal(got[k][1], own[k][0]) and torch.equal(got[k][2], own[k][1]), k
    # the training's gradient: the two summed in bf16 by the shared cast node, then converted
    assert torch.equal(lin.weight.grad, (own[0][0].to(bf16) + own[1][0].to(bf16)).float())
    for mode in ("improve_precision", "bit_noise"):
        fb = FreeBench(dump_path=str(tmp_path / mode), pert_mode=mode, fuzz_stage="backward",
                       list=["linear"])
        with fb:
            with torch.autocast("cpu", dtype=bf16):
                loss = lin(x1).float().sum() + lin(x2).float().sum()
            loss.backward()
        assert fb.results.empty, (mode, fb.results)
        assert fb.summary["checked"] == 2
