"""Megatron-LM #1446 (found by TTrace): with tensor and sequence parallelism the final
LayerNorm's gradients differ between TP ranks before ``optimizer.step()``. Under sequence
parallelism a LayerNorm runs on the rank's slice of the sequence, so its weight and bias get
one slice's share of their gradient; Megatron sums the shares over the TP group in
``finalize_model_grads`` for the parameters marked ``sequence_parallel``, and the final
LayerNorm's were not summed: each rank steps with its own partial gradient.

Here: megatron-core's own ``ColumnParallelLinear`` / ``RowParallelLinear`` with
``sequence_parallel=True``, its sequence-parallel mappings and vocabulary-parallel cross entropy,
and its ``_allreduce_non_tensor_model_parallel_grads`` (the step of ``finalize_model_grads``
that sums those gradients), TP=2 on gloo, one MLP block between an input LayerNorm and the final
LayerNorm. From the onset the final LayerNorm's parameters are no longer marked.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import _megatron
from ._harness import ONSET, Clock, generator, record, reference

NAME = "mcore_sp_final_layernorm"
TITLE = "Final LayerNorm gradients not summed over TP under sequence parallelism"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/1446"
LAYOUT = "TP=2 + SP (Megatron): column/row-parallel MLP, LayerNorms on sequence slices"
IMPLEMENTATION = ("megatron-core 0.16.1 SP layers, mappings, vocab_parallel_cross_entropy and "
                  "_allreduce_non_tensor_model_parallel_grads")
WORLD = 2
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("decoder.final_layernorm.",)
CONTROL = "fp32"
NOTE = ("Each rank's copy holds its half of the sequence's share: rank 0's recorded copy is "
        "wrong (the comparison) and differs from rank 1's (the replica check).")

S, B, DIN, D, FF, V = 8, 4, 16, 32, 64, 48
LR = 1e-2


class Reference(torch.nn.Module):
    """The one-process model, under Megatron's parameter names."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Linear(DIN, D)
        layer = torch.nn.Module()
        layer.input_layernorm = torch.nn.LayerNorm(D)
        layer.mlp = torch.nn.Module()
        layer.mlp.linear_fc1 = torch.nn.Linear(D, FF)
        layer.mlp.linear_fc2 = torch.nn.Linear(FF, D)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer])
        self.decoder.final_layernorm = torch.nn.LayerNorm(D)
        self.output_layer = torch.nn.Linear(D, V, bias=False)
        with torch.no_grad():  # LayerNorms that act
            for norm in (layer.input_layernorm, self.decoder.final_layernorm):
                norm.weight.normal_(1.0, 0.1)
                norm.bias.normal_(0.0, 0.1)

    def forward(self, x):
        layer = self.decoder.layers[0]
        h = self.embedding(x)
        h = h + layer.mlp.linear_fc2(F.gelu(layer.mlp.linear_fc1(layer.input_layernorm(h))))
        return self.output_layer(self.decoder.final_layernorm(h))


def batch(step: int):
    g = generator(step)
    return torch.randn(S, B, DIN, generator=g), torch.randint(0, V, (S, B), generator=g)


def single(path, control=None):
    model = Reference()

    def loss(step):
        x, labels = batch(step)
        return F.cross_entropy(model(x).reshape(-1, V), labels.reshape(-1))

    return reference(model, loss, path, control, lr=LR)


def distributed(out, buggy: bool):
    _megatron.load()
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    ref = Reference()
    rl = ref.decoder.layers[0]
    with _megatron.tensor_parallel(WORLD, sequence_parallel=True) as config:
        model = Reference()   # the replicated modules; the parallel ones replaced below
        layer = model.decoder.layers[0]
        layer.mlp.linear_fc1 = _megatron.column(rl.mlp.linear_fc1, config)
        layer.mlp.linear_fc2 = _megatron.row(rl.mlp.linear_fc2, config)
        model.output_layer = _megatron.column(ref.output_layer, config)
        for norm in (layer.input_layernorm, model.decoder.final_layernorm):
            for p in norm.parameters():   # on sequence slices: summed by the finalisation
                p.sequence_parallel = True
        model.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        config_for_finalize = SimpleNamespace(sequence_parallel=True, qk_layernorm=False)
        shards = _megatron.shards(model)

        def loss(step):
            x, labels = batch(step)
            h = scatter_to_sequence_parallel_region(model.embedding(x))  # [S/TP, B, D]
            a, _ = layer.mlp.linear_fc1(layer.input_layernorm(h))        # all-gathers S
            m, _ = layer.mlp.linear_fc2(F.gelu(a))                        # reduce-scatters S
            logits, _ = model.output_layer(model.decoder.final_layernorm(h + m))
            return vocab_parallel_cross_entropy(logits, labels).mean()   # [S, B, V/TP]

        def finalize(step):
            if buggy and step == ONSET:   # the final LayerNorm no longer marked
                for p in model.decoder.final_layernorm.parameters():
                    p.sequence_parallel = False
            _allreduce_non_tensor_model_parallel_grads([model], config_for_finalize)

        record(out, model, loss, lr=LR, clock=Clock(), shards=shards,
               finalize=finalize)
