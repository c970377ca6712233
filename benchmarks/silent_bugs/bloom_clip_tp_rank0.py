"""BLOOM-176B / DeepSpeed PR 1801 (the bf16 optimizer with pipeline parallelism): gradient
clipping ran on TP rank 0 only. Rank 0's gradients were right; the other TP ranks stepped with
unclipped gradients, and the copies of the replicated LayerNorm weights drifted apart over days
of training.

Here: Megatron's TP=2 attention block (megatron-core's ``ColumnParallelLinear`` /
``RowParallelLinear``; replicated input projection, LayerNorm and head) with Megatron's clipping
(the global norm over the TP group, each parameter counted once by megatron-core's
``param_is_not_tensor_parallel_duplicate``), and from the onset the clip coefficient applied on
TP rank 0 only. Every step clips (``MAX_NORM`` below the gradient norm).
"""
from __future__ import annotations

import torch

from . import _megatron, _tp_attention
from ._harness import ONSET
from .mcore_attention_sink_norm import clip_tp

NAME = "bloom_clip_tp_rank0"
TITLE = "Gradient clipping applied on TP rank 0 only"
SOURCE = "https://github.com/deepspeedai/DeepSpeed/pull/1801"
LAYOUT = "TP=2 (Megatron): sharded attention, replicated LayerNorm; gradient clipping on"
IMPLEMENTATION = ("megatron-core 0.16.1 TP layers and param_is_not_tensor_parallel_duplicate; "
                  "DeepSpeed's bf16 optimizer's skip emulated")
WORLD = _tp_attention.WORLD
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("",)   # the clip coefficient scales every gradient
CONTROL = "fp32"
NOTE = ("The comparison sees rank 1's own shards of the TP weights unclipped (scale). The copies "
        "rank 1 holds of the replicated parameters (the LayerNorm BLOOM saw drift, the input "
        "projection, the head, the row-parallel bias) are recorded by rank 0 only: the replica "
        "check finds them unclipped from step 3, with no reference.")
MAX_NORM = 0.3


def single(path, control=None):
    return _tp_attention.single(path, control, after_backward=lambda model, step: (
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))


def distributed(out, buggy: bool):
    _megatron.load()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    def clip(model, step):
        skip = buggy and step >= ONSET and ps.get_tensor_model_parallel_rank() > 0
        clip_tp(list(model.parameters()), MAX_NORM, param_is_not_tensor_parallel_duplicate,
                apply=not skip)

    _tp_attention.distributed(out, lambda q, k, v, off, step: _tp_attention.sdpa(q, k, v),
                              after_backward=clip)
