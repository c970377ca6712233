"""The replica check of a recorded run, read back and said in words.

The recorder (``grads/record/replicas.py``) compares, at every step, each replicated parameter
with its replicas on the other ranks and stores per (step, parameter) of the rank group that
records it: ``replicas`` (0 not checked, 1 agree, | 2 the gradients differ, | 4 the parameters
differ), ``replica_rank`` (the lowest rank whose copy differs from this rank's; -1 none) and
``replica_gap`` (the largest relative difference of the gradient's max or min; NaN: no gradient
compared); the group attribute ``replica_check`` says the format version and, per parameter,
the group its replicas form ("DDP", a mesh dimension's name, "tied"). Stores written before the
check have none of these: nothing to say, no error.

``replica_disagreements(run)`` gives one row per parameter whose replicas disagreed at some
step (``COLUMNS``); ``replica_line`` says one of them the way every verdict of probekit does:
``replicas of `final_layernorm.weight` disagree from step 0 (tp ranks 0/1: gradients)``.
"""
from __future__ import annotations

import json
import os

import numpy as np

from .chunks import read_plain
from .restarts import read_commit, segments, step_rows
from .storage import location

#: columns of ``replica_disagreements``
COLUMNS = ("param", "first_step", "last_step", "steps", "what", "group", "ranks")
GRAD_DIFFERS, PARAM_DIFFERS = 2, 4


def what_text(code: int) -> str:
    """The ``what`` of a code: "gradients", "parameters" or "gradients and parameters"."""
    parts = [w for bit, w in ((GRAD_DIFFERS, "gradients"), (PARAM_DIFFERS, "parameters"))
             if int(code) & bit]
    return " and ".join(parts)


def replica_line(row) -> str:
    """One disagreement (a row of ``replica_disagreements``, or a dict with its keys) in
    words: ``replicas of `p` disagree from step s (tp ranks 0/1: gradients)``."""
    ranks = "/".join(str(r) for r in dict.fromkeys(int(x) for x in row["ranks"]))
    group = f"{row['group']} " if row.get("group") else ""
    return (f"replicas of `{row['param']}` disagree from step {int(row['first_step'])} "
            f"({group}rank{'s' if '/' in ranks else ''} {ranks}: {row['what']})")


def replica_lines(table, limit: int = 3, who: str = "") -> list[str]:
    """The first ``limit`` disagreements of a table (``replica_disagreements``) in words, the
    rest counted; ``who`` prefixes each line ("in the second run: ")."""
    rows = table.to_dict("records") if hasattr(table, "to_dict") else list(table)
    out = [who + replica_line(r) for r in rows[:limit]]
    if len(rows) > limit:
        out.append(f"{who}... and {len(rows) - limit} more parameter"
                   f"{'s' * (len(rows) - limit != 1)} whose replicas disagree")
    return out


_EMPTY: list = []   # the empty table, built once (1-2 ms; every comparison asks for one)


def _frame(rows: list):
    import pandas as pd

    if not rows:
        if not _EMPTY:
            _EMPTY.append(pd.DataFrame(rows, columns=list(COLUMNS)).astype(
                {"first_step": "int64", "last_step": "int64", "steps": "int64"}))
        return _EMPTY[0].copy()
    agg = {}
    for r in rows:  # one row per parameter: its shards' (or rank groups') disagreements joined
        cur = agg.get(r["param"])
        if cur is None:
            agg[r["param"]] = dict(r, _steps=set(r["_steps"]))
            continue
        cur["_steps"] |= set(r["_steps"])
        if r["first_step"] < cur["first_step"]:
            cur.update(first_step=r["first_step"], ranks=r["ranks"], group=r["group"],
                       what=r["what"])
        cur["last_step"] = max(cur["last_step"], r["last_step"])
    out = []
    for r in agg.values():
        r["steps"] = len(r.pop("_steps"))
        out.append(r)
    df = pd.DataFrame(out, columns=list(COLUMNS))
    return df.sort_values(["first_step", "param"], kind="stable").reset_index(drop=True)


def _rows(names, steps, code, other, labels, rank: int) -> list:
    """Rows (before joining per parameter) of one group's arrays."""
    out = []
    bad = (np.asarray(code, np.int64) & (GRAD_DIFFERS | PARAM_DIFFERS)) > 0
    for j in np.flatnonzero(bad.any(axis=0)):
        at = np.flatnonzero(bad[:, j])
        i = int(at[0])
        odd = int(other[i, j])
        out.append({"param": str(names[j]), "first_step": int(steps[i]),
                    "last_step": int(steps[at[-1]]), "steps": int(at.size),
                    "what": what_text(code[i, j]), "group": (labels[j] if j < len(labels) else None)
                    or "", "ranks": (int(rank), odd) if odd >= 0 else (int(rank),),
                    "_steps": [int(s) for s in steps[at]]})
    return out


def _labels(attrs) -> list:
    check = attrs.get("replica_check")
    if isinstance(check, str):
        check = json.loads(check)
    return list((check or {}).get("labels") or [])


def checked(source) -> bool:
    """Did the run record the replica check (a Dataset, or {rank: Dataset})?"""
    runs = source if isinstance(source, dict) else {0: source}
    return any("replicas" in ds for ds in runs.values())


def from_datasets(runs: dict):
    """``replica_disagreements`` of runs already read ({rank: Dataset}, as ``load_runs``
    gives them, or one Dataset)."""
    if not isinstance(runs, dict):
        runs = {int(runs.attrs.get("rank", 0)): runs}
    rows = []
    for rank, ds in sorted(runs.items()):
        if "replicas" not in ds:
            continue
        code = np.asarray(ds["replicas"].transpose("step", "param").values)
        other = np.asarray(ds["replica_rank"].transpose("step", "param").values)
        rows += _rows(ds["param"].values, np.asarray(ds["step"].values), code, other,
                      _labels(ds.attrs), int(ds.attrs.get("rank", rank)))
    return _frame(rows)


def replica_disagreements(run, *, storage_options=None):
    """The parameters whose replicas disagreed at some step of a recorded ``run`` (a path or
    URL of a probekit store, a Dataset from ``open_grads`` or {rank: Dataset}), as a pandas
    DataFrame, one row per parameter, by first step: ``param``, ``first_step``,
    ``last_step``, ``steps`` (steps at which they disagreed), ``what`` (at the first step:
    "gradients", "parameters" or "gradients and parameters"), ``group`` (what replicates it: "DDP", a
    DTensor mesh dimension's name such as "tp" or "replicate", "tied") and ``ranks`` (the
    recording rank and the first rank whose copy differs from it). Empty when they always
    agreed, or the run recorded no check (a single process, a store from before it). A store
    is read group by group, only these arrays (every segment of a restarted store)."""
    if not isinstance(run, (str, os.PathLike)):
        return from_datasets(run)
    from ...errors import GradStoreError
    from . import msprobe

    fs, path = location(run, storage_options)
    if not fs.remote and os.path.isdir(path) and msprobe.is_grad_dump(path):
        return _frame([])  # msprobe's dumps hold no replica check
    try:
        segs = segments(path, fs=fs, shards=True)
    except GradStoreError:
        return _frame([])  # not a store: the reader that opens it says what it is
    rows = []
    for seg in segs:
        for rank, group in seg.groups.items():
            attrs = seg.attrs.get(rank) or {}
            if attrs.get("replica_check") is None:
                continue
            n = read_commit(group, fs)["steps"]
            got = read_plain(fs.join(group, "step"), n, fs)
            if got is None:
                continue
            steps = got[1]
            r0, r1 = step_rows(steps, seg.first_step, seg.last_step)
            arrays = [read_plain(fs.join(group, name), n, fs, missing_ok=True)
                      for name in ("replicas", "replica_rank")]   # added after earlier rows
            if any(a is None for a in arrays):
                continue
            code, other = (a[1][r0:r1] for a in arrays)
            rows += _rows(attrs.get("params") or [], steps[r0:r1], code, other,
                          _labels(attrs), rank)
    return _frame(rows)
