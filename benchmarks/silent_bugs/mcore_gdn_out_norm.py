"""Megatron-LM #7452, finding 11: the gated-delta-net block's ``out_norm`` (a gated RMSNorm over
each head's output, one weight shared by all heads) is replicated over TP while the heads are
sharded, so each rank's copy gets the gradient of its own heads only. Megatron sums such
gradients over TP in ``finalize_model_grads`` only for parameters marked ``sequence_parallel``
when sequence parallelism is on; without it nothing sums ``out_norm``: the copies get
``[0.1200, 0.0400]`` and ``[0.0197, -0.0077]`` where the whole is ``[0.1397, 0.0323]``, and part.

Here: megatron-core's ``ColumnParallelLinear`` (per head a value and a gate) and
``RowParallelLinear``, a gated per-head RMSNorm between them, TP=2 without sequence parallelism,
and megatron-core's ``_allreduce_non_tensor_model_parallel_grads`` as the finalisation (it leaves
``out_norm`` alone). The healthy twin and the steps before the onset add the report's fix, the
TP sum of ``out_norm``'s gradient.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import _megatron
from ._harness import ONSET, Clock, generator, record, reference

NAME = "mcore_gdn_out_norm"
TITLE = "Gated-delta-net out_norm gradient not summed over TP without SP"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/7452"
LAYOUT = "TP=2 (Megatron), no SP: heads sharded, out_norm replicated"
IMPLEMENTATION = ("megatron-core 0.16.1 TP layers and _allreduce_non_tensor_model_parallel_grads "
                  "(finding 11 of the report); the recurrence left out, the gated norm kept")
WORLD = 2
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("mixer.out_norm.",)
CONTROL = "fp32"
NOTE = ("Each rank's copy holds its own heads' share: rank 0's recorded copy is wrong (the "
        "comparison) and differs from rank 1's (the replica check).")

T, BATCH, DIN, D, HEADS, OUT = 8, 4, 8, 32, 4, 8
HD = D // HEADS
LR = 1e-2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(DIN, D)
        self.mixer = torch.nn.Module()
        self.mixer.in_proj = torch.nn.Linear(D, 2 * D)
        self.mixer.out_norm = torch.nn.Module()
        self.mixer.out_norm.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(HD))
        self.mixer.out_proj = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, OUT)


def mix(model, x, in_proj, out_proj, heads: int):
    """``in_proj``/``out_proj`` map ``[T, B, *]``; per head a value and a gate."""
    h = model.inp(x)
    vg = in_proj(h).view(T, BATCH, heads, 2, HD)
    v, gate = vg[..., 0, :], vg[..., 1, :]
    o = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * model.mixer.out_norm.weight
    o = (o * F.silu(gate)).reshape(T, BATCH, heads * HD)
    return model.head(h + out_proj(o))


def batch(step: int):
    g = generator(step)
    return torch.randn(T, BATCH, DIN, generator=g), torch.randn(T, BATCH, OUT, generator=g)


def single(path, control=None):
    model = Net()

    def loss(step):
        x, y = batch(step)
        return F.mse_loss(mix(model, x, model.mixer.in_proj, model.mixer.out_proj, HEADS), y)

    return reference(model, loss, path, control, lr=LR)


def distributed(out, buggy: bool):
    import torch.distributed as dist

    _megatron.load()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads)

    ref = Net()
    with _megatron.tensor_parallel(WORLD) as config:
        model = Net()
        mixer = model.mixer
        mixer.in_proj = _megatron.column(ref.mixer.in_proj, config)
        mixer.out_proj = _megatron.row(ref.mixer.out_proj, config)
        model.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        config_for_finalize = SimpleNamespace(sequence_parallel=False, qk_layernorm=False)
        shards = _megatron.shards(model)

        def loss(step):
            x, y = batch(step)
            return F.mse_loss(mix(model, x, lambda h: mixer.in_proj(h)[0],
                                  lambda o: mixer.out_proj(o)[0], HEADS // WORLD), y)

        def finalize(step):
            _allreduce_non_tensor_model_parallel_grads([model], config_for_finalize)
            if not (buggy and step >= ONSET):   # the fix: out_norm summed over TP
                dist.all_reduce(mixer.out_norm.weight.grad,
                                group=ps.get_tensor_model_parallel_group())

        record(out, model, loss, lr=LR, clock=Clock(), shards=shards,
               finalize=finalize)
