"""What the replica check costs (issue 35): recording with it against recording without it,
under torchrun (gloo), DDP and tensor parallel at 2 ranks.

One torchrun job per layout; inside it, ``--repeats`` rounds alternate a probe with the check
(``check_replicas=True``, the default) and one without (``False``) on the same model
(``bench_grads_dist.build``: nanoGPT-shaped, 12.2M parameters in 76 tensors by default), each
for ``--steps`` steps (the first dropped: the store's creation and the run's start). Per
round and setting: the median hook time per step of the recording rank (rank 0: statistics,
the check, buffering; ``GradProbe.hook_seconds``, wall) and its CPU time (the training thread's
in the optimizer's pre-step hook: what the check computes, without the waits a machine shared
with other work adds), the slowest rank's median hook time, and the median wall and CPU time
of a training step (forward, backward, the step with its hooks) on rank 0.
Reported: the medians over rounds and the ratios with/without (the issue's bound: 1.05x of the
recording), and the collectives a profiled step adds with the check.

    python benchmarks/bench_grads_replicas.py --out bench_out/grads_replicas.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_grads_dist import (  # noqa: E402
    build, model_arguments, model_flags, torchrun, write_results)


def _cpu_timed(cls, name: str) -> list:
    """Wrap ``cls.name`` to append each call's CPU time (the calling thread's) to the list
    returned."""
    times: list = []
    method = getattr(cls, name)

    def timed(self, *a, **k):
        t0 = time.thread_time()
        try:
            return method(self, *a, **k)
        finally:
            times.append(time.thread_time() - t0)

    setattr(cls, name, timed)
    return times


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    import probekit
    from probekit.grads.record import recorder

    # CPU time of the optimizer pre-step hook (statistics, the check) and of the replica check
    # alone (digests, all-gather, comparison), per call
    hook_cpu = _cpu_timed(recorder.GradProbe, "_pre_step")
    check_cpu = _cpu_timed(recorder.GradProbe, "_replica_step")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build(args.layers, args.width, args.vocab, args.ctx)
    if args.mode == "ddp":
        train_model = torch.nn.parallel.DistributedDataParallel(model)
    else:  # tensor parallel: every block's linears column/row-wise, its norms replicated
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {}
        for i in range(args.layers):
            plan[f"h.{i}.c_fc"] = ColwiseParallel()
            plan[f"h.{i}.mlp_proj"] = RowwiseParallel()
        train_model = parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(train_model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.ctx), generator=gen)

    def step():
        opt.zero_grad()
        logits = train_model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        opt.step()

    rounds = []
    for r in range(args.repeats):
        for check in ((False, True) if r % 2 == 0 else (True, False)):  # interleaved, ABBA
            dump = os.path.join(args.work, f"{args.mode}-{r}-{int(check)}")
            probe = probekit.GradProbe(train_model, grad_level="L1", dump_path=dump,
                                       flush_every=1000, check_replicas=check).start()
            walls, cpus = [], []
            hook_cpu.clear()
            check_cpu.clear()
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                step()
                walls.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)
            hooks_cpu = list(hook_cpu[1:args.steps])
            checks_cpu = list(check_cpu[1:args.steps])
            with profile() as prof:
                step()
            collectives = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
            probe.stop()
            hooks = probe.hook_seconds[1:args.steps]
            rounds.append({"round": r, "check": check, "rank": rank,
                           "hook_s": statistics.median(hooks) if hooks else 0.0,
                           "hook_cpu_s": statistics.median(hooks_cpu) if hooks_cpu else 0.0,
                           "check_cpu_s": statistics.median(checks_cpu) if checks_cpu else 0.0,
                           "step_s": statistics.median(walls[1:]),
                           "step_cpu_s": statistics.median(cpus[1:]),
                           "collectives": collectives})
    with open(os.path.join(args.result_dir, f"{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "world": world, "rounds": rounds,
                   "params": sum(p.numel() for p in model.parameters()),
                   "tensors": len(list(model.parameters()))}, fh)
    dist.barrier()
    dist.destroy_process_group()


def launch(args, mode: str) -> dict:
    work = tempfile.mkdtemp(prefix="probekit_replicas_")
    result_dir = tempfile.mkdtemp(dir=work)
    ranks = torchrun(__file__, args.ranks, ["--mode", mode, "--work", work, "--steps",
                                            str(args.steps), "--repeats", str(args.repeats),
                                            *model_flags(args)], result_dir)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return summarise(mode, ranks)


def summarise(mode: str, ranks: list) -> dict:
    def med(check, key, rank=None, agg=max):
        per_round = {}
        for r in ranks:
            if rank is not None and r["rank"] != rank:
                continue
            for x in r["rounds"]:
                if x["check"] == check:
                    per_round.setdefault(x["round"], []).append(x[key])
        return statistics.median(agg(v) for v in per_round.values())

    out = {"mode": mode, "ranks": len(ranks), "params": ranks[0]["params"],
           "tensors": ranks[0]["tensors"],
           "rounds": max(len(r["rounds"]) for r in ranks) // 2}
    for key, rank in (("hook_s", 0), ("step_s", 0), ("hook_cpu_s", 0), ("step_cpu_s", 0)):
        a, b = med(False, key, rank), med(True, key, rank)
        out[f"{key}_rank0_without"], out[f"{key}_rank0_with"] = a, b
        out[f"{key}_rank0_ratio"] = b / a if a else float("nan")
    a, b = med(False, "hook_s"), med(True, "hook_s")
    out["hook_s_slowest_without"], out["hook_s_slowest_with"] = a, b
    out["hook_s_slowest_ratio"] = b / a if a else float("nan")
    out["extra_collectives"] = (med(True, "collectives", 0) - med(False, "collectives", 0))
    out["check_cpu_s_rank0"] = med(True, "check_cpu_s", 0)
    out["check_cpu_s_slowest"] = med(True, "check_cpu_s")
    return out


def markdown(results: list) -> str:
    lines = ["| layout | ranks | params (tensors) | hook CPU/step rank 0: without → with "
             "(ratio) | hook wall rank 0 (ratio) | slowest rank's hook wall (ratio) | training "
             "step CPU rank 0 (ratio) | training step wall rank 0 (ratio) | + collectives | "
             "the check's own CPU/step: rank 0, slowest rank (per tensor) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['ranks']} | {r['params'] / 1e6:.1f}M ({r['tensors']}) | "
            f"{r['hook_cpu_s_rank0_without'] * 1e3:.1f} → "
            f"{r['hook_cpu_s_rank0_with'] * 1e3:.1f} ms ({r['hook_cpu_s_rank0_ratio']:.3f}x) | "
            f"{r['hook_s_rank0_without'] * 1e3:.1f} → {r['hook_s_rank0_with'] * 1e3:.1f} ms "
            f"({r['hook_s_rank0_ratio']:.3f}x) | {r['hook_s_slowest_ratio']:.3f}x | "
            f"{r['step_cpu_s_rank0_ratio']:.3f}x | "
            f"{r['step_s_rank0_without']:.3f} → {r['step_s_rank0_with']:.3f} s "
            f"({r['step_s_rank0_ratio']:.3f}x) | +{r['extra_collectives']:g} | "
            f"{r['check_cpu_s_rank0'] * 1e3:.2f} ms, {r['check_cpu_s_slowest'] * 1e3:.2f} ms "
            f"({r['check_cpu_s_slowest'] / r['tensors'] * 1e6:.0f} µs) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", default=["ddp", "tp"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=4)
    model_arguments(p)
    p.add_argument("--out", help="JSON results (and a .md table beside it)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    results = [launch(args, mode) for mode in args.modes]
    for r in results:
        print(json.dumps(r), flush=True)
    write_results(args.out, results, markdown(results))

if __name__ == "__main__":
    main()
