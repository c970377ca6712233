"""``probekit mindspore compare``: a PyTorch run against a MindSpore run (needs no MindSpore)."""
from __future__ import annotations

import json

import numpy as np

from ..commands import command
from ..grads.compare.cli import report_unmatched, unmatched_argument
from ..grads.compare.report import PLOTS


def _declare_compare(p):
    p.add_argument("torch_run", help="the PyTorch run (reference): dump folder, grads.zarr or "
                   "msprobe dump")
    p.add_argument("mindspore_run", help="the MindSpore run, aligned to the reference")
    p.add_argument("-o", "--output", required=True, help="output folder (msprobe's layout)")
    p.add_argument("--map", default=None, help="JSON file {mindspore name: torch name}; "
                   "default: automatic (docs/mindspore.md)")
    p.add_argument("--transpose", nargs="*", default=None, metavar="PARAM",
                   help="weights to transpose (default: 2-D weights with reversed shapes)")
    p.add_argument("--plots", choices=PLOTS, default="summary")
    unmatched_argument(p)


@command("mindspore", "compare", "compare a PyTorch run with a MindSpore run of the same model")
def compare(args) -> int:
    from ..grads.compare.report import GradComparator
    from ..grads.store.sources import load_runs
    from .align import align_runs

    mapping = None
    if args.map:
        with open(args.map, encoding="utf-8") as fh:
            mapping = json.load(fh)
    ref = load_runs(args.torch_run)
    aligned = align_runs(ref, args.mindspore_run, mapping,
                         "auto" if args.transpose is None else args.transpose)
    result = GradComparator.compare_distributed({r: ref[r] for r in aligned}, aligned,
                                                args.output, plots=args.plots)
    for rank, ds in sorted(aligned.items()):
        total = np.asarray(result["total"].sel(rank=rank).values)
        flipped = ds.attrs.get("transposed") or []
        print(f"rank {rank}: {result.sizes['param']} params compared over {result.sizes['step']} "
              f"steps; total similarity {np.nanmin(total):.4f}..{np.nanmax(total):.4f}"
              + (f"; transposed: {', '.join(flipped)}" if flipped else ""))
    print(f"written to {args.output}")
    return report_unmatched(result, args.allow_unmatched,
                            " (--map JSON pairs MindSpore names with PyTorch ones)")


compare.declare = _declare_compare
