"""Issue 35: replicas checked in one process (tied weights), the check's store format (old
stores without it still open; a group recorded before it is continued), the names a run is
compared by (``rename``, ``layer_offset``, shapes paired by name), and every rank of a
comparison named."""
import json
import logging

import numpy as np
import pytest
import torch

from probekit.config import ConfigError, GradProbeConfig
from probekit.errors import GradCompareError
from probekit.grads import (GradProbe, compare_grads, layer_offset, open_grads,
                            replica_disagreements)
from probekit.grads.numerics.stats import Layout, StepStats, merge
from probekit.grads.record.replicas import SampleHash
from probekit.grads.record.summary import ProbeSummary
from probekit.grads.store.replicas import replica_line
from test_grads_store_compare import flips, make_ds

STEPS = 3


class Tied(torch.nn.Module):
    """Two layers of one shape, ``a`` and ``b``, that start equal; ``same=True`` feeds them the
    same input, so their gradients and updates stay equal, else ``b`` gets it doubled."""

    def __init__(self, same: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.load_state_dict(self.a.state_dict())
        self.same = same

    def forward(self, x):
        return self.a(x).square().sum() + self.b(x if self.same else 2 * x).square().sum()


def train(model, path, steps=STEPS, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with GradProbe(model, dump_path=str(path), flush_every=1, **options) as probe:
        for _ in range(steps):
            opt.zero_grad()
            model(x).backward()
            opt.step()
    return probe


def test_tied_parameters_in_one_process(tmp_path):
    """``tied`` names parameters that hold the same values wherever they are held: in one
    process too. Equal ones agree at every step; others disagree from step 0, in the summary,
    the store and ``replica_disagreements``."""
    tied = [["a.weight", "b.weight"], ["a.bias", "b.bias"]]
    probe = train(Tied(same=True), tmp_path / "same", tied=tied)
    assert str(probe.summary).endswith("; the replicas of 4 params agree")
    ds = open_grads(tmp_path / "same")
    assert ds["replicas"].values.tolist() == [[1, 1, 1, 1]] * STEPS
    assert ds["replica_rank"].values.tolist() == [[-1] * 4] * STEPS
    assert json.loads(ds.attrs["replica_check"]) == {
        "version": 1, "sample": 256, "labels": ["tied `a.weight`/`b.weight`",
                                                "tied `a.bias`/`b.bias`"] * 2}
    assert replica_disagreements(tmp_path / "same").empty
    probe = train(Tied(same=False), tmp_path / "apart", tied=tied[:1])
    assert str(probe.summary).endswith(
        "; replicas of `a.weight` disagree from step 0 (tied `a.weight`/`b.weight` rank 0: "
        "gradients)")
    ds = open_grads(tmp_path / "apart")
    # the gradients differ from step 0 (b's input doubled), the weights from the first update
    assert ds["replicas"].sel(param="a.weight").values.tolist() == [3, 7, 7]
    assert ds["replicas"].sel(param="a.bias").values.tolist() == [0, 0, 0]  # not tied: unchecked
    assert ds["replica_rank"].sel(param="b.weight").values.tolist() == [0, 0, 0]
    gap = ds["replica_gap"].sel(param="a.weight").values  # |a - b| / max(|a|, |b|) of max, min
    assert np.all(gap > 0.3) and np.all(gap <= 1.0)
    assert np.all(np.isnan(ds["replica_gap"].sel(param="a.bias").values))
    table = replica_disagreements(tmp_path / "apart")
    assert table.to_dict("records") == [
        {"param": "a.weight", "first_step": 0, "last_step": 2, "steps": 3, "what": "gradients",
         "group": "tied `a.weight`/`b.weight`", "ranks": (0, 0)},
        {"param": "b.weight", "first_step": 0, "last_step": 2, "steps": 3, "what": "gradients",
         "group": "tied `a.weight`/`b.weight`", "ranks": (0, 0)}]
    assert replica_disagreements(ds).equals(table)  # from a Dataset: the same table
    train(Tied(same=False), tmp_path / "off", tied=tied[:1], check_replicas=False)
    assert "replicas" not in open_grads(tmp_path / "off")  # switched off: nothing stored


def test_tied_is_validated():
    with pytest.raises(ConfigError, match=r"grad_probe.tied: 'a' is not valid"):
        GradProbeConfig(tied="a")
    with pytest.raises(ConfigError, match=r"each name in one list only \('a' is in \['a', 'b'\] "
                                          r"and \['a'\]\)"):
        GradProbeConfig(tied=[["a", "b"], ["a"]])
    assert GradProbeConfig(tied=[["a", "b"]]).tied == (("a", "b"),)
    with pytest.raises(ConfigError, match=r"grad_probe.tied: \['x.weight'\] is held by no rank"):
        GradProbe(Tied(True), dump_path="unused", tied=[["a.weight", "x.weight"]]).start()
    with pytest.raises(ConfigError, match=r"the parameters of \['a.weight', 'a.bias'\] differ "
                                          r"in shape \(a.weight \[4, 4\], a.bias \[4\]\)"):
        GradProbe(Tied(True), dump_path="unused", tied=[["a.weight", "a.bias"]]).start()


def test_sample_hash_is_exact_and_sees_any_sampled_change():
    h = SampleHash([10, 1000, 3])
    t = [torch.randn(10), torch.randn(1000), torch.randn(3, dtype=torch.float64)]
    base = h(t)
    kept = SampleHash([10, 1000, 3], keep=[0, 1, 2])  # the views kept from call to call
    assert base.tolist() == h([x.clone() for x in t]).tolist() == kept(t).tolist()
    t[0][0] += 1  # in place (an optimizer's update): the kept view sees it
    assert kept(t).tolist()[0] == h(t).tolist()[0] != base.tolist()[0]  # the same bits: the same hash
    flipped = t[1].clone()
    flipped[h.strides[1] * 7] *= -1  # one sampled element's sign
    assert h([t[0], flipped, t[2]]).tolist()[1] != base.tolist()[1]
    bf = t[0].to(torch.bfloat16)
    assert h([bf, None, None]).tolist()[1:] == [0, 0]  # None: no tensor, 0
    with pytest.raises(ValueError, match="tensor 1 has 999 elements, the check started with 1000"):
        h([t[0], torch.randn(999), t[2]])


def _hash_by_hand(t: torch.Tensor, sample: int = 256) -> int:
    """The sample hash in Python integers: the sampled elements' bits as signed integers of
    their width, times 2j + 1, summed modulo 2^64, as a signed int64."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    flat = t.detach().reshape(-1)
    stride = max(1, flat.numel() // sample)
    xs = flat[::stride][:sample].contiguous().view(ints[t.element_size()]).tolist()
    total = sum(x * (2 * j + 1) for j, x in enumerate(xs)) % 2 ** 64
    return total - 2 ** 64 if total >= 2 ** 63 else total


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_sample_hash_kernel_and_numpy_give_the_same_exact_values(path):
    """The compiled kernel hashes every contiguous CPU tensor in one call; numpy hashes the
    rest (non-contiguous ones) and everything where the kernel is not built: the same exact
    value as the definition, for every width, size and layout."""
    from probekit.grads.numerics import kernel

    gen = torch.Generator().manual_seed(5)
    big = torch.randn(300, 700, generator=gen) * 1e3
    tensors = [big, torch.randn(257, generator=gen).to(torch.bfloat16),
               torch.randn(1000, generator=gen, dtype=torch.float64),
               torch.randn(5, generator=gen).to(torch.float16), big.t(),  # not contiguous
               torch.nn.Parameter(torch.randn(33, 9, generator=gen)),    # requires grad
               torch.randint(-128, 127, (600,), generator=gen, dtype=torch.int8), None,
               torch.empty(0)]
    numels = [0 if t is None else t.numel() for t in tensors]
    want = [0 if t is None else _hash_by_hand(t) for t in tensors]
    before = kernel.path
    try:
        if path == "numpy":
            kernel.set_path("numpy")
        elif kernel.path == "numpy":
            pytest.skip("the compiled kernel is not built here")
        else:  # the kernel itself: every tensor by address, in one call
            flat = [big, tensors[1], tensors[2]]
            out = np.zeros(3, np.int64)
            assert kernel.sample_hash(
                np.array([t.data_ptr() for t in flat], np.int64),
                np.array([max(1, t.numel() // 256) for t in flat], np.int64),
                np.array([min(256, t.numel()) for t in flat], np.int64),
                np.array([t.element_size() for t in flat], np.int32), out)
            assert out.tolist() == want[:3]
        assert SampleHash(numels)(tensors).tolist() == want
        # a tensor of another size than the check planned is an error on either path
        with pytest.raises(ValueError, match="tensor 0 has 209999 elements, the check "
                                             "started with 210000"):
            SampleHash(numels)([big.reshape(-1)[1:], *tensors[1:]])
    finally:
        kernel.set_path(before)


def test_merge_keeps_each_optimizers_replica_codes():
    layout = Layout(("a", "b"), (1, 1), ((1,), (1,)))

    def part(i, code):
        s = StepStats(present=np.array([i == 0, i == 1]), max=np.zeros(2), min=np.zeros(2),
                      norm=np.zeros(2))
        s.replicas = np.array([code if i == 0 else 0, code if i == 1 else 0], np.uint8)
        s.replica_rank = np.array([1, -1] if i == 0 else [-1, 3], np.int64)
        s.replica_gap = np.array([0.5, np.nan] if i == 0 else [np.nan, 0.0])
        return s

    got = merge([part(0, 3), part(1, 1)], layout)
    assert got.replicas.tolist() == [3, 1] and got.replica_rank.tolist() == [1, 3]


def test_summary_and_words():
    row = {"param": "final_layernorm.weight", "first_step": 0, "what": "gradients",
           "group": "tp", "ranks": (0, 1)}
    assert replica_line(row) == ("replicas of `final_layernorm.weight` disagree from step 0 "
                                 "(tp ranks 0/1: gradients)")
    s = ProbeSummary(steps=2, params=3, bytes=10, store="run/grads.zarr/rank0",
                     replicas={"checked": 3, "disagree": [row, dict(row, param="b")]})
    assert str(s).endswith("in run/grads.zarr/rank0; replicas of `final_layernorm.weight` "
                           "disagree from step 0 (tp ranks 0/1: gradients); ... and 1 more "
                           "parameter whose replicas disagree")


def test_no_disagreement_is_an_empty_table_of_its_own():
    """The empty table is built once and handed out as copies: the same columns and dtypes
    each time, and a caller's change to one reaches no other."""
    from probekit.grads.store.replicas import COLUMNS, _frame

    a, b = _frame([]), _frame([])
    assert a is not b and list(a.columns) == list(COLUMNS) and len(a) == 0
    assert {c: str(a[c].dtype) for c in ("first_step", "last_step", "steps")} == {
        "first_step": "int64", "last_step": "int64", "steps": "int64"}
    a["extra"] = 1
    a.loc[0] = ["w", 0, 0, 1, "gradients", "", (0, 1), 1]
    assert len(_frame([])) == 0 and "extra" not in _frame([]).columns


def test_old_stores_open_and_are_continued_with_the_check(tmp_path):
    """A store recorded without the check (an older probekit, or the check off) opens as
    before; a run with the check continuing its groups adds the arrays, whose earlier rows
    read as not checked."""
    tied = [["a.weight", "b.weight"]]
    train(Tied(same=True), tmp_path / "run", check_replicas=False)
    assert replica_disagreements(tmp_path / "run").empty
    train(Tied(same=True), tmp_path / "run", tied=tied, start_step=STEPS)
    ds = open_grads(tmp_path / "run")
    assert ds["step"].values.tolist() == list(range(2 * STEPS))
    assert ds["replicas"].sel(param="a.weight").values.tolist() == [0] * STEPS + [1] * STEPS
    assert np.isnan(ds["replica_gap"].sel(param="a.weight").values[:STEPS]).all()


def test_layer_offset_and_rename(tmp_path):
    f = layer_offset(4)
    assert f("layers.0.mlp.weight") == "layers.4.mlp.weight"
    assert f("model.decoder.layers.11.attn.bias") == "model.decoder.layers.15.attn.bias"
    assert f("embed.weight") == "embed.weight" and f("layers.x") == "layers.x"
    assert layer_offset(2, "h")("transformer.h.1.ln.weight") == "transformer.h.3.ln.weight"
    assert repr(f) == "layer_offset(4, container='layers')"
    with pytest.raises(ValueError, match="offset -1 is not valid"):
        layer_offset(-1)
    import pickle

    assert pickle.loads(pickle.dumps(f))("layers.1.w") == "layers.5.w"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradProbe(model, dump_path=str(tmp_path / "r"), rename={"1.weight": "head.weight"}):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    ds = open_grads(tmp_path / "r")
    assert ds["param"].values.tolist() == ["0.weight", "0.bias", "head.weight", "1.bias"]
    assert ds.attrs["recorded_params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(ConfigError, match=r"GradProbe\(rename=\): \['2.weight'\] not found"):
        GradProbe(model, dump_path="unused", rename={"2.weight": "x"})
    with pytest.raises(ConfigError, match=r"'0.weight' and '1.weight' both become 'w'"):
        GradProbe(model, dump_path="unused", rename={"0.weight": "w", "1.weight": "w"})
    with pytest.raises(TypeError, match="rename=.*accepted: a dict"):
        GradProbe(model, dump_path="unused", rename=3)


def test_runs_named_differently_pair_by_a_rename(tmp_path):
    """Megatron's names against a Hugging Face reference: ``rename`` pairs them; a parameter
    paired by name whose shape differs (a transposed weight) is an error naming both sides, as
    is a rename key naming nothing."""
    torch.manual_seed(0)
    hf = torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 3)})
    torch.manual_seed(0)
    mg = torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(4, 3)})

    def rec(model, path, x):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with GradProbe(model, dump_path=str(path), flush_every=1):
            for _ in range(2):
                opt.zero_grad()
                next(iter(model.values()))(x).square().sum().backward()
                opt.step()

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    rec(hf, tmp_path / "hf", x)
    rec(mg, tmp_path / "mg", x)
    names = {"linear_fc1.weight": "dense.weight", "linear_fc1.bias": "dense.bias"}
    cmp = compare_grads(tmp_path / "hf", tmp_path / "mg", rename=names, progress=False)
    assert cmp["param"].values.tolist() == ["dense.weight", "dense.bias"]
    assert np.all(cmp["similarity"].values == 1.0)
    with pytest.raises(GradCompareError, match=r"\['linear_fc2.weight'\] name no parameter"):
        compare_grads(tmp_path / "hf", tmp_path / "mg", progress=False,
                      rename={**names, "linear_fc2.weight": "dense.weight2"})
    torch.manual_seed(0)
    tr = torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(3, 4)})  # 12 elements, (4, 3)
    opt = torch.optim.SGD(tr.parameters(), lr=0.1)
    with GradProbe(tr, dump_path=str(tmp_path / "tr")):
        for _ in range(2):
            opt.zero_grad()
            tr["linear_fc1"](x[:, :3]).square().sum().backward()
            opt.step()
    with pytest.raises(GradCompareError, match=(
            r"parameter shapes differ between the runs: 'dense.weight': shape \(3, 4\) in the "
            r"first run, shape \(4, 3\) \(recorded as 'linear_fc1.weight'\) in the second")):
        compare_grads(tmp_path / "hf", tmp_path / "tr", rename=names, progress=False)


def test_a_rank_with_no_counterpart_is_named(caplog):
    """Several ranks against several: rank r with rank r, and a rank of one run with no
    counterpart is named (attribute, headline, warning), never dropped silently; several
    copies against one run: each compared with it."""
    w, v = flips(70, 0), flips(8, 0)
    a = make_ds([[w, v]])
    with caplog.at_level(logging.WARNING, logger="probekit"):
        res = compare_grads({0: a, 1: a, 2: a}, {0: a, 1: a})
    assert res["rank"].values.tolist() == [0, 1]
    assert res.attrs["unpaired_first"] == [2]
    assert ("rank 2 of the first run has no counterpart in the other run and is not "
            "compared (the ranks compared: 0, 1)") in caplog.text
    assert str(res).splitlines()[0] == ("not compared: rank 2 of the first run (no counterpart "
                                        "in the other run; ranks=[...] picks ranks)")
    res = compare_grads(a, {0: a, 1: a, 3: a})  # copies: each against the one
    assert res["rank"].values.tolist() == [0, 1, 3]
    assert "unpaired_first" not in res.attrs and "unpaired_second" not in res.attrs
    res = compare_grads(a, {0: a, 1: a, 3: a}, ranks=[1])
    assert res["rank"].values.tolist() == [1]


def test_megatron_shards_without_a_group_needs_megatron():
    """``group=None`` means Megatron's tensor-parallel group; where megatron.core is not
    importable (this venv) that is a clear error naming what to pass instead."""
    import importlib.util

    from probekit.grads import megatron_shards

    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron.core is importable here")
    with pytest.raises(ValueError, match="group=None takes Megatron's TP group, and "
                                         "megatron.core is not importable here; accepted: "
                                         "the tensor-parallel process group"):
        megatron_shards(torch.nn.Linear(2, 2))
