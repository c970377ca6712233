"""A self-attention block under Megatron's tensor parallelism (heads sharded over 2 ranks), for
the attention and clipping bugs: a replicated input projection, LayerNorm and head; Megatron's
``ColumnParallelLinear`` QKV projection (per head ``[q, k, v]``, so a rank's block of the output
is whole heads) and ``RowParallelLinear`` output projection; optionally a learnable attention
sink per head (``core_attention.softmax_offset``, head-sharded). The one-process reference is the
same model under the same names with ``nn.Linear`` layers. Tokens run ``[sequence, batch,
hidden]`` as in Megatron."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._harness import Clock, ReplicaWitness, ShardView, generator, train

T, BATCH, DIN, D, HEADS, OUT = 12, 4, 8, 32, 4, 8
HD = D // HEADS
LR = 1e-2
WORLD = 2


class Net(torch.nn.Module):
    def __init__(self, sink: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(DIN, D)
        self.input_layernorm = torch.nn.LayerNorm(D)
        with torch.no_grad():  # a LayerNorm that acts
            self.input_layernorm.weight.normal_(1.0, 0.1)
            self.input_layernorm.bias.normal_(0.0, 0.1)
        att = self.self_attention = torch.nn.Module()
        att.linear_qkv = torch.nn.Linear(D, 3 * D)
        att.linear_proj = torch.nn.Linear(D, D)
        if sink:
            att.core_attention = torch.nn.Module()
            # logits near log(T): the sinks take a good share of the attention, as trained
            # sinks do
            att.core_attention.softmax_offset = torch.nn.Parameter(
                torch.randn(HEADS) * 0.5 + math.log(T))
        self.head = torch.nn.Linear(D, OUT)


def batch(step: int):
    g = generator(step)
    return torch.randn(T, BATCH, DIN, generator=g), torch.randn(T, BATCH, OUT, generator=g)


def sdpa(q, k, v, sink=None):
    """Causal attention, ``[batch, heads, tokens, head_dim]``; ``sink``: one logit per head that
    takes part in the softmax and contributes no value."""
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2) / HD ** 0.5).masked_fill(
        torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    return torch.softmax(s, dim=-1)[..., :t] @ v


def block(model, x, qkv, proj, attend, heads: int):
    """The forward: ``qkv``/``proj`` map ``[T, B, *]`` (Megatron's layers return a pair)."""
    h = model.inp(x)
    z = qkv(model.input_layernorm(h)).view(T, BATCH, heads, 3, HD)
    z = z.permute(3, 1, 2, 0, 4)                                   # [3, B, heads, T, HD]
    o = attend(z[0], z[1], z[2]).permute(2, 0, 1, 3).reshape(T, BATCH, heads * HD)
    return model.head(h + proj(o))


def single(path, control=None, *, sink=False, after_backward=None):
    """``after_backward(model, step)``: what the loop does to the gradients before the step."""
    model = Net(sink)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    att = model.self_attention
    off = att.core_attention.softmax_offset if sink else None

    def step_fn(step):
        x, y = batch(step)
        out = block(model, x, att.linear_qkv, att.linear_proj,
                    lambda q, k, v: sdpa(q, k, v, off), HEADS)
        loss = F.mse_loss(out, y)
        loss.backward()
        if after_backward is not None:
            after_backward(model, step)
        return loss

    return train(model, opt, step_fn, path, clock=Clock(), control=control)


def distributed(out, attend, *, sink=False, after_backward=None):
    """``attend(q, k, v, offset, step)``: the core attention on this rank's heads;
    ``after_backward(model, step)``: what the layout does to the gradients before the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from . import _megatron

    rank, ref = dist.get_rank(), Net(sink)
    with _megatron.tensor_parallel(WORLD) as config:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        model = Net(sink)
        att = model.self_attention
        init = torch.nn.init.zeros_
        att.linear_qkv = ColumnParallelLinear(D, 3 * D, config=config, init_method=init,
                                              bias=True, gather_output=False)
        att.linear_proj = RowParallelLinear(D, D, config=config, init_method=init, bias=True,
                                            input_is_parallel=True, skip_bias_add=False)
        ra = ref.self_attention
        for mine, full, dim in ((att.linear_qkv.weight, ra.linear_qkv.weight, 0),
                                (att.linear_qkv.bias, ra.linear_qkv.bias, 0),
                                (att.linear_proj.weight, ra.linear_proj.weight, 1),
                                (att.linear_proj.bias, ra.linear_proj.bias, None)):
            _megatron.set_shard(mine, full, dim, rank, WORLD)
        shards = {"self_attention.linear_qkv.weight": Shard(0),
                  "self_attention.linear_qkv.bias": Shard(0),
                  "self_attention.linear_proj.weight": Shard(1)}
        off = None
        if sink:   # head-sharded, as the attention's heads
            off = torch.nn.Parameter(ra.core_attention.softmax_offset.detach().chunk(
                WORLD)[rank].clone())
            att.core_attention.softmax_offset = off
            shards["self_attention.core_attention.softmax_offset"] = Shard(0)
        view = ShardView(model, init_device_mesh("cpu", (WORLD,)), shards)
        opt = torch.optim.AdamW(view.parameters(), lr=LR)
        witness = ReplicaWitness({n: p for n, p in model.named_parameters() if n not in shards})
        clock = Clock()

        def step_fn(step):
            x, y = batch(step)
            out_ = block(model, x, lambda h: att.linear_qkv(h)[0],
                         lambda o: att.linear_proj(o)[0],
                         lambda q, k, v: attend(q, k, v, off, step), HEADS // WORLD)
            loss = F.mse_loss(out_, y)
            loss.backward()
            if after_backward is not None:
                after_backward(model, step)
            view.pull_grads()
            witness.grads(step)
            return loss

        train(model, opt, step_fn, out, clock=clock, probe_model=view,
              after_step=witness.params)
        witness.write(out)
