"""Megatron-LM #7452, finding 8: the learnable attention-sink offsets are sharded over TP with
the heads, but are not marked ``tensor_model_parallel``, so the gradient norm for clipping counts
them as a TP-duplicated parameter: only TP rank 0's heads enter the norm. The norm is too small,
the clip coefficient too large, and every gradient is clipped by the wrong factor.

Here: Megatron's TP=2 attention block (megatron-core's ``ColumnParallelLinear`` /
``RowParallelLinear``) with one sink logit per head, and the clipping as Megatron does it: the
gradients for the norm chosen by megatron-core's own ``param_is_not_tensor_parallel_duplicate``,
their squares summed and all-reduced over the model-parallel group, then
``max_norm / (norm + 1e-6)`` applied when below 1 (``get_grad_norm_fp32`` and
``clip_grad_by_total_norm_fp32``, whose CUDA multi-tensor kernels are replaced by the same sums on
the CPU). The healthy twin and the steps before the onset mark the offsets (the fix); the
reference clips with ``torch.nn.utils.clip_grad_norm_``. ``MAX_NORM`` is below the gradient norm
of every step, so every step clips.
"""
from __future__ import annotations

import torch

from . import _megatron, _tp_attention
from ._harness import ONSET

NAME = "mcore_attention_sink_norm"
TITLE = "Head-sharded attention sinks counted on one TP rank in the clip norm"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/7452"
LAYOUT = "TP=2 (Megatron): heads and their sink logits sharded; gradient clipping on"
IMPLEMENTATION = ("megatron-core 0.16.1 TP layers and param_is_not_tensor_parallel_duplicate; "
                  "the sink parameter and its missing mark modelled, the norm's CUDA kernel "
                  "replaced by a CPU sum (finding 8 of the report)")
WORLD = _tp_attention.WORLD
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("",)   # the clip coefficient scales every gradient
CONTROL = "fp32"
NOTE = ("The sinks hold about 1e-4 of the squared gradient norm, so the clip coefficient moves by "
        "about 2e-5 (the headline prints the norm ratio as 1x); found because fp32 rounding moves "
        "it less. Replica check: the norm is all-reduced, every rank clips by the same wrong "
        "factor, the copies agree.")
MAX_NORM = 0.3


def single(path, control=None):
    return _tp_attention.single(path, control, sink=True, after_backward=lambda model, step: (
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))


def clip_tp(params, max_norm: float, counted, apply: bool = True) -> None:
    """Megatron's clipping: the norm of the gradients ``counted`` selects (summed over the TP
    group), the coefficient applied to every gradient (``apply=False``: the norm's collective
    runs, the gradients stay as they are)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    grads = [p.grad for p in params if p.grad is not None]
    total = sum(g.float().pow(2).sum() for p, g in zip(params, grads) if counted(p))
    total = torch.as_tensor(total, dtype=torch.float32)
    dist.all_reduce(total, group=ps.get_model_parallel_group())
    coeff = max_norm / (float(total) ** 0.5 + 1.0e-6)
    if apply and coeff < 1.0:
        for g in grads:
            g.mul_(coeff)


def distributed(out, buggy: bool):
    _megatron.load()
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    def clip(model, step):
        off = model.self_attention.core_attention.softmax_offset
        off.tensor_model_parallel = not (buggy and step >= ONSET)
        clip_tp(list(model.parameters()), MAX_NORM, param_is_not_tensor_parallel_duplicate)

    _tp_attention.distributed(out, lambda q, k, v, off, step: _tp_attention.sdpa(q, k, v, off),
                              sink=True, after_backward=clip)
