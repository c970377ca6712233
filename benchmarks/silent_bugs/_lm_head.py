"""A language-model head under Megatron's tensor parallelism, for the cross-entropy bugs of
Megatron-LM #7452: a replicated input projection and LayerNorm, then Megatron's
``ColumnParallelLinear`` output layer (vocabulary sharded over 2 ranks) and Megatron's
``vocab_parallel_cross_entropy``. The one-process reference is the same model with an
``nn.Linear`` output layer; each bug module gives the two losses."""
from __future__ import annotations

import torch

from ._harness import Clock, generator, record, reference

S, B, DIN, D, V = 8, 4, 16, 32, 64
LR = 1e-2
WORLD = 2


class HeadNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(DIN, D)
        self.norm = torch.nn.LayerNorm(D)
        self.output_layer = torch.nn.Linear(D, V, bias=False)
        with torch.no_grad():  # an affine LayerNorm that acts
            self.norm.weight.normal_(1.0, 0.1)
            self.norm.bias.normal_(0.0, 0.1)

    def hidden(self, x):
        return self.norm(self.inp(x))


def batch(step: int):
    g = generator(step)
    return torch.randn(S, B, DIN, generator=g), torch.randint(0, V, (S, B), generator=g)


def single(path, control, loss_fn):
    """``loss_fn(logits, labels)``: the per-token loss over the whole vocabulary."""
    model = HeadNet()

    def loss(step):
        x, labels = batch(step)
        return loss_fn(model.output_layer(model.hidden(x)), labels).mean()

    return reference(model, loss, path, control, lr=LR)


def distributed(out, loss_fn, *, gather=lambda step: False):
    """``loss_fn(logits, labels, step)``: the per-token loss on this rank; ``gather(step)``: the
    output layer gathers the logits over the vocabulary at this step
    (``runtime_gather_output``)."""
    from . import _megatron

    ref = HeadNet()
    with _megatron.tensor_parallel(WORLD) as config:
        model = torch.nn.Module()
        model.inp, model.norm = ref.inp, ref.norm
        model.output_layer = _megatron.column(ref.output_layer, config)
        shards = _megatron.shards(model)

        def loss(step):
            x, labels = batch(step)
            logits, _ = model.output_layer(model.norm(model.inp(x)),
                                           runtime_gather_output=gather(step))
            return loss_fn(logits, labels, step).mean()

        record(out, model, loss, lr=LR, clock=Clock(), shards=shards)
