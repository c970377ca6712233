"""MindSpore grad-probe benchmark: cost per optimizer step next to PyTorch's, in one process.

Runs in ``.venv-mindspore`` (MindSpore's CPU wheel, torch, probekit). For each size and level,
the same parameter shapes (``bench_grads.build_model``) are recorded by probekit's PyTorch probe
and by its MindSpore probe, alternately, several times; reported are medians of the per-step
cost (hook + writes, as in bench_grads) and each against one plain read of every gradient in
the same framework (``torch.sum`` / ``ops.sum`` of each gradient). With ``--msprobe`` the
MindSpore grad probe of mindstudio-probe (if importable here) is timed on the same optimizer.

    .venv-mindspore/bin/python benchmarks/bench_mindspore.py --out bench_out/ms.json \
        --results benchmarks/RESULTS.md     # (re)writes its section of RESULTS.md (make bench)
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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import ops  # noqa: E402

from bench_grads import build_model, du, read_time, run_steps, set_grads  # noqa: E402


def ms_setup(model: torch.nn.Module, steps: int):
    """MindSpore parameters of the same shapes, and ``steps`` gradient tuples (fixed seeds)."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    params = [ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
              for i, s in enumerate(shapes)]
    grads = []
    for step in range(steps):
        rng = np.random.default_rng(step)
        grads.append(tuple(ms.Tensor((rng.standard_normal(s) * 0.01).astype(np.float32))
                           for s in shapes))
    return params, grads


def ms_read_time(grads, repeats=7) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        outs = [ops.sum(g) for g in grads]
        outs[-1].asnumpy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def ms_run(params, grads, level: str, dump: str) -> dict:
    from probekit.mindspore import GradProbe

    opt = ms.nn.SGD(params, learning_rate=0.0)
    probe = GradProbe(opt, grad_level=level, dump_path=dump).start()
    empty = du(dump)
    for g in grads:
        opt(g)
    t0 = time.perf_counter()
    probe.stop()
    flush = time.perf_counter() - t0
    n = len(grads)
    return {"per_step_s": (sum(probe.hook_seconds) + flush) / n,
            "hook_s": statistics.median(probe.hook_seconds),
            "bytes_per_step": (du(dump) - empty) / n}


def msprobe_run(params, grads, level: str, dump: str) -> dict | None:
    """mindstudio-probe's MindSpore grad probe on the same optimizer (PyNative), if importable."""
    try:
        from msprobe.mindspore import PrecisionDebugger
    except Exception as exc:  # not installed, or not importable with this MindSpore
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    import logging

    logging.disable(logging.INFO)
    cfg = {"task": "grad_probe", "dump_path": dump, "rank": [], "step": [],
           "grad_probe": {"grad_level": level, "param_list": [], "bounds": [-1, 0, 1]}}
    path = dump + ".json"
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    try:
        PrecisionDebugger._instance = None
        dbg = PrecisionDebugger(config_path=path)
        opt = ms.nn.SGD(params, learning_rate=0.0)
        dbg.monitor(opt)
        t0 = time.perf_counter()
        for g in grads:
            opt(g)
        total = time.perf_counter() - t0
        dbg.stop()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    plain = ms.nn.SGD(params, learning_rate=0.0)
    t0 = time.perf_counter()
    for g in grads:
        plain(g)
    base = time.perf_counter() - t0
    return {"per_step_s": (total - base) / len(grads), "bytes_per_step": du(dump) / len(grads)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 16.8])
    parser.add_argument("--levels", nargs="+", default=["L0", "L1", "L2"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--msprobe", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--results", help="RESULTS.md whose MindSpore section is (re)written")
    args = parser.parse_args(argv)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    import logging

    logging.getLogger("probekit").setLevel(logging.WARNING)
    rows = []
    tmp = tempfile.mkdtemp(prefix="bench_ms_")
    try:
        for size in args.sizes:
            torch.manual_seed(0)
            model = build_model(size)
            nparams = sum(p.numel() for p in model.parameters())
            set_grads(model, 0)
            t_read = read_time(model)
            params, grads = ms_setup(model, args.steps)
            m_read = ms_read_time(grads[0])
            for level in args.levels:
                pt, msr = [], []
                for r in range(args.repeats):  # alternate the two, medians
                    d = os.path.join(tmp, f"pt_{size}_{level}_{r}")
                    pt.append(run_steps("probekit", model, level, args.steps, d))
                    d = os.path.join(tmp, f"ms_{size}_{level}_{r}")
                    msr.append(ms_run(params, grads, level, d))
                row = {"params": nparams, "level": level, "steps": args.steps,
                       "torch_read_s": t_read, "ms_read_s": m_read,
                       "torch_per_step_s": statistics.median(x["per_step_s"] for x in pt),
                       "ms_per_step_s": statistics.median(x["per_step_s"] for x in msr),
                       "ms_hook_s": statistics.median(x["hook_s"] for x in msr),
                       "torch_bytes_per_step": pt[0]["bytes_per_step"],
                       "ms_bytes_per_step": msr[0]["bytes_per_step"]}
                if args.msprobe:
                    row["msprobe"] = msprobe_run(params, grads, level,
                                                 os.path.join(tmp, f"msprobe_{size}_{level}"))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    versions = {"mindspore": ms.__version__, "torch": torch.__version__,
                "numpy": np.__version__, "python": sys.version.split()[0]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "versions": versions}, fh, indent=1)
    if args.results:
        write_section(args.results, render(rows, versions, args))
    return 0


BEGIN, END = "<!-- mindspore: written by bench_mindspore.py -->", "<!-- /mindspore -->"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def render(rows, versions, args) -> str:
    load = os.getloadavg()[0]
    lines = [BEGIN, "## Grad probe: MindSpore hook cost per step, next to PyTorch", "",
             f"`benchmarks/bench_mindspore.py` in `.venv-mindspore` (mindspore "
             f"{versions['mindspore']}, torch {versions['torch']}, numpy {versions['numpy']}); "
             f"load average {load:.2f} at the end. The same parameter shapes as above, "
             f"{args.steps} steps, recorded by probekit's PyTorch probe and its MindSpore probe "
             f"alternately, {args.repeats} times, in one process; per step = hook + writes (as "
             "above), medians. `read` = `torch.sum` / `ops.sum` of every gradient. On the CPU "
             "the MindSpore probe reads the gradients in place through the same chunked host "
             "path as PyTorch (docs/mindspore.md), so the two should cost about the same.", "",
             "| params | level | PyTorch per step | MindSpore per step | MindSpore / PyTorch | "
             "MindSpore hook alone | read torch / MindSpore | disk/step (both) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.1f}M | {r['level']} | {_ms(r['torch_per_step_s'])} | "
            f"{_ms(r['ms_per_step_s'])} | **{r['ms_per_step_s'] / r['torch_per_step_s']:.2f}×** | "
            f"{_ms(r['ms_hook_s'])} | {_ms(r['torch_read_s'])} / {_ms(r['ms_read_s'])} | "
            f"{r['ms_bytes_per_step'] / 1e3:.1f} KB |")
    errors = {r["msprobe"]["error"] for r in rows if "error" in r.get("msprobe", {})}
    lines += ["", "msprobe's MindSpore grad probe: " + (
        "not measured: `mindstudio-probe` 1.0.4's `msprobe.mindspore` does not import with "
        "MindSpore 2.10.0 (`_MindsporeFunctionExecutor` is gone from `mindspore.common.api`), "
        "and 26.2.0 has no grad_probe task." if not args.msprobe or errors else "see the JSON."),
        END]
    return "\n".join(lines)


def write_section(path: str, section: str) -> None:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


if __name__ == "__main__":
    raise SystemExit(main())
