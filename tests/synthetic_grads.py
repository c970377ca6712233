"""Synthetic grad-probe datasets following the schemas of ``probekit.open_grads`` and
``probekit.compare_grads``, for the plot and notebook-layer tests (exact known values).

Built from real random gradients, so every statistic is consistent with the sign bits it comes
with. Import it by name (``tests/`` is on ``sys.path`` through the root conftest); never import
from a conftest.
"""

GRAD_PARAMS = {  # name -> shape
    "embed.weight": (16, 8),
    "encoder.layers.0.self_attn.in_proj_weight": (24, 8),
    "encoder.layers.0.linear1.bias": (40,),
    "head.weight": (4, 16),
}
GRAD_BOUNDS = (-1, 0, 1)
#: the parameter that diverges in the second run of ``grads_pair``
GRAD_PARAMS_DIVERGING = "encoder.layers.0.self_attn.in_proj_weight"


def _interval_labels(bounds):
    edges = ["-inf", *[repr(b) for b in bounds], "inf"]
    labels = [f"({lo}, {hi}]" for lo, hi in zip(edges[:-2], edges[1:-1])]
    return labels + [f"({edges[-2]}, inf)"]


def make_grads(steps=8, seed=0, diverge_param=None, diverge_at=None, level="L2", rank=0):
    """An ``open_grads``-shaped Dataset; from ``diverge_at`` on, ``diverge_param``'s gradient gets
    a growing share of flipped signs (as a run with a precision problem would)."""
    import numpy as np
    import xarray as xr

    rng = np.random.default_rng(seed)
    names = list(GRAD_PARAMS)
    numel = np.array([int(np.prod(s)) for s in GRAD_PARAMS.values()], dtype=np.int64)
    nbytes = (numel + 63) // 64 * 8
    offset = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    base = np.random.default_rng(1000)          # the "true" gradients, shared by both runs
    stats = {k: np.zeros((steps, len(names))) for k in ("max", "min", "norm", "zeros")}
    labels = _interval_labels(GRAD_BOUNDS)
    dist = np.zeros((steps, len(names), len(labels)))
    direction = np.zeros((steps, int(nbytes.sum())), dtype=np.uint8)
    for s in range(steps):
        for p, name in enumerate(names):
            g = base.normal(0, 0.8 / (1 + s), numel[p]) * (1 + p)
            g[base.random(numel[p]) < 0.05] = 0.0
            g = g + rng.normal(0, 1e-6, numel[p]) * (g != 0)      # tiny run-to-run noise
            if name == diverge_param and diverge_at is not None and s >= diverge_at:
                flip = rng.random(numel[p]) < min(0.5, 0.08 * (s - diverge_at + 1))
                g[flip] = -g[flip]
            stats["max"][s, p], stats["min"][s, p] = g.max(), g.min()
            stats["norm"][s, p] = float(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
            stats["zeros"][s, p] = np.mean(g == 0)
            idx = np.searchsorted(np.asarray(GRAD_BOUNDS, dtype=float), g, side="left")
            dist[s, p] = np.bincount(idx, minlength=len(labels)) / numel[p]
            bits = np.packbits(g > 0)
            direction[s, offset[p]:offset[p] + bits.size] = bits
    coords = {
        "step": np.arange(steps, dtype=np.int64), "param": names,
        "numel": ("param", numel),
        "shape": ("param", [str(tuple(s)) for s in GRAD_PARAMS.values()]),
    }
    data = {k: (("step", "param"), stats[k]) for k in ("max", "min", "norm")}
    attrs = {"level": level, "bounds": list(GRAD_BOUNDS), "hash_algorithm": "md5", "rank": rank}
    if level == "L0":
        data["hash"] = (("step", "param"), np.array(
            [[f"{s:02d}{p:030d}" for p in range(len(names))] for s in range(steps)]))
    else:
        coords["offset"] = ("param", offset)
        data["direction"] = (("step", "byte"), direction)
    if level == "L2":
        coords["interval"] = labels
        data["zeros"] = (("step", "param"), stats["zeros"])
        data["dist"] = (("step", "param", "interval"), dist)
    return xr.Dataset(data, coords=coords, attrs=attrs)


def compare_synthetic(runs_a, runs_b, step0_threshold=0.97, drop_threshold=0.03):
    """A ``compare_grads``-shaped Dataset for lists of per-rank datasets (sign agreement)."""
    import numpy as np
    import xarray as xr

    a0 = runs_a[0]
    names, numel = list(a0.param.values), a0.numel.values
    sims = []
    for a, b in zip(runs_a, runs_b):
        bits_a = np.unpackbits(a.direction.values, axis=1)
        bits_b = np.unpackbits(b.direction.values, axis=1)
        sim = np.zeros((a.sizes["step"], len(names)))
        for p in range(len(names)):
            lo = int(a.offset.values[p]) * 8
            sim[:, p] = np.mean(bits_a[:, lo:lo + numel[p]] == bits_b[:, lo:lo + numel[p]], axis=1)
        sims.append(sim)
    sim = np.stack(sims)                                              # rank, step, param
    total = (sim * numel).sum(-1) / numel.sum()
    flag = np.zeros_like(sim, dtype=bool)
    flag[:, 0] = sim[:, 0] < step0_threshold
    flag[:, 1:] = (sim[:, :-1] - sim[:, 1:]) > drop_threshold
    first_step = np.full(len(sims), -1)
    first_param = np.full(len(sims), "", dtype=object)
    for r in range(len(sims)):
        hits = np.argwhere(flag[r])
        if len(hits):
            first_step[r] = a0.step.values[hits[0, 0]]
            first_param[r] = names[hits[0, 1]]
    tflag = np.zeros_like(total, dtype=bool)
    tflag[:, 0] = total[:, 0] < step0_threshold
    tflag[:, 1:] = (total[:, :-1] - total[:, 1:]) > drop_threshold
    return xr.Dataset(
        {"similarity": (("rank", "step", "param"), sim), "total": (("rank", "step"), total),
         "flag": (("rank", "step", "param"), flag), "flag_total": (("rank", "step"), tflag),
         "first_step": ("rank", first_step), "first_param": ("rank", first_param.astype(str))},
        coords={"rank": np.arange(len(sims)), "step": a0.step.values, "param": names,
                "numel": ("param", numel)},
        attrs={"step0_threshold": step0_threshold, "drop_threshold": drop_threshold})
