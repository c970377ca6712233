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

from ._harness import Clock, generator, record, reference

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
    att = model.self_attention
    off = att.core_attention.softmax_offset if sink else None

    def loss(step):
        x, y = batch(step)
        return F.mse_loss(block(model, x, att.linear_qkv, att.linear_proj,
                                lambda q, k, v: sdpa(q, k, v, off), HEADS), y)

    return reference(model, loss, path, control, lr=LR, after_backward=after_backward)


def distributed(out, attend, *, sink=False, after_backward=None):
    """``attend(q, k, v, offset, step)``: the core attention on this rank's heads;
    ``after_backward(model, step)``: what the layout does to the gradients before the step."""
    from megatron.core import parallel_state as ps
    from torch.distributed.tensor import Shard

    from . import _megatron

    ref = Net(sink)
    with _megatron.tensor_parallel(WORLD) as config:
        model = Net(sink)
        att, ra = model.self_attention, ref.self_attention
        att.linear_qkv = _megatron.column(ra.linear_qkv, config, gather_output=False)
        att.linear_proj = _megatron.row(ra.linear_proj, config)
        off, extra = None, {}
        if sink:   # head-sharded, as the attention's heads
            rank = ps.get_tensor_model_parallel_rank()
            off = torch.nn.Parameter(ra.core_attention.softmax_offset.detach().chunk(
                WORLD)[rank].clone())
            att.core_attention.softmax_offset = off
            extra["self_attention.core_attention.softmax_offset"] = Shard(0)
        shards = _megatron.shards(model, extra)
        clock = Clock()

        def loss(step):
            x, y = batch(step)
            return F.mse_loss(block(model, x, lambda h: att.linear_qkv(h)[0],
                                    lambda o: att.linear_proj(o)[0],
                                    lambda q, k, v: attend(q, k, v, off, step),
                                    HEADS // WORLD), y)

        record(out, model, loss, lr=LR, clock=clock, shards=shards,
               finalize=None if after_backward is None else (
                   lambda step: after_backward(model, step)))
