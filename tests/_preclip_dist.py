"""Run under torchrun (gloo, 2 ranks): gradients before and after clipping under DDP and FSDP2,
with accumulation over 2 micro-batches (the first without gradient sync: DDP's ``no_sync``,
FSDP2's ``set_requires_gradient_sync(False)``) and ``clip_grad_norm_`` before every step.

argv: output folder, then layouts (``ddp``, ``fsdp2``). Every rank trains on its own batches, so
the all-reduced gradient differs from each rank's local one. For each layout and grad point
(``step``, ``backward``) the store is ``{out}/{layout}_{point}`` and rank 0 prints one line
``LAYOUT POINT passes=(P, S) norms=[...] losses=[...]``: with ``grad_point="backward"`` the
backward passes whose statistics were computed (P) and skipped (S: DDP's unsynchronised ones),
the total norms ``clip_grad_norm_`` returned (of the synchronised gradients, before clipping)
and the losses, as ``repr`` floats.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun_exit import finish  # noqa: E402

MAX_NORM = 0.05
STEPS = 3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU())
                                 for _ in range(2)], torch.nn.Linear(12, 3))


def wrap(layout):
    model = make_model()
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in list(model)[:2]:
        fully_shard(block)
    fully_shard(model)
    return model


def no_sync(model, layout):
    if layout == "ddp":
        return model.no_sync()
    import contextlib

    model.set_requires_gradient_sync(False)

    @contextlib.contextmanager
    def resync():
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return resync()


def run(layout, point, path):
    from probekit.grads import GradProbe

    model = wrap(layout)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    norms, losses = [], []
    with GradProbe(model, grad_level="L2", dump_path=path, grad_point=point,
                   flush_every=1) as probe:
        for _ in range(STEPS):
            for micro in range(2):
                x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
                if micro == 0:
                    with no_sync(model, layout):
                        loss = torch.nn.functional.mse_loss(model(x), y) / 2
                        loss.backward()
                else:
                    loss = torch.nn.functional.mse_loss(model(x), y) / 2
                    loss.backward()
                losses.append(loss.item())
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if hasattr(total, "full_tensor"):
                total = total.full_tensor()
            norms.append(float(total))
            opt.step()
            opt.zero_grad()
    if dist.get_rank() == 0:
        tap = probe._tap
        passes = (tap.passes, tap.skipped) if tap is not None else None
        os.write(1, f"{layout} {point} passes={passes} norms={norms!r} losses={losses!r}\n"
                 .encode())


def main():
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out, layouts = sys.argv[1], sys.argv[2:]
    for layout in layouts:
        for point in ("step", "backward"):
            run(layout, point, os.path.join(out, f"{layout}_{point}"))


if __name__ == "__main__":
    main()
    finish()  # after main() returned: its models are freed before the process group
