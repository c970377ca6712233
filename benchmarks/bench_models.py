"""Real models under probekit: tiny-but-real GPT-2 and LLaMA (transformers, random weights)
trained on synthetic tokens in fp32 and bf16 under every free-benchmark mode and the grad probe.

For each (model, dtype, mode): step time relative to the plain step (medians, same process),
checked calls per step, and the findings grouped by API (what was flagged, of which kind, how
far over its threshold). ``--out`` gets JSON with the results and a markdown rendering.

    python benchmarks/bench_models.py --out models.json [--steps 6] [--layers 4 --width 128]
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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _hf_models import VOCAB, build  # noqa: E402

sys.path.insert(0, HERE)
from bench_freebench import CONFIGS  # noqa: E402

import probekit  # noqa: E402

#: the free benchmark's configurations, as in bench_freebench (every pert_mode, backward, fix)
MODES = [(label, options) for label, options in CONFIGS if label not in (
    "backward bit_noise", "nothing in scope")]


def run(kind, dtype, options, steps, layers, width, dump):
    """Alternate plain and probed steps on two identical models; returns timings + findings."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (4, 32), generator=gen) for _ in range(steps + 1)]
    models = [build(kind, dtype, layers, width), build(kind, dtype, layers, width)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    fb = probekit.FreeBench(dump_path=dump, **options) if options is not None else None
    plain_t, probed_t, losses = [], [], ([], [])
    for s, ids in enumerate(batches):
        for which in (0, 1):
            m, opt = models[which], opts[which]
            t0 = time.perf_counter()
            torch.manual_seed(1000 + s)  # the same dropout masks for both models
            if which and fb is not None:
                fb.start()
            loss = m(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            if which and fb is not None:
                fb.stop()
            opt.step()
            if which and fb is not None:
                fb.step()
            dt = time.perf_counter() - t0
            losses[which].append(loss.item())
            if s:  # the first step is warm-up
                (probed_t if which else plain_t).append(dt)
    out = {"ratio": statistics.median(probed_t) / statistics.median(plain_t),
           "plain_ms": statistics.median(plain_t) * 1e3,
           "same_losses": losses[0] == losses[1]}
    if fb is not None:
        out["checked_per_step"] = fb.summary["checked"] / len(batches)
        res = fb.results
        groups = []
        if not res.empty:
            res = res.assign(api=res["api_name"].str.rsplit(".", n=2).str[0])
            for api, g in res.groupby("api"):
                groups.append({"api": api, "rows": len(g), "kinds": sorted(set(g["kind"])),
                               "max_ratio": float(g["ratio"].max()),
                               "max_rel": float(g["max_rel"].max()),
                               "dtype": str(g["dtype"].iloc[0])})
            groups.sort(key=lambda x: -x["max_ratio"])
        out["findings"] = groups
    return out


def grad_probe(kind, dtype, steps, layers, width, dump):
    out = {}
    for level in ("L0", "L1", "L2"):
        model = build(kind, dtype, layers, width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        probe = probekit.GradProbe(model, optimizer=opt, grad_level=level,
                                   dump_path=os.path.join(dump, level)).start()
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (4, 32), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.stop()
        out[level] = {"hook_ms": statistics.median(probe.hook_seconds) * 1e3,
                      "params": sum(p.numel() for p in model.parameters())}
    return out


def render(results, args) -> str:
    lines = [f"Models: {args.layers} layers, width {args.width}, vocab {VOCAB}, batch 4 × 32 "
             f"tokens, AdamW; {args.steps} measured steps after one warm-up, plain and probed "
             "steps alternating on two identical models.", "",
             "| model | dtype | mode | × plain step | checked calls/step | loss = plain | "
             "findings (API: rows, kind, worst × threshold) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        f = r["result"]
        found = "; ".join(f"`{g['api']}`: {g['rows']}, {'/'.join(g['kinds'])}, "
                          f"{g['max_ratio']:.3g}×" for g in f.get("findings", [])[:4]) or "none"
        more = len(f.get("findings", [])) - 4
        if more > 0:
            found += f"; +{more} more APIs"
        same = "yes" if f["same_losses"] else ("no (fix)" if "fix" in r["mode"] else "**NO**")
        lines.append(f"| {r['model']} | {r['dtype']} | {r['mode']} | {f['ratio']:.2f}× | "
                     f"{f.get('checked_per_step', 0):.0f} | {same} | {found} |")
    lines += ["", "| model | dtype | params | grad probe hook L0 / L1 / L2 |", "|---|---|---|---|"]
    for g in args.grads:
        lines.append(f"| {g['model']} | {g['dtype']} | {g['L0']['params']:,} | "
                     f"{g['L0']['hook_ms']:.2f} / {g['L1']['hook_ms']:.2f} / "
                     f"{g['L2']['hook_ms']:.2f} ms |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    args = ap.parse_args(argv)
    logging.getLogger("probekit").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    results, args.grads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("gpt2", "llama"):
            for dtype in (torch.float32, torch.bfloat16):
                dname = str(dtype).replace("torch.", "")
                for label, options in MODES:
                    r = run(kind, dtype, options, args.steps, args.layers, args.width,
                            os.path.join(tmp, f"{kind}_{dname}_{label.replace(' ', '_')}"))
                    results.append({"model": kind, "dtype": dname, "mode": label, "result": r})
                    print(f"{kind} {dname} {label}: {r['ratio']:.2f}x, "
                          f"{len(r.get('findings', []))} APIs flagged", file=sys.stderr)
                args.grads.append({"model": kind, "dtype": dname, **grad_probe(
                    kind, dtype, args.steps, args.layers, args.width,
                    os.path.join(tmp, f"{kind}_{dname}_grads"))})
    md = render(results, args)
    with open(args.out, "w") as fh:
        json.dump({"results": results, "grads": args.grads, "markdown": md}, fh, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
