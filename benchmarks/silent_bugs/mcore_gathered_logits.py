"""Megatron-LM #7452, finding 2: ``GPTModel``'s labels path with gathered logits. With
``parallel_output=False`` or ``runtime_gather_output=True`` the output layer all-gathers the
logits over the vocabulary, and the loss still calls the vocabulary-parallel cross entropy, which
takes the last dimension as this rank's shard: every rank adds the whole softmax denominator
(loss = correct + log(TP)), only rank 0's range holds the targets, and in the backward each rank
keeps its own slice of a gradient that lost the target term on the others.

Here: megatron-core's own ``ColumnParallelLinear`` (``runtime_gather_output=True`` from the onset,
the trigger the report names) and ``vocab_parallel_cross_entropy``, TP=2 on gloo.
"""
from __future__ import annotations

import torch.nn.functional as F

from . import _lm_head, _megatron
from ._harness import ONSET

NAME = "mcore_gathered_logits"
TITLE = "Gathered logits fed to the vocab-parallel cross entropy"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/7452"
LAYOUT = "TP=2 (Megatron): vocab-parallel output layer, replicated input and LayerNorm"
IMPLEMENTATION = ("megatron-core 0.16.1 ColumnParallelLinear + vocab_parallel_cross_entropy "
                  "(finding 2 of the report)")
WORLD = _lm_head.WORLD
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("output_layer.",)
CONTROL = "fp32"
NOTE = ("Replica check: the error sits in each rank's own shard of the output layer; the "
        "replicated parameters below get the all-reduced input gradient, equal on every rank.")


def single(path, control=None):
    return _lm_head.single(path, control, lambda logits, labels: F.cross_entropy(
        logits.reshape(-1, _lm_head.V), labels.reshape(-1), reduction="none"))


def distributed(out, buggy: bool):
    _megatron.load()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    _lm_head.distributed(out, lambda logits, labels, step: vocab_parallel_cross_entropy(
        logits, labels), gather=lambda step: buggy and step >= ONSET)
