"""TransformerEngine #1557 / Megatron-LM #1464 (found by TTrace): with context parallelism the
ring attention's backward (``AttnFuncWithCPAndKVP2P.backward``, batched P2P communication,
micro-batches > 1) returns wrong dQ, dK and dV (relative error up to 1.2); the error reaches the
QKV projection's weight gradient (up to 2.3). The forward is right, so the loss looks healthy.

Here, emulated in plain PyTorch (TransformerEngine's kernels need a GPU): context parallelism
over 2 ranks, each holding half of the sequence; the ring attention gathers the other ranks' keys
and values, merges the blocks by their log-sum-exp, and has a hand-written flash-style backward.
From the onset that backward rebuilds the probabilities of the remote block from the rank's own
key/value buffer (a communication buffer read before the exchange into it completed), the
failure the issue's numbers describe; the forward stays right. The replicated weights' gradients
are summed over the CP group, as Megatron's data-parallel reduction over DP x CP does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._attention import backward_blocks, forward_blocks
from ._harness import ONSET, Clock, generator, record, reference

NAME = "te_ring_attention"
TITLE = "Ring attention (context parallel) backward reads a stale K/V buffer"
SOURCE = "https://github.com/NVIDIA/TransformerEngine/issues/1557"
LAYOUT = "CP=2: each rank half of the sequence, ring attention, weights replicated"
IMPLEMENTATION = ("plain PyTorch: ring attention with a hand-written backward; the stale "
                  "buffer emulated (TE's kernels need a GPU)")
WORLD = 2
TARGET = ("attention.",)
CONTROL = "fp32"
NOTE = ("The stale read happens on rank 1 only; the CP all-reduce of the replicated weights "
        "carries it into rank 0's copy, and leaves the copies equal: the replica check cannot see "
        "it, only a reference can.")

BATCH, T, DIN, D, HEADS, OUT = 4, 16, 8, 32, 4, 8
LR = 1e-2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(DIN, D)
        self.attention = torch.nn.Module()
        self.attention.qkv = torch.nn.Linear(D, 3 * D)
        self.attention.proj = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, OUT)

    def forward(self, x, attend):
        h = self.inp(x)
        b, t, _ = h.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2)
                   for z in self.attention.qkv(h).split(D, dim=-1))
        o = attend(q, k, v).transpose(1, 2).reshape(b, t, D)
        return self.head(h + self.attention.proj(o))


def batch(step: int):
    g = generator(step)
    return torch.randn(BATCH, T, DIN, generator=g), torch.randn(BATCH, T, OUT, generator=g)


def single(path, control=None):
    model = Net()
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731

    def loss(step):
        x, y = batch(step)
        return F.mse_loss(model(x, sdpa), y)

    return reference(model, loss, path, control, lr=LR)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the blocks of keys and values up to its
    own (the others' gathered); the backward sends each block's dK, dV to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, stale: bool):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in
                                                                range(world)]
        dist.all_gather(ks, k.contiguous())
        dist.all_gather(vs, v.contiguous())
        n = q.shape[-2]
        blocks = [(ks[j], vs[j], j * n) for j in range(rank + 1)]
        out, lse = forward_blocks(q, blocks, rank * n)
        ctx.save_for_backward(q, k, v, out, lse, *ks[:rank + 1], *vs[:rank + 1])
        ctx.stale = stale
        return out

    @staticmethod
    def backward(ctx, dout):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        q, k, v, out, lse, *kv = ctx.saved_tensors
        n = q.shape[-2]
        blocks = [(kv[j], kv[rank + 1 + j], j * n) for j in range(rank + 1)]
        reads = ([(k if j != rank else kj, v if j != rank else vj, k0)
                  for j, (kj, vj, k0) in enumerate(blocks)] if ctx.stale else blocks)
        dq, dkv = backward_blocks(q, blocks, rank * n, out, lse, dout, grad_blocks=reads)
        send = torch.zeros(2, world, *k.shape)
        for j, (dk, dv) in enumerate(dkv):
            send[0, j], send[1, j] = dk, dv
        dist.all_reduce(send)
        return dq, send[0, rank], send[1, rank], None


def distributed(out, buggy: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from probekit.grads import LocalShards

    rank = dist.get_rank()
    model = Net()
    # every parameter a plain copy on each rank, replicated: rank 0 records, the copies checked
    shards = LocalShards(init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",)))
    clock = Clock()
    n = T // WORLD

    def attend(q, k, v):
        return RingAttention.apply(q, k, v, buggy and clock.step >= ONSET)

    def loss(step):
        x, y = batch(step)
        mine = slice(rank * n, (rank + 1) * n)
        return F.mse_loss(model(x[:, mine], attend), y[:, mine], reduction="sum") / y.numel()

    def finalize(step):
        for p in model.parameters():   # the replicas' shares, summed over the CP group
            dist.all_reduce(p.grad)

    record(out, model, loss, lr=LR, clock=clock, shards=shards, finalize=finalize)
