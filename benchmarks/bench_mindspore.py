"""MindSpore grad-probe benchmark: cost per optimizer step next to PyTorch's, in one process.

Runs in ``.venv-mindspore`` (MindSpore's CPU wheel, torch, probekit). For each size and level,
the same parameter shapes (``bench_grads.build_model``) are recorded by probekit's PyTorch probe
and by its MindSpore probe, alternately, several times; reported are medians of the per-step
cost (hook + writes, as in bench_grads) and each against one plain read of every gradient in
the same framework (``torch.sum`` / ``ops.sum`` of each gradient). With ``--msprobe`` the
MindSpore grad probe of mindstudio-probe (if importable here) is timed on the same optimizer.

    .venv-mindspore/bin/python benchmarks/bench_mindspore.py --out bench_out/ms.json \
        --results benchmarks/RESULTS.md     # (re)writes its sections of RESULTS.md (make bench)

A second part (``--graph``, on by default; ``--graph-only`` runs only it) times whole training
steps of a ~10M-parameter MLP: compiled (GRAPH_MODE, one ``@ms.jit`` step with the optimizer
inside) and PyNative, each plain and with the probe at L1 (the host statistics the CPU gets by
default, and the in-graph ops of the accelerator path) and L2. Every variant is built and
compiled first, then they run in turns, a block of steps each, several rounds; reported are
the medians over rounds of each variant's step time over the plain step's time in the same
round, the probe's final write included (spread over the recorded steps).
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
from results_md import write_section  # noqa: E402


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


GRAPH_SIZES = (1024, 2048, 2048, 2048, 10)  # 10.5M parameters
GRAPH_VARIANTS = (("plain", None, None), ("L1 host", "L1", "host"),
                  ("L1 in-graph", "L1", "device"), ("L2 host", "L2", "host"))


def _mlp(sizes):
    from mindspore import nn

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([nn.Dense(a, b) for a, b in zip(sizes, sizes[1:])])

        def construct(self, x):
            for layer in self.layers[:-1]:
                x = ops.tanh(layer(x))
            return self.layers[-1](x)

    return MLP()


def _train_step(compiled: bool):
    """A fresh model, its SGD optimizer and a train step (``@ms.jit``, optimizer inside, or
    PyNative with the optimizer's own compiled construct)."""
    ms.set_seed(0)
    net = _mlp(GRAPH_SIZES)
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=1e-4)
    loss_fn = ms.nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return opt, (ms.jit(step) if compiled else step)


def graph_bench(mode: str, batch: int, rounds: int, block: int, tmp: str) -> list:
    """Step times of every variant in turns (see the module docstring); one row per variant."""
    from probekit.mindspore import GradProbe

    compiled = mode == "graph"
    ms.set_context(mode=ms.GRAPH_MODE if compiled else ms.PYNATIVE_MODE)
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((batch, GRAPH_SIZES[0])).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((batch, GRAPH_SIZES[-1])).astype(np.float32))
    runs = []
    for name, level, where in GRAPH_VARIANTS:
        opt, step = _train_step(compiled)
        probe = None
        if level:
            probe = GradProbe(opt, grad_level=level, where=where,
                              dump_path=os.path.join(tmp, f"{mode}_{level}_{where}")).start()
        for _ in range(2):  # compile, warm up
            step(x, y).asnumpy()
        runs.append({"name": name, "step": step, "probe": probe, "times": []})
    for _ in range(rounds):
        for run in runs:
            t0 = time.perf_counter()
            for _ in range(block):
                loss = run["step"](x, y)
            loss.asnumpy()
            run["times"].append((time.perf_counter() - t0) / block)
    rows = []
    plain = runs[0]["times"]
    for run in runs:
        extra = 0.0
        if run["probe"] is not None:
            t0 = time.perf_counter()
            run["probe"].stop()
            extra = (time.perf_counter() - t0) / max(1, run["probe"].steps_seen)
        times = [t + extra for t in run["times"]]
        rows.append({"mode": mode, "variant": run["name"], "batch": batch,
                     "params": sum(a * b + b for a, b in zip(GRAPH_SIZES, GRAPH_SIZES[1:])),
                     "step_s": statistics.median(times),
                     "ratio": statistics.median(t / p for t, p in zip(times, plain)),
                     "ratio_best": min(times) / min(plain),
                     "rounds": rounds, "block": block})
        print(json.dumps(rows[-1]), flush=True)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 16.8])
    parser.add_argument("--levels", nargs="+", default=["L0", "L1", "L2"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--msprobe", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--results", help="RESULTS.md whose MindSpore sections are (re)written")
    parser.add_argument("--no-graph", dest="graph", action="store_false",
                        help="skip the compiled-training part")
    parser.add_argument("--graph-only", action="store_true",
                        help="only the compiled-training part")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args(argv)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    import logging

    logging.getLogger("probekit").setLevel(logging.WARNING)
    rows, graph_rows = [], []
    tmp = tempfile.mkdtemp(prefix="bench_ms_")
    load0 = os.getloadavg()[0]
    try:
        if args.graph or args.graph_only:
            for mode in ("graph", "pynative"):
                graph_rows += graph_bench(mode, args.batch, args.rounds, args.block, tmp)
        for size in (() if args.graph_only else args.sizes):
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
        json.dump({"rows": rows, "graph_rows": graph_rows, "versions": versions}, fh, indent=1)
    if args.results:
        if rows:
            write_section(args.results, render(rows, versions, args), BEGIN, END)
        if graph_rows:
            write_section(args.results, render_graph(graph_rows, versions, load0),
                          GRAPH_BEGIN, GRAPH_END)
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


GRAPH_BEGIN = "<!-- mindspore-graph: written by bench_mindspore.py -->"
GRAPH_END = "<!-- /mindspore-graph -->"
_MODE_TITLES = {"graph": "GRAPH_MODE, one `@ms.jit` step (optimizer inside)",
                "pynative": "PyNative (optimizer's own compiled construct)"}


def render_graph(rows, versions, load0: float) -> str:
    load = os.getloadavg()[0]
    r0 = rows[0]
    lines = [GRAPH_BEGIN, "## Grad probe: MindSpore training steps, compiled and PyNative", "",
             f"`benchmarks/bench_mindspore.py` in `.venv-mindspore` (mindspore "
             f"{versions['mindspore']}, numpy {versions['numpy']}); load average {load0:.2f} "
             f"at the start, {load:.2f} at the end (a shared 2-core machine: read the ratios). "
             f"An MLP {' → '.join(str(s) for s in GRAPH_SIZES)} ({r0['params'] / 1e6:.1f}M "
             f"parameters, tanh, MSE, SGD), batch {r0['batch']}, fp32 on the CPU. Each variant is "
             f"built and compiled first; then they run in turns, {r0['block']} steps each, "
             f"{r0['rounds']} rounds; × plain = median over rounds of the variant's step time "
             "over the plain step's in the same round, the probe's final write included "
             "(\"best rounds\": the fastest round of each over the fastest plain round, the "
             "least disturbed by other load). "
             "`host` = the statistics the CPU gets by default (each gradient handed, in place, "
             "from the graph to probekit's chunked CPU path); `in-graph` = the accelerator "
             "path (`where=\"device\"`: MindSpore ops in the training graph, the results "
             "handed over once per step), here on MindSpore's CPU kernels.", "",
             "| training step | plain step | " + " | ".join(
                 v for v, _, _ in GRAPH_VARIANTS[1:]) + " |",
             "|---|---|" + "---|" * (len(GRAPH_VARIANTS) - 1)]
    for mode in _MODE_TITLES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        cells = [f"**{r['ratio']:.2f}×** ({_ms(r['step_s'])}; best rounds {r['ratio_best']:.2f}×)"
                 for r in mine[1:]]
        lines.append(f"| {_MODE_TITLES[mode]} | {_ms(mine[0]['step_s'])} | " + " | ".join(cells)
                     + " |")
    lines.append(GRAPH_END)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
