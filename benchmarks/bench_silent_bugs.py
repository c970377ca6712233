"""Public silent distributed-training bugs as the grad probe's benchmark (issue 35, point 2).

    python benchmarks/bench_silent_bugs.py [--bugs a,b] [--out FILE.json] [--results RESULTS.md]

Per bug (``benchmarks/silent_bugs/``): a one-process fp32 reference, a control run of it
(``GradProbe(..., control=...)``), and the distributed layout twice on gloo processes, healthy and
with the bug switched on from step ``ONSET``; each recorded for ``STEPS`` steps by the grad probe
and compared with ``compare_grads(reference, run, control=...)``. A bug is caught when its run
reads "beyond" at ``ONSET`` at a parameter of the buggy module, or when the replicas disagree
(``replica_verdict``); its healthy twin must read "within" and raise no replica flag.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.silent_bugs import BUGS, load  # noqa: E402
from benchmarks.silent_bugs._harness import ONSET, STEPS, read_replicas, spawn  # noqa: E402

KINDS = {1: "signs", 2: "scale", 3: "NaN/Inf"}


def replica_verdict(run_dir: str) -> dict | None:
    """probekit's own verdict on whether the replicas of ``run_dir`` agree (issue 35, point 1):
    ``{"disagree": bool, "text": str}``, or None while probekit has no replica check. The one
    place the harness asks probekit about replicas: the lead wires the replica check here once
    it is merged."""
    return None


def judge(ref: str, run: str, control: str, target=()) -> dict:
    """The comparison's verdict for ``run`` against ``ref`` with ``control``: kind, first step
    and parameter, what flagged it there, the first line of the verdict; and where the
    parameters of the buggy module (``target`` prefixes) stand: flagged at the first step, and
    the rank of their module in ``suspects()``."""
    from probekit.grads import compare_grads
    from probekit.grads.compare.verdict import verdict_kind

    cmp = compare_grads(ref, run, control=control, progress=False)
    r = cmp.isel(rank=0)
    step, param = int(r["first_step"]), str(r["first_param"].item())
    kind, at_step, suspect = "", [], None
    if step >= 0:
        kind = KINDS.get(int(r["flag_kind"].sel(step=step, param=param)), "?")
        row = r["flag"].sel(step=step)
        at_step = [str(p) for p, f in zip(r["param"].values, row.values) if f]
        modules = list(cmp.probekit.suspects()["module"])
        suspect = next((i + 1 for i, m in enumerate(modules)
                        if target and (m + ".").startswith(tuple(target))), None)
    return {"verdict": verdict_kind(cmp), "step": step, "param": param, "kind": kind,
            "flagged": int(np.asarray(r["flag"].values).sum()), "flagged_at_step": at_step,
            "target_at_step": [p for p in at_step if target and p.startswith(tuple(target))],
            "target_suspect_rank": suspect, "ranks": [int(x) for x in cmp["rank"].values],
            "text": str(cmp).split("\n")[0]}


def run_bug(name: str, root: str) -> dict:
    """Record and judge one bug: reference, control, healthy twin and buggy run."""
    bug = load(name)
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    seconds = {}
    t0 = time.perf_counter()
    bug.single(os.path.join(out, "reference"))
    seconds["reference"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    bug.single(os.path.join(out, "control"), control=bug.CONTROL)
    seconds["control"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    spawn(name, out, bug.WORLD)
    seconds["distributed"] = time.perf_counter() - t0  # both runs, process start included
    ref, ctrl = os.path.join(out, "reference"), os.path.join(out, "control")
    res = {"name": name, "title": bug.TITLE, "source": bug.SOURCE, "layout": bug.LAYOUT,
           "implementation": bug.IMPLEMENTATION, "world": bug.WORLD, "target": list(bug.TARGET),
           "onset": ONSET, "steps": STEPS, "seconds": {k: round(v, 2) for k, v in seconds.items()}}
    for twin in ("healthy", "buggy"):
        run = os.path.join(out, twin)
        t0 = time.perf_counter()
        res[twin] = judge(ref, run, ctrl, bug.TARGET)
        res[twin]["compare_s"] = round(time.perf_counter() - t0, 2)
        res[twin]["replicas_probekit"] = replica_verdict(run)
        res[twin]["replicas_harness"] = read_replicas(run)
    res.update(assess(res))
    return res


def assess(res: dict) -> dict:
    """Did the comparison (or the replica check) catch the bug, and did the healthy twin stay
    quiet?"""
    h, b = res["healthy"], res["buggy"]
    probekit_flag = lambda r: bool(r["replicas_probekit"] and r["replicas_probekit"]["disagree"])  # noqa: E731
    at_onset = (b["verdict"] == "beyond" and b["step"] == res["onset"]
                and b["param"].startswith(tuple(res["target"])))
    caught_by = b["kind"] if at_onset else ("replicas" if probekit_flag(b) else "")
    healthy_ok = h["verdict"] == "within" and not probekit_flag(h)
    return {"caught": bool(caught_by), "caught_by": caught_by, "healthy_ok": healthy_ok}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bugs", default=",".join(BUGS))
    p.add_argument("--out", help="JSON file for the results")
    p.add_argument("--dir", help="keep the recorded runs here (default: a temporary folder)")
    p.add_argument("--results", help="RESULTS.md whose silent-bugs section is (re)written")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.ERROR)
    root = args.dir or tempfile.mkdtemp(prefix="probekit-silent-")
    rows = []
    for name in args.bugs.split(","):
        res = run_bug(name, root)
        rows.append(res)
        print(json.dumps({k: res[k] for k in ("name", "caught", "caught_by", "healthy_ok")}),
              "| buggy:", res["buggy"]["text"], "| healthy:", res["healthy"]["text"],
              flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
