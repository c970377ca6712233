"""Run under torchrun (gloo): FSDP2 (fully_shard on each block and the model) with the grad probe.
argv: dump_path of run a, of run b, of run c (c records rank 1 only: rank 0 still joins the
gathers). Every rank trains on the same batch, so the
gradients equal those of a single process on that batch (see make_model / batches)."""
import sys

import torch
import torch.distributed as dist


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU())
                                 for _ in range(3)], torch.nn.Linear(12, 3))


def batches(steps=3):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen))
            for _ in range(steps)]


def train(model, probe_path, ranks=None):
    from probekit.grads import GradProbe

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradProbe(model, grad_level="L2", dump_path=probe_path, rank=ranks):
        for x, y in batches():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def main():
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    for path, ranks in zip(sys.argv[1:4], (None, None, [1])):
        model = make_model()
        for block in list(model)[:3]:
            fully_shard(block)
        fully_shard(model)
        train(model, path, ranks)
    print(f"rank {dist.get_rank()} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
