"""Public silent distributed-training bugs from the corpus (issue 35, point 2), each with its
healthy twin, on real gloo processes:

* three judged both ways: the comparison with a one-process fp32 reference and a control run
  reads "beyond" at the step the bug starts, at the parameter it corrupts, and "within" for
  the twin; probekit's replica check says whether the copies of the replicated parameters
  parted;
* one judged by the replica check alone, with no reference run at all: Megatron-LM #656, the
  tied embedding's two copies untie under the distributed optimizer (4 ranks, PP=2 x DP=2).

The whole corpus (14 bugs, megatron-core among them) runs in ``make bench``
(``benchmarks/bench_silent_bugs.py``)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_silent_bugs import replica_verdict, run_bug  # noqa: E402
from benchmarks.silent_bugs._harness import ONSET, spawn  # noqa: E402

AGREE = {"disagree": False, "text": "", "step": -1, "param": "", "what": "", "group": "",
         "ranks": [], "params": []}
#: the parameters of the hf_grad_accum model (each a parameter the bug reaches)
ALL_HF = ("embed.weight", "body.weight", "body.bias", "lm_head.weight", "lm_head.bias")
CASES = [
    # torchtitan #2387: the replicated router's gradient is one TP rank's partial sum
    ("titan_router", "router.weight", "scale", {
        "disagree": True, "step": 3, "param": "router.weight", "what": "gradients",
        "group": "tp", "ranks": [0, 1], "params": ["router.weight"],
        "text": "replicas of `router.weight` disagree from step 3 (tp ranks 0/1: gradients)"}),
    # Megatron-LM #1012: each DP rank adds its own wgrad after the averaging all-reduce
    ("mcore_embedding_wgrad_after_dp", "output_layer.weight", "scale", {
        "disagree": True, "step": 3, "param": "output_layer.weight", "what": "gradients",
        "group": "dp", "ranks": [0, 1], "params": ["output_layer.weight"],
        "text": "replicas of `output_layer.weight` disagree from step 3 (dp ranks 0/1: "
                "gradients)"}),
    # transformers #34191: per-micro-batch means under DDP + accumulation; replicas agree. The
    # bug is in the loss's normalisation: every gradient is scaled alike, so every parameter is
    # flagged at the onset and which one the headline names (the one departing most) is
    # rounding's choice: lm_head.bias on one CPU, embed.weight on another
    ("hf_grad_accum", ALL_HF, "scale", AGREE),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, param, kind, replicas", CASES, ids=[c[0] for c in CASES])
def test_public_bug_beyond_at_its_onset_and_its_twin_within(tmp_path, name, param, kind,
                                                             replicas):
    res = run_bug(name, str(tmp_path))
    bug, twin = res["buggy"], res["healthy"]
    if isinstance(param, tuple):   # every parameter is reached: all flagged at the onset
        assert sorted(bug["flagged_at_step"]) == sorted(param), bug["text"]
        assert bug["param"] in param
        param = bug["param"]
    assert (bug["verdict"], bug["step"], bug["param"], bug["kind"]) == (
        "beyond", ONSET, param, kind), bug["text"]
    # the verdict in words begins with the replica check's line where the copies parted
    head = (f"the second run: {replicas['text']}" if replicas["disagree"] else
            f"beyond rounding noise from step {ONSET} at {param} ")
    assert bug["text"].startswith(head), bug["text"]
    assert (twin["verdict"], twin["step"], twin["flagged"]) == ("within", -1, 0), twin["text"]
    assert res["caught"] and res["healthy_ok"]
    assert res["caught_by"] == kind + (" + replicas" if replicas["disagree"] else "")
    # probekit's replica check, no reference needed: the buggy run as above, the twin agrees
    assert bug["replicas"] == replicas
    assert twin["replicas"] == AGREE


@pytest.mark.slow
def test_tied_embedding_untied_by_the_distributed_optimizer_caught_by_replicas_alone(tmp_path):
    """Megatron-LM #656 with no reference run: 4 gloo ranks (PP=2 x DP=2, rank = 2 * stage +
    dp), the tied gradients summed after the DP reduce-scatter from step 3. The replica check
    (``tied=``) compares the embedding's owner (rank 1) with the output layer's (rank 2): their
    gradients differ from step 3, the parameters from step 4; the healthy twin's agree."""
    import numpy as np

    from probekit.grads import open_grads, replica_disagreements

    spawn("mcore_tied_embedding_distopt", str(tmp_path), 4)
    verdict = replica_verdict(str(tmp_path / "buggy"))
    assert verdict["text"] == ("replicas of `embedding.weight` disagree from step 3 (tied "
                               "`embedding.weight`/`output_layer.weight` ranks 1/2: gradients)")
    tied = "tied `embedding.weight`/`output_layer.weight`"
    assert replica_disagreements(tmp_path / "buggy").to_dict("records") == [
        {"param": "embedding.weight", "first_step": 3, "last_step": 9, "steps": 7,
         "what": "gradients", "group": tied, "ranks": (1, 2)},
        {"param": "output_layer.weight", "first_step": 3, "last_step": 9, "steps": 7,
         "what": "gradients", "group": tied, "ranks": (2, 1)}]
    # per step: 1 agree (steps 0-2), | 2 the gradients differ (3), | 4 the parameters too (4-)
    ds = open_grads(tmp_path / "buggy", rank=1, shards=True)
    assert ds["param"].values.tolist() == ["embedding.weight"]
    assert ds["replicas"].values.ravel().tolist() == [1, 1, 1, 3] + [7] * 6
    assert ds["replica_rank"].values.ravel().tolist() == [-1] * 3 + [2] * 7
    gap = ds["replica_gap"].values.ravel()
    assert np.all(gap[:3] == 0) and np.all(gap[3:] > 0.05)
    assert replica_disagreements(tmp_path / "healthy").empty
    assert replica_verdict(str(tmp_path / "healthy")) == AGREE
