"""Planning a comparison of many-rank stores: open every rank group and plan (no bit read).

Two runs of a Llama-2-7B-shaped model (291 tensors, 6.74B parameters) are written as stores
of FSDP2 dim-0 shards over ``--ranks`` rank groups (metadata and statistics of ``--steps``
steps; no bit chunk files: the planner reads none), and compared with 1024 vs 1024, 1024 vs
512 ranks and 1024 ranks vs a single process: the time of the comparison's first stages (each
store's segments listed by ``restarts.segments``, their rank groups opened in batches, then the
plan: tasks of the graph), on the local threads, median of ``--repeats`` (wall, and the
process's CPU time: the machine may be shared); also the plan's size (slab sets, run sets,
tasks).

    python benchmarks/bench_grads_plan.py --out bench_out/plan.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=None, help="threads (default: the cores)")
    p.add_argument("--keep", default=None, help="write the stores here and keep them")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import sharded_stores as S
    from probekit.grads import segments
    from probekit.grads.compare.compare import plan_stage
    from probekit.grads.compare.engine import Session
    from probekit.grads.compare.opening import store_of

    params = S.llama7b()
    base = args.keep or tempfile.mkdtemp(prefix="probekit_plan_")
    layouts = {f"fsdp{args.ranks}": S.fsdp(params, args.ranks),
               f"fsdp{args.ranks // 2}": S.fsdp(params, args.ranks // 2),
               "single": S.single(params)}
    results = []
    try:
        for name, layout in layouts.items():
            path = os.path.join(base, name)
            if not os.path.isdir(path):
                t0 = time.perf_counter()
                S.write_random(path, params, layout, args.steps, bits=False)
                print(f"wrote {name} in {time.perf_counter() - t0:.1f} s", flush=True)
        a = os.path.join(base, f"fsdp{args.ranks}")
        for other in layouts:
            b = os.path.join(base, other)
            times, cpus, shape = [], [], None
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                sa, sb = store_of(a), store_of(b)
                with Session(progress=False, num_workers=args.workers) as session:
                    plan = plan_stage(sa, sb, session=session)
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                shape = plan
            pairs = shape["pairs"]
            row = {"first": f"fsdp{args.ranks}", "second": other,
                   "groups": sum(len(s.groups) for p in (a, b) for s in segments(p)),
                   "steps": args.steps,
                   "plan_s": statistics.median(times), "plan_s_all": times,
                   "cpu_s": statistics.median(cpus), "load": os.getloadavg()[0],
                   "slab_sets": sum(len(q["sets"]) for q in pairs),
                   "run_sets": sum(len(s["runs"]) for q in pairs for s in q["sets"]),
                   "count_tasks": sum(len(q["sets"]) * len(q["chunks"]) for q in pairs)}
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
