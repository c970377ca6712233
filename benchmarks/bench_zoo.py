"""The healthy zoo: architectures nobody here tuned the verdicts to, trained a few steps under
the free benchmark; a healthy model should give no findings (issues 19 and 26).

    python benchmarks/bench_zoo.py --out zoo.json [--steps 2] [--models gpt2,llama,...]
        [--modes improve_precision:forward,bit_noise:backward,...] [--before old.json]

The models of ``tests/_hf_models.py``'s ``ZOO`` (GPT-2, LLaMA, BERT, a ResNet, a ViT, Mixtral
with its default and eager expert paths, T5, Wav2Vec2, ConvNeXt, an efficient CNN with
squeeze-excite and in-place activations, an LSTM/GRU language model, Qwen2 with GQA), random
weights, dropout off (``--dropout``: models run with it on, by default the RNN LM, whose
inter-layer dropout is drawn inside ``torch.lstm``/``torch.gru``), SGD on random batches; in
fp32, bf16 and bf16 autocast; forward and backward stage; improve_precision and bit_noise
(``--modes`` adds add_noise...). For each configuration: calls checked, finding rows, the APIs
flagged (worst ratio) and, where the probe keeps them, the hot spots (``fb.hotspots``). Runs
against whatever ``probekit`` is first on ``sys.path`` (so the same script measures an older
version: ``PYTHONPATH=old_tree``), and with ``--before`` renders one table of rows per
architecture and configuration, before -> after.
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
from _hf_models import ZOO, ZOO_DTYPES, zoo_model, zoo_train  # noqa: E402

import probekit  # noqa: E402

MODES = [("improve_precision", "forward"), ("bit_noise", "forward"),
         ("improve_precision", "backward"), ("bit_noise", "backward")]


def run_one(kind, setting, mode, stage, steps, dump, dropout=False) -> dict:
    model = zoo_model(kind, setting, dropout=dropout)
    fb = probekit.FreeBench(dump_path=dump, pert_mode=mode, fuzz_stage=stage)
    zoo_train(model, kind, setting, steps=steps, probe=fb)
    res = fb.results
    out = {"model": kind, "dtype": setting, "mode": mode, "stage": stage, "dropout": dropout,
           "checked": int(fb.summary["checked"]), "rows": int(len(res)), "apis": {}}
    if not res.empty:
        api = res["api_name"].str.rsplit(".", n=2).str[0]
        for name, g in res.groupby(api):
            out["apis"][name] = {"rows": int(len(g)), "max_ratio": float(g["ratio"].max()),
                                 "causes": sorted(set(g["cause"].fillna("")))}
    hot = getattr(fb, "hotspots", None)
    if hot is not None:
        out["hotspots"] = int(len(hot))
    return out


def render(rows) -> str:
    lines = ["| model | dtype | mode | stage | checked | findings | APIs flagged (rows, worst × "
             "threshold) | hot spots |", "|---|---|---|---|---:|---:|---|---:|"]
    for r in rows:
        apis = "; ".join(f"`{a}` {v['rows']}, {v['max_ratio']:.3g}×"
                         for a, v in sorted(r["apis"].items(), key=lambda kv: -kv[1]["rows"])[:3])
        more = len(r["apis"]) - 3
        if more > 0:
            apis += f"; +{more} more"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['mode']} | {r['stage']} | "
                     f"{r['checked']} | {r['rows']} | {apis or '—'} | "
                     f"{r.get('hotspots', '—')} |")
    total = sum(r["rows"] for r in rows)
    checked = sum(r["checked"] for r in rows)
    clean = sum(1 for r in rows if not r["rows"])
    lines.append("")
    lines.append(f"{total} finding rows over {checked} checked calls; {clean} of {len(rows)} "
                 "configurations clean.")
    return "\n".join(lines)


def render_before_after(before, after) -> str:
    """Rows per architecture and configuration, before -> after (``--before``)."""
    key = lambda r: (r["model"], r["dtype"], r["mode"], r["stage"])   # noqa: E731
    old = {key(r): r for r in before}
    modes = list(dict.fromkeys((r["mode"], r["stage"]) for r in after))   # in the run's order
    short = {"improve_precision": "improve_prec.", "bit_noise": "bit_noise", "add_noise":
             "add_noise"}
    head = " | ".join(f"{short.get(m, m)} {s[:3]}" for m, s in modes)
    lines = [f"| model | dtype | {head} | checked |",
             "|---|---|" + "---:|" * (len(modes) + 1)]
    tot_b = tot_a = clean_b = clean_a = n = 0
    for model in dict.fromkeys(r["model"] for r in after):
        for dtype in dict.fromkeys(r["dtype"] for r in after if r["model"] == model):
            cells, checked = [], 0
            for m, s in modes:
                a = next((r for r in after if key(r) == (model, dtype, m, s)), None)
                if a is None:
                    cells.append("—")
                    continue
                b = old.get(key(a))
                checked += a["checked"]
                n += 1
                tot_a += a["rows"]
                clean_a += a["rows"] == 0
                if b is not None:
                    tot_b += b["rows"]
                    clean_b += b["rows"] == 0
                cells.append(f"{'?' if b is None else b['rows']} → {a['rows']}")
            lines.append(f"| {model} | {dtype} | " + " | ".join(cells) + f" | {checked} |")
    lines.append("")
    lines.append(f"Finding rows before → after: {tot_b} → {tot_a}; configurations clean: "
                 f"{clean_b} → {clean_a} of {n}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--dtypes", default=",".join(ZOO_DTYPES))
    ap.add_argument("--modes", default=",".join(f"{m}:{s}" for m, s in MODES))
    ap.add_argument("--before", help="an earlier run's --out (rendered as before -> after)")
    ap.add_argument("--dropout", default="rnnlm",
                    help="models run with their dropout on (default: the RNN LM, as "
                         "tests/integration/test_healthy_zoo.py runs it; '' for none)")
    args = ap.parse_args(argv)
    modes = [tuple(x.split(":")) for x in args.modes.split(",")]
    logging.getLogger("probekit").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            for setting in args.dtypes.split(","):
                for mode, stage in modes:
                    dump = os.path.join(tmp, f"{kind}_{setting}_{mode}_{stage}")
                    r = run_one(kind, setting, mode, stage, args.steps, dump,
                                dropout=kind in args.dropout.split(","))
                    rows.append(r)
                    print(f"{kind} {setting} {mode} {stage}: {r['rows']} rows / {r['checked']} "
                          f"checked {list(r['apis'])[:4]}", file=sys.stderr, flush=True)
    md = render(rows)
    if args.before:
        with open(args.before) as fh:
            md += "\n\n" + render_before_after(json.load(fh)["rows"], rows)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "markdown": md, "seconds": time.perf_counter() - t0}, fh,
                  indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
