"""Grad comparison: the path splits behind the control verdict's remaining false alarms (issue 37).

    python benchmarks/bench_control_splits.py t5  [--out t5.json] [--steps 6]
    python benchmarks/bench_control_splits.py moe [--out moe.json] [--steps 16]
    python benchmarks/bench_control_splits.py layernorm [--models convnext,wav2vec2]

Both record the runs of ``bench_control.py sweep`` (``zoo_record``: AdamW lr 1e-3, batches of
4 x 16 tokens, one torch thread) with forward hooks that only observe.

``t5``: the fp32 reference and its three fp32 controls, a hook on every feed-forward input
projection (``DenseReluDense.wi``: its output is the ReLU's input). Per control and step: the
ReLU inputs whose sign differs from the reference's, and the largest relative deviation of any
parameter's gradient norm from the reference's. For the first such element: each run's value
there. Then the reference again with only that element moved to the crossing run's value at
that step: its gradient norms against the crossing run's and the reference's (does that one
kink decide the path?).

``moe``: the fp32 reference, three bf16 controls and the bf16-autocast test of the tiny
Mixtral (top-2 of 4 experts), a hook on each router. Per run: where its routes differ from the
reference's (step, layer, tokens) and the reference's relative gap between the second and third
probabilities at the first such token; per reference step the tokens within two bf16 units of
such a tie.

``layernorm``: not a split, the alarms of a bf16-autocast test that are true. One batch of each
zoo model (``tests/_hf_models``) under CPU bf16 autocast: per LayerNorm, the dtypes it receives
(input, weight) and its bias gradient against an exact float64 sum of the very upstream
gradient it received (and a float32 sum of it, for scale). A bf16 input with float32 weight is
the mixed-type CPU kernel that sums those gradients in bf16 (the real-bug zoo's
``autocast_layer_norm_backward``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_control as bc  # noqa: E402

from probekit.grads import open_grads  # noqa: E402

#: bf16's unit roundoff
U_BF16 = 2.0 ** -8


def _norms(path) -> np.ndarray:
    """(step, param) gradient norms of a recorded run."""
    return np.asarray(open_grads(path)["norm"].transpose("step", "param").values, np.float64)


def _max_rel(a, b) -> list:
    """Per step, the largest |a / b - 1| over the parameters."""
    with np.errstate(all="ignore"):
        r = np.abs(a / b - 1.0)
    return [float(np.nanmax(x)) for x in r]


def _t5_watch(log: dict, force=None):
    """A ``zoo_record`` watcher: every ``DenseReluDense.wi`` output per step into ``log``;
    ``force = (module, step, index, value)`` moves that one element to ``value`` (a delta
    added: the gradient still flows through it)."""
    def watch(model, clock):
        for name, mod in model.named_modules():
            if name.endswith("DenseReluDense"):
                def hook(m, inp, out, name=name):
                    if force is not None and force[0] == name and force[1] == clock.step:
                        delta = torch.zeros_like(out)
                        delta[force[2]] = force[3] - out[force[2]].item()
                        out = out + delta
                    log.setdefault(name, []).append(out.detach().clone())
                    return out
                mod.wi.register_forward_hook(hook)
    return watch


def t5(args, root) -> dict:
    runs, logs = {}, {}
    for name, control, seed in (("ref", None, 0), ("c_fp32_0", "fp32", 0),
                                ("c_fp32_1", "fp32", 1), ("c_fp32_2", "fp32", 2)):
        logs[name] = {}
        runs[name] = bc.zoo_record(os.path.join(root, name), "t5", control=control, seed=seed,
                                   steps=args.steps, watch=_t5_watch(logs[name]))
    norms = {k: _norms(v) for k, v in runs.items()}
    out = {"runs": {}}
    first = None
    for name in runs:
        if name == "ref":
            continue
        flips = []
        for step in range(args.steps):
            n = 0
            for mod, ys in logs[name].items():
                a, b = logs["ref"][mod][step] > 0, ys[step] > 0
                d = a != b
                n += int(d.sum())
                if d.any() and (first is None or step < first[1]):
                    idx = tuple(int(i) for i in d.nonzero()[0])
                    first = (mod, step, idx, name)
            flips.append(n)
        out["runs"][name] = {"relu_sign_differences": flips,
                             "max_rel_norm_dev": _max_rel(norms[name], norms["ref"])}
    if first is not None:
        mod, step, idx, crossed = first
        values = {k: float(logs[k][mod][step][idx]) for k in logs}
        out["first_crossing"] = {"module": mod, "step": step, "index": list(idx),
                                 "run": crossed, "values": values}
        forced = bc.zoo_record(os.path.join(root, "ref_forced"), "t5", steps=args.steps,
                               watch=_t5_watch({}, (mod, step, idx, values[crossed])))
        nf = _norms(forced)
        out["forced"] = {"vs_crossing_run": _max_rel(nf, norms[crossed]),
                         "vs_reference": _max_rel(nf, norms["ref"])}
    return out


def _moe_watch(log: list):
    def watch(model, clock):
        for mod in model.modules():
            if type(mod).__name__ == "MixtralTopKRouter":
                def hook(m, inp, out):
                    logits, _, idx = out
                    while len(log) <= clock.step:
                        log.append([])
                    p = torch.topk(torch.softmax(logits.detach().float(), -1), 3, dim=-1).values
                    log[clock.step].append((idx.detach().sort(-1).values,
                                            ((p[:, 1] - p[:, 2]) / p[:, 1])))
                mod.register_forward_hook(hook)
    return watch


def moe(args, root) -> dict:
    logs = {}
    for name, setting, control, seed in (("ref", "fp32", None, 0),
                                         ("c_bf16_0", "fp32", "bf16", 0),
                                         ("c_bf16_1", "fp32", "bf16", 1),
                                         ("c_bf16_2", "fp32", "bf16", 2),
                                         ("autocast", "autocast", None, 0)):
        logs[name] = []
        bc.zoo_record(os.path.join(root, name), "moe", setting, control=control, seed=seed,
                      steps=args.steps, watch=_moe_watch(logs[name]))
    ref = logs["ref"]
    out = {"near_ties_per_step": [[int((gap < 2 * U_BF16).sum()) for _, gap in layers]
                                  for layers in ref], "runs": {}}
    for name, log in logs.items():
        if name == "ref":
            continue
        diffs = []
        for step, layers in enumerate(log):
            for layer, (idx, _) in enumerate(layers):
                d = (idx != ref[step][layer][0]).any(-1)
                if d.any():
                    t = int(d.nonzero()[0])
                    diffs.append({"step": step, "layer": layer, "tokens": int(d.sum()),
                                  "ref_gap": float(ref[step][layer][1][t])})
        out["runs"][name] = diffs
    return out


def layernorm(args, root) -> dict:
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from _hf_models import zoo_batch, zoo_model

    out = {}
    for kind in args.models.split(","):
        torch.manual_seed(0)
        model = zoo_model(kind, "fp32")
        norms = {id(m.weight): name for name, m in model.named_modules()
                 if isinstance(m, torch.nn.LayerNorm) and m.weight is not None}
        seen, grads = {}, {}
        orig = F.layer_norm

        def observed(x, shape, weight=None, bias=None, eps=1e-5):
            y = orig(x, shape, weight, bias, eps)
            name = norms.get(id(weight))
            if name is not None and y.requires_grad:
                seen[name] = (str(x.dtype), str(weight.dtype))
                y.register_hook(lambda g, n=name: grads.__setitem__(n, g.detach().clone()))
            return y

        batch = zoo_batch(kind, torch.Generator().manual_seed(1))
        F.layer_norm = observed
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = model(**batch)
        finally:
            F.layer_norm = orig
        loss = res.loss if getattr(res, "loss", None) is not None else \
            res.logits.float().pow(2).mean()
        loss.backward()
        mods = dict(model.named_modules())
        rows = {}
        for name, g in grads.items():
            flat = g.reshape(-1, g.shape[-1])
            exact = flat.double().sum(0)
            got = mods[name].bias.grad.double()
            f32 = flat.float().sum(0).double()
            rows[name] = {"input": seen[name][0], "weight": seen[name][1],
                          "bias_grad_error": float((got - exact).norm() / exact.norm()),
                          "float32_sum_error": float((f32 - exact).norm() / exact.norm())}
        out[kind] = rows
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("t5", "moe", "layernorm"))
    p.add_argument("--models", default="convnext,wav2vec2", help="layernorm: zoo models")
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dir", default=None,
                   help="keep the recorded runs here (without it: a temporary folder, removed)")
    args = p.parse_args(argv)
    args.steps = args.steps or {"t5": 6, "moe": 16}.get(args.what)
    torch.set_num_threads(1)
    import logging

    logging.getLogger("probekit").setLevel(logging.ERROR)
    run = {"t5": t5, "moe": moe, "layernorm": layernorm}[args.what]
    if args.dir is None:   # the recorded runs in a folder of their own, removed at the end
        with tempfile.TemporaryDirectory(prefix=f"probekit-splits-{args.what}-") as root:
            res = run(args, root)
    else:
        res = run(args, args.dir)
    res.update(what=args.what, steps=args.steps)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
