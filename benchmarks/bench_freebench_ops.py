"""Free benchmark: dispatched ATen operators per checked call (the cost that holds on an
accelerator, where each is a kernel launch, whatever the CPU).

    python benchmarks/bench_freebench_ops.py [--calls 20] [--out FILE.json]
        [--models gpt2:bf16,llama:fp32,...]

For each pert_mode and op (64x64 fp32 unless named otherwise), a step of ``--calls`` calls (as
many call sites) is checked twice first (a site's first, exact check and its cause analysis are
not the healthy path), then a third step runs under ``torch.profiler`` inside the probe, and the
same calls without it. The count per checked call is (top-level ``aten::`` events with the
probe - without) / calls: the perturbation or upcasts, the re-run, the magnitude re-run where
the call needs one, the comparison. The step's gather (one ``stack`` and one read-back for all
of a step's checks) is counted apart (``gather``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))   # PYTHONPATH first: measures the probekit it names

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

MODES = ("improve_precision", "bit_noise", "add_noise", "change_value", "no_change")


def ops():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    w, bias = torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    h = a.to(torch.bfloat16)
    c = a.clone()
    return {
        "add": lambda: torch.add(a, b),
        "matmul": lambda: torch.matmul(a, b),
        "linear (bias)": lambda: F.linear(a, w, bias),
        "gelu": lambda: F.gelu(a),
        "softmax": lambda: torch.softmax(a, -1),
        "log_softmax": lambda: F.log_softmax(a, -1),
        "layer_norm bf16": lambda: F.layer_norm(h, (64,)),
        "sum": lambda: torch.sum(a, -1),
        "matmul bf16": lambda: torch.matmul(h, h),
        "gelu bf16": lambda: F.gelu(h),
        # in-place: the input cloned before the real call, the out-of-place re-run on the clone
        "relu_ (in-place)": lambda: torch.relu_(c),
        "ReLU(inplace=True)": lambda: F.relu(c, inplace=True),
    }


def top_level(prof) -> list:
    """Names of the ``aten::`` events with no ``aten::`` ancestor (dispatched by Python)."""
    out = []
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        if p is None:
            out.append(e.name)
    return out


def count(mode: str, fn, calls: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_ops_") as dump:   # removed after
        return _count(mode, fn, calls, dump)


def _count(mode: str, fn, calls: int, dump: str) -> dict:
    import probekit

    fb = probekit.FreeBench(dump_path=dump, pert_mode=mode)
    for _ in range(2):                      # every site's first (exact) check, then a fast one
        with fb:
            for _ in range(calls):
                fn()
        fb.step()
    fb.start()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    probed = top_level(prof)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fb.stop()                           # the gather of the step's verdicts
    gather = top_level(prof)
    fb.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    plain = top_level(prof)
    fb.close()
    names = {}
    for n in probed:
        names[n] = names.get(n, 0) + 1
    for n in plain:
        names[n] = names.get(n, 0) - 1
    return {"per_call": (len(probed) - len(plain)) / calls, "gather": len(gather),
            "checked": fb.summary["checked"],
            "ops": {k: v / calls for k, v in sorted(names.items()) if v}}


def model_average(kind: str, setting: str, mode: str) -> dict:
    """Dispatched operators per checked call averaged over one step of a zoo model
    (``tests/_hf_models.py``), forward stage: two steps check every call site once, then a step
    is profiled with the probe and one without."""
    import probekit

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from _hf_models import zoo_batch, zoo_model

    model = zoo_model(kind, setting)
    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory(prefix="bench_ops_") as dump:   # removed after
        fb = probekit.FreeBench(dump_path=dump, pert_mode=mode)
        try:
            return _model_average(fb, model, dtype, kind, setting, mode)
        finally:
            fb.close()


def _model_average(fb, model, dtype, kind: str, setting: str, mode: str) -> dict:
    batch = zoo_batch(kind, torch.Generator().manual_seed(1))
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}

    def forward():
        import contextlib

        amp = torch.autocast("cpu", dtype=torch.bfloat16) if setting == "autocast" \
            else contextlib.nullcontext()
        with torch.no_grad(), amp:
            model(**batch)

    for _ in range(2):
        with fb:
            forward()
        fb.step()
    before = fb.summary["checked"]
    fb.start()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    probed = top_level(prof)
    fb.stop()
    checked = fb.summary["checked"] - before
    fb.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    plain = top_level(prof)
    return {"model": kind, "dtype": setting, "mode": mode, "checked": checked,
            "per_call": (len(probed) - len(plain)) / max(1, checked)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--models", default="",
                    help="also the average over a zoo model's step, e.g. gpt2:bf16,llama:fp32")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.ERROR)
    if a.models:
        lines = ["| model | dtype | pert_mode | checked calls | operators per checked call |",
                 "|---|---|---|---:|---:|"]
        for item in a.models.split(","):
            kind, setting = item.split(":")
            for mode in ("improve_precision", "bit_noise"):
                r = model_average(kind, setting, mode)
                lines.append(f"| {kind} | {setting} | {mode} | {r['checked']} | "
                             f"{r['per_call']:.2f} |")
        print("\n".join(lines))
    table = ops()
    res = []
    for mode in MODES:
        for name, fn in table.items():
            r = count(mode, fn, a.calls)
            r.update(mode=mode, op=name)
            res.append(r)
    ordered = list(table)
    lines = ["| pert_mode | " + " | ".join(ordered) + " | gather per step |",
             "|---|" + "---:|" * (len(ordered) + 1)]
    for mode in MODES:
        rows = {r["op"]: r for r in res if r["mode"] == mode}
        cells = [("—" if rows[o]["per_call"] == 0 else f"{rows[o]['per_call']:g}")
                 for o in ordered]
        gather = max(r["gather"] for r in rows.values())
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {gather} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
