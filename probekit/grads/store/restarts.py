"""A grad store over restarts: which rank groups hold which steps (``segments``).

A recording that is restarted (a preempted job resuming from its checkpoint, an elastic job
coming back with fewer ranks) continues the same store. The store's layout over steps::

    grads.zarr/                       root group; attribute ``layout_key``: the first layout's key
        rank{r}/                      rank groups of the first layout (as always: old stores,
                                      and every store whose layout never changed, look the same)
        layout-{key}/                 one group per later layout (attribute ``layout_key``)
            rank{r}/                  ...its rank groups

A *layout* is what every rank group of a run shares and every rank can compute alone: level,
bounds, digest, significance, gradient point, the parameters with their global shapes and
placements (mesh shape, ``S(0)``/``R``), the rank filter (``layout_key``, a hash). A run whose
layout is the first one's records into the root's rank groups, any other into
``layout-{key}``; a rank group that already exists is continued (``store.GradWriter``).

*Runs.* Each rank group's ``commit.json`` lists the runs that wrote into it::

    {"steps": n, "format": ..., "last_step": s,
     "runs": [{"run": id, "time": t, "start": s0, "from": f, "scope": "job",
               "rows": [r0, r1], "steps": [first, last]}, ...]}

``run``: the run's id, the same on every rank of a job (agreed through torch.distributed's store
when there is one, ``recorder.py``); ``time``: when it began, in integer microseconds since the
epoch (the wall clock of the rank that decided it; a number of fixed length, so the file's size
does not vary from run to run); ``start``: its first step; ``from``: the step from which it supersedes what earlier
runs recorded (``start``; ``null`` = everything, ``overwrite=True``); ``scope``: ``"job"`` (it
supersedes steps of every rank) or ``"rank"`` (a process recording alone: only its own rank's);
``rows``/``steps``: the rows of this group it wrote and their first and last step. A group's
steps increase with its rows: a run continuing a group first commits it cut to the rows before
``from`` (``store.py``), then appends.

**The rule: a run supersedes, from its ``from`` step on, everything recorded by runs that began
before it.** So a job killed after recording steps 0..57 and resumed from its checkpoint at step
50 keeps 0..49 of the first run and 50.. of the second; steps 50..57 of the first are gone even
where the second never recorded them (it died at 53: the store holds 0..52). A run becomes part
of the store with its first commit; one that died before it leaves the store as it was.

``segments(path)`` applies the rule: a list of ``Segment`` (first and last step, the layout
folder, its rank groups and their placements), sorted by step; for a sharded layout (FSDP2, TP,
HSDP: groups with ``placement``) a segment's steps are those every group holds, otherwise each
rank group is a record of its own. The readers (``sources.open_grads``, ``load_runs``) open each
segment's groups over its steps (assembling shards as ``assemble.py`` does) and join the
segments along ``step``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ...errors import GradStoreError
from .storage import LOCAL, location

STORE_NAME = "grads.zarr"
COMMIT = "commit.json"
LAYOUT_PREFIX = "layout-"


@dataclass(frozen=True)
class Segment:
    """Steps ``first_step..last_step`` (inclusive) of a store, held by the rank groups
    ``groups`` ({rank: group path}) of one layout folder ``folder``.

    ``placements``: {rank: the group's ``placement`` attribute (a list, one entry per recorded
    parameter) or None}; ``attrs``: {rank: the group's attributes}; ``sharded``: the groups are
    shards of one model (assemble them), else each is a rank's own record. The steps a group
    holds in the range are read from its ``step`` array (a step filter or skipped steps leave
    gaps); for a sharded segment, the steps every group holds."""

    first_step: int
    last_step: int
    folder: str
    groups: dict
    placements: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    sharded: bool = False
    layout_key: str | None = None

    @property
    def ranks(self) -> list:
        return sorted(self.groups)


def find_store(path: str, fs=LOCAL) -> str:
    """The ``grads.zarr`` folder for ``path`` (a dump_path or the store itself)."""
    path = os.fspath(path)
    fs.refresh()
    for candidate in (path, fs.join(path, STORE_NAME)):
        if fs.isfile(fs.join(candidate, "zarr.json")) and any(
                d.startswith(("rank", LAYOUT_PREFIX)) for d in fs.listdir(candidate)):
            return candidate
    raise GradStoreError(f"{fs.url(path) if fs.remote else path!r} holds no probekit grad "
                         f"store ({STORE_NAME} with rank groups)")


def group_ranks(folder: str, fs=LOCAL) -> list[int]:
    """The ranks of the rank groups in a layout folder (the root or ``layout-{key}``)."""
    ranks = []
    for d in fs.listdir(folder):
        if d.startswith("rank") and d[4:].isdigit() and fs.isdir(fs.join(folder, d)):
            ranks.append(int(d[4:]))
    return sorted(ranks)


def layout_folders(store: str, fs=LOCAL) -> list[str]:
    """The store's layout folders: the root first, then every ``layout-{key}``."""
    out = [store]
    for d in sorted(fs.listdir(store)):
        if d.startswith(LAYOUT_PREFIX) and fs.isdir(fs.join(store, d)):
            out.append(fs.join(store, d))
    return out


def layout_folder(store: str, key: str, root_key: str | None, fs=LOCAL) -> str:
    """Where a run of layout ``key`` records: the root when the store's first layout is ``key``,
    else ``layout-{key}``."""
    return store if root_key == key else fs.join(store, f"{LAYOUT_PREFIX}{key}")


def parse_commit(info, where: str) -> dict:
    if not isinstance(info, dict) or not isinstance(info.get("steps"), int):
        raise GradStoreError(f"{where}: unreadable commit marker {info!r}")
    return info


def read_commit(group_path: str, fs=LOCAL) -> dict:
    path = fs.join(group_path, COMMIT)
    try:
        info = json.loads(fs.read(path))
    except FileNotFoundError:
        raise GradStoreError(f"{fs.url(group_path)}: no {COMMIT}; the recording died before its "
                             "first commit, or this is not a probekit grad store") from None
    return parse_commit(info, path)


def runs_of(commit: dict, bounds=None) -> list[dict]:
    """The runs of a group's commit; a group written before runs were recorded is one run older
    than any other, holding all its rows (``bounds``: their first and last step)."""
    runs = commit.get("runs")
    if runs is not None:
        return runs
    n = commit["steps"]
    return [{"run": None, "time": None, "start": bounds[0] if n else None, "from": None,
             "scope": "job", "rows": [0, n], "steps": list(bounds) if n else None}]


def _from(run) -> float:
    return -math.inf if run.get("from") is None else run["from"]


def _time(run) -> float:
    return -math.inf if run.get("time") is None else run["time"]


def live_intervals(groups: dict) -> dict:
    """{key: [(first, last), ...]} the steps of each group no later run superseded.

    ``groups``: {key: (rank, [runs])}; a run supersedes, from its ``from`` step, the steps of
    every run that began before it: of every rank (``scope`` "job") or of its own rank."""
    job, own = {}, {}
    for rank, runs in groups.values():
        for r in runs:
            if r.get("run") is None:
                continue
            if r.get("scope", "job") == "job":
                job[r["run"]] = (_time(r), _from(r))
            else:
                own.setdefault(rank, {})[r["run"]] = (_time(r), _from(r))
    out = {}
    for key, (rank, runs) in groups.items():
        pieces = []
        later = list(job.items()) + list(own.get(rank, {}).items())
        for r in runs:
            steps = r.get("steps")
            if not steps or steps[0] is None or steps[1] is None or steps[1] < steps[0]:
                continue
            cut = min((f for rid, (t, f) in later if rid != r.get("run") and t > _time(r)),
                      default=math.inf)
            last = min(steps[1], cut - 1)
            if last >= steps[0]:
                pieces.append((int(steps[0]), int(last)))
        out[key] = pieces
    return out


def _intersect(a: list, b: list) -> list:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _merge(pieces: list) -> list:
    out = []
    for lo, hi in sorted(pieces):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def store_state(store: str, fs=LOCAL) -> dict:
    """{(folder, rank): {"path", "commit", "attrs"}} of every rank group of the store, read in
    one round trip (the commit markers and group attributes of all folders together). A group
    without a commit marker (its run died before committing) has ``commit`` None."""
    from .live import flush_live

    flush_live(fs.url(store), prefix=True)  # recordings in this process: their steps first
    fs.refresh()
    groups = {}
    for folder in layout_folders(store, fs):
        for r in group_ranks(folder, fs):
            groups[(folder, r)] = fs.join(folder, f"rank{r}")
    paths = [p for g in groups.values() for p in (fs.join(g, COMMIT), fs.join(g, "zarr.json"))]
    got = fs.read_many(paths)
    out = {}
    for key, g in groups.items():
        raw_commit, raw_meta = got[fs.join(g, COMMIT)], got[fs.join(g, "zarr.json")]
        commit = None if raw_commit is None else parse_commit(json.loads(raw_commit),
                                                              fs.join(g, COMMIT))
        attrs = {} if raw_meta is None else dict(json.loads(raw_meta).get("attributes", {}))
        out[key] = {"path": g, "commit": commit, "attrs": attrs}
    return out


def step_bounds(group_path: str, n: int, fs=LOCAL) -> tuple[int, int]:
    """(first, last) committed step of a group written before runs were recorded."""
    from .chunks import read_plain

    got = read_plain(fs.join(group_path, "step"), n, fs)
    if got is not None:
        steps = got[1]
    else:
        import zarr

        from .storage import zarr_store

        steps = zarr.open_array(zarr_store(fs, fs.join(group_path, "step")), mode="r")[:n]
    return int(steps[0]), int(steps[n - 1])


def segments(path, storage_options=None, *, fs=None, shards: bool = False) -> list[Segment]:
    """The segments of a grad store (a dump_path, the store, or a URL of either): the step
    ranges each layout folder's rank groups hold after the rule above, sorted by first step.

    A store that was never restarted with another layout has one segment per contiguous run of
    steps of its root folder (usually one); an elastic restart from 4 to 2 ranks at step 50
    gives ``[Segment(0, 49, root, ranks 0-3), Segment(50, ..., layout-..., ranks 0-1)]``. A
    store where no step is committed yet gives each folder's groups over no step
    (``last_step`` < ``first_step``). ``shards=True``: each rank group's own steps, a sharded
    layout's too (the steps a rank committed beyond the others)."""
    if fs is None:
        fs, path = location(path, storage_options)
    store = find_store(path, fs)
    state = store_state(store, fs)
    runs = {}
    for key, g in state.items():
        c = g["commit"]
        if c is None or (c.get("runs") is None and c["steps"] == 0):
            runs[key] = (key[1], [])
            continue
        bounds = step_bounds(g["path"], c["steps"], fs) if c.get("runs") is None else None
        runs[key] = (key[1], runs_of(c, bounds))
    live = live_intervals(runs)
    out = []
    for folder in dict.fromkeys(f for f, _ in state):
        keys = [k for k in state if k[0] == folder]
        sharded = any("placement" in state[k]["attrs"] for k in keys)
        if sharded and not shards:
            common = None
            for k in keys:
                common = live[k] if common is None else _intersect(common, live[k])
            pieces = {tuple(common or ()): keys}
        else:
            pieces = {}
            for k in keys:
                pieces.setdefault(tuple(_merge(live[k])), []).append(k)
        for intervals, members in pieces.items():
            for lo, hi in _merge(list(intervals)):
                out.append(Segment(
                    int(lo), int(hi), folder,
                    {k[1]: state[k]["path"] for k in members},
                    {k[1]: state[k]["attrs"].get("placement") for k in members},
                    {k[1]: state[k]["attrs"] for k in members}, sharded,
                    next((state[k]["attrs"].get("layout_key") for k in members), None)))
    if not out:  # no step committed anywhere: each folder's groups, over no step
        for folder in dict.fromkeys(f for f, _ in state):
            keys = [k for k in state if k[0] == folder]
            out.append(Segment(0, -1, folder, {k[1]: state[k]["path"] for k in keys},
                               {k[1]: state[k]["attrs"].get("placement") for k in keys},
                               {k[1]: state[k]["attrs"] for k in keys},
                               any("placement" in state[k]["attrs"] for k in keys),
                               next((state[k]["attrs"].get("layout_key") for k in keys), None)))
    out.sort(key=lambda s: (s.first_step, s.folder, s.ranks))
    return out


def last_live_step(segs: list, rank: int | None = None):
    """The newest step the segments hold (of ``rank``'s groups), or None when they hold none."""
    lasts = [s.last_step for s in segs if rank is None or rank in s.groups]
    return max(lasts) if lasts else None


def first_live_step(segs: list, rank: int | None = None):
    firsts = [s.first_step for s in segs if rank is None or rank in s.groups]
    return min(firsts) if firsts else None


def step_rows(steps: np.ndarray, first: int, last: int) -> tuple[int, int]:
    """(r0, r1): the rows of an increasing step array holding steps ``first..last``."""
    steps = np.asarray(steps)
    return (int(np.searchsorted(steps, first, side="left")),
            int(np.searchsorted(steps, last, side="right")))


def plan_run(dump_path, *, start=None, inferred=None, why: str = "",
             overwrite: bool = False, scope: str = "job", rank: int | None = None,
             storage_options=None, sample: int = 0) -> dict:
    """The record of a new run into ``dump_path``'s store (``GradWriter.begin``): its first
    step and from which step it supersedes what earlier runs recorded.

    The first step: ``start`` (the user's ``start_step``) if given. Else, in a store that holds
    steps (a job resuming into it), ``inferred`` (the training's own step count, ``why`` says
    whence: an optimizer's state restored from a checkpoint), else the step after the newest one
    the store holds (a run that cannot know its step continues the store rather than replacing
    it). Else 0: a new store numbers steps from the start of the recording, as msprobe does. A
    run that would supersede every step the store holds (it starts at or before the first one)
    needs ``overwrite=True``: otherwise ``GradStoreError`` names the choices. ``scope="rank"``:
    a process recording alone (no job to agree with): only ``rank``'s steps count and are
    superseded.

    ``sample``: the run's ``grad_probe.sample`` as its groups record it (0: every element). A
    store holds one sample: a run of another one into a store holding steps is refused
    (``GradStoreError`` naming both) unless it replaces the recording (``overwrite=True``), since
    its bits would be of other elements than the earlier steps' (a comparison over the store's
    steps would mix them), whichever layout folder it records into."""
    import time
    import uuid

    fs, root = location(dump_path, storage_options)
    try:
        segs = segments(root, fs=fs)
    except GradStoreError:
        segs = []  # no store there yet
    segs = [s for s in segs if s.last_step >= s.first_step]
    who = rank if scope == "rank" else None
    first, last = first_live_step(segs, who), last_live_step(segs, who)
    if start is not None:
        begin, how = int(start), "start_step"
    elif last is None or overwrite:
        begin, how = 0, "a new recording"
    elif inferred is not None:
        begin, how = int(inferred), why or "the training's step count"
    else:
        begin, how = int(last) + 1, "the step after the newest one recorded: the optimizer " \
                                    "keeps no step count; pass start_step= when resuming"
    url = fs.url(fs.join(root, STORE_NAME))
    held = sorted({int((s.attrs.get(r) or {}).get("sample") or 0) for s in segs
                   for r in s.groups} - {int(sample or 0)})
    if held and not overwrite:
        def what(k):
            return f"grad_probe.sample {k}" if k else "every element's bits (sample 0)"

        raise GradStoreError(
            f"grad_probe: {url} holds steps {first}..{last} recorded with {what(held[0])}, and "
            f"this run records {what(int(sample or 0))}: one store holds one sample. Record "
            f"with sample={held[0]} to continue it, pass overwrite=True to replace the "
            "recording, or record into another dump_path")
    if not overwrite and first is not None and begin <= first:
        raise GradStoreError(
            f"grad_probe: {url} already holds steps {first}..{last}, and this run starts at step "
            f"{begin} ({how}), so it would replace every one of them. Pass overwrite=True to "
            "replace the recording, start_step=N to continue it from step N (the step your "
            "checkpoint resumes at), or record into another dump_path")
    return {"run": uuid.uuid4().hex, "time": time.time_ns() // 1000, "start": begin,
            "from": None if overwrite else begin, "scope": scope, "how": how,
            "held": None if first is None else [int(first), int(last)]}
