"""``make bench``: probekit and msprobe 1.0.4 side by side; writes benchmarks/RESULTS.md.

    python benchmarks/run.py --msprobe-python .venv-msprobe/bin/python [--quick] [--out FILE]

Every measurement runs in its own process (each tool in its own venv), the two tools alternating
config by config; each process times its own baseline (a plain read of the gradients, or a plain
training step), so every number reported is a ratio measured within one process, a median of
repeats. ``--quick`` uses smaller models and fewer repeats (a smoke run, not for the record).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_json(python: str, args: list[str], tmp: str, name: str) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([python, *args, "--out", out], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(out) as fh:
        return json.load(fh)


def grads_hooks(pk: str, ms: str, sizes, levels, steps, tmp) -> list[dict]:
    rows = []
    for i, (size, level) in enumerate((s, lv) for s in sizes for lv in levels):
        order = [("probekit", pk), ("msprobe", ms)]
        if i % 2:
            order.reverse()  # alternate which tool runs first
        res = {}
        level, _, hash_name = level.partition("-")  # "L0-xxh3": probekit's fast digest
        for tool, python in order:
            extra = ["--hash", hash_name] if hash_name and tool == "probekit" else []
            res[tool] = run_json(python, [os.path.join(HERE, "bench_grads.py"), "hook", "--tool",
                                          tool, "--params", str(size), "--level", level,
                                          "--steps", str(steps), *extra], tmp,
                                 f"hook_{tool}_{size}_{level}{hash_name}")
            print(f"  grads hook {tool:8s} {size:5}M {level}: {res[tool]['hook_s'] * 1e3:9.1f} ms"
                  f"  ({res[tool]['hook_over_read']:.1f}x read)", flush=True)
        label = f"{level} ({hash_name} vs md5)" if hash_name else level
        rows.append({"size": size, "level": label, **{f"{t}_{k}": v for t, r in res.items()
                                                      for k, v in r.items() if k != "all_hook_s"}})
    return rows


def grads_compare(pk: str, ms: str, size, steps, repeats, tmp) -> dict:
    work = tempfile.mkdtemp(prefix="cmp_", dir=tmp)
    res = {}
    for tool, python in (("probekit", pk), ("msprobe", ms)):
        res[tool] = run_json(python, [os.path.join(HERE, "bench_grads.py"), "compare", "--tool",
                                      tool, "--params", str(size), "--steps", str(steps),
                                      "--repeats", str(repeats), "--workdir", work], tmp,
                             f"compare_{tool}")
        print(f"  grads compare {tool:8s}: {res[tool]['gbit_per_s']:.2f} Gbit/s, with "
              f"{res[tool]['pngs']} PNGs {res[tool]['with_pictures_s']:.2f} s", flush=True)
    return res


def freebench(pk: str, ms: str, repeats: int, tmp: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    outs = {}
    for ext in ("json", "md"):  # one run; the markdown is rendered from the same results
        outs[ext] = os.path.join(tmp, f"freebench.{ext}")
    proc = subprocess.run([pk, os.path.join(HERE, "bench_freebench.py"), "--msprobe-python", ms,
                           "--repeats", str(repeats), "--out", outs["md"]], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_freebench failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print(proc.stderr[-3000:], flush=True)
    with open(outs["md"]) as fh:
        return {"markdown": fh.read()}


def table(pk: str, script: str, args: list) -> str:
    """The markdown table a benchmark script prints (its last lines starting with ``|``)."""
    proc = subprocess.run([pk, os.path.join(HERE, script), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return "\n".join(line for line in proc.stdout.splitlines() if line.startswith("|"))


def freebench_costs(pk: str, quick: bool) -> str:
    """Per checked call (64x64, every call checked), operators per checked call, and peak
    memory (GPT-2-shaped model)."""
    percall = table(pk, "bench_freebench_percall.py", ["--repeats", "5" if quick else "9"])
    ops = table(pk, "bench_freebench_ops.py", [])
    memory = table(pk, "bench_freebench_memory.py", ["--steps", "2"])
    return "\n".join([
        "## Free benchmark: operators per checked call", "",
        "`python benchmarks/bench_freebench_ops.py`: dispatched ATen operators (torch.profiler's "
        "top-level `aten::` events; on an accelerator each is a kernel launch) per checked call "
        "on the healthy path (a call site already seen), 64x64 fp32 unless named, the probed "
        "step minus the same calls without the probe; the step's gather (one `stack`, one "
        "read-back for all its checks) apart. Goal (issue 19): <= 8 per mode; before: 12-18, "
        "23 for change_value.", "", ops, "",
        "## Free benchmark: cost per checked call", "",
        "`python benchmarks/bench_freebench_percall.py`: 64x64 fp32 `add` / `matmul` / `gelu`, "
        "one torch thread, every call checked, 100 calls then `fb.step()` per round; thread CPU "
        "time, medians of the rounds after two warm-up rounds; overhead = probed round minus "
        "plain round, per call (the step's gather included). `rows/call`: findings per checked "
        "call (healthy calls: 0).", "", percall, "",
        "## Free benchmark: peak memory", "",
        "`python benchmarks/bench_freebench_memory.py`: GPT-2-shaped model (4 blocks, width 512, "
        "8 x 256 tokens, SGD), peak resident memory above the set-up of the same script without "
        "the probe, 2 steps, each configuration in its own process. Targets: forward check "
        "<= 1.2x, backward stage <= 1.5x.", "", memory])


def zoo(pk: str, tmp: str, quick: bool) -> str:
    """The healthy zoo (issues 19, 26): findings per healthy model, dtype, mode and stage."""
    args = ["--models", "gpt2,resnet"] if quick else []
    res = run_json(pk, [os.path.join(HERE, "bench_zoo.py"), *args], tmp, "zoo")
    return "\n".join([
        "## Free benchmark: the healthy zoo", "",
        "`python benchmarks/bench_zoo.py`: the thirteen models of `tests/_hf_models.py`'s "
        "`ZOO` (GPT-2, LLaMA, BERT, a ResNet, a ViT, Mixtral on its default and eager expert "
        "paths, T5, Wav2Vec2, ConvNeXt, a squeeze-excite CNN, an LSTM/GRU LM, Qwen2), random "
        "weights, dropout off, 2 SGD steps on random batches, in fp32, bf16 and bf16 autocast; "
        "forward and backward stage; improve_precision and bit_noise. A healthy model gives no "
        "false finding; the rows left in bf16 are PyTorch's CPU bf16 backward kernels of "
        "layer_norm, batch_norm and the GRU (notes below: the sweeps before issues 19 and 26).",
        "",
        res["markdown"]])


def sweep(pk: str, timm_python: str, quick: bool) -> str:
    """The free benchmark over whole model libraries (issue 34, point 7): rows per family, dtype
    and stage, the known defects apart, what could not be built. Results are kept per commit
    in bench_out/sweep-<commit>/ (an interrupted sweep resumes; delete it to run again)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip() or "nogit"
    results = os.path.join(ROOT, "bench_out", f"sweep-{commit}{'-quick' if quick else ''}")
    md = os.path.join(results, "sweep.md")
    only = ["--only", "timm.resnet,timm.vision_transformer,transformers.gpt2"] if quick else []
    proc = subprocess.run([pk, os.path.join(HERE, "bench_sweep.py"), "all", "--results", results,
                           "--python-timm", timm_python, "--md", md, *only], text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_sweep failed (exit status {proc.returncode})")
    with open(md) as fh:
        body = fh.read().strip()
    return "\n".join([
        "## Free benchmark: whole model libraries", "",
        "`python benchmarks/bench_sweep.py all`: one model per timm architecture module (the "
        "smallest that trains at 64-224 px) and every transformers model type with an LM, "
        "classification, CTC or seq2seq head (config shrunk: width 64, 2 layers, vocabulary "
        "256), random init; 2 SGD steps, batch 2, in fp32, bf16 and bf16 autocast; "
        "`pert_mode=\"combined\"` (step 0 improve_precision, step 1 bit_noise), forward and "
        "backward stage; every probed run compared bit for bit with an unprobed one. timm runs "
        "in .venv-sweep (torch 2.14.1: timm needs torchvision), transformers in .venv.", "",
        body])


def models(pk: str, tmp: str, quick: bool) -> dict:
    args = ["--steps", "3", "--layers", "2", "--width", "64"] if quick else []
    return run_json(pk, [os.path.join(HERE, "bench_models.py"), *args], tmp, "models")


def machine_notes(pk: str) -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = subprocess.run([pk, "-c", "import torch, numpy, zarr, xarray; print(torch.__version__,"
                               " numpy.__version__, zarr.__version__, xarray.__version__)"],
                              capture_output=True, text=True).stdout.split()
    load = os.getloadavg()
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
            f"{versions[0]}, numpy {versions[1]}, zarr {versions[2]}, xarray {versions[3]}; load "
            f"average at start {load[0]:.2f}. A shared machine: absolute times are noisy, the "
            f"ratios (same process, medians) are what to read.")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


NOTES_BEGIN, NOTES_END = "<!-- notes: kept by run.py -->", "<!-- /notes -->"


def kept_notes(path: str) -> str:
    """The hand-written block of an existing RESULTS.md (what was flagged and why), kept."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return ""
    if NOTES_BEGIN in text and NOTES_END in text:
        return text[text.index(NOTES_BEGIN):text.index(NOTES_END) + len(NOTES_END)]
    return ""


def targets(hooks, cmp) -> list[str]:
    """A sentence per target the issues set, met or missed and by how much."""
    out = []
    big = [r for r in hooks if r["size"] >= 16]
    for level, limit, aim in (("L2", 5.0, None), ("L1", 4.0, None)):
        rows = [r for r in big if r["level"] == level]
        if not rows:
            continue
        worst = max(r["probekit_hook_over_read"] for r in rows)
        sizes = ", ".join(f"{r['probekit_params'] / 1e6:.1f}M: {r['probekit_hook_over_read']:.1f}× "
                          f"with writes, {r['probekit_compute_over_read']:.1f}× the hook alone"
                          for r in rows)
        verdict = "met" if worst <= limit else f"missed by {worst / limit:.2f}×"
        aim_txt = (f"; the aim of {aim:g}× is {'met' if worst <= aim else 'not met'}"
                   if aim else "")
        out.append(f"- {level} hook ≤ {limit:g}× one read of the gradients ({sizes}): "
                   f"**{verdict}**{aim_txt}.")
    rows = [r for r in big if r["level"] == "L2"]
    if rows:  # both tools' costs include their writes
        least = min(r["msprobe_hook_s"] / r["probekit_hook_s"] for r in rows)
        out.append(f"- L2 hook (significance bits on, the default) ≥ 20× faster than msprobe 1.0.4: "
                   f"**{'met' if least >= 20 else 'missed'}** (at least {least:.0f}× here).")
    g = cmp["probekit"]["gbit_per_s"]
    out.append(f"- comparison ≥ 5 Gbit/s from Zarr: **{'met' if g >= 5 else 'missed'}** "
               f"({g:.1f} Gbit/s; msprobe {cmp['msprobe']['gbit_per_s']:.2f} Gbit/s).")
    return out


def render(hooks, cmp, fb, args, notes, model_md=None, kept="", zoo_md="",
           sweep_md="") -> str:
    lines = [
        "# probekit benchmarks", "",
        f"Produced by `{args.command}` on {datetime.date.today().isoformat()}.", "",
        f"Machine: {notes}", "",
        "## Grad probe: hook time per optimizer step", "",
        "`read` = one plain read of every gradient byte (`torch.sum` of each gradient, all "
        "threads) in the same process; hook = cost per optimizer step, the mean over the "
        "recorded steps of the hook and the writes (msprobe writes in its hook; probekit "
        "buffers and writes a block at `stop()` or every `flush_every` steps); disk/step = bytes "
        "the steps added (probekit's store also has a fixed part of about "
        f"{fmt_bytes(max((r.get('probekit_fixed_bytes', 0) for r in hooks), default=0))}, "
        "written once per run).", "",
        "| params | level | probekit per step | × read | (hook alone, × read) | msprobe per step "
        "| × read | msprobe / probekit | disk/step probekit | disk/step msprobe | disk ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in hooks:
        speed = r["msprobe_hook_s"] / r["probekit_hook_s"]
        disk = r["msprobe_bytes_per_step"] / max(1.0, r["probekit_bytes_per_step"])
        lines.append(
            f"| {r['probekit_params'] / 1e6:.1f}M | {r['level']} | "
            f"{r['probekit_hook_s'] * 1e3:.1f} ms | {r['probekit_hook_over_read']:.1f}× | "
            f"{r['probekit_compute_over_read']:.1f}× | "
            f"{r['msprobe_hook_s'] * 1e3:.0f} ms | {r['msprobe_hook_over_read']:.0f}× | "
            f"**{speed:.0f}×** | {fmt_bytes(r['probekit_bytes_per_step'])} | "
            f"{fmt_bytes(r['msprobe_bytes_per_step'])} | {disk:.1f}× |")
    pk, ms = cmp["probekit"], cmp["msprobe"]
    lines += [
        "", "## Grad probe: comparing two runs", "",
        f"Two L1 runs of {pk['params'] / 1e6:.1f}M parameters × {pk['steps']} steps, compared "
        "from disk (median of repeats). Throughput = compared sign bits per second.", "",
        "| tool | compare | throughput | with per-parameter PNGs |", "|---|---|---|---|",
        f"| probekit | {pk['compare_s'] * 1e3:.0f} ms | {pk['gbit_per_s']:.2f} Gbit/s | "
        f"{pk['with_pictures_s']:.2f} s ({pk['pngs']} PNGs) |",
        f"| msprobe 1.0.4 | {ms['compare_s'] * 1e3:.0f} ms | {ms['gbit_per_s']:.2f} Gbit/s | "
        f"{ms['with_pictures_s']:.2f} s ({ms['pngs']} PNGs) |",
    ]
    if fb is not None:
        lines += ["", fb.get("markdown", "").strip()]
        if fb.get("costs"):
            lines += ["", fb["costs"]]
    if zoo_md:
        lines += ["", zoo_md]
    if sweep_md:
        lines += ["", sweep_md]
    if model_md:
        lines += ["", "## Real models (Hugging Face transformers, random weights)", "", model_md]
    lines += ["", "## Targets", "", *targets(hooks, cmp),
              "- Free benchmark targets: see the `target` column of its table above.", ""]
    if kept:
        lines += [kept, ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--msprobe-python", required=True)
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-freebench", action="store_true")
    parser.add_argument("--sweep-timm-python",
                        help="the interpreter of .venv-sweep (timm); without it no library sweep")
    args = parser.parse_args(argv)
    args.command = "make bench" if not args.quick else "python benchmarks/run.py --quick"
    pk = sys.executable
    tmp = tempfile.mkdtemp(prefix="probekit_bench_")
    notes = machine_notes(pk)
    print(notes, flush=True)
    sizes = [1.0, 4.0] if args.quick else [1.0, 16.8, 51.0]
    hooks = grads_hooks(pk, args.msprobe_python, sizes, ["L0", "L0-xxh3", "L1", "L2"],
                        5 if args.quick else 10, tmp)
    cmp = grads_compare(pk, args.msprobe_python, 4.0 if args.quick else 16.8,
                        5 if args.quick else 20, 3 if args.quick else 5, tmp)
    fb = None if args.skip_freebench else freebench(pk, args.msprobe_python,
                                                     5 if args.quick else 7, tmp)
    if fb is not None:
        fb["costs"] = freebench_costs(pk, args.quick)
    model_md = models(pk, tmp, args.quick)["markdown"]
    zoo_md = zoo(pk, tmp, args.quick)
    sweep_md = sweep(pk, args.sweep_timm_python, args.quick) if args.sweep_timm_python else ""
    text = render(hooks, cmp, fb, args, notes, model_md, kept_notes(args.out), zoo_md, sweep_md)
    with open(args.out, "w") as fh:
        fh.write(text)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
