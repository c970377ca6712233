"""Free benchmark cost per checked call: 64x64 fp32 add / matmul / gelu / in-place relu_, every call checked.

    python benchmarks/bench_freebench_percall.py [--calls 100] [--repeats 9] [--out FILE.json]

For each op and pert_mode, rounds alternate a plain loop of ``--calls`` calls and the same loop
under the probe followed by ``fb.step()`` (so the step's gather point, the one read-back of the
verdicts, is included). Times are CPU time of this thread (``time.thread_time``), one torch
thread; the overhead per checked call is (probed round - plain round) / calls, the median over
``--repeats`` rounds after two warm-up rounds (so each call site has had its first, exact check).
``syncs/call`` = device-to-host reads of verdicts per checked call (``Verdicts.syncs``).

``detection off``: the same probed loop with the random-call detection switched off for the
measurement (``Engine._observed`` patched to answer None: no call signature is built or looked
up); the difference is what watching the generators costs a checked call that draws nothing,
once its signature is known (the generators themselves are read only at a signature's first
call). ``relu_``: an in-place call (its input cloned before the real call, the re-run out of
place on the clone: ``state.py``).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODES = ("improve_precision", "bit_noise")


def measure(op: str, mode: str, calls: int, repeats: int, warmup: int = 2) -> dict:
    import probekit

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    c = a.clone()
    fn = {"add": lambda: torch.add(a, b), "matmul": lambda: torch.matmul(a, b),
          "gelu": lambda: F.gelu(a), "relu_": lambda: torch.relu_(c)}[op]
    fb = probekit.FreeBench(dump_path=tempfile.mkdtemp(prefix="bench_pc_"), pert_mode=mode)
    off = probekit.FreeBench(dump_path=tempfile.mkdtemp(prefix="bench_pc_"), pert_mode=mode)
    off._engine._observed = lambda *args: None      # no detection (measurement only)

    def plain():
        for _ in range(calls):
            fn()

    def probed(session=fb):
        with session:
            for _ in range(calls):
                fn()
        session.step()

    def probed_off():
        probed(off)

    def timed(f):
        t = time.thread_time()
        f()
        return time.thread_time() - t

    for _ in range(warmup):
        plain()
        probed()
        probed_off()
    syncs0, checked0 = fb._engine.verdicts.syncs, fb._engine.checked
    rows0 = fb.summary["flagged"]
    ps, qs, rs = [], [], []
    for _ in range(repeats):
        ps.append(timed(plain))
        qs.append(timed(probed))
        rs.append(timed(probed_off))
    checked = fb._engine.checked - checked0
    p, q = statistics.median(ps) / calls, statistics.median(qs) / calls
    r = statistics.median(rs) / calls
    return {"op": op, "mode": mode, "plain_us": p * 1e6, "probed_us": q * 1e6,
            "overhead_us": (q - p) * 1e6, "overhead_detection_off_us": (r - p) * 1e6,
            "checked_per_round": checked / repeats,
            "syncs_per_call": (fb._engine.verdicts.syncs - syncs0) / max(1, checked),
            "rows_per_call": (fb.summary["flagged"] - rows0) / max(1, checked)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.WARNING)
    res = [measure(op, mode, a.calls, a.repeats) for mode in MODES
           for op in ("add", "matmul", "gelu", "relu_")]
    lines = ["| pert_mode | op | plain call | probed call | overhead per checked call | "
             "detection off | syncs per checked call | rows/call |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res:
        lines.append(f"| {r['mode']} | {r['op']} | {r['plain_us']:.1f} µs | "
                     f"{r['probed_us']:.1f} µs | {r['overhead_us']:.1f} µs | "
                     f"{r['overhead_detection_off_us']:.1f} µs | "
                     f"{r['syncs_per_call']:.3f} | {r['rows_per_call']:.2f} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
