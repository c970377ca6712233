"""What the grad probe costs under torchrun (gloo): FSDP2 and DDP at 2 and 4 ranks.

A nanoGPT-shaped model (``--layers`` blocks of width ``--width``, 12.2M parameters in 76 tensors
by default, as in issue 20), trained for ``--steps`` steps on the same batch on every rank, with
and without the grad probe (L2). Per configuration and rank:

* collectives per step: the gloo collectives (``gloo:*`` profiler events) of one profiled step,
  with the probe minus without;
* peak memory per rank: the process's peak RSS with the probe minus without (separate runs;
  both import probekit.grads, zarr and xarray first, so this is the probe's memory while
  recording);
* bytes per step: what the store gained per step, all ranks together; the whole store, and
  its size against the store of one process (``single``: the same model unwrapped, one rank)
  when that mode is measured too;
* hook time: the median of the probe's per-step hook time (statistics + buffering).

    python benchmarks/bench_grads_dist.py --ranks 2 4 --out bench_out/grads_dist.json
    python benchmarks/bench_grads_dist.py --modes single fsdp2 --ranks 8 --steps 10 \
        --layers 2 --width 192      # a short run at 8 ranks against one process's store
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build(layers: int, width: int, vocab: int, ctx: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
            heads = max(1, width // 64)
            B, T, C = q.shape
            q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(ctx, width)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.t()

    torch.manual_seed(0)
    return GPT()


def worker(args) -> None:
    """One rank: train ``steps`` steps, profile one, write this rank's numbers as JSON."""
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    import xarray  # noqa: F401  (the probe's imports in both runs: RSS compares like with like)
    import zarr  # noqa: F401

    import probekit.grads  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = build(args.layers, args.width, args.vocab, args.ctx)
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        train_model = model
    elif args.mode == "single":
        train_model = model
    else:
        train_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(train_model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.ctx), generator=gen)
    probe = None
    if args.probe:
        import probekit

        probe = probekit.GradProbe(train_model, grad_level="L2", dump_path=args.dump,
                                   flush_every=1000).start()

    def step():
        opt.zero_grad()
        logits = train_model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        opt.step()

    t0 = time.perf_counter()
    for _ in range(args.steps - 1):
        step()
    with profile() as prof:
        step()
    wall = (time.perf_counter() - t0) / args.steps
    collectives = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    if probe is not None:
        probe.stop()
    out = {"rank": rank, "world": dist.get_world_size(), "mode": args.mode,
           "probe": bool(args.probe), "collectives": collectives, "step_s": wall,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "hook_s": statistics.median(probe.hook_seconds) if probe and probe.hook_seconds
           else 0.0, "params": sum(p.numel() for p in model.parameters()),
           "tensors": len(list(model.parameters()))}
    with open(os.path.join(args.result_dir, f"{args.mode}-{int(args.probe)}-{rank}.json"),
              "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def torchrun(script: str, nranks: int, flags: list, result_dir: str) -> list[dict]:
    """Run ``script --worker --result-dir result_dir *flags`` under torchrun (gloo, one thread
    per rank); the JSON files its ranks wrote there, in name order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nranks}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", script, "--worker",
           "--result-dir", result_dir, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    rows = []
    for name in sorted(os.listdir(result_dir)):
        with open(os.path.join(result_dir, name)) as fh:
            rows.append(json.load(fh))
    return rows


def launch(args, mode: str, nranks: int, probe: bool, work: str) -> list[dict]:
    result_dir = tempfile.mkdtemp(dir=work)
    dump = os.path.join(work, f"dump-{mode}-{nranks}")
    shutil.rmtree(dump, ignore_errors=True)
    rows = torchrun(__file__, nranks, ["--mode", mode, "--dump", dump, "--steps",
                                       str(args.steps), *model_flags(args)]
                    + (["--probe"] if probe else []), result_dir)
    if probe:
        store = os.path.join(dump, "grads.zarr")
        for r in rows:
            r["store_bytes"] = du(store) if os.path.isdir(store) else 0
    return rows


def measure(args) -> dict:
    work = tempfile.mkdtemp(prefix="probekit_dist_")
    results = []
    try:
        for mode in args.modes:
            for n in ([1] if mode == "single" else args.ranks):
                plain = launch(args, mode, n, False, work)
                probed = launch(args, mode, n, True, work)
                coll = [p["collectives"] - q["collectives"] for p, q in zip(probed, plain)]
                mem = [p["peak_rss"] - q["peak_rss"] for p, q in zip(probed, plain)]
                results.append({
                    "mode": mode, "ranks": n, "params": plain[0]["params"],
                    "tensors": plain[0]["tensors"],
                    "plain_collectives": plain[0]["collectives"],
                    "extra_collectives": max(coll),
                    "extra_peak_rss_max": max(mem), "extra_peak_rss_median":
                        statistics.median(mem),
                    "bytes_per_step": probed[0]["store_bytes"] / args.steps,
                    "store_bytes": probed[0]["store_bytes"],
                    "hook_s_max": max(p["hook_s"] for p in probed),
                    "step_s_plain": statistics.median(q["step_s"] for q in plain),
                    "step_s_probed": statistics.median(p["step_s"] for p in probed)})
                print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"steps": args.steps, "results": results}


def markdown(data: dict) -> str:
    single = next((r["store_bytes"] for r in data["results"] if r["mode"] == "single"), None)
    lines = ["| layout | ranks | collectives/step (plain) | + probe | peak RSS + probe (max rank, "
             "median) | store bytes/step (all ranks) | store, all ranks (x single) | hook "
             "time/step (max rank) | step plain → probed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["results"]:
        ratio = f" ({r['store_bytes'] / single:.2f}x)" if single else ""
        lines.append(f"| {r['mode']} | {r['ranks']} | {r['plain_collectives']} | "
                     f"+{r['extra_collectives']} | {r['extra_peak_rss_max'] / 2**20:+.0f} MiB, "
                     f"{r['extra_peak_rss_median'] / 2**20:+.0f} MiB | "
                     f"{r['bytes_per_step'] / 2**20:.2f} MiB | "
                     f"{r['store_bytes'] / 1e6:.2f} MB{ratio} | {r['hook_s_max'] * 1e3:.0f} ms | "
                     f"{r['step_s_plain']:.2f} → {r['step_s_probed']:.2f} s |")
    return "\n".join(lines)


def write_results(out, data, table: str) -> None:
    """Print ``table``; with ``out``, the JSON there and the table beside it (``.md``)."""
    print(table)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(data, fh, indent=1)
        with open(os.path.splitext(out)[0] + ".md", "w") as fh:
            fh.write(table + "\n")


def model_arguments(p) -> None:
    """The model's shape (``build``) and batch, as both distributed benchmarks take them."""
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)


def model_flags(args) -> list:
    """``model_arguments``' values as command-line flags (for the torchrun workers)."""
    return ["--layers", str(args.layers), "--width", str(args.width), "--vocab",
            str(args.vocab), "--ctx", str(args.ctx), "--batch", str(args.batch)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="fsdp2", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", default=["fsdp2", "ddp"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--steps", type=int, default=4)
    model_arguments(p)
    p.add_argument("--out", help="JSON results (and a .md table beside it)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    data = measure(args)
    write_results(args.out, data, markdown(data))


if __name__ == "__main__":
    main()
