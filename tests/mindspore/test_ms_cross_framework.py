"""A PyTorch MLP and a MindSpore MLP started from the same weights and fed the same data:
their gradient signs agree at every step (similarity 1.0); names and transposed weights are
reconciled by probekit.mindspore.align."""
import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

import torch  # noqa: E402

import probekit  # noqa: E402
from probekit.errors import GradCompareError  # noqa: E402
from probekit.grads import GradProbe as TorchGradProbe  # noqa: E402
from probekit.mindspore import GradProbe, align_runs, compare_frameworks  # noqa: E402
from probekit.mindspore.align import AlignError, ms_to_torch_name  # noqa: E402

from ms_models import MLP, TorchMLP, data, graph_mode, make_step, run_steps, train  # noqa: E402

STEPS = 6


def record_both(tmp_path, level="L2", mode=None, significance=False):
    """The same MLP, weights and batches in PyTorch and MindSpore (PyNative, or compiled in
    ``mode``: see ms_models.make_step), each recorded by its probe."""
    ms.set_seed(11)
    net = MLP()
    tnet = TorchMLP()
    with torch.no_grad():  # the same starting weights: nn.Dense and nn.Linear are both (out, in)
        for name, p in tnet.named_parameters():
            p.copy_(torch.from_numpy(net.parameters_dict()[name].asnumpy()))
    batches = data(STEPS, seed=4)
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=0.05)
    probe = GradProbe(opt, grad_level=level, dump_path=tmp_path / "ms",
                      significance=significance).start()
    if mode is None:
        train(net, opt, batches)
    else:
        with graph_mode(mode):
            run_steps(make_step(mode, net, opt), batches)
    probe.stop()
    topt = torch.optim.SGD(tnet.parameters(), lr=0.05)
    with TorchGradProbe(tnet, topt, grad_level=level, dump_path=str(tmp_path / "pt"),
                        significance=significance):
        for x, y in batches:
            topt.zero_grad()
            torch.nn.functional.mse_loss(tnet(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            topt.step()
    return tmp_path / "pt", tmp_path / "ms"


def test_pytorch_and_mindspore_mlp_agree_for_every_step(tmp_path):
    pt, msr = record_both(tmp_path)
    res = compare_frameworks(pt, msr)
    sim = np.asarray(res["similarity"].values)
    assert sim.shape[-2:] == (STEPS, 6)
    assert (sim == 1.0).all()
    assert (np.asarray(res["total"].values) == 1.0).all()
    # the statistics agree too, within float32 rounding of two different kernels
    a, b = probekit.open_grads(pt), probekit.open_grads(msr)
    assert np.allclose(a["norm"].values, b["norm"].values, rtol=1e-4)
    # the notebook's explorer opens the MindSpore run against that comparison
    from probekit.notebook import GradExplorer

    ex = GradExplorer(b, comparison=res, param="fc2.weight")
    titles = [ax.get_title() for ax in ex.figure.axes if ax.get_title()]
    assert titles[0] == "Direction similarity: fc2.weight"
    assert ex.flagged_params() == [] and ex.image.value[:4] == b"\x89PNG"


def test_graph_mode_run_agrees_with_pytorch(tmp_path):
    """A GRAPH_MODE MindSpore run (TrainOneStepCell) against PyTorch from the same weights:
    similarity 1.0 at every step, plain and noise-aware (significance bits on both sides)."""
    pt, msr = record_both(tmp_path, level="L2", mode="graph_cell", significance=True)
    res = compare_frameworks(pt, msr)
    assert np.asarray(res["similarity"].values).shape[-2:] == (STEPS, 6)
    assert (np.asarray(res["similarity"].values) == 1.0).all()
    assert (np.asarray(res["similarity_significant"].values) == 1.0).all()
    assert (np.asarray(res["significant"].values) > 0).all()
    a, b = probekit.open_grads(pt), probekit.open_grads(msr)
    assert np.allclose(a["norm"].values, b["norm"].values, rtol=1e-4)


def test_cli_compares_the_two_frameworks(tmp_path):
    import subprocess
    import sys

    pt, msr = record_both(tmp_path, level="L1")
    out = subprocess.run([sys.executable, "-m", "probekit.cli", "mindspore", "compare", str(pt),
                          str(msr), "-o", str(tmp_path / "cmp")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "rank 0: 6 params compared over 6 steps; total similarity 1.0000..1.0000" in out.stdout
    csv = (tmp_path / "cmp" / "rank0" / "similarities.csv").read_text(encoding="utf-8-sig")
    assert csv.splitlines()[0] == "step," + ",".join(str(s) for s in range(STEPS))


def test_transposed_weight_and_renamed_params_are_reconciled(tmp_path):
    pt, msr = record_both(tmp_path, level="L1")
    ref = probekit.open_grads(pt)
    other = probekit.open_grads(msr)
    # the MindSpore run as another port would store it: fc2.weight transposed (in, out) and
    # named with MindSpore's suffixes
    off = other["offset"].values
    bits = other["direction"].values.copy()
    r, c = 8, 16
    seg = np.unpackbits(bits[:, off[2]:off[2] + 16], axis=1, count=r * c)
    seg = seg.reshape(-1, r, c).transpose(0, 2, 1).reshape(-1, r * c)
    bits[:, off[2]:off[2] + 16] = np.packbits(seg, axis=1)
    names = ["fc1.weight", "fc1.beta", "fc2.weight", "fc2.beta", "head.weight", "head.beta"]
    shapes = other["shape"].values.copy()
    shapes[2] = "(16, 8)"
    ported = other.assign(direction=(("step", "byte"), bits)).assign_coords(
        param=("param", names), shape=("param", shapes))
    # compared by name without reconciling, the transposed weight is refused by name, with
    # both shapes (it used to be compared element by element and read as a divergence)
    with pytest.raises(GradCompareError, match="'fc2.weight': shape \\(8, 16\\) in the first "
                                               "run, shape \\(16, 8\\) in the second"):
        probekit.compare_grads(ref, ported.assign_coords(param=("param", other["param"].values)))
    res = compare_frameworks(ref, ported)
    assert (np.asarray(res["similarity"].values) == 1.0).all()
    assert list(res["param"].values) == list(ref["param"].values)
    aligned = align_runs(ref, ported)[0]
    assert aligned.attrs["transposed"] == ["fc2.weight"]
    assert aligned["shape"].values.tolist()[2] == "(8, 16)"
    # a mapping given as a dict, or a function
    res2 = compare_frameworks(ref, ported, mapping=lambda n: n.replace(".beta", ".bias"))
    assert (np.asarray(res2["similarity"].values) == 1.0).all()
    res3 = compare_frameworks(ref, ported, mapping={"head.weight": "head.weight"})
    assert "head.weight" in res3["param"].values
    # a square or otherwise incompatible weight is refused by name
    bad = ported.assign_coords(shape=("param", ["(96,)", *shapes[1:]]))
    with pytest.raises(AlignError, match="'fc1.weight' .* has shape \\(96,\\), the reference "
                                         "\\(16, 6\\)"):
        compare_frameworks(ref, bad)


def test_ms_to_torch_name():
    assert ms_to_torch_name("bn.gamma") == "bn.weight"
    assert ms_to_torch_name("bn.moving_variance") == "bn.running_var"
    assert ms_to_torch_name("emb.embedding_table") == "emb.weight"
    assert ms_to_torch_name("fc.weight") == "fc.weight"


class RenamedMLP(ms.nn.Cell):
    """The MLP under other module paths (``inp``, ``hidden``; ``head`` as in PyTorch's)."""

    def __init__(self, sizes=(6, 16, 8, 3)):
        super().__init__()
        self.inp = ms.nn.Dense(sizes[0], sizes[1])
        self.hidden = ms.nn.Dense(sizes[1], sizes[2])
        self.head = ms.nn.Dense(sizes[2], sizes[3])

    def construct(self, x):
        return self.head(ms.ops.tanh(self.hidden(ms.ops.tanh(self.inp(x)))))


def record_renamed(tmp_path):
    """A PyTorch run of the MLP and a MindSpore run of ``RenamedMLP`` (no mapping pairs them)."""
    ms.set_seed(11)
    net = RenamedMLP()
    batches = data(STEPS, seed=4)
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=0.05)
    with GradProbe(opt, grad_level="L1", dump_path=tmp_path / "ms"):
        train(net, opt, batches)
    tnet = TorchMLP()
    topt = torch.optim.SGD(tnet.parameters(), lr=0.05)
    with TorchGradProbe(tnet, topt, grad_level="L1", dump_path=str(tmp_path / "pt")):
        for x, y in batches:
            topt.zero_grad()
            torch.nn.functional.mse_loss(tnet(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            topt.step()
    return tmp_path / "pt", tmp_path / "ms"


LEFT_OUT_LINE = ("rank 0: 8 parameters in one run only, not compared: first run only (4 of 6): "
                 "fc1.weight, fc1.bias, fc2.weight, fc2.bias; second run only (4 of 6): "
                 "inp.weight, inp.bias, hidden.weight, hidden.bias")


def test_parameters_of_one_framework_only_are_named(tmp_path, caplog):
    """Issue 21: other module paths and no mapping compared 2 parameters without a word."""
    import logging

    pt, msr = record_renamed(tmp_path)
    with caplog.at_level(logging.WARNING, logger="probekit"):
        res = compare_frameworks(pt, msr).sel(rank=0)
    assert res["param"].values.tolist() == ["head.weight", "head.bias"]
    assert res["only_in_first"].values.tolist() == ["fc1.weight", "fc1.bias", "fc2.weight",
                                                    "fc2.bias"]
    assert res["only_in_second"].values.tolist() == ["inp.weight", "inp.bias", "hidden.weight",
                                                     "hidden.bias"]
    assert [int(res[k]) for k in ("n_only_in_first", "n_only_in_second", "n_params_first",
                                  "n_params_second")] == [4, 4, 6, 6]
    assert [r.getMessage() for r in caplog.records] == ["[probekit] " + LEFT_OUT_LINE]
    # a mapping pairing them leaves nothing out
    full = compare_frameworks(pt, msr, mapping={"inp.weight": "fc1.weight", "inp.bias": "fc1.bias",
                                                "hidden.weight": "fc2.weight",
                                                "hidden.bias": "fc2.bias"}).sel(rank=0)
    assert full.sizes["param"] == 6 and int(full["n_only_in_first"]) == 0
    assert int(full["n_only_in_second"]) == 0


def test_cli_refuses_a_comparison_of_mostly_unmatched_parameters(tmp_path):
    import subprocess
    import sys

    pt, msr = record_renamed(tmp_path)
    args = [sys.executable, "-m", "probekit.cli", "mindspore", "compare", str(pt), str(msr), "-o",
            str(tmp_path / "cmp")]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"rank 0: 2 params compared over {STEPS} steps; total similarity ")
    assert lines[1:] == [f"written to {tmp_path / 'cmp'}", LEFT_OUT_LINE]
    assert out.stderr.splitlines()[-1] == (
        "probekit: error: rank 0: 4 of the first run's 6 parameters; rank 0: 4 of the second "
        "run's 6 parameters have no counterpart in the other run (more than half), so the "
        "comparison covers too little of it (--map JSON pairs MindSpore names with PyTorch "
        "ones); --allow-unmatched accepts this")
    allowed = subprocess.run([*args, "--allow-unmatched"], capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.splitlines()[1:] == lines[1:]
