"""Free benchmark peak memory against the same training script without the probe.

    python benchmarks/bench_freebench_memory.py [--steps 2] [--out FILE.json]

GPT-2-shaped model (``bench_freebench_msprobe.Block``: LayerNorm, attention matmuls, softmax,
MLP; 4 layers, width 512, 8 x 256 tokens, SGD, one torch thread), fp32 and bf16. Each
configuration runs in its own process; the number is the peak resident memory of that process
(``ru_maxrss``) above its resident memory once the model, optimizer and batch exist, so torch's
own libraries do not dilute the ratio (glibc set to mmap tensors above 64 KiB, ``MALLOC_ENV``, so
freed tensors leave the resident set). CPU only: on accelerators the same question is asked of
the device allocator (``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

#: glibc: tensors above 64 KiB are mmapped and returned on free, so the resident peak follows the
#: live tensors instead of the allocator's retained heap
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}

CONFIGS = [("plain", None), ("check improve_precision", {"pert_mode": "improve_precision"}),
           ("check bit_noise", {"pert_mode": "bit_noise"}),
           ("backward improve_precision", {"pert_mode": "improve_precision",
                                           "fuzz_stage": "backward"})]


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(dtype_name: str, options: dict | None, steps: int) -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import logging

    import torch
    import torch.nn as nn

    import bench_freebench_msprobe as m

    torch.set_num_threads(1)
    m.D, m.H, m.T, m.B = 512, 2048, 256, 8
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = nn.Sequential(*[m.Block() for _ in range(4)]).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(m.B, m.T, m.D, dtype=dtype)
    fb = None
    if options is not None:
        import probekit

        logging.getLogger("probekit").setLevel(logging.WARNING)
        fb = probekit.FreeBench(dump_path=tempfile.mkdtemp(prefix="bench_mem_"), **options)
    base = rss_kib()
    for _ in range(steps):
        opt.zero_grad()
        if fb is not None:
            fb.start()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        if fb is not None:
            fb.stop()
            fb.step()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"base_kib": base, "peak_kib": peak, "extra_kib": peak - base,
            "checked": fb.summary["checked"] if fb else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=2, metavar=("DTYPE", "OPTIONS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], json.loads(a.child[1]), a.steps)))
        return 0
    res = []
    for dtype in ("float32", "bfloat16"):
        for label, options in CONFIGS:
            out = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--child",
                                  dtype, json.dumps(options)], capture_output=True, text=True,
                                 check=True, env={**os.environ, **MALLOC_ENV,
                                                  "PYTHONPATH": os.path.dirname(HERE)})
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res.append({"dtype": dtype, "label": label, **r})
            print(dtype, label, r, file=sys.stderr, flush=True)
    lines = ["| dtype | configuration | peak above setup | × plain | checked calls |",
             "|---|---|---:|---:|---:|"]
    for r in res:
        plain = next(p for p in res if p["dtype"] == r["dtype"] and p["label"] == "plain")
        lines.append(f"| {r['dtype']} | {r['label']} | {r['extra_kib'] / 1024:.0f} MiB | "
                     f"{r['extra_kib'] / plain['extra_kib']:.2f}× | {r['checked']} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
