"""Grad stores of simulated distributed runs, written rank group by rank group with placements
(as ``GradProbe`` writes them under FSDP2, tensor parallel, HSDP), for the comparison's tests and
benchmarks (``benchmarks/bench_grads_plan.py``, ``bench_grads_compare_dask.py``).

A layout is {rank: [(name, offset, local shape)]} over parameters {name: global shape}; an offset
of None is a whole parameter (an unsharded group when every entry of a rank is None). Gradients
are real random tensors (``grads``: the same for every layout of one ``seed``, so two layouts of
one seed hold the same bits), and the statistics are ``stats.compute``'s of each shard. Import it
by name (``tests/`` is on ``sys.path`` through the root conftest; benchmarks add it).
"""
from __future__ import annotations

import numpy as np


def fsdp(params: dict, ranks: int) -> dict:
    """FSDP2's dim-0 shards: rank r holds rows [r*c, (r+1)*c) of every parameter, c =
    ceil(rows / ranks) (the last ranks may hold fewer or none, as torch.chunk leaves them)."""
    out = {r: [] for r in range(ranks)}
    for name, shape in params.items():
        if not shape:  # a scalar: whole, on the first rank
            out[0].append((name, None, shape))
            continue
        rows = shape[0]
        c = -(-rows // ranks)
        for r in range(ranks):
            lo, hi = min(rows, r * c), min(rows, (r + 1) * c)
            out[r].append((name, (lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:])))
    return out


def tensor_parallel(params: dict, ranks: int) -> dict:
    """Column blocks (Shard(1)) of 2-D parameters, row blocks (Shard(0)) of 1-D ones, others
    whole on rank 0 only (a replicated parameter: only mesh coordinate 0 records it)."""
    out = {r: [] for r in range(ranks)}
    for name, shape in params.items():
        if len(shape) in (1, 2):
            d = len(shape) - 1
            c = -(-shape[d] // ranks)
            for r in range(ranks):
                lo, hi = min(shape[d], r * c), min(shape[d], (r + 1) * c)
                off = [0] * len(shape)
                loc = list(shape)
                off[d], loc[d] = lo, hi - lo
                out[r].append((name, tuple(off), tuple(loc)))
        else:
            out[0].append((name, None, shape))
    return out


def mesh2d(params: dict, dp: int, tp: int) -> dict:
    """2-D parallelism: dim 0 over ``dp`` and dim 1 over ``tp`` (rank = i * tp + j); 1-D
    parameters over dim 0 on tp coordinate 0 only."""
    out = {r: [] for r in range(dp * tp)}
    for name, shape in params.items():
        if not shape:
            out[0].append((name, None, shape))
            continue
        c0 = -(-shape[0] // dp)
        for i in range(dp):
            lo0, hi0 = min(shape[0], i * c0), min(shape[0], (i + 1) * c0)
            if len(shape) == 1:
                out[i * tp].append((name, (lo0,), (hi0 - lo0,)))
                continue
            c1 = -(-shape[1] // tp)
            for j in range(tp):
                lo1, hi1 = min(shape[1], j * c1), min(shape[1], (j + 1) * c1)
                out[i * tp + j].append((name, (lo0, lo1) + (0,) * (len(shape) - 2),
                                        (hi0 - lo0, hi1 - lo1, *shape[2:])))
    return out


def single(params: dict) -> dict:
    return {0: [(name, None, shape) for name, shape in params.items()]}


def grads(params: dict, step: int, seed: int, noise: float = 0.0) -> dict:
    """The gradients of a step: the same base for every seed, plus ``noise`` x a seeded
    perturbation (so two seeds differ in a share of the signs that grows with ``noise``)."""
    base = np.random.default_rng([7, step])
    other = np.random.default_rng([seed, step])
    out = {}
    for name, shape in params.items():
        g = base.standard_normal(shape).astype(np.float32)
        g[base.random(shape) < 0.1] = 0.0
        if noise:
            g = g + np.float32(noise) * other.standard_normal(shape).astype(np.float32)
        out[name] = g
    return out


def place(shape, offset, local) -> dict | None:
    return None if offset is None else {
        "global_shape": list(shape), "offset": list(offset), "local_shape": list(local),
        "mesh_shape": [1], "mesh_coord": [0], "mesh_dims": [], "placements": ["S(0)"]}


def write(path, params: dict, layout: dict, steps, *, seed: int = 0, noise: float = 0.0,
          level: str = "L1", significance: bool = True, flush_every: int = 2,
          data=None, sample: int = 0, run: dict | None = None,
          layout_key: str | None = None) -> None:
    """Write the store of ``layout`` at ``path`` (a folder or URL): ``steps`` (an int or the
    step numbers; {rank: steps} gives each rank its own, a rank that died early), gradients from
    ``grads`` (or ``data(step) -> {name: array}``); ``sample``: sampled sign bits, as
    ``grad_probe.sample`` records them. A restart into an existing store: ``run`` (the record
    of ``restarts.plan_run``, the same for every rank: {"run", "time", "start", "from",
    "scope"}) and ``layout_key`` (the layout's key, as ``GradProbe`` derives it from the whole
    model's layout: another world size records into its own layout folder)."""
    import torch

    from probekit.grads.numerics.sampling import samples_in_box
    from probekit.grads.numerics.stats import Layout, compute
    from probekit.grads.store.store import GradWriter

    sharded = any(off is not None for entries in layout.values() for _, off, _ in entries)
    for r, entries in sorted(layout.items()):
        if not entries:
            continue
        numels = tuple(int(np.prod(e[2], dtype=np.int64)) for e in entries)
        positions = None
        if sample:
            positions = [samples_in_box(params[n], sample, off or (0,) * len(loc), loc)[1]
                         for n, off, loc in entries]
            positions = [None if p.size == m else p for p, m in zip(positions, numels)]
        lay = Layout(tuple(e[0] for e in entries), numels, tuple(tuple(e[2]) for e in entries),
                     None if positions is None else tuple(
                         m if p is None else int(p.size) for p, m in zip(positions, numels)))
        attrs = ({"placement": [place(params[n], off, loc) for n, off, loc in entries]}
                 if sharded else {})
        if sample:
            attrs.update(sample=int(sample), sample_bits=list(lay.bits))
        w = GradWriter(str(path), r, lay, level, (-1, 0, 1), "md5", flush_every,
                       attrs=attrs or None, significance=significance, layout_key=layout_key)
        if run is not None:
            w.begin(dict(run))
        mine = steps[r] if isinstance(steps, dict) else steps
        for step in (range(mine) if isinstance(mine, int) else mine):
            full = data(step) if data is not None else grads(params, step, seed, noise)
            local = []
            for name, off, loc in entries:
                g = full[name]
                if off is not None:
                    g = g[tuple(slice(o, o + s) for o, s in zip(off, loc))]
                local.append(torch.from_numpy(np.ascontiguousarray(g)))
            w.append(step, compute(local, lay, level, (-1, 0, 1), "md5", None, significance,
                                   sample=positions))
        w.close()


def llama7b() -> dict:
    """Llama-2-7B's 291 parameter tensors (6.74B elements)."""
    d, ff, vocab = 4096, 11008, 32000
    out = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(32):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{proj}.weight"] = (d, d)
        out[p + "mlp.gate_proj.weight"] = (ff, d)
        out[p + "mlp.up_proj.weight"] = (ff, d)
        out[p + "mlp.down_proj.weight"] = (d, ff)
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
    out["model.norm.weight"] = (d,)
    out["lm_head.weight"] = (vocab, d)
    return out


def write_random(path, params: dict, layout: dict, steps: int, *, seed: int = 0,
                 significance: bool = True, flush_every: int = 50, bits: bool = True) -> None:
    """A store of ``layout`` with random sign and significance bits (no gradients computed:
    for throughput and planning benchmarks). Ranks of the same local layout after the first are
    copies of its group with their own ``rank`` and ``placement`` attributes (fast for many
    ranks; their bits are the first one's); ``bits=False`` writes no bit chunk files (every
    element reads as the fill value: the metadata of a large store at no disk cost)."""
    import json
    import os
    import shutil

    from probekit.grads.numerics.stats import Layout, StepStats
    from probekit.grads.store.store import GradWriter

    rng = np.random.default_rng(seed)
    sharded = any(off is not None for entries in layout.values() for _, off, _ in entries)
    store = os.path.join(str(path), "grads.zarr")
    templates = {}
    for r, entries in sorted(layout.items()):
        if not entries:
            continue
        numels = tuple(int(np.prod(e[2], dtype=np.int64)) for e in entries)
        key = (tuple(e[0] for e in entries), numels)
        placement = ([place(params[n], off, loc) for n, off, loc in entries]
                     if sharded else None)
        group = os.path.join(store, f"rank{r}")
        if key in templates:
            shutil.copytree(templates[key], group)
            meta_path = os.path.join(group, "zarr.json")
            with open(meta_path) as fh:
                meta = json.load(fh)
            meta["attributes"]["rank"] = int(r)
            if placement is not None:
                meta["attributes"]["placement"] = placement
            with open(meta_path, "w") as fh:
                json.dump(meta, fh)
            continue
        lay = Layout(key[0], numels, tuple(tuple(e[2]) for e in entries))
        w = GradWriter(str(path), r, lay, "L1", (-1, 0, 1), "md5", flush_every,
                       attrs={"placement": placement} if sharded else None,
                       significance=significance)
        p = len(entries)
        for s in range(steps):
            w.append(s, StepStats(
                present=np.ones(p, bool), max=np.ones(p), min=-np.ones(p), norm=np.ones(p),
                direction=(rng.integers(0, 256, lay.nbytes, np.uint8) if bits
                           else np.zeros(lay.nbytes, np.uint8)),
                significant=(rng.integers(0, 256, lay.nbytes, np.uint8) if bits
                             else np.full(lay.nbytes, 255, np.uint8))))
        w.close()
        if not bits:
            for name in ("direction", "significant"):
                shutil.rmtree(os.path.join(group, name, "c"), ignore_errors=True)
        templates[key] = group
