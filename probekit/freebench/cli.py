"""``probekit freebench report PATH``: the findings of a run, worst first, and a per-API tally.

PATH is a dump folder (its ``free_benchmark.csv`` is read) or a CSV file; msprobe's nine-column
CSV is read too (its rows are ranked by max_rel).
"""
from __future__ import annotations

import os

from ..commands import command
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
    return 0


report.declare = _args
