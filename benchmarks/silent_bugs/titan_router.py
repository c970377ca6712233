"""torchtitan #2387: under tensor parallelism the MoE router (``NoParallel``: its weight
replicated over the TP mesh) hands its scores to the experts with ``to_local()`` and no
``grad_placements``. The experts' weights are TP-sharded local tensors, so the gradient flowing
back into the scores is one rank's share of a sum; declared ``Replicate``, it is never reduced:
each rank's router weight gets its own partial gradient and the copies part after the first step.
The fix: ``to_local(grad_placements=(Partial(),))``.

Here: DTensor on a 2-rank gloo mesh, a torchtitan-shaped MoE block (replicated input projection,
router and head; two experts whose ``w1``/``w2`` are column/row sharded, the router scores applied
before the experts as torchtitan's ``score_before_experts``), every token routed to every expert
with its softmax weight (no top-k, so the reference has no ties to break).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import ONSET, Clock, generator, record, reference, settle_grads

NAME = "titan_router"
TITLE = "MoE router under TP: to_local() without Partial grad placements"
SOURCE = "https://github.com/pytorch/torchtitan/issues/2387"
LAYOUT = "TP=2 (DTensor): router replicated, experts column/row sharded"
IMPLEMENTATION = "DTensor (torch.distributed.tensor), torchtitan's boundary in a small MoE block"
WORLD = 2
TARGET = ("router.",)
CONTROL = "fp32"
NOTE = ("Each rank's router copy holds its own partial gradient: rank 0's recorded copy is "
        "wrong (the comparison) and differs from rank 1's (the replica check).")

D, H, E, N, OUT = 16, 32, 2, 24, 4
LR = 1e-2


class MoE(torch.nn.Module):
    """The one-process model, and the parameter layout the TP run shares."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(E, H, D) / D ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, D, H) / H ** 0.5)
        self.head = torch.nn.Linear(D, OUT)

    def forward(self, x):
        h = self.inp(x)
        scores = torch.softmax(self.router(h), dim=-1)
        y = experts(h, scores, self.w1, self.w2)
        return self.head(h + y)


def experts(h, scores, w1, w2):
    """Every expert on every token, its input scaled by the token's score (local tensors)."""
    y = 0
    for e in range(w1.shape[0]):
        y = y + F.gelu((h * scores[:, e:e + 1]) @ w1[e].t()) @ w2[e].t()
    return y


def batch(step: int):
    g = generator(step)
    return torch.randn(N, D, generator=g), torch.randn(N, OUT, generator=g)


def single(path, control=None):
    model = MoE()

    def loss(step):
        x, y = batch(step)
        return F.mse_loss(model(x), y)

    return reference(model, loss, path, control, lr=LR)


def distributed(out, buggy: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    model = MoE()
    shard = {"w1": Shard(1), "w2": Shard(2)}
    for name, p in list(model.named_parameters()):
        owner, leaf = (model, name) if "." not in name else (
            model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
        owner.register_parameter(leaf, torch.nn.Parameter(
            distribute_tensor(p.detach(), mesh, [shard.get(name, Replicate())])))
    clock = Clock()
    rep = lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)  # noqa: E731

    def forward(x):
        h = model.inp(rep(x))                                        # Replicate
        scores = torch.softmax(model.router(h), dim=-1)
        bug = buggy and clock.step >= ONSET
        scores = (scores.to_local() if bug  # the bug: the partial gradient passes as final
                  else scores.to_local(grad_placements=(Partial(),)))
        y = experts(h.to_local(grad_placements=(Partial(),)), scores,
                    model.w1.to_local(), model.w2.to_local())         # a partial sum per rank
        y = DTensor.from_local(y, mesh, [Partial()]).redistribute(mesh, [Replicate()])
        return model.head(h + y)

    def loss(step):
        x, y = batch(step)
        return F.mse_loss(forward(x), rep(y)).to_local()

    record(out, model, loss, lr=LR, clock=clock,
           finalize=lambda step: settle_grads(model.parameters()))
