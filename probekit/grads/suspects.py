"""Suspects of a comparison: the modules owning the first diverging parameters, ranked.

``suspects(cmp, model=None)`` takes what ``compare_grads`` returns and gives one row per module
that owns a flagged parameter: the module's earliest flagged step (over its parameters and the
ranks), the module's similarity at that step (element-weighted over its parameters) and its
parameters flagged then. Rows are ranked by that step (earliest first), then by that similarity
(lowest first). The same
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
COLUMNS = ("module", "step", "similarity", "params", "rank")


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


def suspects(cmp, model=None, top: int | None = None):
    """Modules owning flagged parameters, ranked (earliest flagged step, then lowest similarity).

    ``cmp``: a ``compare_grads`` result; ``model``: optional ``nn.Module`` to check names against.
    Returns a pandas DataFrame with ``COLUMNS``: ``module``, ``step`` (its earliest flagged step,
    over its parameters and the ranks), ``similarity`` (the module's sign similarity at that step:
    over all its parameters, element-weighted, so a 4-element bias does not outweigh its
    weight matrix), ``params`` (its parameters flagged at that step, lowest similarity first)
    and ``rank``; ``top`` keeps the first rows.
    """
    import pandas as pd

    modules = dict(model.named_modules()) if model is not None else None
    if "rank" not in cmp.dims:
        cmp = cmp.expand_dims(rank=[0])
    params = [str(p) for p in cmp["param"].values]
    owner = np.array([param_module(p, modules) for p in params], dtype=object)
    numel = (np.asarray(cmp["numel"].values, np.float64) if "numel" in cmp.coords
             else np.ones(len(params)))
    if numel.ndim > 1:   # concatenated ranks carry numel per rank; the sizes are the same
        numel = numel.max(axis=0)
    steps = np.asarray(cmp["step"].values)
    rows = []
    for r in cmp["rank"].values:
        sub = cmp.sel(rank=r)
        flag = np.asarray(sub["flag"].transpose("step", "param").values, bool)
        sim = np.asarray(sub["similarity"].transpose("step", "param").values, np.float64)
        for mod in dict.fromkeys(owner[flag.any(axis=0)]):
            cols = np.flatnonzero(owner == mod)
            i = int(np.flatnonzero(flag[:, cols].any(axis=1))[0])
            s, n = sim[i, cols], numel[cols]
            ok = ~np.isnan(s)
            msim = float((s[ok] * n[ok]).sum() / n[ok].sum()) if ok.any() and n[ok].sum() else \
                np.nan
            hit = [(_nan_high(s[k]), params[c]) for k, c in enumerate(cols) if flag[i, c]]
            rows.append({"module": mod, "step": int(steps[i]), "similarity": msim,
                         "params": tuple(p for _, p in sorted(hit)), "rank": int(r)})
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    if not df.empty:   # one row per module: its earliest step, then its lowest similarity
        df = (df.assign(_s=df["similarity"].fillna(np.inf))
              .sort_values(["step", "_s", "module", "rank"], kind="stable")
              .drop_duplicates("module").drop(columns="_s").reset_index(drop=True))
    df = df.astype({"module": object, "step": "int64", "similarity": "float64", "rank": "int64"})
    return df.head(top) if top is not None else df


def _nan_high(v) -> float:
    v = float(v)
    return np.inf if np.isnan(v) else v


@xr.register_dataset_accessor("probekit")
class ProbekitAccessor:
    """``cmp.probekit.suspects(model=None, top=None)`` on a ``compare_grads`` result."""

    def __init__(self, ds) -> None:
        self._ds = ds

    def suspects(self, model=None, top: int | None = None):
        return suspects(self._ds, model=model, top=top)
