"""Run under torchrun (gloo, CPU): an FSDP2 job that is killed and resumed from its checkpoint.

argv: the store's dump_path, the checkpoint folder, then ``full`` (train steps 0..STEPS-1
without interruption), ``killed`` (save a checkpoint after step CKPT-1, record on to step
KILL-1, commit, then rank 0 dies of SIGKILL: torchrun ends the others) or ``resume`` (load the
checkpoint, at any world size, and train on from step CKPT; the probe takes its first step from
the optimizer's restored step count).

Every rank trains on the same batch of each step, so the gradients are those of one process on
it, whatever the world size (the comparison's rounding aside).
"""
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun_exit import finish  # noqa: E402

STEPS, CKPT, KILL = 6, 3, 5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU())
                                 for _ in range(3)], torch.nn.Linear(12, 3))


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)


def main():
    from datetime import timedelta

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from probekit.grads import GradProbe

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dump, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    model = make_model()
    for block in list(model)[:3]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = 0
    if mode == "resume":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        first = CKPT
    probe = GradProbe(model, grad_level="L2", dump_path=dump, flush_every=2).start()
    for step in range(first, STEPS):
        if mode == "killed" and step == KILL:
            probe.flush()  # steps 0..KILL-1 committed on every rank
            dist.barrier()
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()  # the others wait here until torchrun ends them
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if mode == "killed" and step == CKPT - 1:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    probe.stop()
    os.write(1, f"rank {dist.get_rank()} done\n".encode())


if __name__ == "__main__":
    main()
    finish()
