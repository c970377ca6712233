"""The real-bug zoo found per mode: fifteen genuine defects and ill-conditioned computations
(``tests/_real_bugs.py``) and issue 34's CPU bf16 kernels, each run under improve_precision,
bit_noise, add_noise and combined (two steps); which modes report it, with the cause and the
worst ratio. Runs against whatever ``probekit`` is first on ``sys.path`` (``PYTHONPATH=old``
measures an older version), and with ``--before`` renders before -> after.

    python benchmarks/bench_real_bugs.py --out bugs.json [--before old.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _real_bugs import NEW_BF16, REAL_BUGS  # noqa: E402

import probekit  # noqa: E402

MODES = ("improve_precision", "bit_noise", "add_noise", "combined")


def cases():
    """(name, the mode it shows in, options, the call, the expected cause or None, the API)."""
    out = [(n, m, o, f, why, None) for n, m, o, f, why in REAL_BUGS]
    out += [(n, "improve_precision", o, f, None, api) for n, o, f, api in NEW_BF16]
    return out


def run_case(tmp, name, options, fn, mode) -> dict:
    fb = probekit.FreeBench(dump_path=os.path.join(tmp, f"{name}_{mode}"), pert_mode=mode,
                            **options)
    for _ in range(2 if mode == "combined" else 1):
        with fb:
            fn()
        fb.step()
    df = fb.results
    finite = df[df["kind"] != "nan_inf"]
    return {"rows": int(len(df)), "causes": sorted(set(df["cause"])),
            "apis": sorted(set(zip(df["api_name"], df["output_index"].astype(int)))),
            "nan_inf": bool((df["kind"] == "nan_inf").any()),
            "ratio": float(finite["ratio"].max()) if len(finite) else 0.0}


def render(rows, before=None) -> str:
    old = {(r["name"], r["mode"]): r for r in (before or [])}
    lines = ["| bug | its mode | " + " | ".join(MODES) + " |", "|---|---|" + "---|" * len(MODES)]
    found = {m: 0 for m in ("own",) + MODES}
    names = list(dict.fromkeys(r["name"] for r in rows))
    for name in names:
        mine = {r["mode"]: r for r in rows if r["name"] == name}
        own = mine[MODES[0]]["own"]
        cells = []
        for m in MODES:
            r = mine[m]
            size = "NaN/Inf" if r.get("nan_inf") else f"{r['ratio']:.3g}×"
            cell = f"{', '.join(r['causes'])} {size}" if r["ok"] else "—"
            b = old.get((name, m))
            if b is not None and b["ok"] != r["ok"]:
                cell = f"{'found' if b['ok'] else '—'} → {cell}"
            cells.append(cell)
            found[m] += r["ok"]
        found["own"] += mine[own]["ok"]
        lines.append(f"| {name} | {own} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Found in their own mode: {found['own']}/{len(names)}; per mode: " +
                 ", ".join(f"{m} {found[m]}" for m in MODES) + ".")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--before", help="an earlier run's --out (rendered as before -> after)")
    args = ap.parse_args(argv)
    logging.getLogger("probekit").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, own, options, fn, why, api in cases():
            for mode in MODES:
                r = run_case(tmp, name, options, fn, mode)
                ok = r["rows"] > 0 if api is None else tuple(api) in map(tuple, r["apis"])
                if why is not None:
                    ok = ok and why in r["causes"]
                rows.append(dict(r, name=name, mode=mode, own=own, ok=bool(ok)))
                print(f"{name} {mode}: {r['rows']} rows {r['causes']}", file=sys.stderr,
                      flush=True)
    before = None
    if args.before:
        with open(args.before) as fh:
            before = json.load(fh)["rows"]
    md = render(rows, before)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "markdown": md}, fh, indent=1, default=list)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
