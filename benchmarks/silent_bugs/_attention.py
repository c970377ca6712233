"""Causal attention with a hand-written backward, as the fused kernels compute it: the forward
keeps the log-sum-exp of each query row, the backward rebuilds the probabilities block by block
from it (``dS = P * (dP - rowsum(dO * O))``). The emulated kernel bugs of TransformerEngine
#1557 and #1615 are switches of this backward; the one-process references use
``F.scaled_dot_product_attention``. Shapes ``[batch, heads, tokens, head_dim]``.
"""
from __future__ import annotations

import math

import torch


def _scores(q, k, q0: int, k0: int):
    """Scaled scores of queries at positions ``q0...`` against keys at ``k0...``, causal."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    qi = torch.arange(q0, q0 + q.shape[-2]).unsqueeze(-1)
    ki = torch.arange(k0, k0 + k.shape[-2]).unsqueeze(0)
    return s.masked_fill(ki > qi, float("-inf"))


def forward_blocks(q, blocks, q0: int):
    """Attention of ``q`` (starting at position ``q0``) over the key/value blocks ``[(k, v,
    k0), ...]``: the output and the row log-sum-exp."""
    scores = [_scores(q, k, q0, k0) for k, v, k0 in blocks]
    lse = torch.logsumexp(torch.cat(scores, dim=-1), dim=-1, keepdim=True)
    out = sum(torch.exp(s - lse) @ v for s, (k, v, k0) in zip(scores, blocks))
    return out, lse


def backward_blocks(q, blocks, q0: int, out, lse, dout, *, grad_blocks=None, drop_delta=False):
    """The gradients of ``forward_blocks``: ``dq`` and ``[(dk, dv), ...]`` per block. The
    probabilities of block ``i`` are rebuilt from ``grad_blocks[i]`` (default: ``blocks``: a
    kernel reading another buffer than the forward read passes others); ``drop_delta``: ``dq``
    leaves out the ``rowsum(dO * O)`` term of the softmax's backward."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    dkv = []
    for k, v, k0 in (grad_blocks or blocks):
        p = torch.exp(_scores(q, k, q0, k0) - lse)
        dp = dout @ v.transpose(-1, -2)
        ds = p * (dp - delta)
        dq = dq + (p * dp if drop_delta else ds) @ k * scale
        dkv.append((ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout))
    return dq, dkv


class FusedAttention(torch.autograd.Function):
    """Causal attention on whole sequences; ``drop_delta``: the emulated dQ error."""

    @staticmethod
    def forward(ctx, q, k, v, drop_delta: bool):
        out, lse = forward_blocks(q, [(k, v, 0)], 0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.drop_delta = drop_delta
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, [(dk, dv)] = backward_blocks(q, [(k, v, 0)], 0, out, lse, dout,
                                         drop_delta=ctx.drop_delta)
        return dq, dk, dv, None
