"""Hugging Face transformers #34191 (the gradient-accumulation loss bug): with gradient
accumulation the Trainer averaged each micro-batch's loss over that micro-batch's tokens and
then over the micro-batches, so the tokens of a short (mostly padded) micro-batch weighed more
than those of a long one: the accumulated gradient is not the big batch's. The fix passes
``num_items_in_batch`` (the valid tokens of all the accumulated micro-batches, summed over the
data-parallel ranks) and divides the summed loss by it.

Here: DDP over 2 gloo ranks, 2 accumulated micro-batches per rank (``no_sync`` on the first),
a tiny causal LM whose micro-batches hold between 3 and 32 valid tokens (labels -100 on the
padding); healthy and before the onset the fixed loss, from the onset the old one. The reference
is one process on all four micro-batches at once: the mean over every valid token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import ONSET, Clock, generator, reference, train

NAME = "hf_grad_accum"
TITLE = "Gradient accumulation averages per micro-batch, not per token"
SOURCE = "https://github.com/huggingface/transformers/issues/34191"
LAYOUT = "DDP=2, 2 accumulated micro-batches per rank, padded sequences"
IMPLEMENTATION = "plain PyTorch DDP; the Trainer's loss normalisation before and after the fix"
WORLD = 2
TARGET = ("",)   # the loss: every gradient is the sum it weighs
CONTROL = "fp32"
NOTE = ("Replica check: every rank normalises the same wrong way and DDP averages the result, "
        "so the replicas agree; only a reference sees it.")

VOCAB, D, SEQ, ROWS, ACCUM = 32, 16, 16, 2, 2
LR = 1e-2


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.body = torch.nn.Linear(D, D)
        self.lm_head = torch.nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.body(self.embed(ids))))


def micro_batches(step: int):
    """The step's ``WORLD * ACCUM`` micro-batches ``(ids, labels)``, rank-major: a long and a
    short one on each rank."""
    g = generator(step)
    out = []
    for i in range(WORLD * ACCUM):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.roll(-1, dims=1)
        lo, hi = (12, SEQ) if i % 2 == 0 else (1, 3)
        valid = torch.randint(lo, hi + 1, (ROWS,), generator=g)
        labels[torch.arange(SEQ).unsqueeze(0) >= valid.unsqueeze(1)] = -100
        out.append((ids, labels))
    return out


def token_losses(model, ids, labels):
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def single(path, control=None):
    model = LM()

    def loss(step):
        mbs = micro_batches(step)
        ids, labels = torch.cat([m[0] for m in mbs]), torch.cat([m[1] for m in mbs])
        return token_losses(model, ids, labels) / (labels != -100).sum()

    return reference(model, loss, path, control, lr=LR)


def distributed(out, buggy: bool):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = LM()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)

    def step_fn(step):
        mine = micro_batches(step)[rank * ACCUM:(rank + 1) * ACCUM]
        items = torch.tensor(sum(int((m[1] != -100).sum()) for m in mine))
        dist.all_reduce(items)                     # num_items_in_batch over the ranks
        total = 0.0
        for i, (ids, labels) in enumerate(mine):
            if buggy and step >= ONSET:            # the old Trainer: a mean per micro-batch
                loss = token_losses(ddp, ids, labels) / (labels != -100).sum() / ACCUM
            else:                                  # DDP averages: times the world size
                loss = token_losses(ddp, ids, labels) / items * WORLD
            if i < ACCUM - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += float(loss.detach())
        return torch.tensor(total)

    train(ddp, opt, step_fn, out, clock=Clock())
