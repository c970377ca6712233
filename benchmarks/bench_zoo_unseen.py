"""Out-of-sample validation of the free benchmark's verdicts (issue 26, point 6): architectures
that are NOT in the healthy zoo (``tests/_hf_models.py``'s ``ZOO``) and that nobody tuned the
error model to, trained 2 SGD steps under the free benchmark.

    python benchmarks/bench_zoo_unseen.py --out unseen.json [--models deberta,whisper,...]
        [--modes improve_precision:forward,...] [--no-identity] [--md unseen.md]

Models (transformers configs, tiny sizes, random init, nothing downloaded): DeBERTa-v2
(disentangled relative attention), Whisper (log-mel conv1d front + encoder-decoder), Swin
(shifted-window attention with relative position bias, patch merging), MobileViT (BN convs,
in-place-free SiLU, unfold/fold around a transformer), Gemma (RMSNorm with ``1 + w``,
gelu-tanh GLU, GQA/RoPE), ConvBERT (span-based dynamic convolution heads, separable conv1d),
Mamba (selective scan, the slow sequential path on CPU). Each in fp32, bf16 weights and bf16
autocast; improve_precision and bit_noise, forward and backward; ``combined`` once per model
(bf16, backward); dropout off. Per model also check-mode runs with dropout on (fp32 improve_precision forward, bf16
bit_noise backward, autocast combined backward), compared with
an unprobed run of the same model and seeds: losses, parameters and ``torch.get_rng_state()``
after the steps must be bit-identical. Each configuration records calls checked, the checked
share, finding rows (api_name, ratio, cause), hot spots and the flags still ``pending`` or
``unexplained`` after ``stop()`` (0 on the CPU since every flag is explained in its call). Reuses bench_zoo.py's rendering and JSON layout.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import struct
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_zoo import MODES, render  # noqa: E402
from _hf_models import zoo_train  # noqa: E402

import probekit  # noqa: E402

VOCAB = 256
UNSEEN = ("deberta", "whisper", "swin", "mobilevit", "gemma", "convbert", "mamba")
DTYPES = ("fp32", "bf16", "autocast")
IMAGE = ("swin", "mobilevit")


def unseen_model(kind: str, setting: str = "fp32", seed: int = 0, dropout: bool = False):
    """A tiny randomly initialised model of an architecture outside the zoo, training mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    p = 0.1 if dropout else 0.0
    w, heads = 64, 4
    T = transformers
    if kind == "deberta":
        cfg = T.DebertaV2Config(vocab_size=VOCAB, hidden_size=w, num_hidden_layers=2,
                                num_attention_heads=heads, intermediate_size=2 * w,
                                max_position_embeddings=64, relative_attention=True,
                                position_buckets=16, max_relative_positions=32,
                                pos_att_type=["p2c", "c2p"], hidden_dropout_prob=p,
                                attention_probs_dropout_prob=p)
        model = T.DebertaV2ForMaskedLM(cfg)
    elif kind == "whisper":
        cfg = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=w, encoder_layers=2,
                              decoder_layers=2, encoder_attention_heads=heads,
                              decoder_attention_heads=heads, encoder_ffn_dim=2 * w,
                              decoder_ffn_dim=2 * w, max_source_positions=32,
                              max_target_positions=32, dropout=p, attention_dropout=p,
                              activation_dropout=p, decoder_start_token_id=1, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, suppress_tokens=None,
                              begin_suppress_tokens=None)
        model = T.WhisperForConditionalGeneration(cfg)
    elif kind == "swin":
        cfg = T.SwinConfig(image_size=32, patch_size=2, num_channels=3, embed_dim=16,
                           depths=[2, 2], num_heads=[2, 4], window_size=4, mlp_ratio=2.0,
                           hidden_dropout_prob=p, attention_probs_dropout_prob=p,
                           drop_path_rate=0.0, num_labels=4)
        model = T.SwinForImageClassification(cfg)
    elif kind == "mobilevit":
        cfg = T.MobileViTConfig(image_size=32, patch_size=2, num_channels=3,
                                hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32,
                                                                               40, 48, 96],
                                num_attention_heads=4, hidden_dropout_prob=p,
                                attention_probs_dropout_prob=p, classifier_dropout_prob=p,
                                num_labels=4)
        model = T.MobileViTForImageClassification(cfg)
    elif kind == "gemma":
        cfg = T.GemmaConfig(vocab_size=VOCAB, hidden_size=w, intermediate_size=2 * w,
                            num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=1,
                            head_dim=16, max_position_embeddings=64, attention_dropout=p,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = T.GemmaForCausalLM(cfg)
    elif kind == "convbert":
        cfg = T.ConvBertConfig(vocab_size=VOCAB, hidden_size=w, num_hidden_layers=2,
                               num_attention_heads=heads, intermediate_size=2 * w,
                               max_position_embeddings=64, embedding_size=w, head_ratio=2,
                               conv_kernel_size=5, num_groups=1, hidden_dropout_prob=p,
                               attention_probs_dropout_prob=p)
        model = T.ConvBertForMaskedLM(cfg)
    elif kind == "mamba":
        cfg = T.MambaConfig(vocab_size=VOCAB, hidden_size=w, state_size=8, num_hidden_layers=2,
                            expand=2, conv_kernel=4, use_mambapy=False, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)
        model = T.MambaForCausalLM(cfg)
    else:
        raise ValueError(f"kind: {kind!r} is not valid; accepted: {', '.join(UNSEEN)}")
    if setting not in DTYPES:
        raise ValueError(f"setting: {setting!r} is not valid; accepted: {', '.join(DTYPES)}")
    model.train()
    return model.to(torch.bfloat16) if setting == "bf16" else model


def unseen_batch(kind: str, gen, batch: int = 2, seq: int = 16) -> dict:
    if kind in IMAGE:
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
                "labels": torch.randint(0, 4, (batch,), generator=gen)}
    if kind == "whisper":   # log-mel features: 2 * max_source_positions frames
        return {"input_features": torch.randn(batch, 16, 64, generator=gen),
                "labels": torch.randint(3, VOCAB, (batch, 8), generator=gen)}
    ids = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def unseen_train(model, kind: str, setting: str, steps: int = 2, probe=None, seed: int = 1):
    """``tests/_hf_models.zoo_train`` on this script's batches. Returns the losses (floats)."""
    return zoo_train(model, kind, setting, steps=steps, probe=probe, seed=seed,
                     batch=unseen_batch)


def _record(kind, setting, mode, stage, dropout, fb) -> dict:
    res = fb.results
    s = fb.summary
    out = {"model": kind, "dtype": setting, "mode": mode, "stage": stage, "dropout": dropout,
           "checked": int(s["checked"]), "calls": int(s["calls"]),
           "float_calls": int(s.get("float_calls", 0)),
           "checked_share": float(s.get("checked_share", float("nan"))),
           "float_skipped": dict(s.get("float_skipped", {})),
           "pending": int(s.get("pending", 0)), "unexplained": int(s.get("unexplained", 0)),
           "flagged": int(s.get("flagged", 0)),
           "rows": int(len(res)), "apis": {}, "findings": []}
    if not res.empty:
        api = res["api_name"].str.rsplit(".", n=2).str[0]
        for name, g in res.groupby(api):
            out["apis"][name] = {"rows": int(len(g)), "max_ratio": float(g["ratio"].max()),
                                 "causes": sorted(set(g["cause"].fillna("")))}
        cols = [c for c in ("api_name", "ratio", "cause", "dtype", "shape", "max_rel",
                            "threshold", "pert_mode", "step", "output_index", "kind", "max_abs",
                            "call_site") if c in res.columns]
        out["findings"] = json.loads(res[cols].to_json(orient="records"))
    hot = fb.hotspots
    out["hotspots"] = int(len(hot))
    if len(hot):
        cols = [c for c in ("api_name", "ratio", "cause", "count") if c in hot.columns]
        out["hotspot_rows"] = json.loads(hot[cols].head(10).to_json(orient="records"))
    return out


def run_one(kind, setting, mode, stage, steps, dump, dropout=False) -> dict:
    model = unseen_model(kind, setting, dropout=dropout)
    fb = probekit.FreeBench(dump_path=dump, pert_mode=mode, fuzz_stage=stage)
    unseen_train(model, kind, setting, steps=steps, probe=fb)
    return _record(kind, setting, mode, stage, dropout, fb)


def identity(kind, setting, mode, stage, steps, dump) -> dict:
    """Dropout on, check mode: the probed run's losses, parameters and global RNG state after
    ``steps`` must be bit-identical to an unprobed run of the same model and seeds."""
    ref_model = unseen_model(kind, setting, dropout=True)
    ref_losses = unseen_train(ref_model, kind, setting, steps=steps)
    ref_rng = torch.get_rng_state()
    model = unseen_model(kind, setting, dropout=True)
    fb = probekit.FreeBench(dump_path=dump, pert_mode=mode, fuzz_stage=stage)
    losses = unseen_train(model, kind, setting, steps=steps, probe=fb)
    rng = torch.get_rng_state()
    rec = _record(kind, setting, mode, stage, True, fb)
    rec["identity"] = identity_of((ref_model, ref_losses, ref_rng), (model, losses, rng), fb)
    return rec


def identity_of(ref, probed, fb) -> dict:
    """Bit-identity of a probed run against an unprobed one, each ``(model, losses, rng state
    after the steps)``: the losses and every parameter compared by their bits (two equal NaNs
    are equal), and the global RNG state."""
    (ref_model, ref_losses, ref_rng), (model, losses, rng) = ref, probed
    bits = lambda xs: [struct.pack("<d", float(x)) for x in xs]   # noqa: E731
    raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)   # noqa: E731
    diff_params = [n for (n, a), (_, b) in zip(ref_model.named_parameters(),
                                                model.named_parameters())
                   if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(raw(a), raw(b))]
    return {"losses_equal": bits(ref_losses) == bits(losses), "params_differing": diff_params,
            "n_params": sum(1 for _ in model.parameters()),
            "rng_equal": bool(torch.equal(ref_rng, rng)),
            "losses": [float(x) for x in losses],
            "replayed": int(fb.summary.get("replayed", 0))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--md", help="also write the markdown table here")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--models", default=",".join(UNSEEN))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--modes", default=",".join(f"{m}:{s}" for m, s in MODES))
    ap.add_argument("--combined", default="bf16:backward",
                    help="dtype:stage of the one `combined` run per model ('' for none)")
    ap.add_argument("--identity", default="fp32:improve_precision:forward,"
                    "bf16:bit_noise:backward,autocast:combined:backward",
                    help="dtype:mode:stage of the dropout-on bit-identity runs, comma-separated "
                         "('' for none)")
    args = ap.parse_args(argv)
    modes = [tuple(x.split(":")) for x in args.modes.split(",") if x]
    logging.getLogger("probekit").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = []
    t0 = time.perf_counter()

    def save():
        md = render([r for r in rows if "identity" not in r])
        ident = [r for r in rows if "identity" in r]
        if ident:
            md += "\n\n| model | dropout-on run | checked | rows | replayed | losses | params " \
                  "| RNG state |\n|---|---|---:|---:|---:|---|---|---|\n"
            for r in ident:
                i = r["identity"]
                md += (f"| {r['model']} | {r['dtype']} {r['mode']} {r['stage']} | {r['checked']}"
                       f" | {r['rows']} | {i['replayed']} | "
                       f"{'identical' if i['losses_equal'] else 'DIFFER'} | "
                       f"{i['n_params'] - len(i['params_differing'])}/{i['n_params']} identical"
                       f" | {'identical' if i['rng_equal'] else 'DIFFERS'} |\n")
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "markdown": md, "seconds": time.perf_counter() - t0}, fh,
                      indent=1)
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(md + "\n")
        return md

    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            t1 = time.perf_counter()
            grid = [(s, m, st) for s in args.dtypes.split(",") for m, st in modes]
            if args.combined:
                s, st = args.combined.split(":")
                grid.append((s, "combined", st))
            for setting, mode, stage in grid:
                dump = os.path.join(tmp, f"{kind}_{setting}_{mode}_{stage}")
                try:
                    r = run_one(kind, setting, mode, stage, args.steps, dump)
                except Exception as exc:   # an architecture that fails to run is reported
                    r = {"model": kind, "dtype": setting, "mode": mode, "stage": stage,
                         "error": f"{type(exc).__name__}: {exc}"[:300], "rows": 0,
                         "checked": 0, "apis": {}}
                rows.append(r)
                print(f"{kind} {setting} {mode} {stage}: {r['rows']} rows / {r['checked']} "
                      f"checked, share {r.get('checked_share', float('nan')):.3f} "
                      f"{[(a, round(v['max_ratio'], 2), v['causes']) for a, v in r['apis'].items()]}"
                      f"{' ERROR ' + r['error'] if 'error' in r else ''}",
                      file=sys.stderr, flush=True)
            for spec in filter(None, args.identity.split(",")):
                s, m, st = spec.split(":")
                r = identity(kind, s, m, st, args.steps,
                             os.path.join(tmp, f"{kind}_ident_{s}_{m}_{st}"))
                rows.append(r)
                print(f"{kind} identity {s} {m} {st}: {r['identity']} rows {r['rows']}",
                      file=sys.stderr, flush=True)
            print(f"{kind}: {time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
            save()
    md = save()
    print(md)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
