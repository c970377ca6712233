"""Public silent distributed-training bugs as the grad probe's benchmark (issue 35, point 2).

    python benchmarks/bench_silent_bugs.py [--bugs a,b] [--out FILE.json] [--results RESULTS.md]

Per bug (``benchmarks/silent_bugs/``): a one-process fp32 reference, a control run of it
(``GradProbe(..., control=...)``), and the distributed layout twice on gloo processes, healthy and
with the bug switched on from step ``ONSET``; each recorded for ``STEPS`` steps by the grad probe
and judged twice: compared with ``compare_grads(reference, run, control=...)``, and by probekit's
replica check alone, which needs no reference (``replica_verdict``: ``replica_disagreements``).
A bug is caught when its run reads "beyond" at ``ONSET`` at a parameter of the buggy module, or
when the replicas disagree; its healthy twin must read "within" and raise no replica flag.
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
from benchmarks.silent_bugs._harness import ONSET, STEPS, spawn  # noqa: E402

KINDS = {1: "signs", 2: "scale", 3: "NaN/Inf"}


def replica_verdict(run_dir: str) -> dict:
    """probekit's own replica check of the run recorded in ``run_dir`` (``replica_disagreements``,
    issue 35 point 1): ``{"disagree", "text", "step", "param", "what", "group", "ranks",
    "params"}``: the first disagreement (by step, then name) in words and its parts, the
    parameters whose replicas disagreed at some step; ``step`` -1 and ``text`` "" when they
    always agreed (or nothing was checked)."""
    from probekit.grads import replica_disagreements
    from probekit.grads.store.replicas import replica_line

    table = replica_disagreements(run_dir)
    if not len(table):
        return {"disagree": False, "text": "", "step": -1, "param": "", "what": "",
                "group": "", "ranks": [], "params": []}
    first = table.iloc[0]
    return {"disagree": True, "text": replica_line(first), "step": int(first["first_step"]),
            "param": str(first["param"]), "what": str(first["what"]),
            "group": str(first["group"]), "ranks": [int(r) for r in first["ranks"]],
            "params": [str(p) for p in table["param"]]}


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
    if getattr(bug, "MEGATRON", False):
        from benchmarks.silent_bugs import _megatron

        _megatron.load()   # MegatronMissing says how to install it
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
           "control": bug.CONTROL, "note": bug.NOTE, "onset": ONSET, "steps": STEPS,
           "seconds": {k: round(v, 2) for k, v in seconds.items()}}
    for twin in ("healthy", "buggy"):
        run = os.path.join(out, twin)
        t0 = time.perf_counter()
        res[twin] = judge(ref, run, ctrl, bug.TARGET)
        res[twin]["compare_s"] = round(time.perf_counter() - t0, 2)
        res[twin]["replicas"] = replica_verdict(run)
    res.update(assess(res))
    return res


def assess(res: dict) -> dict:
    """Did the comparison or the replica check catch the bug, and did the healthy twin stay
    quiet (within, no replica flag)? ``caught_by``: what caught it, the comparison's kind at
    the onset in the buggy module (signs / scale / NaN/Inf) and "replicas" when probekit's
    replica check (no reference) flagged it; ``replicas_alone``: the replica check caught it at
    the onset."""
    h, b = res["healthy"], res["buggy"]
    at_onset = (b["verdict"] == "beyond" and b["step"] == res["onset"]
                and b["param"].startswith(tuple(res["target"])))
    by = ([b["kind"]] if at_onset else []) + (["replicas"] if b["replicas"]["disagree"] else [])
    healthy_ok = h["verdict"] == "within" and not h["replicas"]["disagree"]
    return {"caught": bool(by), "caught_by": " + ".join(by), "healthy_ok": healthy_ok,
            "compare_at_onset": at_onset,
            "replicas_alone": b["replicas"]["step"] == res["onset"]}


BEGIN = "<!-- silent-bugs: written by bench_silent_bugs.py -->"
END = "<!-- /silent-bugs -->"


def render(rows: list, skipped: dict, notes: str) -> str:
    """The RESULTS.md section: one row per bug."""
    lines = [
        BEGIN, "## Grad probe: public silent distributed-training bugs (issue 35)", "",
        f"`python benchmarks/bench_silent_bugs.py` ({notes}). Each bug runs on CPU with gloo "
        f"({', '.join(sorted({str(r['world']) for r in rows}))} processes), tiny models, "
        f"{STEPS} AdamW steps, the bug switched on from step {ONSET}; its healthy twin is the "
        "same layout without it. Both are recorded by the grad probe (plain local shards "
        "declared with `GradProbe(shards=...)`) and judged twice: *compared* with a one-process "
        "fp32 reference and a control run of it (`compare_grads(reference, run, control=...)`), "
        "and by probekit's *replica check* alone, which needs no reference "
        "(`replica_disagreements(run)`: every replicated parameter's copies compared at every "
        "step). *Caught by*: what flagged the first diverging parameter at the onset step when "
        "it lies in the buggy module (signs / scale / NaN), and `replicas` when the replica check "
        "flagged the run. *Replica check alone*: its first disagreement (step, parameter, "
        "ranks, what differs) and how many parameters disagreed. *Time*: reference, control "
        "and both distributed runs (process start included) plus two comparisons, seconds on "
        "this shared machine.", "",
        "| bug | source | layout; what runs | caught by | comparison: step, parameter | "
        "replica check alone (no reference) | healthy twin | why; what was missed | time |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, h = r["buggy"], r["healthy"]
        caught = r["caught_by"] or ("nothing (within)" if b["verdict"] == "within" else (
            f"{b['kind']}, another module first" if b["step"] == r["onset"]
            else f"{b['kind']} from step {b['step']}"))
        if not r["compare_at_onset"] and r["caught"]:
            caught += (" (comparison: within)" if b["verdict"] == "within" else
                       f" (comparison: {b['kind']}, another module first)"
                       if b["step"] == r["onset"] else
                       f" (comparison: {b['kind']} from step {b['step']})")
        compared = (f"{b['step']}, `{b['param']}`" if b["step"] >= 0 else "-")
        missed = []
        if b["verdict"] == "beyond" and not r["compare_at_onset"] and b["target_at_step"]:
            missed.append(f"Compared: named `{b['param']}` first; `{b['target_at_step'][0]}` "
                          f"flagged at the same step, #{b['target_suspect_rank']} in "
                          "`suspects()`.")
        if r["note"]:
            missed.append(r["note"])
        rep = b["replicas"]
        replicas = "agree" if not rep["disagree"] else (
            f"**disagree from step {rep['step']}**: {rep['text'].split(' disagree ')[0]} "
            f"({rep['text'].rsplit('(', 1)[1]}"
            + (f"; {len(rep['params'])} parameters in all: "
               + ", ".join(f"`{p}`" for p in rep["params"]) if len(rep["params"]) > 1 else ""))
        twin = ("within, replicas agree" if r["healthy_ok"] else
                f"{h['verdict']} at step {h['step']} `{h['param']}`"
                + (f"; {h['replicas']['text']}" if h["replicas"]["disagree"] else ""))
        total = sum(r["seconds"].values()) + h["compare_s"] + b["compare_s"]
        lines.append(
            f"| {r['title']} | [{_link(r['source'])}]({r['source']}) | {r['layout']}; "
            f"{r['implementation']} | **{caught}** | {compared} | {replicas} | {twin} | "
            f"{' '.join(missed) or '-'} | {total:.0f} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | | | not run: {why} | | | | | |")
    n = len(rows)
    lines += ["", f"Caught: {sum(r['caught'] for r in rows)} of {n}; by the comparison at the "
              f"onset in the buggy module: {sum(r['compare_at_onset'] for r in rows)} of {n}; "
              "by the replica check alone (no reference) at the onset: "
              f"{sum(r['replicas_alone'] for r in rows)} of {n}, at any step: "
              f"{sum(r['buggy']['replicas']['disagree'] for r in rows)} of {n}; healthy twins "
              f"within with no replica flag: {sum(r['healthy_ok'] for r in rows)} of {n}.", END]
    return "\n".join(lines)


def _link(url: str) -> str:
    """``owner/repo#N`` (or ``owner/repo PR N``) for a GitHub link."""
    parts = url.rstrip("/").split("/")
    if "github.com" in url and len(parts) >= 7:
        return f"{parts[3]}/{parts[4]}{' PR ' if parts[5] == 'pull' else '#'}{parts[6]}"
    return url


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
    from benchmarks.silent_bugs._megatron import MegatronMissing

    root = args.dir or tempfile.mkdtemp(prefix="probekit-silent-")
    rows, skipped = [], {}
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    for name in args.bugs.split(","):
        try:
            res = run_bug(name, root)
        except MegatronMissing as exc:
            skipped[name] = str(exc)
            print(f"{name}: not run: {exc}", flush=True)
            continue
        rows.append(res)
        print(json.dumps({k: res[k] for k in ("name", "caught", "caught_by", "healthy_ok")}),
              "| buggy:", res["buggy"]["text"], "| healthy:", res["healthy"]["text"],
              flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "skipped": skipped}, fh, indent=1)
    if args.results:
        import torch

        sys.path.insert(0, HERE)
        from results_md import write_section

        from benchmarks.silent_bugs._megatron import VERSION

        notes = (f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, megatron-core "
                 f"{VERSION}, {time.perf_counter() - t0:.0f} s in all; load average "
                 f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
        write_section(args.results, render(rows, skipped, notes), BEGIN, END)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
