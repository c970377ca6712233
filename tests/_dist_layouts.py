"""Run under torchrun (gloo): the grad probe under several parallel layouts of one tiny model.

argv: output folder, then the layouts to run, in order: ``fsdp2``, ``ddp``, ``ddp_all`` (DDP with
``rank=[every rank]``: msprobe's filter, every rank writes), ``tp`` (tensor parallel: colwise /
rowwise Linear layers), ``hsdp`` (4 ranks: 2 replicas x 2 shards), ``crash`` (FSDP2; the last
rank kills itself in the middle of step 2, after its backward, before its optimizer step),
``fsdp2_dp`` (FSDP2 with each rank on its own slice of the batch, an attention model).

Every rank trains on the same batch, so the gradients are those of a single process on it
(``make_model``, ``batches``, ``train_single``). Each layout's store is ``{out}/{layout}``; a
line ``rank R LAYOUT collectives plain=N probe=M`` gives the gloo collectives of one profiled
step without and with the probe.
"""
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun_exit import finish  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU())
                                 for _ in range(3)], torch.nn.Linear(12, 3))


def batches(steps=4):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen))
            for _ in range(steps)]


def train_single(path, steps=4):
    """The reference: one process, the same model and batches."""
    from probekit.grads import GradProbe

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradProbe(model, grad_level="L2", dump_path=str(path),
                   flush_every=1):
        for x, y in batches(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


class Attention(torch.nn.Module):
    """Causal self-attention with a fused QKV projection (GPT-2) or separate ones (BERT): the
    key bias's gradient is mathematically zero (softmax ignores it), so its signs are rounding
    noise, which differs with the order of the ranks' sums."""

    def __init__(self, d=16, heads=2, fused=True):
        super().__init__()
        self.heads, self.fused = heads, fused
        if fused:
            self.qkv = torch.nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.proj = torch.nn.Linear(d, d)
        for p in self.parameters():
            if p.dim() == 1:
                torch.nn.init.normal_(p, std=0.02)  # non-zero biases: the key bias acts

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (self.qkv(x).split(d, dim=2) if self.fused
                   else (self.q(x), self.k(x), self.v(x)))
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


def make_attention_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Attention(fused=True), Attention(fused=False),
                               torch.nn.Linear(16, 5))


def attention_data(steps=3, batch=8):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 6, 16, generator=gen), torch.randn(batch, 6, 5, generator=gen))
            for _ in range(steps)]


def run_data_parallel(path):
    """FSDP2 with real data parallelism: each rank trains on its slice of the batch, so the
    gradient is the whole batch's, summed in an order that depends on the number of ranks."""
    from torch.distributed.fsdp import fully_shard

    from probekit.grads import GradProbe

    model = make_attention_model()
    for block in list(model)[:2]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    with GradProbe(model, dump_path=path, flush_every=1):
        for x, y in attention_data():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
            opt.step()


def wrap(layout):
    model = make_model()
    world = dist.get_world_size()
    if layout in ("fsdp2", "crash", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if layout == "hsdp" else None)
        for block in list(model)[:3]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if layout in ("ddp", "ddp_all"):
        return torch.nn.parallel.DistributedDataParallel(model)
    if layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (world,))
        return parallelize_module(model, mesh, {"0.0": ColwiseParallel(),
                                                "1.0": RowwiseParallel(),
                                                "2.0": ColwiseParallel(), "3": RowwiseParallel()})
    raise SystemExit(f"unknown layout {layout!r}")


def run(layout, path, probe):
    from torch.profiler import profile

    from probekit.grads import GradProbe

    model = wrap(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ranks = list(range(dist.get_world_size())) if layout == "ddp_all" else None
    gp = (GradProbe(model, grad_level="L2", dump_path=path, rank=ranks,
                    flush_every=1).start() if probe else None)
    data = batches()
    collectives = 0
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        if step == len(data) - 1:
            with profile() as prof:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            collectives = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
            continue
        torch.nn.functional.mse_loss(model(x), y).backward()
        if layout == "crash" and step == 2 and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after backward, before step()
        opt.step()
    if gp is not None:
        gp.stop()
    if probe and layout in ("fsdp2", "tp", "hsdp"):
        check_amax(model, layout)
    return collectives


def check_amax(model, layout):
    """placement.amax_reducer (one all-reduce per mesh group) against the gathered gradients."""
    from probekit.grads.record.placement import amax_reducer, dtensor_placement

    params = [p for p in model.parameters() if p.grad is not None]
    places = [dtensor_placement(p) for p in params]
    local = torch.tensor([float(p.grad.to_local().abs().max()) if p.grad.to_local().numel()
                          else 0.0 for p in params], dtype=torch.float64)
    amax = amax_reducer(params, places)(local).tolist()
    full = [float(p.grad.full_tensor().abs().max()) for p in params]
    ok = all(a == f for a, f in zip(amax, full))
    os.write(1, f"rank {dist.get_rank()} {layout} amax ok={ok}\n".encode())


def main():
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out, layouts = sys.argv[1], sys.argv[2:]
    rank = dist.get_rank()
    for layout in layouts:
        if layout == "fsdp2_dp":
            run_data_parallel(os.path.join(out, layout))
            continue
        if layout == "crash":  # the last one: a rank dies, torchrun ends the others
            run(layout, os.path.join(out, layout), True)
            continue
        plain = run(layout, os.path.join(out, layout + "_plain"), False)
        probed = run(layout, os.path.join(out, layout), True)
        os.write(1, f"rank {rank} {layout} collectives plain={plain} probe={probed}\n".encode())


if __name__ == "__main__":
    main()
    finish()  # after main() returned: its models are freed before the process group
