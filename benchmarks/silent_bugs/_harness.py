"""What every reproduction of the silent-bug corpus shares: the step the bug starts at, the
recorded training loop, gloo processes, a DTensor view of Megatron-style local shards (so the grad
probe records them with their placements and the reader assembles full parameters), and the
harness's own check of replicated gradients (the ground truth the replica check will be judged
against; it is not part of probekit).

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

import hashlib
import json
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
          probe_model=None, after_step=None) -> list[float]:
    """``steps`` optimizer steps recorded by a grad probe into ``path``: ``step_fn(step)`` runs
    the forward and backward (and whatever the layout does before ``opt.step()``) and returns the
    loss. ``probe_model``: what the probe watches (default ``model``); ``after_step(step)``: run
    after each ``opt.step()``."""
    from probekit.grads import GradProbe

    losses = []
    with GradProbe(probe_model if probe_model is not None else model, dump_path=str(path),
                   control=control, flush_every=steps):
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


def record(out, model, loss_of_step, *, lr: float, clock: Clock, witness, view=None,
           finalize=None) -> None:
    """The distributed run on this rank: the loss's backward, ``finalize(step)`` (what the layout
    does to the gradients before the step: its reductions, clipping), the gradients handed to
    ``view`` (a ``ShardView``) when there is one, the witness's check; AdamW at ``lr`` steps the
    view's parameters (or the model's), the grad probe records them into ``out``."""
    opt = torch.optim.AdamW((view if view is not None else model).parameters(), lr=lr)

    def step_fn(step):
        loss = loss_of_step(step)
        loss.backward()
        if finalize is not None:
            finalize(step)
        if view is not None:
            view.pull_grads()
        witness.grads(step)
        return loss

    train(model, opt, step_fn, out, clock=clock, probe_model=view, after_step=witness.params)
    witness.write(out)


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


# -- Megatron's layout seen as DTensors -------------------------------------------------------
class ShardView(torch.nn.Module):
    """The parameters of ``model`` (whose layers hold plain local shards, as Megatron's do) as
    DTensor parameters over ``mesh`` sharing their storage: ``placements`` maps a parameter name
    to its placement (default ``Replicate()``). The optimizer steps these (updating ``model`` in
    place) and the grad probe records them: a rank records its shard with its placement, a
    replicated parameter only on mesh coordinate 0, and the reader assembles full parameters
    under the same names as the one-process reference. ``pull_grads()`` hands each local
    gradient over, after the layout's own reductions."""

    def __init__(self, model: torch.nn.Module, mesh, placements: dict | None = None):
        from torch.distributed.tensor import DTensor, Replicate

        super().__init__()
        self.mesh = mesh
        self.pairs = []
        for name, p in model.named_parameters():
            place = (placements or {}).get(name, Replicate())
            view = torch.nn.Parameter(DTensor.from_local(p.detach(), mesh, [place],
                                                         run_check=False))
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, view)
            self.pairs.append((view, p, place))

    def pull_grads(self) -> None:
        from torch.distributed.tensor import DTensor

        for view, p, place in self.pairs:
            view.grad = (None if p.grad is None else
                         DTensor.from_local(p.grad, self.mesh, [place], run_check=False))


def settle_grads(params) -> None:
    """Every DTensor gradient in its parameter's placements (a ``Partial`` gradient is reduced):
    what the optimizer's first touch would do, done on every rank before the probe reads it."""
    for p in params:
        g = p.grad
        if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(
                p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


# -- the harness's own replica check (ground truth, not probekit) ------------------------------
class ReplicaWitness:
    """Whether the copies of replicated tensors agree across ``group`` (digests of their bytes
    all-gathered), step by step: the gradients before ``opt.step()`` (``grads(step)``) and the
    parameters after it (``params(step)``). Written by the group's first rank to
    ``{out}/replicas.json``: the first step and tensor where the copies differ, or -1."""

    def __init__(self, named: dict, group=None):
        self.named, self.group = named, group
        self.first = {"step": -1, "what": "", "param": "", "ranks": []}

    def grads(self, step: int) -> None:
        self._check(step, "grad", {n: p.grad for n, p in self.named.items()})

    def params(self, step: int) -> None:
        self._check(step, "param", dict(self.named))

    def _check(self, step, what, tensors) -> None:
        if self.first["step"] >= 0:
            return
        names = sorted(n for n, t in tensors.items() if t is not None)
        mine = [_digest(tensors[n]) for n in names]
        world = dist.get_world_size(self.group)
        every = [None] * world
        dist.all_gather_object(every, mine, group=self.group)
        for i, n in enumerate(names):
            differ = sorted({r for r in range(world) if every[r][i] != every[0][i]})
            if differ:
                self.first = {"step": step, "what": what, "param": n, "ranks": [0, *differ]}
                return

    def write(self, out: str) -> None:
        if dist.get_rank(self.group) == 0:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "replicas.json"), "w") as fh:
                json.dump(self.first, fh)


def _digest(t) -> str:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return hashlib.md5(t.detach().contiguous().float().numpy().tobytes()).hexdigest()


def read_replicas(out: str) -> dict | None:
    """What ``ReplicaWitness`` wrote for the run in ``out``, or None."""
    try:
        with open(os.path.join(out, "replicas.json")) as fh:
            return json.load(fh)
    except OSError:
        return None
