"""``probekit grads compare|summary|export``."""
from __future__ import annotations

import sys

import numpy as np

from ...commands import command
from .compare import DROP_THRESHOLD, STEP0_THRESHOLD
from .report import PLOTS
from .unmatched import mostly_unmatched, unmatched, unmatched_text


def _declare_compare(p):
    p.add_argument("run_a", help="first run: probekit dump folder, grads.zarr, its fsspec URL "
                                 "(s3://...), or msprobe dump")
    p.add_argument("run_b", help="second run")
    p.add_argument("-o", "--output", required=True, help="output folder (msprobe's layout)")
    p.add_argument("--plots", choices=PLOTS, default="summary",
                   help="PNGs to render: every parameter (msprobe), summary only, or none")
    p.add_argument("--control", metavar="RUN", action="append", default=None,
                   help="a control run of run_a (GradProbe(..., control='bf16'): the "
                        "reference's code trained again with its rounding drawn at random at "
                        "the precision under test); flags then mean 'beyond rounding noise'. "
                        "Repeat for several (their envelope)")
    p.add_argument("--step0-threshold", type=float, default=STEP0_THRESHOLD)
    p.add_argument("--drop-threshold", type=float, default=DROP_THRESHOLD)
    p.add_argument("--scheduler", metavar="ADDR", default=None,
                   help="run the comparison on this dask.distributed scheduler "
                        "(tcp://host:8786); default: the local cores")
    unmatched_argument(p)
    _storage_argument(p)
    _declare_rename(p)


def unmatched_argument(p):
    p.add_argument("--allow-unmatched", action="store_true",
                   help="exit 0 even when more than half of a run's parameters have no "
                        "counterpart in the other (they are named either way)")


def report_unmatched(result, allow: bool, hint: str = "") -> int:
    """Print the parameters of one run only, per rank; the exit code: 1 when more than half of
    a run's parameters are unmatched (said on stderr) unless ``allow``, else 0."""
    refused = []
    for rank in result["rank"].values:
        r = result.sel(rank=rank)
        u = unmatched(r)
        text = unmatched_text(u["first"], u["second"], u["n_first"], u["n_second"])
        if text:
            print(f"rank {int(rank)}: {text}")
        refused += [f"rank {int(rank)}: {m}" for m in mostly_unmatched(r)]
    if refused and not allow:
        print(f"probekit: error: {'; '.join(refused)} have no counterpart in the other run "
              f"(more than half), so the comparison covers too little of it{hint}; "
              "--allow-unmatched accepts this", file=sys.stderr)
        return 1
    return 0


def _storage_argument(p):
    p.add_argument("--storage-options", metavar="JSON", type=_json_object, default=None,
                   help="fsspec storage_options for URL runs, as a JSON object (endpoint, "
                        "credentials); the usual AWS_* variables work without it")


def _json_object(text):
    import argparse
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("accepted: a JSON object, e.g. "
                                         "'{\"endpoint_url\": \"http://host:9000\"}'")
    return value


def _declare_rename(p):
    p.add_argument("--rename", metavar="JSON", type=_json_object, default=None,
                   help="a JSON object of parameter names to names, applied to both runs "
                        "(runs naming the same parameters differently)")


@command("grads", "compare", "compare the gradient signs of two runs, per rank/step/param")
def compare(args) -> int:
    from .report import GradComparator

    result = GradComparator.compare_distributed(
        args.run_a, args.run_b, args.output, plots=args.plots,
        step0_threshold=args.step0_threshold, drop_threshold=args.drop_threshold,
        scheduler=args.scheduler, storage_options=args.storage_options, control=args.control,
        rename=args.rename)
    from .verdict import judged_total_name, replica_text, unpaired_text, verdict_line

    for line in replica_text(result) + unpaired_text(result):  # said before any rank's verdict
        print(line)
    name = judged_total_name(result)     # the similarity the flags are judged on
    label = " (significant signs)" if name == "total_significant" else ""
    for rank in result["rank"].values:
        r = result.sel(rank=rank)
        step, param = int(r["first_step"].item()), str(r["first_param"].item())
        total = np.asarray(r[name].values)
        steps = np.asarray(r["step"].values)
        print(f"rank {int(rank)}: {r.sizes['step']} steps x {r.sizes['param']} params compared; "
              f"total similarity{label} {np.nanmin(total):.4f}..{np.nanmax(total):.4f}")
        if step >= 0:
            print(f"rank {int(rank)}: first flagged at step {step}"
                  + (f", parameter {param}" if param else " (total similarity)"))
        else:
            print(f"rank {int(rank)}: no step flagged (steps {steps.min()}..{steps.max()})")
        print(verdict_line(r, int(rank)))
    print(f"written to {args.output}")
    return report_unmatched(result, args.allow_unmatched)


compare.declare = _declare_compare


def _declare_summary(p):
    p.add_argument("run", help="probekit dump folder, grads.zarr, its fsspec URL, or msprobe "
                               "dump")
    p.add_argument("--rank", type=int, default=None)
    _storage_argument(p)


@command("grads", "summary", "describe a recorded run: ranks, steps, params, last statistics")
def summary(args) -> int:
    from ..store.replicas import from_datasets, replica_lines
    from ..store.sources import load_runs, without_grad

    runs = load_runs(args.run, storage_options=args.storage_options)
    table = from_datasets(runs)  # the replica check, said first: a bug with no reference
    for line in replica_lines(table, limit=10):
        print(line)
    if not len(table) and any("replicas" in ds for ds in runs.values()):
        print("replicas agree at every recorded step")
    for rank, ds in sorted(runs.items()):
        if args.rank is not None and rank != args.rank:
            continue
        steps = np.asarray(ds["step"].values)
        numel = int(np.asarray(ds["numel"].values).sum())
        print(f"rank {rank}: level {ds.attrs.get('level')}, {ds.sizes['param']} params "
              f"({numel:,} elements), {steps.size} steps"
              + (f" ({steps.min()}..{steps.max()})" if steps.size else ""))
        missing = without_grad(ds)
        if missing:
            print(f"  {len(missing)} of {ds.sizes['param']} params never had a gradient "
                  f"(first: {', '.join(missing[:3])}"
                  + (", ..." if len(missing) > 3 else "") + ")"
                  + ("" if len(missing) < ds.sizes["param"] else
                     ": an empty recording (frozen parameters, or a backward pass that did "
                     "not reach them)"))
        elif not steps.size:
            print("  no step recorded: no optimizer step over these parameters was seen")
        if steps.size:
            last = ds.isel(step=-1)
            print(f"  step {int(steps[-1])}:  {'param':40s} {'max':>12s} {'min':>12s} {'norm':>12s}")
            for j, name in enumerate(ds["param"].values):
                print(f"  {'':9s} {str(name)[:40]:40s} {float(last['max'][j]):12.5g} "
                      f"{float(last['min'][j]):12.5g} {float(last['norm'][j]):12.5g}")
    return 0


summary.declare = _declare_summary


def _declare_export(p):
    p.add_argument("run", help="probekit dump folder, grads.zarr or its fsspec URL")
    p.add_argument("--to", choices=("msprobe",), required=True)
    p.add_argument("output", help="output folder")
    _storage_argument(p)


@command("grads", "export", "write a run in another tool's layout (msprobe's grad dump)")
def export(args) -> int:
    from ..store.export import write_grad_dump

    files = write_grad_dump(args.run, args.output, storage_options=args.storage_options)
    print(f"wrote {len(files)} files under {args.output}")
    return 0


export.declare = _declare_export
