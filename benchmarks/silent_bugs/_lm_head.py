"""A language-model head under Megatron's tensor parallelism, for the cross-entropy bugs of
Megatron-LM #7452: a replicated input projection and LayerNorm, then Megatron's
``ColumnParallelLinear`` output layer (vocabulary sharded over 2 ranks) and Megatron's
``vocab_parallel_cross_entropy``. The one-process reference is the same model with an
``nn.Linear`` output layer; each bug module gives the two losses."""
from __future__ import annotations

import torch

from ._harness import Clock, ReplicaWitness, ShardView, generator, train

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
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step_fn(step):
        x, labels = batch(step)
        loss = loss_fn(model.output_layer(model.hidden(x)), labels).mean()
        loss.backward()
        return loss

    return train(model, opt, step_fn, path, clock=Clock(), control=control)


def distributed(out, loss_fn, *, gather=lambda step: False):
    """``loss_fn(output_layer, hidden, labels, step)``: the per-token loss on this rank;
    ``gather(step)``: the output layer gathers the logits over the vocabulary at this step
    (``runtime_gather_output``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from . import _megatron

    rank = dist.get_rank()
    ref = HeadNet()
    with _megatron.tensor_parallel(WORLD) as config:
        from megatron.core.tensor_parallel import ColumnParallelLinear

        model = torch.nn.Module()
        model.inp, model.norm = ref.inp, ref.norm
        model.output_layer = ColumnParallelLinear(D, V, config=config, bias=False,
                                                  init_method=torch.nn.init.zeros_)
        _megatron.set_shard(model.output_layer.weight, ref.output_layer.weight, 0, rank, WORLD)
        view = ShardView(model, init_device_mesh("cpu", (WORLD,)),
                         {"output_layer.weight": Shard(0)})
        opt = torch.optim.AdamW(view.parameters(), lr=LR)
        clock = Clock()
        witness = ReplicaWitness({n: p for n, p in model.named_parameters()
                                  if not n.startswith("output_layer.")})

        def step_fn(step):
            x, labels = batch(step)
            hidden = model.norm(model.inp(x))
            logits, _ = model.output_layer(hidden, runtime_gather_output=gather(step))
            loss = loss_fn(logits, labels, step).mean()
            loss.backward()
            view.pull_grads()
            witness.grads(step)
            return loss

        train(model, opt, step_fn, out, clock=clock, probe_model=view,
              after_step=witness.params)
        witness.write(out)
