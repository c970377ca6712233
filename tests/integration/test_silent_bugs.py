"""Three public silent distributed-training bugs from the corpus (issue 35, point 2), each with
its healthy twin, on real gloo processes: the comparison with a one-process fp32 reference and a
control run reads "beyond" at the step the bug starts, at the parameter it corrupts, and "within"
for the twin. The whole corpus (twelve bugs, megatron-core among them) runs in ``make bench``
(``benchmarks/bench_silent_bugs.py``)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_silent_bugs import replica_verdict, run_bug  # noqa: E402
from benchmarks.silent_bugs._harness import ONSET  # noqa: E402

CASES = [
    # torchtitan #2387: the replicated router's gradient is one TP rank's partial sum
    ("titan_router", "router.weight", "scale", {"step": 3, "what": "grad",
                                                "param": "router.weight", "ranks": [0, 1]}),
    # Megatron-LM #1012: each DP rank adds its own wgrad after the averaging all-reduce
    ("mcore_embedding_wgrad_after_dp", "output_layer.weight", "scale",
     {"step": 3, "what": "grad", "param": "output_layer.weight", "ranks": [0, 1]}),
    # transformers #34191: per-micro-batch means under DDP + accumulation; replicas agree
    ("hf_grad_accum", "lm_head.bias", "scale", {"step": -1, "what": "", "param": "",
                                                "ranks": []}),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, param, kind, replicas", CASES, ids=[c[0] for c in CASES])
def test_public_bug_beyond_at_its_onset_and_its_twin_within(tmp_path, name, param, kind,
                                                             replicas):
    res = run_bug(name, str(tmp_path))
    bug, twin = res["buggy"], res["healthy"]
    assert (bug["verdict"], bug["step"], bug["param"], bug["kind"]) == (
        "beyond", ONSET, param, kind), bug["text"]
    assert bug["text"].startswith(f"beyond rounding noise from step {ONSET} at {param} ")
    assert (twin["verdict"], twin["step"], twin["flagged"]) == ("within", -1, 0), twin["text"]
    assert res["caught"] and res["healthy_ok"]
    # the harness's replica ground truth; probekit's own replica check is not wired yet
    assert bug["replicas_harness"] == replicas
    assert twin["replicas_harness"]["step"] == -1
    assert replica_verdict(str(tmp_path / name / "healthy")) is None
