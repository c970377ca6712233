"""torchrun with gloo, 2 ranks: replicas checked against each other with no reference run (DDP,
tensor parallel under sequence parallelism, tied weights across pipeline stages, Megatron-style
plain shards declared by ``shards=``), and sharded or staged runs compared with a one-process
reference by logical name and full shape.

One torchrun runs every layout of ``tests/_replica_layouts.py`` (module fixture); each test
reads its stores."""
import os
import subprocess
import sys

import numpy as np
import pytest

from probekit.errors import GradCompareError
from probekit.grads import compare_grads, open_grads, replica_disagreements

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(HERE, "_replica_layouts.py")
LAYOUTS = ("ddp_bad", "tp", "tp_bad", "pp", "pp_bad", "copies", "mtp", "mtp_bad",
           "mtp_errors")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={_free_port()}", SCRIPT,
                          str(out), *LAYOUTS], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sys.path.insert(0, HERE)
    import _replica_layouts

    _replica_layouts.single(str(out))  # the one-process references
    return out, res.stdout + res.stderr


def _codes(path, param):
    ds = open_grads(path)
    return np.asarray(ds["replicas"].sel(param=param).values).tolist()


@pytest.mark.slow
def test_a_ddp_rank_corrupted_after_the_all_reduce_is_reported(runs):
    """Rank 1 scales its gradients after DDP's all-reduce from step 2: rank 0, the one that
    records, is right, so only the replica check sees it: the gradients differ at step 2, the
    parameters from step 3, in every parameter, between ranks 0 and 1."""
    out, log = runs
    table = replica_disagreements(out / "ddp_bad")
    assert table["param"].tolist() == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert table["first_step"].tolist() == [2] * 4 and table["last_step"].tolist() == [3] * 4
    assert table["what"].tolist() == ["gradients"] * 4
    assert table["group"].tolist() == ["DDP"] * 4
    assert table["ranks"].tolist() == [(0, 1)] * 4
    # 1 checked and agree (steps 0 and 1, before the bug); | 2 the gradients differ; | 4 the
    # parameters differ (the update of step 2 made them part)
    assert _codes(out / "ddp_bad", "0.weight") == [1, 1, 3, 7]
    assert ("replicas of `0.bias` disagree from step 2 (DDP ranks 0/1: gradients)" in log)


@pytest.mark.slow
def test_a_tp_norm_whose_gradient_is_not_reduced_is_caught(runs):
    """Megatron-LM #1446: under sequence parallelism each TP rank holds half the sequence; a
    norm's weight replicated over TP used through ``to_local()`` without ``Partial`` gradient
    placements keeps each rank's half's gradient: its replicas disagree from step 0. With
    ``grad_placements=[Partial()]`` (and torch's ``SequenceParallel`` LayerNorm, whose
    gradient is a pending reduction) they agree, and the run equals the one-process one."""
    out, log = runs
    table = replica_disagreements(out / "tp_bad")
    assert table.to_dict("records") == [{
        "param": "final_norm.weight", "first_step": 0, "last_step": 3, "steps": 4,
        "what": "gradients", "group": "tp", "ranks": (0, 1)}]
    # AdamW's first update is lr * sign(g): the halves' gradients share their signs, so the
    # parameters part only with the second update
    assert _codes(out / "tp_bad", "final_norm.weight") == [3, 3, 7, 7]
    assert _codes(out / "tp_bad", "proj.weight") == [1, 1, 1, 1]
    assert replica_disagreements(out / "tp").empty
    cmp = compare_grads(out / "tp_single", out / "tp_bad", progress=False)
    assert str(cmp).splitlines()[0] == ("the second run: replicas of `final_norm.weight` "
                                        "disagree from step 0 (tp ranks 0/1: gradients)")
    assert cmp.attrs["replicas_second"] == [
        "replicas of `final_norm.weight` disagree from step 0 (tp ranks 0/1: gradients)"]
    assert "probekit-verdict' style='color:#b71c1c'" in cmp._repr_html_()
    # the healthy run against the one-process reference: DTensor replicas resolved, equal
    cmp = compare_grads(out / "tp_single", out / "tp", progress=False)
    assert cmp["param"].values.tolist() == ["ln.weight", "ln.bias", "proj.weight", "proj.bias",
                                            "final_norm.weight"]
    assert np.all(cmp["similarity"].values == 1.0)
    assert "replicas" not in str(cmp).splitlines()[0]
    np.testing.assert_allclose(open_grads(out / "tp")["norm"].values,
                               open_grads(out / "tp_single")["norm"].values, rtol=1e-5)


@pytest.mark.slow
def test_tied_weights_across_pipeline_stages(runs):
    """``tied=[["embed.weight", "head.weight"]]``: stage 0's embedding and stage 1's output
    layer are checked against each other; without the all-reduce of their gradients
    (``pp_bad``) they disagree from step 0."""
    out, _ = runs
    assert replica_disagreements(out / "pp").empty
    table = replica_disagreements(out / "pp_bad")
    assert table[["param", "first_step", "what", "ranks"]].to_dict("records") == [
        {"param": "embed.weight", "first_step": 0, "what": "gradients", "ranks": (0, 1)},
        {"param": "head.weight", "first_step": 0, "what": "gradients", "ranks": (1, 0)}]
    assert set(table["group"]) == {"tied `embed.weight`/`head.weight`"}


@pytest.mark.slow
def test_pipeline_stages_pair_with_a_one_process_reference(runs):
    """Stage 1 recorded its local ``layers.0`` as ``layers.1`` (``rename=layer_offset(1)``):
    the two stages are one run, compared with the one-process model parameter by parameter.
    Recorded with their local names, the stages overlap: a clear error naming both."""
    out, _ = runs
    cmp = compare_grads(out / "pp_single", out / "pp", progress=False)
    assert cmp["rank"].values.tolist() == [0]
    assert cmp["param"].values.tolist() == ["embed.weight", "layers.0.weight", "layers.0.bias",
                                            "layers.1.weight", "layers.1.bias"]
    assert np.all(cmp["similarity"].values == 1.0)
    # the reference ties the head to the embedding: one parameter, named once
    assert cmp["only_in_second"].values.ravel().tolist() == ["head.weight"]
    ds = open_grads(out / "pp", rank=1)  # the names as the stage recorded them are kept
    assert ds.attrs["recorded_params"] == ["layers.0.weight", "layers.0.bias", "head.weight"]
    assert ds["param"].values.tolist() == ["layers.1.weight", "layers.1.bias", "head.weight"]
    local = {0: open_grads(out / "pp", rank=0),  # stage 1 under its local names
             1: ds.assign_coords(param=ds.attrs["recorded_params"])}
    with pytest.raises(GradCompareError, match=(
            r"^the second run's ranks 0 and 1 record overlapping but different parameters "
            r"\(both hold 'layers.0.bias'; rank 0 also \['embed.weight'\], rank 1 also "
            r"\['head.weight'\]\), .*rename=probekit.grads.layer_offset\(first_layer\)")):
        compare_grads(out / "pp_single", local, progress=False)


@pytest.mark.slow
def test_every_rank_that_recorded_is_compared(runs):
    """Every rank records a whole copy (an unwrapped model): compared with a one-process run,
    each rank is compared with it (before: rank 0 only, rank 1 never mentioned)."""
    out, _ = runs
    cmp = compare_grads(out / "copies_single", out / "copies", progress=False)
    assert cmp["rank"].values.tolist() == [0, 1]
    assert np.all(cmp["similarity"].values == 1.0)
    assert "unpaired_first" not in cmp.attrs and "unpaired_second" not in cmp.attrs


@pytest.mark.slow
def test_cli_says_the_replica_check(runs, capsys):
    from probekit.cli import main

    out, _ = runs
    assert main(["grads", "summary", str(out / "tp_bad")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("replicas of `final_norm.weight` disagree from step 0 (tp ranks 0/1: "
                        "gradients)")
    assert main(["grads", "summary", str(out / "tp")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "replicas agree at every recorded step"
    assert main(["grads", "compare", str(out / "tp_single"), str(out / "tp_bad"), "-o",
                 str(out / "cmp"), "--plots", "none"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "the second run: replicas of `final_norm.weight` disagree from step 0 (tp ranks 0/1: "
        "gradients)")


@pytest.mark.slow
def test_plain_megatron_shards_declared_pair_and_are_checked(runs):
    """Megatron's tensor parallelism keeps plain tensors (a column-parallel ``fc``'s rows, a
    row-parallel ``proj``'s columns, marked ``tensor_model_parallel``/``partition_dim``; the
    input projection and norm plain copies). ``shards=megatron_shards(model, group)`` declares
    them: each rank records its block, rank 0 the replicated ones, and the run assembles into
    the one-process model's full parameters (equal to it); the replicated copies are checked:
    with the input's gradient no longer all-reduced over TP from step 1 (``mtp_bad``), the
    parameters below ``fc`` disagree from step 1, and nothing else."""
    import json

    out, log = runs
    ds = open_grads(out / "mtp")
    assert ds["param"].values.tolist() == ["inp.weight", "inp.bias", "norm.weight",
                                           "fc.weight", "fc.bias", "proj.weight", "proj.bias"]
    cmp = compare_grads(out / "mtp_single", out / "mtp", progress=False)
    assert cmp["param"].values.tolist() == ds["param"].values.tolist()
    assert np.all(cmp["similarity"].values == 1.0)
    np.testing.assert_allclose(ds["norm"].values, open_grads(out / "mtp_single")["norm"].values,
                               rtol=1e-6)
    # rank 1 recorded only its blocks of the sharded parameters, with their places
    r1 = open_grads(out / "mtp", rank=1, shards=True)
    assert r1["param"].values.tolist() == ["fc.weight", "fc.bias", "proj.weight"]
    places = json.loads(r1.attrs["placement"]) if isinstance(r1.attrs["placement"], str) \
        else r1.attrs["placement"]
    assert [(p["global_shape"], p["offset"], p["local_shape"], p["placements"], p["mesh_dims"])
            for p in places] == [([16, 8], [8, 0], [8, 8], ["S(0)"], ["tp"]),
                                 ([16], [8], [8], ["S(0)"], ["tp"]),
                                 ([8, 16], [0, 8], [8, 8], ["S(1)"], ["tp"])]
    assert replica_disagreements(out / "mtp").empty
    table = replica_disagreements(out / "mtp_bad")
    assert table.to_dict("records") == [
        {"param": p, "first_step": 1, "last_step": 3, "steps": 3, "what": "gradients",
         "group": "tp", "ranks": (0, 1)} for p in ("inp.bias", "inp.weight", "norm.weight")]
    assert ("replicas of `inp.bias` disagree from step 1 (tp ranks 0/1: gradients); ... and 2 "
            "more parameters whose replicas disagree") in log


@pytest.mark.slow
def test_bad_shard_declarations_say_what_is_wrong(runs):
    import json

    out, _ = runs
    with open(out / "mtp_errors" / "errors.json") as fh:
        errors = json.load(fh)
    assert errors == {
        "unknown": "ConfigError: GradProbe(shards=): ['fc.wieght'] not found in the model; "
                   "accepted: names from model.named_parameters() (e.g. fc.bias, fc.weight, "
                   "inp.bias, inp.weight, norm.weight, proj.bias, proj.weight)",
        "dim": "ConfigError: GradProbe(shards=): Shard(1) is not valid for 'fc.bias', of shape "
               "[8]; accepted: Shard(0) to Shard(0) or Replicate()",
        "partial": "ConfigError: GradProbe(shards=): 'fc.weight' -> Partial(sum) is not valid; "
                   "accepted: Shard(dim) or Replicate(), one per dimension of the mesh (1)",
        "type": "TypeError: GradProbe(shards=): dict is not valid; accepted: "
                "probekit.grads.LocalShards (or megatron_shards(model)), or None",
        "stride": "ValueError: megatron_shards: 'fc.weight' is partitioned with stride 2, not a "
                  "block of the whole parameter; accepted: partition_stride 1"}
