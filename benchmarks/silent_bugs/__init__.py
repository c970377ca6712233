"""The corpus of public silent distributed-training bugs (issue 35, point 2): one small module
per bug, each with a healthy twin, run on CPU with gloo by ``benchmarks/bench_silent_bugs.py``.
``_harness.py`` says what a module defines."""
from __future__ import annotations

import importlib

#: the reproductions, in the order of the results table
BUGS = ("titan_router", "mcore_gathered_logits", "mcore_label_smoothing",
        "mcore_sp_final_layernorm", "mcore_moe_router_sp", "mcore_gdn_out_norm",
        "mcore_attention_sink_norm",
        "te_ring_attention",
        "te_fused_attention_dq", "bloom_clip_tp_rank0", "hf_grad_accum",
        "mcore_embedding_wgrad_after_dp", "mcore_tied_embedding_distopt", "fsdp2_tp_reduce_dtype")


def load(name: str):
    if name not in BUGS:
        raise ValueError(f"bug: {name!r} is not valid; accepted: {', '.join(BUGS)}")
    return importlib.import_module(f"{__name__}.{name}")
