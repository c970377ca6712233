"""Comparing two many-rank runs on dask: 1 vs 2 workers, and memory against the number of ranks.

Two runs of ``--ranks`` rank groups each (``--params`` parameters of one rank, sign and
significance bits, ``--steps`` steps, random bits written with the store's own writer) are
compared with ``compare_grads`` on a ``distributed.LocalCluster`` of 1 and of 2 worker processes
(one thread each), and on the default local threads; wall time = median of ``--repeats``.
Memory: the peak RSS of each worker process and of the calling process, for 16, 32 and 64 ranks.
``--before PYTHONPATH``: also time the previous code's ``compare_grads`` (one core, rank after
rank) in a subprocess importing probekit from there.

    python benchmarks/bench_grads_compare_dask.py --out bench_out/compare_dask.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def write_runs(base: str, ranks: int, params: int, steps: int) -> None:
    from probekit.grads.stats import Layout, StepStats
    from probekit.grads.store import GradWriter

    sizes = [params // 2, params // 4, params // 4]
    layout = Layout(("w", "v", "u"), tuple(sizes), tuple((n,) for n in sizes))
    rng = np.random.default_rng(0)
    for run in ("a", "b"):
        for r in range(ranks):
            w = GradWriter(os.path.join(base, run), r, layout, "L1", (-1, 0, 1), "md5", 50,
                           significance=True)
            for s in range(steps):
                w.append(s, StepStats(present=np.ones(3, bool), max=np.ones(3),
                                      min=-np.ones(3), norm=np.ones(3),
                                      direction=rng.integers(0, 256, layout.nbytes, np.uint8),
                                      significant=rng.integers(0, 256, layout.nbytes,
                                                               np.uint8)))
            w.close()


def _maxrss() -> int:
    """This process's peak RSS (VmHWM: reset at exec, unlike ru_maxrss, which a worker process
    would inherit from the process that started it)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def on_cluster(base: str, workers: int, repeats: int) -> dict:
    from distributed import Client, LocalCluster

    from probekit.grads import compare_grads

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as lc, Client(lc) as client:
        run = lambda: compare_grads(os.path.join(base, "a"), os.path.join(base, "b"),  # noqa
                                    client=client, progress=False)
        run()  # warm-up: imports on the workers
        wall = timed(run, repeats)
        rss = client.run(_maxrss)
    return {"wall_s": wall, "worker_peak_rss": sorted(rss.values())}


def before(base: str, pythonpath: str, repeats: int) -> float:
    code = ("import sys, time, statistics; from probekit.grads import compare_grads\n"
            f"a, b = {os.path.join(base, 'a')!r}, {os.path.join(base, 'b')!r}\n"
            "compare_grads(a, b); t = []\n"
            f"for _ in range({repeats}):\n"
            "    t0 = time.perf_counter(); compare_grads(a, b); t.append(time.perf_counter() - t0)\n"
            "print(statistics.median(t))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--params", type=int, default=1 << 20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", default=None, help="PYTHONPATH of the previous probekit")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from probekit.grads import compare_grads

    results = []
    for ranks in args.ranks:
        base = tempfile.mkdtemp(prefix="probekit_cmp_")
        try:
            write_runs(base, ranks, args.params, args.steps)
            row = {"ranks": ranks, "params_per_rank": args.params, "steps": args.steps,
                   "bits_per_run": 2 * ranks * args.steps * args.params}
            rss0 = _maxrss()
            row["threads_wall_s"] = timed(lambda: compare_grads(
                os.path.join(base, "a"), os.path.join(base, "b"), progress=False),
                args.repeats)
            row["caller_peak_rss_growth"] = _maxrss() - rss0
            for workers in (1, 2):
                row[f"workers{workers}"] = on_cluster(base, workers, args.repeats)
            if args.before and ranks == max(args.ranks):
                row["before_wall_s"] = before(base, args.before, args.repeats)
            results.append(row)
            print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
