"""Suspects of a comparison: the modules owning the first diverging parameters, ranked.

``suspects(cmp, model=None)`` takes what ``compare_grads`` returns and gives one row per module
that owns a flagged parameter: the module's earliest flagged step (over its parameters and the
ranks), its parameters flagged then and the similarity of the first of them: the judged
similarity (``verdict.judged``: significant signs when the comparison is noise-aware), the same
number the flag, the headline and the plots use; ``module_similarity`` is the module's own,
over all its parameters (counted over the elements the flag compares). Rows are ranked by that
step (earliest first), then, calibrated by a control, by how far beyond what the control
allows its first parameter's flag is (``excess``, as ``first_param`` is chosen), else by that
similarity (lowest first). The same
is reachable as ``cmp.probekit.suspects()`` (an xarray Dataset accessor registered on import).

A parameter's module is its name without the last dotted component
(``transformer.h.2.attn.c_attn.weight`` -> ``transformer.h.2.attn.c_attn``; a parameter of the
root module has module ""). With ``model``, names are checked against ``model.named_modules()``:
wrapper prefixes the model does not have (``module.``, ``_orig_mod.``, ...) are dropped, and a
name that is still unknown raises ``ValueError`` naming the parameter.
"""
from __future__ import annotations

import numpy as np
import xarray as xr

#: wrapper prefixes dropped from parameter names when the model has no such module
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
COLUMNS = ("module", "step", "similarity", "params", "rank", "module_similarity", "kind",
           "forward")
#: ``kind`` of a suspect's first flag: by the fixed threshold (uncalibrated) or, with a control,
#: by its signs, its scale (norm, max - min) or a NaN/Inf gradient
KIND_NAMES = {0: "threshold", 1: "sign", 2: "scale", 3: "nonfinite"}


def param_module(name: str, modules=None) -> str:
    """The module owning parameter ``name`` ("" for the root); ``modules``: a collection of
    valid module names (e.g. ``dict(model.named_modules())``) to check and unwrap against."""
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    if modules is None or owner in modules:
        return owner
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if owner.startswith(prefix) or owner + "." == prefix:
                owner = owner[len(prefix):] if owner.startswith(prefix) else ""
                stripped = True
        if owner in modules:
            return owner
    raise ValueError(f"parameter {name!r}: its module {owner!r} is not in the model; accepted: "
                     "parameter names of this model (as model.named_parameters() gives them, "
                     f"wrapper prefixes {', '.join(WRAPPER_PREFIXES)} allowed)")


def suspects(cmp, model=None, top: int | None = None, order=None):
    """Modules owning flagged parameters, ranked (earliest flagged step, then lowest similarity).

    ``cmp``: a ``compare_grads`` result; ``model``: optional ``nn.Module`` to check names against;
    ``order``: the modules in the order the forward pass runs them (``triage`` records it),
    default ``model.named_modules()``'s (construction order: the forward's for most models).
    Returns a pandas DataFrame with ``COLUMNS``: ``module``, ``step`` (its earliest flagged step,
    over its parameters and the ranks), ``similarity`` (the judged similarity of its first
    flagged parameter at that step: the number behind the flag), ``params`` (its parameters
    flagged at that step, lowest similarity first), ``rank``, ``module_similarity`` (over all
    its parameters, element-weighted, so a 4-element bias does not outweigh its weight matrix)
    ``kind`` (``KIND_NAMES``) and ``forward`` (the module's position in ``order``: where it runs
    in the forward pass; -1 without a model or order); ``top`` keeps the first rows.
    Calibrated comparisons rank parameters and modules by ``excess`` (furthest beyond the
    control first) after the step.

    The first row is where the divergence is largest at its first step, not always where it
    starts: a wrong forward output changes the gradients of every module after it (their inputs
    changed) and of those before it (the backward passes through it), and the module after the
    defect can depart most (``walk_back``: the suspects of the same step that run before it).
    """
    import pandas as pd

    from .verdict import counts, judged_name

    modules = dict(model.named_modules()) if model is not None else None
    position = _positions(order if order is not None else
                          (list(modules) if modules is not None else None))
    if "rank" not in cmp.dims:
        cmp = cmp.expand_dims(rank=[0])
    params = [str(p) for p in cmp["param"].values]
    owner = np.array([param_module(p, modules) for p in params], dtype=object)
    numel = (np.asarray(cmp["numel"].values, np.float64) if "numel" in cmp.coords
             else np.ones(len(params)))
    if numel.ndim > 1:   # concatenated ranks carry numel per rank; the sizes are the same
        numel = numel.max(axis=0)
    name = judged_name(cmp)
    calibrated = bool(cmp.attrs.get("calibrated")) and "excess" in cmp
    have_counts = "differ" in cmp or "significant" in cmp
    steps = np.asarray(cmp["step"].values)
    rows = []
    for r in cmp["rank"].values:
        sub = cmp.sel(rank=r)
        flag = np.asarray(sub["flag"].transpose("step", "param").values, bool)
        sim = np.asarray(sub[name].transpose("step", "param").values, np.float64)
        excess = (np.asarray(sub["excess"].transpose("step", "param").values, np.float64)
                  if "excess" in sub else np.zeros(sim.shape))
        kinds = (np.asarray(sub["flag_kind"].transpose("step", "param").values)
                 if "flag_kind" in sub else np.zeros(sim.shape, np.int8))
        if have_counts:
            d, n = counts(sub, ("step", "param"))
        else:   # a bare similarity: weighted by the parameters' sizes
            n = np.where(np.isnan(sim), np.nan, numel)
            d = (1.0 - sim) * n
        for mod in dict.fromkeys(owner[flag.any(axis=0)]):
            cols = np.flatnonzero(owner == mod)
            i = int(np.flatnonzero(flag[:, cols].any(axis=1))[0])
            nn_, dd = n[i, cols], d[i, cols]
            ok = ~np.isnan(nn_) & ~np.isnan(dd)
            msim = float(1.0 - dd[ok].sum() / nn_[ok].sum()) if ok.any() and nn_[ok].sum() \
                else np.nan
            # calibrated: furthest beyond the control first; else the lowest similarity
            key = ((lambda c: (-int(kinds[i, c]), -_nan_low(excess[i, c]), params[c]))
                   if calibrated else (lambda c: (_nan_high(sim[i, c]), params[c])))
            hit = sorted((c for c in cols if flag[i, c]), key=key)
            lead = hit[0]
            rows.append({"module": mod, "step": int(steps[i]), "similarity": float(sim[i, lead]),
                         "params": tuple(params[c] for c in hit), "rank": int(r),
                         "module_similarity": msim,
                         "kind": KIND_NAMES.get(int(kinds[i, lead]), "threshold"),
                         "forward": _where(mod, position),
                         "_e": (-int(kinds[i, lead]), -_nan_low(excess[i, lead]))})
    df = pd.DataFrame(rows, columns=[*COLUMNS, "_e"])
    if not df.empty:   # one row per module: its earliest step, then its lead's order
        keys = ["step", "_e", "_s"] if calibrated else ["step", "_s"]
        df = (df.assign(_s=df["similarity"].fillna(np.inf))
              .sort_values([*keys, "module", "rank"], kind="stable")
              .drop_duplicates("module").drop(columns="_s").reset_index(drop=True))
    df = df.drop(columns="_e").astype({"module": object, "step": "int64", "similarity": "float64",
                                       "rank": "int64", "module_similarity": "float64",
                                       "kind": object, "forward": "int64"})
    return df.head(top) if top is not None else df


def _positions(order) -> dict | None:
    if order is None:
        return None
    out: dict = {}
    for name in order:
        out.setdefault(str(name), len(out))
    return out


def _where(module: str, position) -> int:
    """``module``'s place in the forward order: its own, else its first submodule's (a
    container runs when its first child does); -1 unknown."""
    if position is None:
        return -1
    if module in position:
        return position[module]
    inside = [v for k, v in position.items() if k.startswith(module + ".") or module == ""]
    return min(inside) if inside else -1


def walk_back(table, module: str | None = None) -> list:
    """Where a divergence named at ``module`` (default: the first suspect's) may start: the
    other suspects of ``table`` (``suspects``, with a forward order) flagged at the same step
    that run before it in the forward pass, nearest first. A wrong output of one of them changes
    the gradients of every module after it, and the one right after the defect can be the one
    that departs most."""
    if table.empty or (table["forward"] < 0).all():
        return []
    lead = table.iloc[0] if module is None else table[table["module"] == module].iloc[0]
    same = table[(table["step"] == lead["step"]) & (table["forward"] >= 0)
                 & (table["forward"] < lead["forward"]) & (table["module"] != lead["module"])]
    return same.sort_values("forward", ascending=False, kind="stable")["module"].tolist()


def walk_back_text(table) -> str:
    """``walk_back`` in words, for the first suspect (empty when there is nothing to say)."""
    back = walk_back(table)
    if not back:
        return ""
    lead = table.iloc[0]
    names = ", ".join(back[:3]) + (f" and {len(back) - 3} more" if len(back) > 3 else "")
    return (f"{lead['module']} departs most at step {int(lead['step'])}, but a wrong forward "
            f"output changes the gradients of every module after it: flagged at the same step "
            f"and earlier in the forward pass: {names} (nearest first). Walk back through them: "
            "where the divergence starts is the earliest whose own calls are wrong (triage "
            "checks the nearest too).")


def _nan_low(v) -> float:
    v = float(v)
    return -np.inf if np.isnan(v) else v


def _nan_high(v) -> float:
    v = float(v)
    return np.inf if np.isnan(v) else v


@xr.register_dataset_accessor("probekit")
class ProbekitAccessor:
    """``cmp.probekit.suspects(model=None, top=None, order=None)`` and ``cmp.probekit.verdict``
    (the ``verdict.Verdict``: kind, step, parameter, reason) on a ``compare_grads`` result."""

    def __init__(self, ds) -> None:
        self._ds = ds

    def suspects(self, model=None, top: int | None = None, order=None):
        return suspects(self._ds, model=model, top=top, order=order)

    @property
    def verdict(self):
        from .verdict import verdict_of

        return verdict_of(self._ds)
