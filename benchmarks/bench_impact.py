"""Does a finding matter? ``fb.impact`` on a small GPT-2 cast to bf16 (issue 36, point 2).

    python benchmarks/bench_impact.py --out impact.json [--tokens 4x32,8x128] [--steps 1,5]

A tiny random-init GPT-2 (Hugging Face config, ``tests/_control_models.py``: 4 layers, width 64,
MLP 1024; nothing downloaded) cast to bf16, AdamW. Per batch shape:

1. the grad comparison of a bf16 run against the fp32 reference over ``--compare-steps`` steps,
   with two ``bf16:cast`` controls (the verdict the issue saw: "within");
2. the free benchmark (``improve_precision``, backward) on one step: the findings (the CPU bf16
   ``layer_norm`` backward sums its weight and bias gradients in bf16);
3. ``fb.impact`` of the worst finding, and of every ``layer_norm`` call fixed at once
   (``every_call``), over each ``--steps`` (AdamW stepping), with time.

Results: a JSON file and a table for ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import _control_models as cm  # noqa: E402

import probekit  # noqa: E402
from probekit.grads import GradProbe, compare_grads  # noqa: E402


def gpt2(dtype):
    model = cm.build("gpt2", layers=4)
    return model.to(dtype)


def batches(n, size, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [cm.batch("gpt2", g, size=size, seq=seq) for _ in range(n)]


def train(model, data, root, name, control=None, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GradProbe(model, optimizer=opt, dump_path=os.path.join(root, name), overwrite=True,
                   control=control, control_seed=seed if control else None):
        for b in data:
            opt.zero_grad()
            model(**b).loss.backward()
            opt.step()


def compare(size, seq, steps, root):
    data = batches(steps, size, seq)
    for name, dtype, control, seed in (("fp32", torch.float32, None, 0),
                                       ("bf16", torch.bfloat16, None, 0),
                                       ("c0", torch.float32, "bf16:cast", 0),
                                       ("c1", torch.float32, "bf16:cast", 1)):
        train(gpt2(dtype), data, root, name, control, seed)
    cmp = compare_grads(os.path.join(root, "fp32"), os.path.join(root, "bf16"),
                        control=[os.path.join(root, "c0"), os.path.join(root, "c1")],
                        progress=False)
    return cmp.probekit.verdict


def measure(size, seq, steps_list, compare_steps):
    out = {"tokens": f"{size}x{seq}"}
    with tempfile.TemporaryDirectory() as root:
        v = compare(size, seq, compare_steps, root)
        out["compare"] = {"kind": v.kind, "text": v.text, "steps": compare_steps}
        model = gpt2(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = batches(max(steps_list), size, seq, seed=2)

        def step_fn(i):
            opt.zero_grad()
            model(**data[i]).loss.backward()
            opt.step()

        fb = probekit.FreeBench(dump_path=os.path.join(root, "fb"), overwrite=True,
                                pert_mode="improve_precision", fuzz_stage="backward")
        t0 = time.perf_counter()
        with fb:
            step_fn(0)
        res = fb.results
        out["findings"] = int(len(res))
        out["by_api"] = res.groupby(res["api_name"].str.rsplit(".", n=2).str[0])["ratio"] \
            .agg(["count", "max"]).round(1).reset_index().values.tolist()
        out["fb_seconds"] = round(time.perf_counter() - t0, 1)
        worst = res.sort_values("ratio", ascending=False).iloc[0]
        out["worst"] = {"api_name": worst["api_name"], "ratio": round(float(worst["ratio"]), 1),
                        "cause": worst["cause"], "output_index": int(worst["output_index"])}
        out["impact"] = []
        for every in (False, True):
            for steps in steps_list:
                t0 = time.perf_counter()
                r = fb.impact(worst, model, step_fn, steps=steps, optimizer=opt,
                              every_call=every)
                out["impact"].append({"every_call": every, "steps": steps, "kind": r.kind,
                                      "text": r.text, "calls_fixed": r.calls_fixed,
                                      "seconds": round(time.perf_counter() - t0, 1)})
                print(json.dumps(out["impact"][-1]), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="impact.json")
    p.add_argument("--tokens", default="4x32,8x128", help="batch x sequence shapes")
    p.add_argument("--steps", default="1,5", help="steps fb.impact re-runs")
    p.add_argument("--compare-steps", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.WARNING)
    steps = [int(s) for s in args.steps.split(",")]
    results = []
    for shape in args.tokens.split(","):
        size, seq = (int(x) for x in shape.split("x"))
        results.append(measure(size, seq, steps, args.compare_steps))
        print(json.dumps(results[-1], indent=1), flush=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    print("| tokens | fp32 vs bf16 (2 bf16:cast controls) | findings | worst | impact: "
          "worst call, 1 / 5 steps | impact: every layer_norm call, 1 / 5 steps |")
    for r in results:
        imp = {(i["every_call"], i["steps"]): i["kind"] for i in r["impact"]}
        one = " / ".join(imp.get((False, s), "-") for s in steps)
        every = " / ".join(imp.get((True, s), "-") for s in steps)
        print(f"| {r['tokens']} | {r['compare']['kind']} | {r['findings']} | "
              f"{r['worst']['api_name']} {r['worst']['ratio']}x | {one} | {every} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
