"""Comparing two many-rank runs on dask: throughput per core, 1 vs 2 workers, memory.

Two runs with sign and significance bits, ``--steps`` steps, random bits written with the
store's own writer (``tests/sharded_stores.py``):

* ``--layout fsdp`` (default): a model of ``--ranks`` x ``--params`` elements (8 tensors) as
  FSDP2 dim-0 shards over ``--ranks`` rank groups against the same model over half as many: the
  comparison runs over the element ranges the two layouts share (no parameter assembled);
* ``--layout plain``: ``--ranks`` unsharded rank groups each (``--params`` elements per rank),
  rank r against rank r.

``--flush-every`` (the writer's, 50 by default) chooses how the bits are stored: a rank's row
under 1 MiB in shards of several steps (the store's form for small rows since issue 29's
restarts), ``1``: plain chunk files of one step; several values: one measurement each.

``compare_grads`` runs on the default local threads (``--threads``), and on a
``distributed.LocalCluster`` of 1 and of 2 worker processes (one thread each); wall time =
median of ``--repeats``. Throughput = bits read (both runs, sign and significance) per second,
per core (divided by the threads or workers). Memory: the peak RSS of each worker process and
the growth of the calling process. ``--before PYTHONPATH``: also time the previous code's
``compare_grads`` (one thread) in a subprocess importing probekit from there.

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def write_runs(base: str, layout: str, ranks: int, params: int, steps: int,
               flush_every: int = 50) -> int:
    """The two runs under ``base``/a and /b; returns the elements of one run."""
    import sharded_stores as S

    if layout == "plain":
        model = {"w": (params // 2,), "v": (params // 4,), "u": (params - params // 2
                                                                 - params // 4,)}
        for run, seed in (("a", 1), ("b", 2)):
            for r in range(ranks):  # every rank its own data: each group written
                S.write_random(os.path.join(base, run), model, {r: S.single(model)[0]},
                               steps, seed=seed * 1000 + r, flush_every=flush_every)
        return ranks * params
    cols = 1024
    rows = ranks * params // (8 * cols)
    model = {f"layer{i}.weight": (rows, cols) for i in range(8)}
    S.write_random(os.path.join(base, "a"), model, S.fsdp(model, ranks), steps, seed=1,
                   flush_every=flush_every)
    S.write_random(os.path.join(base, "b"), model, S.fsdp(model, max(1, ranks // 2)), steps,
                   seed=2, flush_every=flush_every)
    return 8 * rows * cols


def _maxrss() -> int:
    """This process's peak RSS (VmHWM: reset at exec, unlike ru_maxrss, which a worker process
    would inherit from the process that started it)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds of this process) over ``repeats``."""
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def on_cluster(base: str, workers: int, repeats: int) -> dict:
    from distributed import Client, LocalCluster

    from probekit.grads import compare_grads

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as lc, Client(lc) as client:
        run = lambda: compare_grads(os.path.join(base, "a"), os.path.join(base, "b"),  # noqa
                                    client=client, progress=False)
        run()  # warm-up: imports on the workers
        wall, _ = timed(run, repeats)
        rss = client.run(_maxrss)
    return {"wall_s": wall, "worker_peak_rss": sorted(rss.values())}


def before(base: str, pythonpath: str, repeats: int) -> float:
    code = ("import sys, time, statistics, dask; from probekit.grads import compare_grads\n"
            f"a, b = {os.path.join(base, 'a')!r}, {os.path.join(base, 'b')!r}\n"
            "dask.config.set(num_workers=1); compare_grads(a, b); t = []\n"
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
    p.add_argument("--layout", choices=("fsdp", "plain"), default="fsdp")
    p.add_argument("--ranks", type=int, nargs="+", default=[64])
    p.add_argument("--params", type=int, default=1 << 20, help="elements per rank")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--flush-every", type=int, nargs="+", default=[50],
                   help="the writer's flush_every: 1 stores the bits as plain one-step chunk "
                        "files, more as shards of steps (rows under 1 MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-cluster", action="store_true")
    p.add_argument("--before", default=None, help="PYTHONPATH of the previous probekit")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import dask

    from probekit.grads import compare_grads
    from probekit.grads.store.chunks import bits_meta

    results = []
    for ranks, flush in [(r, f) for r in args.ranks for f in args.flush_every]:
        base = tempfile.mkdtemp(prefix="probekit_cmp_")
        try:
            elements = write_runs(base, args.layout, ranks, args.params, args.steps, flush)
            bits = 2 * 2 * elements * args.steps  # two runs, sign + significance bits
            a, b = os.path.join(base, "a"), os.path.join(base, "b")
            meta = bits_meta(os.path.join(a, "grads.zarr", "rank0", "direction"))
            row = {"layout": args.layout, "ranks": ranks, "elements_per_run": elements,
                   "steps": args.steps, "bits_read": bits, "flush_every": flush,
                   "bits_stored": f"{meta['kind']}, {meta['chunk'][0]} step(s) per file"}
            compare_grads(a, b, progress=False)  # page cache warm
            for threads in args.threads:
                rss0 = _maxrss()
                with dask.config.set(num_workers=threads):
                    wall, cpu = timed(lambda: compare_grads(a, b, progress=False), args.repeats)
                row[f"threads{threads}"] = {
                    "wall_s": wall, "cpu_s": cpu,
                    "gbit_per_s_per_core": bits / wall / threads / 1e9,
                    "caller_peak_rss_growth": _maxrss() - rss0}
            if not args.no_cluster:
                for workers in (1, 2):
                    res = on_cluster(base, workers, args.repeats)
                    res["gbit_per_s_per_core"] = bits / res["wall_s"] / workers / 1e9
                    row[f"workers{workers}"] = res
                row["scaling_1_to_2_workers"] = (row["workers1"]["wall_s"]
                                                 / row["workers2"]["wall_s"])
            if args.before:
                wall = before(base, args.before, args.repeats)
                row["before_wall_s"] = wall
                row["before_gbit_per_s_per_core"] = bits / wall / 1e9
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
