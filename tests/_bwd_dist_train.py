"""Run under torchrun (gloo): the free benchmark's backward stage under DDP and under FSDP2.
argv: dump_path. Per rank and wrapper it prints whether the losses equal those of the same run
without the probe (bit for bit), the checked calls, the rows, and how many backward checks took
the training's own input gradients as their reference (``realgrad``)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun_exit import finish  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU())
                                 for _ in range(3)], torch.nn.Linear(12, 3))


def run(kind, dump_path):
    import probekit

    model = make_model()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in list(model)[:3]:
            fully_shard(block)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    fb = None if dump_path is None else probekit.FreeBench(
        dump_path=dump_path, pert_mode="improve_precision", fuzz_stage="backward")
    losses = []
    for _ in range(3):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
        if fb is not None:
            fb.start()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if fb is not None:
            fb.stop()
            fb.step()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, fb


def main():
    from probekit.freebench.engine import backward

    real = []
    with_real = backward._BackwardCheck.with_real

    def counting(self, grads):
        real.append(self.name)
        return with_real(self, grads)

    backward._BackwardCheck.with_real = counting
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for kind in ("ddp", "fsdp2"):
        plain, _ = run(kind, None)
        real.clear()
        probed, fb = run(kind, os.path.join(sys.argv[1], kind))
        same = all(torch.equal(a, b) for a, b in zip(plain, probed))
        os.write(1, f"rank {rank} {kind} same_loss={same} checked={fb.summary['checked']} "
                    f"rows={len(fb.results)} real={len(real)}\n".encode())


if __name__ == "__main__":
    main()
    finish()  # after main() returned: its models are freed before the process group
