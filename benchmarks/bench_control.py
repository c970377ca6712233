"""Grad comparison verdicts with a control run (issue 27): validation on real models, the line
where a planted bf16 accumulation becomes visible, and the cost.

    python benchmarks/bench_control.py validate --out control.json [--models gpt2,...]
    python benchmarks/bench_control.py line --out line.json
    python benchmarks/bench_control.py cost --out cost.json [--steps-only] [--model small] [--recorded]
    python benchmarks/bench_control.py sweep --out sweep.json [--models gpt2,...] [--bf16]
    python benchmarks/bench_control.py priors --out priors.json [--models ...] [--controls 10]

``validate``: per model (tiny random-init Hugging Face configs, ``tests/_control_models.py``;
AdamW, 20 steps, 4 x 32 tokens) a reference run in fp32, test runs that are healthy (bf16
autocast, the model cast to bf16, SDPA's math path instead of the fused kernel, every linear
layer's reduction in another order) or carry a bug planted in block 1 from step 5 (a matmul
accumulating in bf16, an fp16 overflow in one activation, one parameter's gradient divided by
2, a LayerNorm scaled by sqrt(128/96)), and control runs of the reference (``GradProbe(...,
control=...)``: bf16 autocast seeds 0 and 1, bf16 cast seeds 0 and 1, fp32 seeds 0 and 1, and a
third bf16 seed as a healthy test); then ``compare_grads(ref, test, control=...)`` with two
controls (their envelope) and with one. ``line``: the bf16-accumulation bug at 128 and 1024
tokens per step, sequential or in fp32 chunks. ``cost``: a control run's step time (``--model``: the
GPT-2, or ``bench_freebench_msprobe``'s model in fp32 at size ``block`` or ``small``) and a
comparison with a control against a plain comparison (medians of repeats, same process; the
verdict's margins cached and cold; each also as the median of every round's own ratio, the
plain and control comparisons of a round run next to each other; ``--compare-only``: the
comparisons alone; ``--recorded``:
also whole recorded runs, 12 steps, with each control against the same run recorded plainly).
``sweep`` (issue 37): the false-alarm rate over many healthy fp32 pairs (kernel and backend
swaps, reduction orders, attention paths) on zoo models the verdict's priors were not measured
on, with one control and with two, each control judged against the others too, and planted
fp32 scale bugs (``SWEEP``, ``SWEEP_BUGS``). ``priors``: the spread of runs of rounding behind
``verdict.PRIOR_SPREAD``, measured again on the tuned models, for the log deviation and for the
verdict's deviation in units of a parameter's typical statistic.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import _control_models as cm  # noqa: E402

from probekit.grads import GradProbe, compare_grads  # noqa: E402
from probekit.grads.compare import verdict  # noqa: E402
from probekit.grads.compare.verdict import verdict_kind  # noqa: E402

ONSET = 5
#: the planted bugs; overflow_inf: the activation overflows to inf instead of saturating
BUGS = (*cm.BUGS, "overflow_inf")
HEALTHY = ("autocast", "bf16", "sdpa_math", "reorder")
#: the controls each test is judged with: two (their envelope), and the first alone
CONTROLS = {"autocast": ("c_bf16_0", "c_bf16_1"), "bf16": ("c_cast_0", "c_cast_1"),
            "sdpa_math": ("c_fp32_0", "c_fp32_1"), "reorder": ("c_fp32_0", "c_fp32_1"),
            "c_bf16_2": ("c_bf16_0", "c_bf16_1")}
CONTROL_RUNS = {"c_bf16_0": "bf16", "c_bf16_1": "bf16", "c_bf16_2": "bf16",
                "c_cast_0": "bf16:cast", "c_cast_1": "bf16:cast", "c_fp32_0": "fp32",
                "c_fp32_1": "fp32"}


def record(root, kind, name, setting="fp32", control=None, seed=0, bug=None, steps=20,
           size=4, seq=32, folder=None, **options) -> tuple:
    path = os.path.join(root, folder or kind, name)
    shutil.rmtree(path, ignore_errors=True)
    model = cm.build(kind)
    clock = cm.Clock()
    if bug:
        cm.plant(model, kind, bug, clock, ONSET, **options)
    t0 = time.perf_counter()
    with GradProbe(model, dump_path=path, control=control, control_seed=seed):
        cm.train(model, kind, setting, steps, clock=clock, size=size, seq=seq)
    return path, time.perf_counter() - t0


def where(param: str, target: str) -> str:
    """Where the reported parameter lies relative to the planted module."""
    module = target.rsplit(".", 1)[0] if target.endswith((".weight", ".bias")) else target
    if param.startswith(module + ".") or param == target:
        return "planted module"
    parent = module.rsplit(".", 1)[0]
    if param.startswith(parent + "."):
        return "its parent"
    block = _block(module)
    if block and param.startswith(block + "."):
        return "same block"
    if block and _block(param) == _next_block(block):
        return "next block"
    return "elsewhere"


def _block(name: str) -> str:
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ""


def _next_block(block: str) -> str:
    head, _, index = block.rpartition(".")
    return f"{head}.{int(index) + 1}"


def judge(ref, test, controls) -> dict:
    cmp = compare_grads(ref, test, control=list(controls), progress=False)
    r = cmp.isel(rank=0)
    kinds = np.asarray(r["flag_kind"].values)
    with np.errstate(all="ignore"):
        worst = float(np.nanmax(np.where(kinds > 0, r["excess"].values, np.nan))) \
            if (kinds > 0).any() else 0.0
    return {"verdict": verdict_kind(cmp), "step": int(r["first_step"]), "excess": worst,
            "margin": float(r["margin"]) if "margin" in r else float("nan"),
            "param": str(r["first_param"].item()), "sign": int((kinds == 1).sum()),
            "scale": int((kinds == 2).sum()), "nonfinite": int((kinds == 3).sum()),
            "total": int(np.asarray(r["flag_total"].values).sum()),
            "suspects": list(cmp.probekit.suspects().head(3)["module"]),
            "text": str(cmp).split("\n")[0]}


def validate(args) -> dict:
    root = args.dir or tempfile.mkdtemp(prefix="probekit-control-")
    rows, seconds = [], {}
    for kind in args.models.split(","):
        if args.judge_only:     # the runs an earlier ``--dir`` run recorded, judged again
            names = ["ref", *CONTROL_RUNS, *HEALTHY, *("bug_" + b for b in BUGS)]
            runs = {n: (os.path.join(root, kind, n), 0.0) for n in names}
            seconds[kind] = {}
            path = {k: v[0] for k, v in runs.items()}
            rows += _judge_all(kind, path)
            continue
        runs = {"ref": record(root, kind, "ref", steps=args.steps)}
        for name, spec in CONTROL_RUNS.items():
            runs[name] = record(root, kind, name, control=spec, seed=int(name[-1]),
                                steps=args.steps)
        for setting in HEALTHY:
            runs[setting] = record(root, kind, setting, setting, steps=args.steps)
        for bug in BUGS:
            plant, _, variant = bug.partition("_inf")
            runs["bug_" + bug] = record(root, kind, "bug_" + bug, "autocast", bug=plant,
                                        steps=args.steps,
                                        **({"saturate": False} if bug == "overflow_inf" else {}))
        seconds[kind] = {k: round(v[1], 2) for k, v in runs.items()}
        rows += _judge_all(kind, {k: v[0] for k, v in runs.items()})
    return {"rows": rows, "seconds": seconds, "steps": args.steps, "onset": ONSET}


def _judge_all(kind, path) -> list:
    """Every test of ``kind`` judged with two controls and with the first alone."""
    rows = []
    tests = [*HEALTHY, "c_bf16_2"] + ["bug_" + b for b in BUGS]
    for test in tests:
        ctrls = CONTROLS.get(test, ("c_bf16_0", "c_bf16_1"))
        two = judge(path["ref"], path[test], [path[c] for c in ctrls])
        one = judge(path["ref"], path[test], [path[ctrls[0]]])
        bug = test[4:].replace("_inf", "") if test.startswith("bug_") else ""
        row = {"model": kind, "test": test, "controls": list(ctrls), "two": two, "one": one,
               "expected": "beyond" if bug else "within"}
        if bug:
            target = cm.TARGETS[kind][bug]
            row.update(target=target, where_two=where(two["param"], target),
                       where_one=where(one["param"], target))
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("model", "test", "expected")}),
              two["verdict"], two["step"], two["param"], "| one:", one["verdict"],
              one["step"], one["param"], flush=True)
    return rows


def _gradient_error(root, tag, name):
    """The planted parameter's recorded gradient against the reference's at the onset step:
    significant-sign flips, norm and range ratios."""
    from probekit.grads import open_grads

    param = cm.TARGETS["gpt2"]["accumulate"] + ".weight"
    ref = open_grads(os.path.join(root, tag, "ref"))
    run = open_grads(os.path.join(root, tag, name))
    j = [str(p) for p in ref["param"].values].index(param)
    s = list(ref["step"].values).index(ONSET)
    rng = lambda ds: float(ds["max"].values[s, j] - ds["min"].values[s, j])  # noqa: E731
    return {"norm_ratio": float(run["norm"].values[s, j] / ref["norm"].values[s, j]),
            "range_ratio": rng(run) / rng(ref)}


def line(args) -> dict:
    """The bf16-accumulation bug (GPT-2's block-1 MLP down projection: K = 1024 in its forward,
    K = the tokens of a step in its weight gradient) at 128, 1024 and 4096 tokens per step,
    sequential or in fp32 chunks of 16: where it becomes beyond noise."""
    root = args.dir or tempfile.mkdtemp(prefix="probekit-line-")
    out = []
    for size, seq in ((4, 32), (8, 128), (16, 256)):
        tag = f"{size}x{seq}"
        kw = {"steps": args.steps, "size": size, "seq": seq}
        kw = {**kw, "folder": tag}
        ref = record(root, "gpt2", "ref", **kw)[0]
        ctrls = [record(root, "gpt2", f"c{s}", control="bf16", seed=s, **kw)[0] for s in (0, 1)]
        for chunk in (1, 16):
            test = record(root, "gpt2", f"acc{chunk}", "autocast", bug="accumulate", chunk=chunk,
                          **kw)[0]
            res = judge(ref, test, ctrls)
            res.update(tokens=size * seq, chunk=chunk,
                       **_gradient_error(root, tag, f"acc{chunk}"))
            out.append(res)
            print(json.dumps({k: res[k] for k in ("tokens", "chunk", "verdict", "step",
                                                   "param")}), flush=True)
    return {"line": out, "steps": args.steps}


# -- the healthy-pair sweep (issue 37) ---------------------------------------------------------
#: healthy fp32 changes per zoo model (tests/_hf_models.py): another attention path (eager
#: instead of SDPA, SDPA's math backend), the oneDNN kernels off (convolutions, LSTM/GRU), the
#: batch in two micro-batches (another reduction order in every weight gradient; not for
#: BatchNorm models, whose statistics it changes), every linear layer's input features permuted,
#: and the CPU's vector kernels at their default ISA instead of AVX512 (``isa``, in a process of
#: its own: ATEN_CPU_CAPABILITY)
SWEEP = {"gpt2": ("eager", "sdpa_math", "split", "reorder", "isa"),
         "bert": ("eager", "split", "reorder", "isa"),
         "t5": ("eager", "split", "reorder", "isa"),
         "vit": ("eager", "mkldnn_off", "split", "isa"),
         "wav2vec2": ("eager", "mkldnn_off", "split", "isa"),
         "moe": ("eager", "experts_eager", "split", "isa"),
         "resnet": ("mkldnn_off", "reorder", "isa"),
         "secnn": ("mkldnn_off", "isa"),
         "rnnlm": ("mkldnn_off", "split", "reorder", "isa"),
         # the three the rule's priors were measured on (not held out)
         "convnext": ("mkldnn_off", "split", "isa"), "qwen2": ("eager", "split", "isa"),
         "llama": ("eager", "split", "isa")}
TUNED = ("convnext", "qwen2", "llama")
#: planted in an fp32 test from ONSET, judged against the fp32 controls: the middle
#: parameter's gradient divided by 2, or scaled by 1.01
SWEEP_BUGS = {"bug_half": 2.0, "bug_1pc": 1 / 1.01}
SWEEP_STEPS = 16


def _zoo_setting(setting):
    import contextlib

    if setting == "mkldnn_off":
        return torch.backends.mkldnn.flags(enabled=False)
    if setting == "sdpa_math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def zoo_record(path, kind, setting="fp32", control=None, seed=0, steps=SWEEP_STEPS,
               bf16=False, watch=None) -> str:
    """One recorded run of a zoo model: AdamW (lr 1e-3), batches of 4 (x 16 tokens);
    ``setting`` a healthy change (``SWEEP``), a bug (``SWEEP_BUGS``), or "fp32"/"autocast".
    ``watch(model, clock)``: called on the model before training (hooks that observe the run:
    ``bench_control_splits.py``); the run is then recorded again even where it exists."""
    import _hf_models as hm

    if watch is None and os.path.exists(os.path.join(path, "grads.zarr", "rank0",
                                                     "commit.json")):
        return path
    if setting == "isa" and os.environ.get("ATEN_CPU_CAPABILITY") != "default":
        import subprocess

        env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
        subprocess.run([sys.executable, os.path.abspath(__file__), "record", "--out", path,
                        "--models", kind, "--setting", "isa", "--steps", str(steps)],
                       env=env, check=True)
        return path
    shutil.rmtree(path, ignore_errors=True)
    model = hm.zoo_model("moe_eager" if setting == "experts_eager" else kind)
    if setting == "eager":
        model.set_attn_implementation("eager")
    if setting == "reorder":
        cm.reorder(model)
    clock = cm.Clock()
    if watch is not None:
        watch(model, clock)
    if setting in SWEEP_BUGS:
        names = [n for n, p in model.named_parameters() if p.dim() >= 2]
        param = model.get_parameter(names[len(names) // 2])
        factor = SWEEP_BUGS[setting]

        def scale(p):
            if clock.step >= ONSET:
                p.grad.div_(factor)
        param.register_post_accumulate_grad_hook(scale)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GradProbe(model, dump_path=path, control=control, control_seed=seed) as probe:
        for step in range(steps):
            clock.step = step
            inputs = hm.zoo_batch(kind, gen, batch=4, seq=16)
            halves = ([{k: v[:2] for k, v in inputs.items()}, {k: v[2:] for k, v in inputs.items()}]
                      if setting == "split" else [inputs])
            opt.zero_grad()
            # the test's autocast, and where it is, the reference's code marks it for its
            # control (an autocast(enabled=False) in there would turn the control's off)
            amp = (torch.autocast("cpu", dtype=torch.bfloat16) if setting == "autocast"
                   else probe.recipe())
            with _zoo_setting(setting):
                for part in halves:
                    with amp:
                        loss = model(**part).loss / len(halves)
                    loss.backward()
                opt.step()
    return path


def sweep(args) -> dict:
    """Healthy fp32 pairs (``SWEEP``) and planted fp32 bugs on zoo models, judged with two fp32
    controls and with each of three alone; each control judged against the others (null pairs);
    ``--bf16``: bf16 autocast against bf16 controls too."""
    root = args.dir or tempfile.mkdtemp(prefix="probekit-sweep-")
    rows = []
    for kind in args.models.split(","):
        at = lambda name: os.path.join(root, kind, name)  # noqa: E731
        t0 = time.perf_counter()
        ref = zoo_record(at("ref"), kind, steps=args.steps)
        groups = [("fp32", [zoo_record(at(f"c_fp32_{s}"), kind, control="fp32", seed=s,
                                       steps=args.steps) for s in range(3)],
                   [*SWEEP[kind], *SWEEP_BUGS])]
        if args.bf16:
            groups.append(("bf16", [zoo_record(at(f"c_bf16_{s}"), kind, control="bf16",
                                               seed=s, steps=args.steps) for s in range(3)],
                           ["autocast"]))
        for prec, ctrls, tests in groups:
            runs = {t: zoo_record(at(t), kind, t, steps=args.steps) for t in tests}
            for test, path in runs.items():
                expected = "beyond" if test in SWEEP_BUGS else "within"
                for use in ([0, 1], [0], [1], [2]):
                    res = judge(ref, path, [ctrls[i] for i in use])
                    rows.append({"model": kind, "precision": prec, "test": test,
                                 "controls": len(use), "expected": expected,
                                 "held_out": kind not in TUNED, **res})
            for i in range(3):          # null pairs: a control as the test
                others = [j for j in range(3) if j != i]
                for use in (others, others[:1], others[1:]):
                    res = judge(ref, ctrls[i], [ctrls[j] for j in use])
                    rows.append({"model": kind, "precision": prec, "test": f"control {i}",
                                 "controls": len(use), "expected": "within",
                                 "held_out": kind not in TUNED, **res})
        print(kind, f"{time.perf_counter() - t0:.0f} s", flush=True)
        for r in rows:
            if r["model"] == kind and r["verdict"] != r["expected"]:
                print("  ", r["precision"], r["test"], r["controls"], r["verdict"],
                      f"excess {r['excess']:.3g} margin {r['margin']:.3g}", r["text"][:150],
                      flush=True)
    return {"rows": rows, "steps": args.steps, "onset": ONSET, "summary": _summary(rows)}


def _peaks(ref, run, stat) -> np.ndarray:
    """A run's largest deviation per parameter over the steps, for the norm and the range, by
    ``stat`` ("log": ``|ln(x/r)|``; "typical": the verdict's ``step_dev``): (2, params)."""
    from probekit.grads import open_grads

    r, x = open_grads(ref), open_grads(run)
    out = []
    for k in ("norm", "range"):
        get = (lambda ds: ds["norm"].values) if k == "norm" else \
            (lambda ds: ds["max"].values - ds["min"].values)
        rv, xv = np.asarray(get(r), np.float64)[None], np.asarray(get(x), np.float64)[None]
        dev = verdict.log_dev(xv, rv) if stat == "log" else \
            verdict.step_dev(xv, rv, verdict.typical_share(rv))
        with np.errstate(all="ignore"):
            out.append(np.nanmax(np.where(np.isfinite(dev), dev, np.nan), axis=1)[0])
    return np.stack(out)


def priors(args) -> dict:
    """The spread of runs of rounding (``verdict.PRIOR_SPREAD``) measured again: ``--controls``
    fp32 and bf16 controls of each model against its reference (``zoo_record``); per
    statistic (the log deviation, and the verdict's deviation in units of the typical one) the
    log of each control's largest deviation per parameter, split into a shift of the run (sd
    over the controls of their mean departure) and a term of each parameter (sd of what is
    left), with the parameter term's kurtosis."""
    root = args.dir or tempfile.mkdtemp(prefix="probekit-priors-")
    out = {}
    for kind in args.models.split(","):
        at = lambda name: os.path.join(root, kind, name)  # noqa: E731
        ref = zoo_record(at("ref"), kind, steps=args.steps)
        for prec in ("fp32", "bf16"):
            runs = [zoo_record(at(f"c_{prec}_{s}"), kind, control=prec, seed=s,
                               steps=args.steps) for s in range(args.controls)]
            for stat in ("log", "typical"):
                y = np.log(np.stack([_peaks(ref, r, stat) for r in runs]))  # (c, 2, p)
                y = y.reshape(len(runs), -1)
                y = y[:, np.isfinite(y).all(axis=0)]
                level = y.mean(axis=0, keepdims=True)
                shift = (y - level).mean(axis=1, keepdims=True)
                rest = y - level - shift
                dof = max(1, (y.shape[0] - 1) * (y.shape[1] - 1))
                sd = float(np.sqrt((rest ** 2).sum() / dof))
                kurt = float(((rest / sd) ** 4).mean()) if sd > 0 else float("nan")
                out[f"{kind} {prec} {stat}"] = {
                    "run_sd": float(shift.std(ddof=1)), "param_sd": sd,
                    "param_kurtosis": kurt, "params": int(y.shape[1] // 2)}
                print(kind, prec, stat, {k: round(v, 3) for k, v in
                                         out[f"{kind} {prec} {stat}"].items()}, flush=True)
    return {"controls": args.controls, "steps": args.steps, "priors": out,
            "verdict_prior": verdict.PRIOR_SPREAD}


def _summary(rows) -> dict:
    out = {}
    for label, keep in (("healthy", lambda r: r["expected"] == "within"
                         and not r["test"].startswith("control")),
                        ("null", lambda r: r["test"].startswith("control")),
                        ("bugs", lambda r: r["expected"] == "beyond")):
        for k in (1, 2):
            for held in (True, False):
                sel = [r for r in rows if keep(r) and r["controls"] == k
                       and r["held_out"] == held]
                if sel:
                    key = f"{label} {'held-out' if held else 'tuned'} {k} control(s)"
                    if label == "bugs":
                        out[key] = {"pairs": len(sel),
                                    "beyond at onset": sum(r["verdict"] == "beyond"
                                                           and r["step"] == ONSET for r in sel),
                                    "beyond": sum(r["verdict"] == "beyond" for r in sel)}
                    else:
                        out[key] = {"pairs": len(sel),
                                    "false beyond": sum(r["verdict"] == "beyond" for r in sel)}
    return out


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


#: ``cost --model``: the validation's GPT-2 (width 64, 3 layers, 4 x 32 tokens, AdamW), or
#: ``bench_freebench_msprobe``'s model at one of its sizes (``block``: d=128, 4 x 32 tokens;
#: ``small``: d=256, 4 x 64 tokens, issue 38's "size people try first"), built in fp32 (a
#: control's reference is fp32) with SGD
COST_MODELS = ("gpt2", "block", "small")


def _cost_model(kind: str):
    """(model, step(setting)) for ``COST_MODELS``: one training step, ``setting`` "fp32" or
    "autocast" (bf16 autocast around the forward)."""
    if kind == "gpt2":
        model = cm.build("gpt2")
        return model, lambda setting: cm.train(model, "gpt2", setting, 1)
    import bench_freebench_msprobe as fm

    fm.set_size(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(fm.Block(), fm.Block())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(fm.B, fm.T, fm.D)

    def step(setting):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step


def _step_costs(repeats: int, kind: str = "gpt2") -> dict:
    """A training step of ``kind`` (``COST_MODELS``; one torch thread) plain in fp32, under bf16
    autocast, and as control runs (each on its own copy of the model, the control's mode entered
    for its step only), the configurations interleaved step by step; the thread's CPU time,
    medians of the per-round ratios to the plain step (issue 38: on a shared machine the load
    moves a round's steps alike)."""
    from probekit.grads.record.control import perturb

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    configs = {}
    for name, setting, control in (("plain", "fp32", None), ("autocast", "autocast", None),
                                   ("control bf16", "fp32", "bf16"),
                                   ("control bf16:cast", "fp32", "bf16:cast"),
                                   ("control fp32", "fp32", "fp32")):
        model, run = _cost_model(kind)
        configs[name] = (run, setting, perturb(model, control) if control else None)

    def step(name):
        run, setting, probe = configs[name]
        if probe is not None:
            probe.start()
        try:
            c0 = time.thread_time()
            run(setting)
            return time.thread_time() - c0
        finally:
            if probe is not None:
                probe.stop()

    try:
        for name in configs:            # warm-up
            step(name), step(name)
        times = {name: [] for name in configs}
        for _ in range(max(repeats, 5)):
            for name in configs:
                times[name].append(step(name))
    finally:
        torch.set_num_threads(threads)
    res = {}
    for name, ts in times.items():
        res[f"step {name} ms"] = round(statistics.median(ts) * 1e3, 1)
        ratios = [t / p for t, p in zip(ts, times["plain"])]
        res[f"step {name} / plain"] = round(statistics.median(ratios), 2)
        res[f"step {name} / plain quartiles"] = [round(q, 2) for q in
                                                 statistics.quantiles(ratios, n=4)[::2]]
    return res


def _recorded_costs(repeats: int, kind: str = "gpt2", steps: int = 12) -> dict:
    """Issue 38 point 5 as it reads: a whole recorded run (``GradProbe`` over ``steps`` steps of
    ``kind``, one torch thread, a fresh model and store each time) with each control against
    the same run recorded plainly, the configurations in turn, ``repeats`` rounds; the process's
    CPU time of each run (the writing thread's included), medians of the per-round ratios."""
    from probekit.grads import GradProbe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="probekit-recorded-")
    configs = {"plain recorded": None, "control bf16": "bf16", "control bf16:cast": "bf16:cast",
               "control fp32": "fp32"}

    def one(control) -> float:
        path = os.path.join(root, "run")
        shutil.rmtree(path, ignore_errors=True)
        model, run = _cost_model(kind)
        c0 = time.process_time()
        with GradProbe(model, dump_path=path, control=control):
            for _ in range(steps):
                run("fp32")
        return time.process_time() - c0

    try:
        for control in configs.values():     # warm-up
            one(control)
        times = {name: [] for name in configs}
        for _ in range(max(repeats, 3)):
            for name, control in configs.items():
                times[name].append(one(control))
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)
    res = {}
    for name, ts in times.items():
        res[f"recorded {name} s"] = round(statistics.median(ts), 3)
        res[f"recorded {name} / plain recorded"] = round(statistics.median(
            t / p for t, p in zip(ts, times["plain recorded"])), 2)
    return res


def cost(args) -> dict:
    """Step time of a control run against a plain fp32 run and a bf16-autocast run (GPT-2 of
    the validation); a comparison with one control against a plain comparison (wall and CPU
    time, alternating, medians), on those runs and on larger recordings (MLPs of 16.8M and 67M
    parameters, 20 steps): with the verdict's margins cached (a process's later comparisons)
    and cold (simulated again, as in a process's first)."""
    root = args.dir or tempfile.mkdtemp(prefix="probekit-cost-")
    res = {} if args.compare_only else _step_costs(args.repeats, args.model)
    if args.recorded:
        res.update(_recorded_costs(args.repeats, args.model))
    if args.model != "gpt2":
        res = {f"{args.model}: {k}": v for k, v in res.items()}
    if args.steps_only:
        return res
    # comparisons: the validation's GPT-2 runs, and larger recordings
    small = {n: record(root, "gpt2", n, s, control=c, steps=20)[0] for n, s, c in (
        ("ref", "fp32", None), ("test", "autocast", None), ("ctrl", "fp32", "bf16"))}
    sets = [("gpt2 0.2M x 20 steps", small)]
    for width, label in ((2048, "mlp 16.8M x 20 steps"), (4096, "mlp 67M x 20 steps")):
        sets.append((label, {n: _mlp_run(root, n, c, width=width) for n, c in (
            ("ref", None), ("test", None), ("ctrl", "bf16"))}))
    for label, runs in sets:
        def plain():
            compare_grads(runs["ref"], runs["test"], progress=False)

        def with_control():
            compare_grads(runs["ref"], runs["test"], control=runs["ctrl"], progress=False)

        def cold():                      # the verdict's margins simulated again (first use)
            verdict._MARGINS.clear()
            getattr(verdict, "_FAMILY", {}).clear()
            with_control()

        plain(), with_control()          # the page cache warm for both
        fns = (("plain", plain), ("control", with_control), ("cold", cold))
        times = {name: [] for name, _ in fns}
        for i in range(args.repeats):    # alternating, wall and CPU time of this process
            for name, fn in fns[::1 if i % 2 else -1]:
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
        for what, k in (("wall", 0), ("cpu", 1)):
            p = statistics.median(t[k] for t in times["plain"])
            c = statistics.median(t[k] for t in times["control"])
            f = statistics.median(t[k] for t in times["cold"])
            res[f"compare {label} {what} plain s"] = round(p, 3)
            res[f"compare {label} {what} with control s"] = round(c, 3)
            res[f"compare {label} {what} ratio"] = round(c / p, 2)
            # each round's own ratio (its plain and control comparisons run next to each
            # other): a machine whose speed drifts between rounds moves both alike
            per = [x[k] / y[k] for x, y in zip(times["control"], times["plain"])]
            res[f"compare {label} {what} ratio per round"] = round(statistics.median(per), 3)
            if len(per) >= 4:
                q = statistics.quantiles(per, n=4)
                res[f"compare {label} {what} ratio per round quartiles"] = [round(q[0], 2),
                                                                           round(q[2], 2)]
            res[f"compare {label} {what} with control, margins cold s"] = round(f, 3)
            res[f"compare {label} {what} ratio, margins cold"] = round(f / p, 2)
    return res


def _mlp_run(root, name, control, steps=20, width=2048):
    """An MLP of 4 layers of ``width`` x ``width`` (16.8M parameters at 2048, 67M at 4096), fp32
    weights, recorded over ``steps``; ``name`` "test" under bf16 autocast; with ``control`` its
    bf16-autocast control."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    path = os.path.join(root, f"mlp{width}", name)
    if os.path.exists(os.path.join(path, "grads.zarr", "rank0", "commit.json")):
        return path                     # recorded by an earlier run of this benchmark (--dir)
    shutil.rmtree(path, ignore_errors=True)
    gen = torch.Generator().manual_seed(1)
    with GradProbe(model, dump_path=path, control=control):
        for _ in range(steps):
            x = torch.randn(8, width, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "test"):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("validate", "line", "cost", "sweep", "record", "priors"))
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="gpt2,llama,bert,resnet,vit,distilbert")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None,
                   help="keep the recorded runs here (without it: a temporary folder, removed)")
    p.add_argument("--steps-only", action="store_true",
                   help="cost: the control runs' step times only (no comparisons)")
    p.add_argument("--recorded", action="store_true",
                   help="cost: also whole recorded runs with each control against a plain one")
    p.add_argument("--compare-only", action="store_true",
                   help="cost: the comparisons only (no control runs' step times)")
    p.add_argument("--judge-only", action="store_true",
                   help="validate: judge the runs already recorded in --dir again")
    p.add_argument("--bf16", action="store_true", help="sweep: bf16 autocast pairs too")
    p.add_argument("--controls", type=int, default=10, help="priors: controls per precision")
    p.add_argument("--setting", default="fp32", help="record: the setting (one run)")
    p.add_argument("--model", default="gpt2", choices=COST_MODELS,
                   help="cost: the model whose steps are timed (default: the GPT-2)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.WARNING)
    if args.what == "record":       # one zoo run (the sweep's ``isa`` runs, in a process)
        zoo_record(args.out, args.models, args.setting, steps=args.steps)
        return 0
    if args.what == "priors":
        if args.models == p.get_default("models"):
            args.models = ",".join(TUNED)
        if args.steps == p.get_default("steps"):
            args.steps = SWEEP_STEPS
    if args.what == "sweep":
        if args.models == p.get_default("models"):
            args.models = ",".join(k for k in SWEEP if k not in TUNED)
        if args.steps == p.get_default("steps"):
            args.steps = SWEEP_STEPS
    run = {"validate": validate, "line": line, "cost": cost, "sweep": sweep,
           "priors": priors}[args.what]
    if args.dir is None:   # the recorded runs in a folder of their own, removed at the end
        with tempfile.TemporaryDirectory(prefix=f"probekit-{args.what}-") as tmp:
            args.dir = tmp
            res = run(args)
    else:
        res = run(args)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
