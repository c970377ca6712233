"""Grad-probe benchmark: hook time per optimizer step, bytes on disk, comparison throughput.

Runs under probekit's venv (``--tool probekit``) or msprobe 1.0.4's venv (``--tool msprobe``);
``benchmarks/run.py`` alternates the two and reports ratios. Each process also times one plain
read of every gradient byte (``torch.sum`` of each gradient, all threads), so hook times are
reported against the physical limit measured in the same process.

    python benchmarks/bench_grads.py hook --tool probekit --params 16.8 --level L2 --out r.json
    python benchmarks/bench_grads.py compare --tool probekit --params 16.8 --steps 10 --out c.json
    python benchmarks/bench_grads.py hook --tool probekit --durable ...   # fsync every commit
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch


def build_model(mparams: float) -> torch.nn.Module:
    """Linear layers of 1024 x width (+ bias) adding up to about ``mparams`` million params,
    plus a few small ones (LayerNorm-sized), as in a transformer."""
    total = int(mparams * 1e6)
    layers = []
    width = 1024
    while total > 0:
        out = max(1, min(4096, total // (width + 1)))
        layers.append(torch.nn.Linear(width, out))
        layers.append(torch.nn.LayerNorm(out))
        total -= out * (width + 1) + 2 * out
        width = out if out >= 64 else 1024
    return torch.nn.Sequential(*layers)


def set_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01


def read_time(model, repeats=7) -> float:
    grads = [p.grad for p in model.parameters()]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for g in grads:
            g.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def _wrap_msprobe_hook(timings: list) -> None:
    import torch.optim.optimizer as om

    for key, hook in list(om._global_optimizer_pre_hooks.items()):
        def timed(opt, args, kwargs, _hook=hook):
            t0 = time.perf_counter()
            _hook(opt, args, kwargs)
            timings.append(time.perf_counter() - t0)
        om._global_optimizer_pre_hooks[key] = timed


def run_steps(tool: str, model, level: str, steps: int, dump: str, seed: int = 0,
              hash_name: str = "md5", sample: int = 0, durable: bool = False) -> dict:
    """Record ``steps`` optimizer steps. Returns the cost per step: the mean over the steps of
    the hook time plus the writes (probekit hands each step to its writing thread and waits for
    the last ones at ``stop()``; msprobe writes inside its hook), and the bytes the steps added
    on disk. ``durable``: probekit fsyncs every commit (``GradProbe(durable=True)``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if tool == "probekit":
        from probekit import GradProbe

        probe = GradProbe(model, optimizer=opt, grad_level=level, dump_path=dump,
                          hash=hash_name, sample=sample,
                          **({"durable": True} if durable else {})).start()
        empty = du(dump)  # the store's fixed part (metadata), written once per run
        for s in range(steps):
            set_grads(model, seed + s)
            opt.step()
        t0 = time.perf_counter()
        probe.stop()
        flush = time.perf_counter() - t0
        return {"hook_s": list(probe.hook_seconds),
                "per_step_s": (sum(probe.hook_seconds) + flush) / steps,
                "bytes_per_step": (du(dump) - empty) / steps, "fixed_bytes": empty}
    import torch.optim.optimizer as om
    from msprobe.pytorch import PrecisionDebugger

    PrecisionDebugger._instance = None
    om._global_optimizer_pre_hooks.clear()
    cfg = {"task": "grad_probe", "dump_path": dump, "rank": [], "step": [],
           "grad_probe": {"grad_level": level, "param_list": [], "bounds": [-1, 0, 1]}}
    cfg_path = os.path.join(os.path.dirname(dump), f"cfg_{os.path.basename(dump)}.json")
    os.makedirs(os.path.dirname(dump), exist_ok=True)
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    import logging

    logging.disable(logging.INFO)
    debugger = PrecisionDebugger(config_path=cfg_path)
    debugger.monitor(model)
    timings: list = []
    _wrap_msprobe_hook(timings)
    for s in range(steps):
        set_grads(model, seed + s)
        opt.step()
    om._global_optimizer_pre_hooks.clear()
    return {"hook_s": timings, "per_step_s": sum(timings) / steps,
            "bytes_per_step": du(dump) / steps, "fixed_bytes": 0}


def cmd_hook(args) -> dict:
    torch.manual_seed(0)
    model = build_model(args.params)
    nparams = sum(p.numel() for p in model.parameters())
    set_grads(model, 0)
    read = read_time(model)
    tmp = tempfile.mkdtemp(prefix="bench_grads_")
    try:
        res = run_steps(args.tool, model, args.level, args.steps, os.path.join(tmp, "dump"),
                        hash_name=args.hash, sample=args.sample, durable=args.durable)
        return {"tool": args.tool, "level": args.level, "hash": args.hash, "params": nparams,
                "sample": args.sample,
                "n_tensors": len(list(model.parameters())), "read_s": read,
                "hook_s": res["per_step_s"], "hook_over_read": res["per_step_s"] / read,
                "compute_s": statistics.median(res["hook_s"]),
                "compute_over_read": statistics.median(res["hook_s"]) / read,
                "steps": args.steps, "bytes_per_step": res["bytes_per_step"],
                "fixed_bytes": res["fixed_bytes"], "all_hook_s": res["hook_s"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_compare(args) -> dict:
    """Record two runs of ``steps`` steps at L1, then time the comparison."""
    torch.manual_seed(0)
    model = build_model(args.params)
    nparams = sum(p.numel() for p in model.parameters())
    tmp = args.workdir or tempfile.mkdtemp(prefix="bench_cmp_")
    a, b = os.path.join(tmp, f"{args.tool}_a"), os.path.join(tmp, f"{args.tool}_b")
    if not os.path.exists(a):
        run_steps(args.tool, model, "L1", args.steps, a)
        run_steps(args.tool, model, "L1", args.steps, b, seed=1000)  # other gradients
    subprocess.run(["sync"], check=False)
    bits = nparams * args.steps
    times, png_times = [], []
    for _ in range(args.repeats):
        if args.tool == "probekit":
            from probekit import compare_grads

            t0 = time.perf_counter()
            compare_grads(a, b)
            times.append(time.perf_counter() - t0)
        else:
            from msprobe.core.grad_probe.grad_compare import GradComparator
            import logging

            logging.disable(logging.INFO)
            steps = GradComparator._get_matched_dirs(os.path.join(a, "rank0"),
                                                     os.path.join(b, "rank0"), "step")
            t0 = time.perf_counter()
            sims = GradComparator._calculate_separated_similarities(
                os.path.join(a, "rank0"), os.path.join(b, "rank0"), steps)
            times.append(time.perf_counter() - t0)
    out = {"tool": args.tool, "params": nparams, "steps": args.steps, "compare_s":
           statistics.median(times), "gbit_per_s": bits / statistics.median(times) / 1e9}
    # pictures: per-param PNG time of each tool's writer
    outdir = os.path.join(tmp, f"{args.tool}_pictures")
    if args.tool == "probekit":
        from probekit.grads import GradComparator as PC

        t0 = time.perf_counter()
        res = PC.compare_distributed(a, b, outdir, plots="all")
        total = time.perf_counter() - t0
        n_png = int(res.sizes["param"]) + 1
    else:
        t0 = time.perf_counter()
        GradComparator._save_similarities(sims, steps, outdir)
        total = time.perf_counter() - t0 + statistics.median(times)
        n_png = len(sims)
    out.update(with_pictures_s=total, pngs=n_png)
    if not args.workdir:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("hook", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--tool", choices=("probekit", "msprobe"), required=True)
        p.add_argument("--params", type=float, default=16.8, help="millions of parameters")
        p.add_argument("--level", default="L2")
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--hash", default="md5", choices=("md5", "xxh3"))
        p.add_argument("--sample", type=int, default=0,
                       help="grad_probe.sample: sign bits of this many elements per tensor")
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--workdir", default=None)
        p.add_argument("--durable", action="store_true",
                       help="probekit: fsync every commit (GradProbe(durable=True))")
        p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    result = cmd_hook(args) if args.cmd == "hook" else cmd_compare(args)
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    print(json.dumps({k: v for k, v in result.items() if k != "all_hook_s"}))


if __name__ == "__main__":
    main()
