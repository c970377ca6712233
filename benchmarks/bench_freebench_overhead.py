"""Free benchmark: what the probe costs on the step users feel it on (issue 38).

    python benchmarks/bench_freebench_overhead.py nothing [--size small] [--repeats 40]
    python benchmarks/bench_freebench_overhead.py budget  [--size small] [--budgets 0.1 0.2 0.5]
    python benchmarks/bench_freebench_overhead.py checked [--size small] [--repeats 20]
        [--out FILE.json]

The model is ``bench_freebench_msprobe.build`` (bf16, 2 blocks of LayerNorm / matmul / softmax /
Linear / GELU, SGD, one torch thread): ``small`` is d=256, 4 x 64 tokens; ``medium`` d=512,
4 x 128 tokens. Every timed number is a ratio to a plain step measured in the same process, the
configurations interleaved step by step (plain, A, B, plain, A, B...), medians of the thread's
CPU time: on a shared machine the load moves both sides alike. Next to them, counts that load
cannot move:

* ``nothing``: a plain step, a bare ``TorchFunctionMode`` that only calls through (the floor of
  any function-mode interception), and the free benchmark with nothing in scope, forward and
  backward stage; ``over_bare_mode``: what the probe adds over the bare mode, per round, in
  plain steps (the bare mode's own ratio moves by about 2 % from process to process). Counted: calls the mode sees per step, and Python function calls (``call``
  and ``c_call`` profile events) per intercepted call beyond the bare mode's.
* ``budget``: ``budget=b`` end to end (interception, checks, the step's gather), over
  ``--steps`` steps after the first (the calibration): the mean step over the mean plain step
  (the budget's promise is an average; ``median_ratio`` is the typical step's); the share of
  eligible call sites checked at least once, the most steps a site waited, and what the summary
  says the budget cost.
* ``checked``: every call checked, forward (``bit_noise``, ``improve_precision``) and backward
  stage; ATen operators per checked call: a ``TorchDispatchMode`` counting every operator of a
  probed step minus a plain one, over the step's checked calls (composite operators counted as
  what they decompose into, autograd's too), and ``torch.profiler``'s top-level ``aten::``
  events the same way (``bench_freebench_ops``'s count: one per call Python makes).

``PYTHONPATH`` first: run it with ``PYTHONPATH=/path/to/other/checkout`` to measure that code.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))   # PYTHONPATH first: measures the probekit it names

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import bench_freebench_msprobe as model_def  # noqa: E402

SIZES = {"small": (256, 1024, 64, 4), "medium": (512, 2048, 128, 4)}


def build(size: str):
    model_def.D, model_def.H, model_def.T, model_def.B = SIZES[size]
    return model_def.build()


class Bare(TorchFunctionMode):
    """A function mode that only calls through: the floor of any function-mode interception."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def interleaved(fns: dict, repeats: int, warmup: int = 3) -> dict:
    """{name: [thread CPU seconds per call]}, the callables run in turn, ``repeats`` rounds."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    out = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            c = time.thread_time()
            f()
            out[k].append(time.thread_time() - c)
    return out


def ratios(times: dict, base: str = "plain") -> dict:
    """Per configuration, the median over rounds of its time over the plain step's time in the
    same round (paired: a slow stretch of the machine moves both sides of a pair)."""
    p = times[base]
    return {k: statistics.median(a / b for a, b in zip(v, p)) for k, v in times.items()}


def spread(times: dict, base: str = "plain") -> dict:
    """The quartiles of the paired ratios (how much one round's ratio moves on this machine)."""
    p = times[base]
    out = {}
    for k, v in times.items():
        q = statistics.quantiles([a / b for a, b in zip(v, p)], n=4)
        out[k] = (q[0], q[2])
    return out


def session(dump: str, **options):
    import probekit

    fb = probekit.FreeBench(dump_path=dump, **options)

    def probed(step):
        def run():
            with fb:
                step()
            fb.step()
        return run
    return fb, probed


def python_calls(fn) -> int:
    """Python function calls (``call`` and ``c_call`` profile events) while ``fn`` runs."""
    n = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def bench_nothing(a, tmp) -> dict:
    step, _ = build(a.size)
    scope = ["Torch.not_called_anywhere.0.forward"]
    fwd, probed_f = session(os.path.join(tmp, "f"), scope=scope)
    bwd, probed_b = session(os.path.join(tmp, "b"), scope=scope, fuzz_stage="backward")

    def bare():
        with Bare():
            step()
    fns = {"plain": step, "bare mode": bare, "nothing in scope (forward)": probed_f(step),
           "nothing in scope (backward)": probed_b(step)}
    times = interleaved(fns, a.repeats)
    counter = Counting()
    with counter:
        step()
    seen = counter.n
    py = {k: statistics.median(python_calls(f) for _ in range(3)) for k, f in fns.items()}
    bare_t, plain_t = times["bare mode"], times["plain"]
    return {"ratios": ratios(times), "quartiles": spread(times),
            # the bare mode's own ratio moves by ~2 % from process to process (1.019-1.043 on
            # the 2026-12-04 machine), more than the probe's part: what the probe adds over it,
            # paired per round, in plain steps
            "over_bare_mode": {k: statistics.median((t - b) / p for t, b, p in
                                                    zip(v, bare_t, plain_t))
                               for k, v in times.items() if k.startswith("nothing")},
            "plain_ms": statistics.median(times["plain"]) * 1e3,
            "intercepted_per_step": seen,
            "python_calls_per_intercepted_call": {
                k: (py[k] - py["bare mode"]) / seen for k in fns if k.startswith("nothing")}}


def max_gap(history: list[dict]) -> int:
    """The most steps any call site waited between two checks (from bench_freebench)."""
    from bench_freebench import max_gap as gap
    return gap(history)


def bench_budget(a, tmp) -> dict:
    step, _ = build(a.size)
    out = {}
    fns = {"plain": step}
    sessions = {}
    for b in a.budgets:
        fb, probed = session(os.path.join(tmp, f"b{b}"), pert_mode="bit_noise", budget=b)
        sessions[b] = fb
        fns[f"budget {b:g}"] = probed(step)
    # the calibration step (every call checked) is not what the budget promises: run it first
    for f in fns.values():
        f()
    history = {b: [] for b in a.budgets}
    times = {k: [] for k in fns}
    for _ in range(a.steps):
        for k, f in fns.items():
            c = time.thread_time()
            f()
            times[k].append(time.thread_time() - c)
        for b, fb in sessions.items():
            cov = fb.coverage
            cov = cov[cov["reason"].isin(["", "budget"])]
            history[b].append(dict(zip(cov["api_name"], cov["checked"])))
    # the budget's promise is an average over the steps (quiet and probed steps differ by
    # design): the mean step over the mean plain step; the median of the per-round ratios next
    # to it is the typical step's
    r = ratios(times)
    plain = statistics.fmean(times["plain"])
    for b, fb in sessions.items():
        s = fb.summary
        out[f"{b:g}"] = {"ratio": statistics.fmean(times[f"budget {b:g}"]) / plain,
                         "median_ratio": r[f"budget {b:g}"], "coverage": s.get("coverage"),
                         "budget_limit": s.get("budget_limit"),
                         "budget_every": s.get("budget_every"),
                         "budget_steps": s.get("budget_steps"),
                         "max_gap": max_gap(history[b]),
                         "checked_per_step": s["checked"] / max(1, s["steps"]),
                         "float_calls_per_step": s["float_calls"] / max(1, s["steps"]),
                         "summary_cost": s.get("budget_cost")}
    return {"plain_ms": statistics.median(times["plain"]) * 1e3, "budgets": out}


def bench_checked(a, tmp) -> dict:
    step, _ = build(a.size)
    configs = {"check bit_noise": {"pert_mode": "bit_noise"},
               "check improve_precision": {"pert_mode": "improve_precision"},
               "backward bit_noise": {"pert_mode": "bit_noise", "fuzz_stage": "backward"},
               "backward improve_precision": {"pert_mode": "improve_precision",
                                              "fuzz_stage": "backward"}}
    fns = {"plain": step}
    sessions = {}
    for i, (label, opts) in enumerate(configs.items()):
        fb, probed = session(os.path.join(tmp, f"c{i}"), **opts)
        sessions[label] = fb
        fns[label] = probed(step)
    times = interleaved(fns, a.repeats)
    ops = {}
    plain_ops = OpCount()
    with plain_ops:
        step()
    from torch.profiler import ProfilerActivity, profile

    from bench_freebench_ops import top_level

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    plain_top = len(top_level(prof))
    for label, fb in sessions.items():
        before = fb.summary["checked"]
        counter = OpCount()
        with counter:
            fns[label]()
        checked = fb.summary["checked"] - before
        before = fb.summary["checked"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fns[label]()
        top_checked = fb.summary["checked"] - before
        ops[label] = {"checked": checked,
                      "aten_ops_per_checked_call": (counter.n - plain_ops.n) / max(1, checked),
                      "top_level_per_checked_call": (len(top_level(prof)) - plain_top)
                      / max(1, top_checked)}
    return {"ratios": ratios(times), "quartiles": spread(times),
            "plain_ms": statistics.median(times["plain"]) * 1e3, "ops": ops, "rows": {k: int(fb.summary["flagged"]) for k, fb in sessions.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["nothing", "budget", "checked"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--steps", type=int, default=30, help="budget: steps after the calibration")
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.2])
    ap.add_argument("--out", help="write the results here (JSON)")
    a = ap.parse_args(argv)
    logging.getLogger("probekit").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench_fb_overhead_") as tmp:
        res = {"nothing": bench_nothing, "budget": bench_budget,
               "checked": bench_checked}[a.what](a, tmp)
    res.update({"what": a.what, "size": a.size, "load": os.getloadavg()[0]})
    report(res, a.out)
    return 0


def report(res: dict, out: str | None) -> None:
    """Print the results as JSON, and write them to ``out`` when given."""
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text)


if __name__ == "__main__":
    sys.exit(main())
