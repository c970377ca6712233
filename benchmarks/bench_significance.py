"""Cost of the grad probe's significance bit (``grad_probe.significance``, on by default)
against msprobe's sign bits alone (``significance=False``).

Records the same steps with the bit off and on, alternating in one process (same model, same
gradients), and reports medians of the per-step cost (hook + writes, as ``bench_grads.py``) and
the bytes per step, with the ratio on/off of each repeat.

    python benchmarks/bench_significance.py --params 16.8 --level L2 --steps 10 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grads import build_model, du, set_grads  # noqa: E402


def one_run(model, level, steps, dump, significance):
    from probekit import GradProbe

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, optimizer=opt, grad_level=level, dump_path=dump,
                      significance=significance).start()
    empty = du(dump)
    for s in range(steps):
        set_grads(model, s)
        opt.step()
    import time

    t0 = time.perf_counter()
    probe.stop()
    flush = time.perf_counter() - t0
    return (sum(probe.hook_seconds) + flush) / steps, (du(dump) - empty) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=16.8)
    ap.add_argument("--level", default="L2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = build_model(args.params)
    work = tempfile.mkdtemp(prefix="probekit_sig_")
    cost = {False: [], True: []}
    size = {}
    try:
        for r in range(args.repeats + 1):
            for sig in (False, True):
                dump = os.path.join(work, f"{r}_{sig}")
                c, b = one_run(model, args.level, args.steps, dump, sig)
                shutil.rmtree(dump)
                if r:  # the first round warms up
                    cost[sig].append(c)
                    size[sig] = b
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [on / off for off, on in zip(cost[False], cost[True])]
    n = sum(p.numel() for p in model.parameters())
    print(f"| {n / 1e6:.1f}M | {args.level} | {statistics.median(cost[False]) * 1e3:.1f} ms | "
          f"{statistics.median(cost[True]) * 1e3:.1f} ms | {statistics.median(ratios):.2f}x | "
          f"{size[False] / 1e6:.2f} MB | {size[True] / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
