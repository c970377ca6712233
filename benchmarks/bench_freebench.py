"""Free benchmark overhead, probekit vs msprobe 1.0.4, side by side in one run.

    python benchmarks/bench_freebench.py --out benchmarks/RESULTS.md \
        [--msprobe-python .venv-msprobe/bin/python] [--repeats 7]

For each configuration (check mode with each pert_mode, backward stage, fix, nothing in scope),
both tools time a training step of the same bf16 block (``bench_freebench_msprobe.build``:
LayerNorm, matmul, softmax, Linear, GELU; one torch thread) and report the median step time
divided by the median plain step time, measured in the same process. The primary number is CPU time of the training
thread (robust on a shared machine); wall-clock ratios are printed beside it. probekit interleaves
plain and probed steps; msprobe's helper times its plain steps first, because msprobe's API wrappers
stay installed once it has started. ``--out`` gets a markdown table (``.md``) or JSON (``.json``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import bench_freebench_msprobe as model_def  # noqa: E402
from bench_freebench_msprobe import build, medians, timed  # noqa: E402

#: (label, probekit/msprobe free_benchmark options)
CONFIGS = [
    ("check improve_precision", {"pert_mode": "improve_precision"}),
    ("check bit_noise", {"pert_mode": "bit_noise"}),
    ("check add_noise", {"pert_mode": "add_noise"}),
    ("check change_value", {"pert_mode": "change_value"}),
    ("check no_change", {"pert_mode": "no_change"}),
    ("check to_cpu", {"pert_mode": "to_cpu", "fuzz_device": "cpu"}),
    ("backward improve_precision", {"pert_mode": "improve_precision", "fuzz_stage": "backward"}),
    ("backward bit_noise", {"pert_mode": "bit_noise", "fuzz_stage": "backward"}),
    ("fix improve_precision", {"pert_mode": "improve_precision", "handler_type": "fix"}),
    ("nothing in scope", {"scope": ["Torch.not_called_anywhere.0.forward"]}),
    # probekit only (msprobe has no budget): at least 30 timed steps, for the coverage column
    ("check bit_noise, budget 0.2", {"pert_mode": "bit_noise", "budget": 0.2}),
]
#: configurations msprobe cannot run (probekit extensions)
PROBEKIT_ONLY = {"check bit_noise, budget 0.2"}
#: steps the budget configuration runs at least (every call site must be checked within 30)
BUDGET_STEPS = 30
TARGETS = {"check improve_precision": 2.5, "check bit_noise": 2.5, "check add_noise": 2.5,
           "check change_value": 2.5, "check no_change": 2.5, "check to_cpu": 2.5,
           "backward improve_precision": 5.0, "backward bit_noise": 5.0,
           "nothing in scope": 1.05, "check bit_noise, budget 0.2": 1.25}


def run_probekit(options: dict, repeats: int, warmup: int, dump: str) -> dict:
    import probekit

    step, _ = build()
    fb = probekit.FreeBench(dump_path=dump, **options)

    def probed():
        with fb:
            step()
        fb.step()

    if options.get("budget") is not None:
        repeats = max(repeats, BUDGET_STEPS - warmup)
    budget = options.get("budget") is not None
    history = []  # with a budget: per step, {call site: times checked so far}

    def note():
        if budget:   # the eligible sites (the others, views and copies..., are never checked)
            cov = fb.coverage
            cov = cov[cov["reason"].isin(["", "budget"])]
            history.append(dict(zip(cov["api_name"], cov["checked"])))

    for _ in range(warmup):
        step()
        probed()
        note()
    plain, runs = [], []
    for _ in range(repeats):
        plain.append(timed(step))
        runs.append(timed(probed))
        note()
    e = fb._engine
    return {"plain": plain, "probed": runs, "rows": int(fb.summary["flagged"]),
            "checked": int(fb.summary["checked"]), "warmup": warmup,
            "syncs_per_check": e.verdicts.syncs / max(1, e.checked),
            "max_gap": max_gap(history) if budget else None}


def max_gap(history: list[dict]) -> int:
    """The most steps any call site waited between two checks (its first check, step 0, the
    calibration, counts; a site not checked again by the last step counts up to the end)."""
    worst = 0
    for site in history[-1]:
        last = -1
        before = 0
        for k, counts in enumerate(history):
            c = counts.get(site, 0)
            if c > before:
                worst = max(worst, k - last)
                last, before = k, c
        worst = max(worst, len(history) - 1 - last)
    return worst


def run_msprobe(python: str, options: dict, repeats: int, warmup: int, dump: str,
                size: str = "block") -> dict | None:
    cmd = [python, os.path.join(HERE, "bench_freebench_msprobe.py"), "--section",
           json.dumps(options), "--repeats", str(repeats), "--warmup", str(warmup), "--dump", dump,
           "--size", size]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        last = lines[-1].split("]:", 1)[-1].strip() if lines else f"exit {proc.returncode}"
        print(f"msprobe run failed for {options}: {last}", file=sys.stderr)
        return {"error": last}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratio(res: dict | None):
    if res is None or "error" in res:
        return res
    pc, pw = medians(res["plain"])
    qc, qw = medians(res["probed"])
    return {"cpu": qc / pc, "wall": qw / pw, "plain_ms": pc * 1e3, "rows": res["rows"],
            "checked": res.get("checked"), "steps": len(res["probed"]) + res.get("warmup", 0),
            "syncs_per_check": res.get("syncs_per_check"),
            "max_gap": res.get("max_gap")}


def fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(results: list[dict]) -> str:
    lines = ["| configuration | probekit × plain (CPU) | probekit × plain (wall) | "
             "msprobe × plain (CPU) | msprobe × plain (wall) | target | probekit checked "
             "calls/step | probekit rows | msprobe rows | probekit syncs per checked call | "
             "every call site checked within (steps) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        p, m = r["probekit"], r["msprobe"]
        target = TARGETS.get(r["label"])
        if m is None:
            ms = ["n/a (no budget)" if r["label"] in PROBEKIT_ONLY else "n/a", "n/a", "n/a"]
        elif "error" in m:
            ms = [f"crashed: {m['error'][:60]}", "", "n/a"]
        else:
            ms = [f"{fmt(m['cpu'])}×", f"{fmt(m['wall'])}×", str(m["rows"])]
        per_step = (f"{p['checked'] / p['steps']:.0f}" if p.get("checked") is not None
                    and p.get("steps") else "n/a")
        lines.append(
            f"| {r['label']} | {fmt(p['cpu'])}× | {fmt(p['wall'])}× | {ms[0]} | {ms[1]} | "
            f"{'≤ ' + format(target, 'g') + '×' if target else ''} | {per_step} | {p['rows']} | "
            f"{ms[2]} | {fmt(p.get('syncs_per_check'), 3)} | "
            f"{'' if p.get('max_gap') is None else p['max_gap']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the table (.md) or the raw results (.json) here")
    ap.add_argument("--msprobe-python", default=os.path.join(os.path.dirname(HERE),
                                                             ".venv-msprobe", "bin", "python"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="labels to run (default: all)")
    ap.add_argument("--size", default="block", choices=sorted(model_def.SIZES),
                    help="model size: block (D=128, 4x32 tokens) or small (d=256, 4x64 tokens)")
    a = ap.parse_args(argv)
    model_def.set_size(a.size)
    if a.repeats < 5:
        ap.error("--repeats must be >= 5 (medians of at least 5 steps)")
    logging.getLogger("probekit").setLevel(logging.WARNING)
    has_msprobe = os.path.exists(a.msprobe_python)
    if not has_msprobe:
        print(f"msprobe python not found at {a.msprobe_python}: probekit only", file=sys.stderr)
    results = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_fb_") as tmp:
        for i, (label, options) in enumerate(CONFIGS):
            if a.only and label not in a.only:
                continue
            p = ratio(run_probekit(options, a.repeats, a.warmup, os.path.join(tmp, f"pk{i}")))
            m = ratio(run_msprobe(a.msprobe_python, options, a.repeats, a.warmup,
                                  os.path.join(tmp, f"ms{i}"), a.size)) \
                if has_msprobe and label not in PROBEKIT_ONLY else None
            results.append({"label": label, "options": options, "probekit": p, "msprobe": m})
            m_txt = "n/a" if m is None else m.get("error") or f"{fmt(m['cpu'])}x"
            print(f"{label}: probekit {fmt(p['cpu'])}x, msprobe {m_txt}", file=sys.stderr)
    plain = results[0]["probekit"]["plain_ms"] if results else 0.0
    md = "\n".join([
        "## Free benchmark: step time relative to a plain training step",
        "",
        f"Command: `python benchmarks/bench_freebench.py {shlex.join(argv or sys.argv[1:])}`",
        "",
        f"Model: `build()` in `benchmarks/bench_freebench_msprobe.py` (bf16, 2 blocks of "
        f"LayerNorm/matmul/softmax/Linear/GELU, D={model_def.D}, H={model_def.H}, "
        f"T={model_def.T}, batch {model_def.B},"
        f" SGD; one torch thread); plain step ≈ {plain:.1f} ms CPU; medians of {a.repeats} steps "
        f"after {a.warmup} warm-up steps; torch {torch.__version__}; total run "
        f"{time.time() - t0:.0f} s.",
        "",
        "Ratios: median probed step / median plain step, both timed in the same process. The first "
        "ratio uses the CPU time of the training thread (robust on this shared 2-core machine), "
        "the second wall-clock time. fix improve_precision is below 1×: it replaces each bf16 "
        "call by its fp32 computation, which this CPU runs faster than bf16.",
        "",
        table(results),
        "",
        "Rows: findings written to free_benchmark.csv over all timed and warm-up steps. The "
        "counts differ in kind: msprobe also re-runs in-place calls (e.g. SGD's bf16 "
        "`Tensor.add_` updates, all of its improve_precision rows here) and applies change_value "
        "to any API; probekit never re-runs in-place calls and judges bit_noise/add_noise "
        "against twice the input's one-ulp change. Syncs per checked call: device-to-host reads "
        "of verdicts (one per step's gather point) divided by the checked calls. The budget row "
        f"runs at least {BUDGET_STEPS} steps (step 0 checks every call to measure the costs); its "
        "last column is the most steps any eligible call site waited between two checks.",
    ])
    print(md)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            if a.out.endswith(".json"):
                json.dump(results, fh, indent=2)
            else:
                fh.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
