"""Free benchmark repro (issue 30): what a finding's repro costs, and what the scripts measure.

    python benchmarks/bench_freebench_repro.py [--rows 4096 8192 16384] [--repeats 3]

The CPU bf16 layer_norm backward defect (weight and bias gradients summed in bf16), ``D = 64``:

* the session's cost of saving the repro record: the ``with fb:`` block (forward, backward, the
  check, the float64 analysis of the flagged call) with the session's recorder and without it
  (``engine.repro_capture = None``), medians of ``--repeats`` alternating runs, wall time;
  the record's size on disk, inputs saved or generated (above ``SAVE_LIMIT``: 4 MiB);
* ``fb.repro(row)`` (rebuild, check with the float64 analysis, ``S``, write, run in-process),
  with and without shrinking, and how far shrinking went;
* what the scripts measure: the bias and weight gradients' largest error against float64 in
  bf16 ``u`` of ``max|exact|``, and against the bound the free benchmark judged with.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

D = 64


def inputs(rows: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, D, generator=g).to(torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).requires_grad_()
    b = (0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).requires_grad_()
    gy = torch.randn(rows, D, generator=g).to(torch.bfloat16)
    return x, w, b, gy


def session(rows: int, record: bool):
    from probekit.freebench import FreeBench

    x, w, b, gy = inputs(rows)
    fb = FreeBench(dump_path=tempfile.mkdtemp(prefix="bench_repro_"),
                   pert_mode="improve_precision", fuzz_stage="backward", list=["layer_norm"])
    if not record:
        fb._engine.repro_capture = None
    t = time.perf_counter()
    with fb:
        F.layer_norm(x, (D,), w, b).backward(gy)
    return fb, time.perf_counter() - t


def measure(rows: int, repeats: int) -> dict:
    from probekit.freebench.repro import record as repro_record

    on, off = [], []
    for _ in range(repeats):
        fb, t = session(rows, True)
        on.append(t)
        off.append(session(rows, False)[1])
    path = repro_record.record_path(fb.config.dump_path, "Functional.layer_norm.0.backward", 0)
    rec = repro_record.load(path)
    t = time.perf_counter()
    r = fb.repro(1)
    t_repro = time.perf_counter() - t
    t = time.perf_counter()
    small = fb.repro(1, os.path.join(fb.config.dump_path, "small"), shrink=True)
    t_shrink = time.perf_counter() - t
    u = 2.0 ** -8
    res = {i: (v["max_error"] / (u * v["scale"]), v["accuracy"], v["verdict"])
           for i, v in r.results.items()}
    return {"rows": rows, "with": statistics.median(on), "without": statistics.median(off),
            "bytes": os.path.getsize(path),
            "stored": ",".join(sorted({s["stored"] for s in rec.meta["tensors"].values()})),
            "repro_s": t_repro, "shrink_s": t_shrink,
            "shrunk": [n for n in small.notes if n.startswith(("shrunk", "not shrunk"))],
            "res": res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    logging.getLogger("probekit").setLevel(logging.WARNING)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    print("| rows | block with record / without | record | fb.repro | shrink | weight grad: "
          "u of max|exact|, error/bound | bias grad: u of max|exact|, error/bound |")
    print("|---:|---:|---|---:|---:|---|---|")
    for rows in a.rows:
        m = measure(rows, a.repeats)
        cell = lambda i: (f"{m['res'][i][0]:.1f} u, {m['res'][i][1]:.1f} ({m['res'][i][2]})"  # noqa
                          if i in m["res"] else "-")
        print(f"| {rows} | {m['with']:.2f} s / {m['without']:.2f} s | {m['bytes'] / 1024:.0f} KiB "
              f"({m['stored']}) | {m['repro_s']:.1f} s | {m['shrink_s']:.1f} s | {cell(2)} | "
              f"{cell(3)} |")
        print(f"|  | {'; '.join(m['shrunk'])} | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
