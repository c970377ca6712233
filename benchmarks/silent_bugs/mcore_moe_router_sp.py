"""Megatron-LM #599 (in TTrace's list of existing bugs; fixed by PR #619): with MoE, tensor and
sequence parallelism together, each TP rank's router sees its own slice of the sequence, so its
weight gets one slice's share of the gradient. Megatron sums such shares over the TP group in
``finalize_model_grads`` for the parameters marked ``sequence_parallel``; the router's weight
was not marked, so nothing summed it: each TP rank stepped its copy of the router with its own
partial gradient and the copies drifted apart as training went on.

Here: megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` with
``sequence_parallel=True`` as the experts' MLPs, its sequence-parallel mappings and
vocabulary-parallel cross entropy, and its ``_allreduce_non_tensor_model_parallel_grads`` (the
step of ``finalize_model_grads`` that sums those gradients), TP=2 on gloo: a MoE block of two
experts between a LayerNorm and the final LayerNorm. The router is a linear gate marked as
megatron-core's ``Router`` marks its weight (``sequence_parallel`` when sequence parallelism is
on), softmax scores over every expert applied to the expert's input (no top-k: the reference has
no ties to break). From the onset the router's weight is no longer marked, as before PR #619.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import _megatron
from ._harness import ONSET, Clock, generator, record, reference

NAME = "mcore_moe_router_sp"
TITLE = "MoE router replicated over TP, its gradient never summed under sequence parallelism"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/599"
LAYOUT = ("TP=2 + SP (Megatron): experts' MLPs column/row-parallel, router and LayerNorms on "
          "sequence slices")
IMPLEMENTATION = ("megatron-core 0.16.1 SP layers, mappings, vocab_parallel_cross_entropy and "
                  "_allreduce_non_tensor_model_parallel_grads; the router's gate a plain linear "
                  "marked as megatron-core's Router marks it")
WORLD = 2
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("decoder.layers.0.mlp.router.",)
CONTROL = "fp32"
NOTE = ("Rank 0's copy of the router steps with its half of the sequence's share: the comparison "
        "sees it in rank 0's record, the replica check in the copies.")

S, B, DIN, D, FF, E, V = 8, 4, 16, 16, 32, 2, 32
LR = 1e-2


class Reference(torch.nn.Module):
    """The one-process model, under Megatron's parameter names."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Linear(DIN, D)
        layer = torch.nn.Module()
        layer.pre_mlp_layernorm = torch.nn.LayerNorm(D)
        layer.mlp = torch.nn.Module()
        layer.mlp.router = torch.nn.Module()
        layer.mlp.router.weight = torch.nn.Parameter(torch.randn(E, D) / D ** 0.5)
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.local_experts = torch.nn.ModuleList()
        for _ in range(E):
            expert = torch.nn.Module()
            expert.linear_fc1 = torch.nn.Linear(D, FF)
            expert.linear_fc2 = torch.nn.Linear(FF, D)
            layer.mlp.experts.local_experts.append(expert)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer])
        self.decoder.final_layernorm = torch.nn.LayerNorm(D)
        self.output_layer = torch.nn.Linear(D, V, bias=False)
        with torch.no_grad():  # LayerNorms that act
            for norm in (layer.pre_mlp_layernorm, self.decoder.final_layernorm):
                norm.weight.normal_(1.0, 0.1)
                norm.bias.normal_(0.0, 0.1)


def moe(layer, h, fc1, fc2):
    """The MoE block on ``h`` (this rank's tokens): softmax scores over every expert from the
    router, each expert's input scaled by its score (``fc1``/``fc2``: expert e's layers as
    functions of ``[tokens, B, *]``)."""
    n = layer.pre_mlp_layernorm(h)
    scores = torch.softmax(n @ layer.mlp.router.weight.t(), dim=-1)
    return sum(fc2(e, F.gelu(fc1(e, n * scores[..., e:e + 1]))) for e in range(E))


def batch(step: int):
    g = generator(step)
    return torch.randn(S, B, DIN, generator=g), torch.randint(0, V, (S, B), generator=g)


def single(path, control=None):
    model = Reference()
    layer = model.decoder.layers[0]
    experts = layer.mlp.experts.local_experts

    def loss(step):
        x, labels = batch(step)
        h = model.embedding(x)
        h = h + moe(layer, h, lambda e, a: experts[e].linear_fc1(a),
                    lambda e, a: experts[e].linear_fc2(a))
        logits = model.output_layer(model.decoder.final_layernorm(h))
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))

    return reference(model, loss, path, control, lr=LR)


def distributed(out, buggy: bool):
    _megatron.load()
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    ref = Reference()
    ref_experts = ref.decoder.layers[0].mlp.experts.local_experts
    with _megatron.tensor_parallel(WORLD, sequence_parallel=True) as config:
        model = Reference()   # the replicated modules; the parallel ones replaced below
        layer = model.decoder.layers[0]
        experts = layer.mlp.experts.local_experts
        for e in range(E):
            experts[e].linear_fc1 = _megatron.column(ref_experts[e].linear_fc1, config)
            experts[e].linear_fc2 = _megatron.row(ref_experts[e].linear_fc2, config)
        model.output_layer = _megatron.column(ref.output_layer, config)
        for norm in (layer.pre_mlp_layernorm, model.decoder.final_layernorm):
            for p in norm.parameters():   # on sequence slices: summed by the finalisation
                p.sequence_parallel = True
        router = layer.mlp.router.weight
        router.sequence_parallel = True   # megatron-core's Router.reset_parameters
        model.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        config_for_finalize = SimpleNamespace(sequence_parallel=True, qk_layernorm=False)

        def loss(step):
            x, labels = batch(step)
            h = scatter_to_sequence_parallel_region(model.embedding(x))      # [S/TP, B, D]
            h = h + moe(layer, h, lambda e, a: experts[e].linear_fc1(a)[0],   # all-gathers S
                        lambda e, a: experts[e].linear_fc2(a)[0])             # reduce-scatters
            logits, _ = model.output_layer(model.decoder.final_layernorm(h))
            return vocab_parallel_cross_entropy(logits, labels).mean()       # [S, B, V/TP]

        def finalize(step):
            if buggy and step == ONSET:   # the router's weight no longer marked (before #619)
                router.sequence_parallel = False
            _allreduce_non_tensor_model_parallel_grads([model], config_for_finalize)

        record(out, model, loss, lr=LR, clock=Clock(), shards=_megatron.shards(model),
               finalize=finalize)
