"""TransformerEngine #1615 / Megatron-LM #1503 (found by TTrace): the dQ of TransformerEngine's
fused attention (``FusedAttnFunc.backward`` -> ``fused_attn_bwd``) differs from Megatron's local
attention by a relative error of 0.5 to 1.1, single card and tensor parallel alike; dK and dV
agree. The issue is open and names no cause.

Here, emulated (the cuDNN kernel needs a GPU): Megatron's TP=2 attention block on gloo
(megatron-core's ``ColumnParallelLinear`` QKV and ``RowParallelLinear`` projection) whose core
attention is a fused-style kernel with a hand-written backward; from the onset its dQ leaves out
the ``rowsum(dO * O)`` term of the softmax backward (an error of the issue's size that touches
dQ only). The healthy twin runs the same kernel with the whole formula.
"""
from __future__ import annotations

from . import _megatron, _tp_attention
from ._attention import FusedAttention
from ._harness import ONSET

NAME = "te_fused_attention_dq"
TITLE = "Fused attention backward: wrong dQ"
SOURCE = "https://github.com/NVIDIA/TransformerEngine/issues/1615"
LAYOUT = "TP=2 (Megatron): heads sharded, column-parallel QKV, row-parallel projection"
IMPLEMENTATION = ("megatron-core 0.16.1 TP layers; the attention kernel emulated with a "
                  "hand-written backward")
WORLD = _tp_attention.WORLD
MEGATRON = True   # runs megatron-core (``_megatron.load``)
TARGET = ("self_attention.linear_qkv.",)
CONTROL = "fp32"
NOTE = ("The kernel has no parameters: the error enters at the QKV projection, and the LayerNorm "
        "below it departs furthest. Replica check: the wrong dQ reaches the replicated LayerNorm "
        "through the TP all-reduce of the input gradient, equal on every rank: the copies agree.")


def single(path, control=None):
    return _tp_attention.single(path, control)


def distributed(out, buggy: bool):
    _megatron.load()
    _tp_attention.distributed(out, lambda q, k, v, off, step: FusedAttention.apply(
        q, k, v, buggy and step >= ONSET))
