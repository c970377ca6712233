"""Megatron-LM #656 (in TTrace's list of existing bugs; the mechanism as #844 lays it out): with
pipeline parallelism the first stage's word embedding and the last stage's output layer are two
copies of one tied weight, kept equal by summing their gradients over the embedding group
(the first and last stage of each data-parallel rank). Under the distributed optimizer the
gradient buffer is reduce-scattered over the data-parallel group *before* that sum, and the two
copies lie in different DP ranks' partitions (the buffer runs in reverse order: the first
stage's embedding in the last DP rank's partition, the last stage's output layer in the first's).
Each DP rank's sum then adds an averaged gradient to another rank's un-averaged one, each
copy's owner steps with a different wrong gradient, and the copies untie.

Here, in plain PyTorch on 4 gloo ranks (PP=2 x DP=2; rank = 2 * stage + dp): a two-stage
pipeline (activations and their gradients sent between the stages), Megatron's finalisation
(the DP reduce-scatter, averaged, and the all-reduce of the tied gradients over the embedding
group) and its distributed optimizer (each DP rank steps the parameters of its partition, then
the owners' parameters are all-gathered). Healthy: the tied gradients summed first (Megatron's
order since the fix); from the onset after the reduce-scatter.

Each rank's grad probe records what its optimizer steps (``param_list``: the gradient the
update uses; the rest of its buffer is stale by design), the second stage under the model's
layer numbers (``rename=layer_offset(1)``), and names the tied pair
(``tied=[["embedding.weight", "output_layer.weight"]]``): the replica check compares the two
copies, held by the owners of the two partitions (ranks 1 and 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import ONSET, Clock, generator, reference, train

NAME = "mcore_tied_embedding_distopt"
TITLE = "Tied embedding copies untie under the distributed optimizer"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/656"
LAYOUT = ("PP=2 x DP=2: the first stage's embedding tied to the last stage's output layer; "
          "distributed optimizer")
IMPLEMENTATION = ("plain PyTorch: the pipeline's sends, Megatron's finalisation order (DP "
                  "reduce-scatter, tied-gradient all-reduce) and the distributed optimizer's "
                  "partitions and parameter all-gather")
WORLD = 4
TARGET = ("embedding.", "output_layer.")
CONTROL = "fp32"
NOTE = ("The one-process reference holds one tied weight (`embedding.weight`): the last stage's "
        "copy, `output_layer.weight`, is named as recorded by the second run only.")

VOCAB, D, ROWS, SEQ = 32, 16, 8, 6
LR = 1e-2
TIED = [["embedding.weight", "output_layer.weight"]]
#: the DP rank whose partition holds each parameter, per stage (the buffer's reverse order)
OWNER = ({"embedding.weight": 1, "layers.0.weight": 0, "layers.0.bias": 0},
         {"layers.0.weight": 1, "layers.0.bias": 1, "output_layer.weight": 0})


class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D)])

    def forward(self, ids):
        return torch.tanh(self.layers[0](self.embedding(ids)))


class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D)])
        self.output_layer = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, h):
        return self.output_layer(torch.tanh(self.layers[0](h)))


def stages():
    """Both stages as the one-process model starts them (the output layer a copy of the
    embedding)."""
    torch.manual_seed(0)
    s0 = Stage0()
    torch.manual_seed(1)
    s1 = Stage1()
    with torch.no_grad():
        s1.output_layer.weight.copy_(s0.embedding.weight)
    return s0, s1


class Whole(torch.nn.Module):
    """The one-process model: the output layer tied to the embedding (one parameter)."""

    def __init__(self):
        super().__init__()
        s0, s1 = stages()
        self.embedding = s0.embedding
        self.layers = torch.nn.ModuleList([s0.layers[0], s1.layers[0]])
        self.output_layer = s1.output_layer
        self.output_layer.weight = self.embedding.weight

    def forward(self, ids):
        h = torch.tanh(self.layers[0](self.embedding(ids)))
        return self.output_layer(torch.tanh(self.layers[1](h)))


def batch(step: int):
    g = generator(step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def single(path, control=None):
    model = Whole()

    def loss(step):
        ids, labels = batch(step)
        return F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))

    return reference(model, loss, path, control, lr=LR)


def distributed(out, buggy: bool):
    import torch.distributed as dist

    from probekit.grads import layer_offset

    rank = dist.get_rank()
    stage, dp = divmod(rank, 2)
    # every rank makes every group, in the same order
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tied_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_group, tied_group = dp_groups[stage], tied_groups[dp]
    model = stages()[stage]
    tied = model.embedding.weight if stage == 0 else model.output_layer.weight
    named = dict(model.named_parameters())
    owner = OWNER[stage]
    mine = [n for n in named if owner[n] == dp]
    opt = torch.optim.AdamW([named[n] for n in mine], lr=LR)
    peer = 2 + dp if stage == 0 else dp   # the other stage of this DP rank
    clock = Clock()

    def step_fn(step):
        ids, labels = (t.chunk(2)[dp] for t in batch(step))
        if stage == 0:
            h = model(ids)
            dist.send(h.detach(), peer)
            grad = torch.empty_like(h)
            dist.recv(grad, peer)
            h.backward(grad)
            loss = torch.zeros(())
        else:
            h = torch.empty(ids.shape[0], SEQ, D)
            dist.recv(h, peer)
            h.requires_grad_(True)
            loss = F.cross_entropy(model(h).reshape(-1, VOCAB), labels.reshape(-1))
            loss.backward()
            dist.send(h.grad, peer)
        late = buggy and step >= ONSET
        if not late:
            dist.all_reduce(tied.grad, group=tied_group)   # the tied copies' gradients summed
        for n, p in named.items():   # the DP reduce-scatter: the owner gets the average
            total = p.grad.clone()
            dist.all_reduce(total, group=dp_group)
            if owner[n] == dp:
                p.grad.copy_(total / 2)
        if late:   # the tied sum after it: averaged and un-averaged shares added
            dist.all_reduce(tied.grad, group=tied_group)
        return loss

    def gather_params(step):   # the distributed optimizer's all-gather of the updated params
        with torch.no_grad():
            for n, p in named.items():
                dist.broadcast(p, src=2 * stage + owner[n], group=dp_group)

    train(model, opt, step_fn, out, clock=clock, after_step=gather_params,
          param_list=mine, tied=TIED, rename=layer_offset(stage))
