"""``probekit freebench report PATH``: the findings of a run, worst first, and a per-API tally.
``probekit freebench repro DUMP ROW -o DIR``: a finding as a standalone repro folder.

PATH is a dump folder (its ``free_benchmark.csv`` is read) or a CSV file; msprobe's nine-column
CSV is read too (its rows are ranked by max_rel).
"""
from __future__ import annotations

import os
import sys

from ...commands import command
from . import results


def load(path: str):
    """The findings of ``path`` (a dump folder or a CSV) as a DataFrame."""
    import pandas as pd

    if os.path.isdir(path):
        path = os.path.join(path, results.CSV_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no free-benchmark CSV at {path}")
    return pd.read_csv(path, encoding="utf-8-sig")


def _args(p) -> None:
    p.add_argument("path", help="dump folder or free_benchmark.csv")
    p.add_argument("--top", type=int, default=20, help="rows to show (default 20)")


@command("freebench", "report", "show a free-benchmark CSV: worst findings and a per-API tally")
def report(args) -> int:
    df = load(args.path)
    print(f"{args.path}: {len(df)} finding(s)")
    if df.empty:
        return 0
    if "ratio" in df.columns:
        ranked = results.by_severity(df)
    else:
        ranked = df.sort_values("max_rel", ascending=False, kind="stable")
    api = df["api_name"].str.rsplit(".", n=2).str[0]
    tally = (df.assign(api=api).groupby("api")["max_rel"].agg(["count", "max"])
             .sort_values(["count", "max"], ascending=False))
    print("\nper API (count, largest max_rel):")
    print(tally.to_string())
    cols = [c for c in ("step", "api_name", "kind", "cause", "max_rel", "ratio", "dtype", "shape",
                        "output_index", "call_site") if c in df.columns]
    print(f"\nworst {min(args.top, len(df))}:")
    print(ranked[cols].head(args.top).to_string(index=False))
    dump = args.path if os.path.isdir(args.path) else os.path.dirname(args.path) or "."
    if "rank" in df.columns and os.path.isdir(os.path.join(dump, "repro", "records")):
        from ..repro.record import record_path

        first = next((r for _, r in ranked.iterrows()
                      if os.path.isfile(record_path(dump, r["api_name"], int(r["rank"])))), None)
        if first is not None:
            print(f"\nrepro (a script needing only torch): probekit freebench repro {dump} "
                  f"{first['api_name']}")
    return 0


report.declare = _args


def _repro_args(p) -> None:
    p.add_argument("path", help="dump folder (its free_benchmark.csv and repro/records) or the "
                   "CSV in it")
    p.add_argument("row", help="the finding: its row in the CSV (0 = the first) or its api_name "
                   "(e.g. Functional.layer_norm.0.backward)")
    p.add_argument("-o", "--out", help="folder to write (default: DUMP/repro/API_NAME.rankR)")
    p.add_argument("--shrink", action="store_true", help="make the inputs smaller while the "
                   "finding still reproduces")
    p.add_argument("--check", action="store_true", help="also run the script in a fresh Python "
                   "that has only torch")


@command("freebench", "repro", "write a finding as a standalone repro folder (repro.py needs only "
         "torch; REPORT.md)")
def repro(args) -> int:
    from ..repro import folder as _repro

    df = load(args.path)
    dump = args.path if os.path.isdir(args.path) else os.path.dirname(args.path) or "."
    row = int(args.row) if args.row.isdigit() else args.row
    done = _repro.for_row(dump, row, args.out, results=df, shrink=args.shrink, check=args.check)
    print(done)
    if done.check is not None and done.check[0] not in (0, 1):
        print(done.check[1], file=sys.stderr)
        return 1
    return 0


repro.declare = _repro_args
