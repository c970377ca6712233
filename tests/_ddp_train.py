"""Run under torchrun: a tiny DDP model on gloo with the grad probe (and, when asked, the free
benchmark) on every rank. argv: dump_path, comma-separated ranks to record ('' = all)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun_exit import finish  # noqa: E402

import probekit


def main():
    dump_path, ranks = sys.argv[1], [int(r) for r in sys.argv[2].split(",") if r]
    with_freebench = len(sys.argv) > 3 and sys.argv[3] == "freebench"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 2, generator=gen)
    probe = probekit.GradProbe(ddp, grad_level="L2", rank=ranks, dump_path=dump_path).start()
    # a threshold so small that any one-ulp move is a row (the float64 analysis that confirms a
    # finding scales its criterion alike): every checked rank writes rows
    bench = probekit.FreeBench(dump_path=dump_path, rank=ranks, pert_mode="bit_noise",
                               thresholds={"float32": 1e-12}) if with_freebench else None
    for _ in range(4):
        if bench is not None:
            bench.start()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bench is not None:
            bench.stop()
            bench.step()
    probe.stop()
    checked = bench.summary["checked"] if bench is not None else 0
    # one write() of less than PIPE_BUF bytes: the two ranks' lines never interleave
    os.write(1, f"rank {rank} done steps={probe.steps_seen} world={dist.get_world_size()} "
                f"checked={checked}\n".encode())


if __name__ == "__main__":
    main()
    finish()  # after main() returned: its models are freed before the process group
