"""Run under torchrun (gloo, 2 ranks): layouts whose replicas must agree, healthy and with a bug.

argv: output folder, then layouts, in order (each store is ``{out}/{layout}``):

* ``ddp``, ``ddp_bad``: DDP; in ``ddp_bad`` rank 1 scales its gradients by 1.5 after the
  all-reduce from step 2 on (a bug that leaves rank 0 right: the gradients differ at step 2, the
  parameters from step 3);
* ``tp``, ``tp_bad``: tensor parallel with sequence parallelism: each rank holds half the
  sequence; a ``LayerNorm`` under torch's ``SequenceParallel`` (its gradient a ``Partial``
  DTensor, reduced by the optimizer's ops) and a hand-written norm ``final_norm`` whose weight is
  a DTensor ``Replicate`` used through ``to_local()``: with ``grad_placements=[Partial()]`` its
  gradient is reduced (``tp``), without (``tp_bad``, Megatron-LM #1446: a final LayerNorm's
  gradient not all-reduced across TP under sequence parallelism) each rank keeps its own half's;
* ``pp``, ``pp_bad``: two pipeline stages (rank 0: ``embed``, ``layers.0``; rank 1: its own
  ``layers.0``, recorded as ``layers.1`` through ``rename=layer_offset(1)``, and ``head``, whose
  weight is tied to ``embed``'s: ``tied=[["embed.weight", "head.weight"]]``); the tied gradients
  are all-reduced between the stages, except in ``pp_bad``;
* ``pp_local``: ``pp`` without ``rename`` (stage-local layer names in the store);
* ``copies``: an unwrapped model on each rank, every rank recording a full copy;
* ``mtp``, ``mtp_bad``: Megatron-style tensor parallelism on plain tensors: a replicated input
  projection and norm, a column-parallel ``fc`` (each rank its rows) and a row-parallel
  ``proj`` (its columns; its bias replicated), the sharded ones marked as Megatron marks them
  (``tensor_model_parallel``, ``partition_dim``) and declared by ``megatron_shards(model,
  group)``; Megatron's two mappings (the input's gradient all-reduced over TP, the partial
  output all-reduced); in ``mtp_bad`` the input's gradient is not all-reduced from step 1, so
  the replicated parameters below ``fc`` keep each rank's partial gradient.

``single(out)`` records the one-process references of ``tp``, ``pp``, ``copies`` and ``mtp``
(``{out}/tp_single``, ...).
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 4
D, SEQ, VOCAB = 8, 6, 16


def data(steps=STEPS):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(4, SEQ, D, generator=gen), torch.randn(4, SEQ, D, generator=gen))
            for _ in range(steps)]


# -- DDP ----------------------------------------------------------------------------------------
def run_ddp(path, bad):
    from probekit.grads import GradProbe

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.GELU(), torch.nn.Linear(D, D)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    with GradProbe(model, dump_path=path, flush_every=1):
        for step, (x, y) in enumerate(data()):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank::2]), y[rank::2]).backward()
            if bad and rank == 1 and step >= 2:
                for p in model.parameters():
                    p.grad.mul_(1.5)
            opt.step()


# -- tensor parallel, sequence parallel ------------------------------------------------------------
class Norm(torch.nn.Module):
    """A scale-only norm whose weight is a DTensor replicated over the TP mesh, applied to each
    rank's half of the sequence through ``to_local()``."""

    def __init__(self, mesh, reduced: bool):
        from torch.distributed.tensor import Replicate, distribute_tensor

        super().__init__()
        self.weight = torch.nn.Parameter(distribute_tensor(torch.ones(D), mesh, [Replicate()]))
        self.reduced = reduced

    def forward(self, x):
        from torch.distributed.tensor import Partial

        w = (self.weight.to_local(grad_placements=[Partial()]) if self.reduced
             else self.weight.to_local())
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class SeqModel(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.proj = torch.nn.Linear(D, D)
        self.final_norm = norm

    def forward(self, x):
        h = self.ln(x)
        h = h.to_local() if hasattr(h, "to_local") else h
        return self.final_norm(self.proj(h))


class PlainNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def run_tp(path, bad):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from probekit.grads import GradProbe

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = SeqModel(Norm(mesh, reduced=not bad))
    parallelize_module(model.ln, mesh, SequenceParallel())
    # proj replicated too (its gradient a pending reduction, like the LayerNorm's)
    model.proj.weight = torch.nn.Parameter(distribute_tensor(model.proj.weight.data, mesh,
                                                             [Replicate()]))
    model.proj.bias = torch.nn.Parameter(distribute_tensor(model.proj.bias.data, mesh,
                                                           [Replicate()]))
    proj = model.proj

    def proj_forward(x):
        from torch.distributed.tensor import Partial

        w = proj.weight.to_local(grad_placements=[Partial()])
        b = proj.bias.to_local(grad_placements=[Partial()])
        return torch.nn.functional.linear(x, w, b)

    proj.forward = proj_forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    half = SEQ // 2
    from torch.distributed.tensor import DTensor

    with GradProbe(model, dump_path=path, flush_every=1):
        for x, y in data():
            opt.zero_grad()
            xl = DTensor.from_local(x[:, rank * half:(rank + 1) * half], mesh, [Shard(1)])
            out = model(xl)
            loss = torch.nn.functional.mse_loss(out, y[:, rank * half:(rank + 1) * half],
                                                reduction="sum") / y.numel()
            loss.backward()
            opt.step()


def tp_single(path):
    """The one-process reference of ``tp``: the whole sequence, plain parameters."""
    from probekit.grads import GradProbe

    torch.manual_seed(0)
    model = SeqModel(PlainNorm())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradProbe(model, dump_path=path, flush_every=1):
        for x, y in data():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / y.numel()
            loss.backward()
            opt.step()


# -- pipeline parallel, tied embedding ----------------------------------------------------------
class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D)])

    def forward(self, tokens):
        return torch.tanh(self.layers[0](self.embed(tokens)))


class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D)])
        self.head = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, h):
        return self.head(torch.tanh(self.layers[0](h)))


class Whole(torch.nn.Module):
    """The one-process model of ``pp``: the same modules, the head tied to the embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        s0 = Stage0()
        torch.manual_seed(1)
        s1 = Stage1()
        self.embed = s0.embed
        self.layers = torch.nn.ModuleList([s0.layers[0], s1.layers[0]])
        self.head = s1.head
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = torch.tanh(self.layers[0](self.embed(tokens)))
        return self.head(torch.tanh(self.layers[1](h)))


def tokens(steps=STEPS):
    gen = torch.Generator().manual_seed(4)
    return [(torch.randint(0, VOCAB, (4, SEQ), generator=gen),
             torch.randint(0, VOCAB, (4, SEQ), generator=gen)) for _ in range(steps)]


def run_pp(path, bad=False, rename=True):
    from probekit.grads import GradProbe, layer_offset

    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = Stage0() if rank == 0 else Stage1()
    tied = stage.embed.weight if rank == 0 else stage.head.weight
    if rank == 1:  # the tied copy starts as the embedding does
        torch.manual_seed(0)
        tied.data.copy_(Stage0().embed.weight.data)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    probe = GradProbe(stage, dump_path=path, flush_every=1,
                      tied=[["embed.weight", "head.weight"]],
                      rename=layer_offset(rank) if rename else None)
    with probe:
        for x, y in tokens():
            opt.zero_grad()
            if rank == 0:
                h = stage(x)
                dist.send(h.detach(), 1)
                grad = torch.empty_like(h)
                dist.recv(grad, 1)
                h.backward(grad)
            else:
                h = torch.empty(4, SEQ, D)
                dist.recv(h, 0)
                h.requires_grad_(True)
                loss = torch.nn.functional.cross_entropy(stage(h).reshape(-1, VOCAB),
                                                         y.reshape(-1))
                loss.backward()
                dist.send(h.grad, 0)
            if not bad:
                dist.all_reduce(tied.grad)  # the tied copies' gradients summed
            opt.step()


def pp_single(path):
    from probekit.grads import GradProbe

    model = Whole()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradProbe(model, dump_path=path, flush_every=1):
        for x, y in tokens():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB),
                                              y.reshape(-1)).backward()
            opt.step()


def run_copies(path):
    from probekit.grads import GradProbe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.GELU(), torch.nn.Linear(D, D))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradProbe(model, dump_path=path, flush_every=1):
        for x, y in data():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def copies_single(path):
    run_copies(path)


# -- Megatron-style tensor parallelism on plain tensors -----------------------------------------
class MegatronLike(torch.nn.Module):
    """``inp`` and ``norm`` replicated, ``fc`` (D -> 2D) column-parallel, ``proj`` (2D -> D)
    row-parallel; ``world`` 1: the one-process model."""

    def __init__(self, world=1, rank=0):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D, D)
        self.norm = PlainNorm()
        self.fc = torch.nn.Linear(D, 2 * D)
        self.proj = torch.nn.Linear(2 * D, D)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)
        if world > 1:
            fc, proj = self.fc, self.proj
            self.fc = torch.nn.Linear(D, 2 * D // world)
            self.proj = torch.nn.Linear(2 * D // world, D)
            with torch.no_grad():
                self.fc.weight.copy_(fc.weight.chunk(world, 0)[rank])
                self.fc.bias.copy_(fc.bias.chunk(world, 0)[rank])
                self.proj.weight.copy_(proj.weight.chunk(world, 1)[rank])
                self.proj.bias.copy_(proj.bias)
            for p, dim in ((self.fc.weight, 0), (self.fc.bias, 0), (self.proj.weight, 1)):
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region``: identity forward, the gradient
    all-reduced backward (not, when ``skip``)."""

    @staticmethod
    def forward(ctx, x, skip):
        ctx.skip = skip
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        if not ctx.skip:
            dist.all_reduce(g)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity
    backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _mtp_forward(model, x, world, skip=False):
    h = model.norm(model.inp(x))
    if world > 1:
        h = _CopyToTP.apply(h, skip)
    a = torch.nn.functional.gelu(model.fc(h))
    if world == 1:
        return model.proj(a)
    y = _ReduceFromTP.apply(a @ model.proj.weight.t())
    return y + model.proj.bias


def run_mtp(path, bad):
    from probekit.grads import GradProbe, megatron_shards

    world = dist.get_world_size()
    model = MegatronLike(world, dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradProbe(model, dump_path=path, flush_every=1,
                   shards=megatron_shards(model, dist.group.WORLD)):
        for step, (x, y) in enumerate(data()):
            opt.zero_grad()
            out = _mtp_forward(model, x, world, skip=bad and step >= 1)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()


def mtp_errors(path):
    """What a bad declaration says (``{path}/errors.json``: one message per case)."""
    import json

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Shard

    from probekit.grads import GradProbe, LocalShards, megatron_shards

    model = MegatronLike(dist.get_world_size(), dist.get_rank())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("tp",))
    cases = {
        "unknown": lambda: GradProbe(model, dump_path=path,
                                     shards=LocalShards(mesh, {"fc.wieght": Shard(0)})),
        "dim": lambda: GradProbe(model, dump_path=path,
                                 shards=LocalShards(mesh, {"fc.bias": Shard(1)})),
        "partial": lambda: LocalShards(mesh, {"fc.weight": Partial()}),
        "type": lambda: GradProbe(model, dump_path=path, shards={"fc.weight": Shard(0)}),
    }
    model.fc.weight.partition_stride = 2
    cases["stride"] = lambda: megatron_shards(model, dist.group.WORLD)
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 (the message is what is tested)
            out[name] = f"{type(exc).__name__}: {exc}"
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "errors.json"), "w") as fh:
            json.dump(out, fh)


def mtp_single(path):
    from probekit.grads import GradProbe

    model = MegatronLike()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradProbe(model, dump_path=path, flush_every=1):
        for x, y in data():
            opt.zero_grad()
            torch.nn.functional.mse_loss(_mtp_forward(model, x, 1), y).backward()
            opt.step()


LAYOUTS = {"ddp": lambda p: run_ddp(p, False), "ddp_bad": lambda p: run_ddp(p, True),
           "tp": lambda p: run_tp(p, False), "tp_bad": lambda p: run_tp(p, True),
           "pp": lambda p: run_pp(p), "pp_bad": lambda p: run_pp(p, bad=True),
           "pp_local": lambda p: run_pp(p, rename=False), "copies": run_copies,
           "mtp": lambda p: run_mtp(p, False), "mtp_bad": lambda p: run_mtp(p, True),
           "mtp_errors": mtp_errors}


def single(out):
    tp_single(os.path.join(out, "tp_single"))
    pp_single(os.path.join(out, "pp_single"))
    copies_single(os.path.join(out, "copies_single"))
    mtp_single(os.path.join(out, "mtp_single"))


def main():
    from datetime import timedelta

    from _torchrun_exit import finish

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out, layouts = sys.argv[1], sys.argv[2:]
    for layout in layouts:
        LAYOUTS[layout](os.path.join(out, layout))
    finish()


if __name__ == "__main__":
    main()
