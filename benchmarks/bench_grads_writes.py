"""Grad probe: what the writes cost, over the hook alone (issue 38).

    python benchmarks/bench_grads_writes.py [--level L1] [--blocks 8] [--steps 5] [--one-core]
        [--out FILE.json]

The parameters of a nanoGPT-shaped model of 16.9M parameters (``bench_grads_dist.build``: 4
blocks of width 512, vocabulary 8192; 52 tensors) get gradients from a bank of two random sets
(assigned, not computed: the step is the probe's) and an SGD step, in blocks of ``--steps``
steps, two configurations in turn on their own copies: the probe with ``sample=64``, which reads
every gradient and writes almost nothing (*the hook alone*), and the probe at ``--level``, which
writes every sign and significance bit (4.2 MB per step at L1). A block's time is the wall time
of its steps until the writing thread has written every step handed over (a step is handed over
with the next one, so a block writes its predecessor's last step; commits come every
``flush_every`` = 50 steps, as in a run), so the writing thread's work is inside the block that
made it. Reported, medians over ``--blocks`` rounds:

* ``block ratio``: a block with the writes over a block of the hook alone (end to end; with
  ``--one-core`` the writing thread shares the training's core, so its work adds to the step);
* ``cost ratio``: (hook + writing thread CPU) per step with the writes over the same without
  them, the cost when no second core is free;
* the writing thread's CPU per step (``time.pthread_getcpuclockid``) and the hook's time.

``--one-core``: the process is pinned to one core (``os.sched_setaffinity``, one torch thread).
``PYTHONPATH`` first: run it with ``PYTHONPATH=/path/to/other/checkout`` to measure that code.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))   # PYTHONPATH first: measures the probekit it names


def writer_cpu() -> float:
    """CPU seconds of the grad writing thread so far (0 when it is not running)."""
    for t in threading.enumerate():
        if t.name == "probekit-grad-writer" and t.ident is not None:
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ValueError):
                return 0.0
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--level", default="L1")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--one-core", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.one_core:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import torch
    import logging

    from bench_freebench_overhead import report
    from bench_grads_dist import build
    from probekit import GradProbe
    from probekit.grads.store.live import LIVE

    logging.getLogger("probekit").setLevel(logging.WARNING)
    torch.set_num_threads(1 if a.one_core else len(os.sched_getaffinity(0)))
    vocab, ctx = 8192, 128
    tmp = tempfile.mkdtemp(prefix="bench_grads_writes_")
    configs = {}
    bank = None
    for name, probe_opts in (("hook alone", {"sample": 64}), (a.level, {})):
        model = build(4, 512, vocab, ctx)
        params = [p for p in model.parameters()]
        if bank is None:
            gen = torch.Generator().manual_seed(0)
            bank = [[torch.randn(p.shape, generator=gen) * 0.01 for p in params]
                    for _ in range(2)]
        opt = torch.optim.SGD(params, lr=0.0)
        probe = GradProbe(model, optimizer=opt, grad_level=a.level,
                          dump_path=os.path.join(tmp, name.replace(" ", "_")),
                          **probe_opts).start()
        configs[name] = (params, opt, probe)
    nparams = sum(p.numel() for p in configs[a.level][0])

    def block(name, k):
        params, opt, probe = configs[name]
        n0 = len(probe.hook_seconds)
        c0 = writer_cpu()
        t0 = time.perf_counter()
        for s in range(a.steps):
            for p, g in zip(params, bank[(k + s) % 2]):
                p.grad = g
            opt.step()
        while LIVE.queued:   # every step handed over is written (the newest is handed over
            time.sleep(2e-4)  # with the next one: a block also writes its predecessor's last)
        wall = (time.perf_counter() - t0) / a.steps
        hook = sum(probe.hook_seconds[n0:]) / a.steps
        return wall, hook, (writer_cpu() - c0) / a.steps

    for name in configs:   # warm-up: the first steps of each
        block(name, 0)
    runs = {k: [] for k in configs}
    for r in range(a.blocks):
        for name in (configs if r % 2 == 0 else reversed(list(configs))):
            runs[name].append(block(name, r))
    for _, _, p in configs.values():
        p.stop()
    # the stores (~130 MB a run) go: left in /tmp they grow the page cache run after run, and
    # a writing thread that must take fresh pages for its files costs 9 ms a step instead of 2
    # on this VM (measured: every run after ~5 GB of earlier runs' stores)
    shutil.rmtree(tmp, ignore_errors=True)
    w, h = runs[a.level], runs["hook alone"]
    res = {"level": a.level, "one_core": a.one_core, "params": nparams, "steps": a.steps,
           "blocks": a.blocks,
           "block_ratio": statistics.median(x[0] / y[0] for x, y in zip(w, h)),
           "cost_ratio": statistics.median((x[1] + x[2]) / (y[1] + y[2]) for x, y in zip(w, h)),
           "block_ratio_rounds": [x[0] / y[0] for x, y in zip(w, h)],
           "block_ms": {k: statistics.median(x[0] for x in v) * 1e3 for k, v in runs.items()},
           "hook_ms": {k: statistics.median(x[1] for x in v) * 1e3 for k, v in runs.items()},
           "writer_cpu_ms": {k: statistics.median(x[2] for x in v) * 1e3
                             for k, v in runs.items()},
           "load": os.getloadavg()[0]}
    report(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
