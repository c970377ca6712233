"""Megatron-LM #1012 (in TTrace's list of existing bugs): with the output layer's weight-gradient
GEMM deferred (``defer_embedding_wgrad_compute``), the pipeline schedule called
``finish_embedding_wgrad_compute`` after the data-parallel gradient all-reduce had been started:
each rank adds its own, un-averaged weight gradient to an already averaged buffer. Rank 0's
gradient is wrong and the replicas differ.

Here, in plain PyTorch: data parallelism over 2 gloo ranks with Megatron's order of things (the
backward, then one all-reduce of every gradient averaged over the DP group, as Megatron's
``finalize_model_grads`` does), and an output layer whose weight-gradient GEMM waits in a list
until ``finish_wgrad()``. Healthy: it runs before the all-reduce; from the onset after it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import ONSET, Clock, generator, record, reference

NAME = "mcore_embedding_wgrad_after_dp"
TITLE = "Deferred output-layer weight gradient added after the DP all-reduce"
SOURCE = "https://github.com/NVIDIA/Megatron-LM/issues/1012"
LAYOUT = "DP=2 (Megatron-style gradient sync after the backward), deferred wgrad GEMM"
IMPLEMENTATION = "plain PyTorch: the deferred GEMM and the order of the calls"
WORLD = 2
TARGET = ("output_layer.",)
CONTROL = "fp32"
NOTE = ("Each rank adds its own un-averaged share to the averaged buffer: rank 0's recorded copy "
        "is wrong (the comparison) and differs from rank 1's (the replica check).")

VOCAB, D, ROWS, SEQ = 32, 16, 8, 6
LR = 1e-2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(VOCAB, D)
        self.body = torch.nn.Linear(D, D)
        self.output_layer = torch.nn.Linear(D, VOCAB, bias=False)

    def hidden(self, ids):
        return torch.tanh(self.body(self.embedding(ids)))


def batch(step: int):
    g = generator(step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def single(path, control=None):
    model = Net()

    def loss(step):
        ids, labels = batch(step)
        return F.cross_entropy(model.output_layer(model.hidden(ids)).reshape(-1, VOCAB),
                               labels.reshape(-1))

    return reference(model, loss, path, control, lr=LR)


class DeferredWgrad(torch.autograd.Function):
    """``x @ w.T``: the input gradient now, the weight gradient's operands kept in ``pending``
    for ``finish_wgrad``."""

    @staticmethod
    def forward(ctx, x, w, pending):
        ctx.save_for_backward(x, w)
        ctx.pending = pending
        return x @ w.t()

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        ctx.pending.append((w, x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])))
        return gy @ w, None, None


def finish_wgrad(pending: list) -> None:
    for w, x, gy in pending:
        g = gy.t() @ x
        w.grad = g if w.grad is None else w.grad + g
    pending.clear()


def distributed(out, buggy: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from probekit.grads import LocalShards

    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net()
    # every parameter a plain copy on each rank, replicated: rank 0 records, the copies checked
    shards = LocalShards(init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    pending = []

    def loss(step):
        ids, labels = (t.chunk(world)[rank] for t in batch(step))
        logits = DeferredWgrad.apply(model.hidden(ids), model.output_layer.weight, pending)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    def finalize(step):
        late = buggy and step >= ONSET
        if not late:
            finish_wgrad(pending)
        for p in model.parameters():              # the DP all-reduce, averaged
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        if late:
            finish_wgrad(pending)

    record(out, model, loss, lr=LR, clock=Clock(), shards=shards, finalize=finalize)
