"""What every reproduction of the silent-bug corpus shares: the step the bug starts at, the
recorded training loop and gloo processes. Layouts that keep plain local shards (Megatron's
tensor parallelism, data or context parallelism written by hand) declare them to the grad probe
with ``GradProbe(shards=...)`` (``probekit.grads.LocalShards``, ``megatron_shards``): it records
each rank's block with its place, the reader assembles full parameters, and probekit's replica
check compares the replicated copies (the only replica check here: ``bench_silent_bugs.py``'s
``replica_verdict`` reads it).

A reproduction module (``benchmarks/silent_bugs/<name>.py``) defines ``NAME``, ``TITLE``,
``SOURCE`` (a public link), ``LAYOUT``, ``IMPLEMENTATION`` (what runs: megatron-core, DTensor or
plain PyTorch, and what is emulated), ``WORLD`` (processes), ``MEGATRON`` (optional: True when
it runs megatron-core), ``TARGET`` (prefixes of the parameters in the buggy module; ``""`` where
the bug scales every gradient), ``CONTROL`` (the control recipe), ``NOTE`` (what the results
table says beside the measured columns), ``single(path, control)`` (the one-process fp32
reference, and with ``control`` the control run) and ``distributed(out, buggy)`` (run on every
rank of a gloo group of ``WORLD`` processes; records into ``out``; the bug on from ``ONSET``).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TESTS = os.path.join(ROOT, "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
from _control_models import Clock  # noqa: E402  (the training step a planted bug reads)
from _torchrun_exit import finish  # noqa: E402

#: the step every bug starts at, and the steps recorded
ONSET, STEPS = 3, 10


def train(model, opt, step_fn, path, *, clock: Clock, control=None, steps: int = STEPS,
          after_step=None, **probe) -> list[float]:
    """``steps`` optimizer steps recorded by a grad probe into ``path``: ``step_fn(step)`` runs
    the forward and backward (and whatever the layout does before ``opt.step()``) and returns the
    loss. ``after_step(step)``: run after each ``opt.step()``; ``probe``: more options of the
    ``GradProbe`` (``shards``, ``tied``, ``param_list``...)."""
    from probekit.grads import GradProbe

    losses = []
    with GradProbe(model, dump_path=str(path), control=control, flush_every=steps, **probe):
        for step in range(steps):
            clock.step = step
            opt.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            losses.append(float(step_fn(step).detach()))
            opt.step()
            if after_step is not None:
                after_step(step)
    return losses


def reference(model, loss_of_step, path, control=None, *, lr: float, after_backward=None):
    """The one-process run (with ``control``, the control run): AdamW at ``lr``;
    ``loss_of_step(step)`` gives the loss, ``after_backward(model, step)`` runs before the
    optimizer step (clipping)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step_fn(step):
        loss = loss_of_step(step)
        loss.backward()
        if after_backward is not None:
            after_backward(model, step)
        return loss

    return train(model, opt, step_fn, path, clock=Clock(), control=control)


def record(out, model, loss_of_step, *, lr: float, clock: Clock, finalize=None,
           **probe) -> None:
    """The distributed run on this rank: the loss's backward, ``finalize(step)`` (what the layout
    does to the gradients before the step: its reductions, clipping); AdamW at ``lr`` steps the
    model's parameters, the grad probe records them into ``out`` (``probe``: its options, e.g.
    ``shards=`` for plain local shards)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step_fn(step):
        loss = loss_of_step(step)
        loss.backward()
        if finalize is not None:
            finalize(step)
        return loss

    train(model, opt, step_fn, out, clock=clock, **probe)


def generator(step: int, salt: int = 0) -> torch.Generator:
    """The data of step ``step``: the same on every rank and in the reference."""
    return torch.Generator().manual_seed(1000 + 7919 * salt + step)


# -- processes --------------------------------------------------------------------------------
def spawn(name: str, out: str, world: int) -> None:
    """Run ``distributed(out/healthy, buggy=False)`` and then ``distributed(out/buggy,
    buggy=True)`` of reproduction ``name`` on ``world`` gloo processes (a file store, no port)."""
    import tempfile

    import torch.multiprocessing as mp

    os.makedirs(out, exist_ok=True)
    store = tempfile.mktemp(prefix="store_", dir=out)
    mp.start_processes(_child, args=(world, store, name, out), nprocs=world, join=True,
                       start_method="spawn")


def _child(rank: int, world: int, store: str, name: str, out: str) -> None:
    import importlib
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    bug = importlib.import_module(f"benchmarks.silent_bugs.{name}")
    for buggy in (False, True):
        path = os.path.join(out, "buggy" if buggy else "healthy")
        bug.distributed(path, buggy)
        dist.barrier()
    finish()  # leave together, skip the interpreter's finalization (tests/_torchrun_exit.py)


# -- DTensor layouts -----------------------------------------------------------------------------
def settle_grads(params) -> None:
    """Every DTensor gradient in its parameter's placements (a ``Partial`` gradient is reduced):
    what the optimizer's first touch would do, done on every rank before the probe reads it."""
    for p in params:
        g = p.grad
        if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(
                p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
