"""Megatron-LM #7452, finding 1: label smoothing in ``vocab_parallel_cross_entropy`` under
TP > 1. The smoothing term uses the rank's vocabulary shard as the whole vocabulary: ``K`` is
the local size and ``mean(log p)`` the local mean, so each rank's loss differs and the uniform
part of the gradient is ``TP`` times too large (related upstream: Megatron-LM #737, #5522).

Here: megatron-core's own ``vocab_parallel_cross_entropy(..., label_smoothing=0.2)`` from the
onset, TP=2 on gloo. The healthy twin and the steps before the onset compute the same smoothed
loss over the whole vocabulary: Megatron's cross entropy without smoothing plus the smoothing
term with its sums all-reduced over the vocabulary shards (the fix the report proposes). The
reference is the same formula in one process (Megatron's: 1/(K-1) of the mass on every
non-target token, not torch's ``label_smoothing``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _lm_head, _megatron
from ._harness import ONSET

NAME = "mcore_label_smoothing"
TITLE = "Label smoothing in the vocab-parallel cross entropy uses the local vocabulary"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/7452"
LAYOUT = "TP=2 (Megatron): vocab-parallel output layer, replicated input and LayerNorm"
IMPLEMENTATION = ("megatron-core 0.16.1 ColumnParallelLinear + vocab_parallel_cross_entropy "
                  "with label_smoothing (finding 1 of the report)")
WORLD = _lm_head.WORLD
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("output_layer.",)
CONTROL = "fp32"
NOTE = ("The loss's error enters at the logits; the LayerNorm below the output layer departs "
        "furthest from the reference. Replica check: the replicated parameters "
        "below the output layer get the all-reduced input gradient, equal on every rank.")
ALPHA = 0.2


def smoothing(k: int) -> float:
    return ALPHA * k / (k - 1)


def single(path, control=None):
    def loss(logits, labels):
        logits = logits.reshape(-1, _lm_head.V)
        ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
        s = smoothing(_lm_head.V)
        return (1 - s) * ce - s * torch.log_softmax(logits, dim=-1).mean(-1)

    return _lm_head.single(path, control, loss)


def distributed(out, buggy: bool):
    _megatron.load()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def whole_vocabulary(logits, labels):
        """The smoothed loss over the whole vocabulary, from this rank's shard of it (Megatron's
        cross entropy overwrites the logits it is given with their softmax: it gets a copy)."""
        ce = vocab_parallel_cross_entropy(logits.clone(), labels)
        top = logits.detach().max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        lse = top + torch.log(reduce_from_tensor_model_parallel_region(
            torch.exp(logits - top.unsqueeze(-1)).sum(-1)))
        mean_logp = reduce_from_tensor_model_parallel_region(logits.sum(-1)) / _lm_head.V - lse
        s = smoothing(_lm_head.V)
        return (1 - s) * ce - s * mean_logp

    def loss(logits, labels, step):
        if buggy and step >= ONSET:
            return vocab_parallel_cross_entropy(logits, labels, label_smoothing=ALPHA)
        return whole_vocabulary(logits, labels)

    _lm_head.distributed(out, loss)
