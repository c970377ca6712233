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
#: where a store a new run replaces waits (``move_aside``) until that run commits its first step
ASIDE = STORE_NAME + ".replaced"
#: written into a store before it is moved aside: a store aside without it is not one
REPLACED = "replaced.json"


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


def is_store(path: str, fs=LOCAL) -> bool:
    return fs.isfile(fs.join(path, "zarr.json")) and any(
        d.startswith(("rank", LAYOUT_PREFIX)) for d in fs.listdir(path))


def find_store(path: str, fs=LOCAL) -> str:
    """The ``grads.zarr`` folder for ``path`` (a dump_path or the store itself). While a new
    run replaces the store and has not committed a step, the store it replaces, moved aside
    (``grads.zarr.replaced``), is the one read: a replacement is seen whole or not at all."""
    path = os.fspath(path)
    fs.refresh()
    for candidate in (path, fs.join(path, STORE_NAME)):
        if is_store(candidate, fs):
            aside = fs.join(fs.dirname(candidate.rstrip(fs.sep) or candidate), ASIDE)
            if (candidate.rstrip(fs.sep).endswith(STORE_NAME) and valid_aside(aside, fs)
                    and not holds_steps(store_state(candidate, fs))):
                return aside
            return candidate
    aside = fs.join(path, ASIDE)
    if valid_aside(aside, fs):  # a replacement stopped between moving the store and a new one
        return aside
    raise GradStoreError(f"{fs.url(path) if fs.remote else path!r} holds no probekit grad "
                         f"store ({STORE_NAME} with rank groups)")


def valid_aside(path: str, fs=LOCAL) -> bool:
    """A store moved aside whole (its ``REPLACED`` marker is in it)."""
    return fs.isfile(fs.join(path, REPLACED))


def holds_steps(state: dict, rank: int | None = None) -> bool:
    """Does any rank group of ``store_state`` (of ``rank``) hold a committed step?"""
    return any(g["commit"] is not None and g["commit"]["steps"] > 0
               for (_, r), g in state.items() if rank is None or r == rank)


def last_run(state: dict, rank: int | None = None):
    """(the run that began last in the store (of ``rank``'s groups) as its groups list it, did
    it end cleanly): True when every group it wrote marks it ``closed``, False when one does
    not (it crashed, was killed, or is still running), None for a store written before runs
    said so (no ``closed`` at all) or holding no run. (None, None) without runs."""
    entries = {}
    for (_, r), g in state.items():
        if rank is not None and r != rank or g["commit"] is None:
            continue
        for run in g["commit"].get("runs") or []:
            if run.get("run") is not None:
                entries.setdefault(run["run"], []).append(run)
    if not entries:
        return None, None
    rid = max(entries, key=lambda k: max(_time(e) for e in entries[k]))
    mine = entries[rid]
    if all("closed" not in e for e in mine):
        return mine[0], None
    return mine[0], all(bool(e.get("closed")) for e in mine)


def move_aside(store: str, aside: str, run: dict, fs=LOCAL) -> None:
    """Move ``store`` aside to ``aside`` (a new run replaces it), so that a stop at any moment
    leaves one readable store: locally the marker, then one rename; on an object store every
    object copied, the marker written, then the originals removed commit markers first (a
    group without one holds no step, so the copy is the one read)."""
    marker = json.dumps({"replaced_by": run["run"], "time": run["time"]})
    if fs.exists(aside):
        fs.rmtree(aside)  # a partial copy of an earlier move (no marker): nothing to keep
    if not fs.remote:
        fs.write(fs.join(store, REPLACED), marker)
        fs.move(store, aside)
        return
    fs.copy(store, aside)
    fs.write(fs.join(aside, REPLACED), marker)
    for (folder, r), g in store_state(store, fs).items():
        fs.remove(fs.join(g["path"], COMMIT))
    fs.rmtree(store)


def restore_aside(store: str, aside: str, fs=LOCAL) -> None:
    """The store moved aside back in place (its replacement never committed a step)."""
    if fs.exists(store):
        fs.rmtree(store)
    if fs.remote:
        fs.copy(aside, store)
        fs.remove(fs.join(store, REPLACED))
        fs.rmtree(aside)
        return
    fs.move(aside, store)
    fs.remove(fs.join(store, REPLACED))


def remove_aside(aside: str, fs=LOCAL) -> None:
    """Delete a store moved aside (its replacement committed): marker first, so a stop midway
    leaves no store that could be taken for one."""
    fs.remove(fs.join(aside, REPLACED))
    if fs.exists(aside):
        fs.rmtree(aside)


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
    """A commit marker as read, checked: a count of steps (an int, not negative) and, where it
    has them, its runs (a list of dicts)."""
    runs = info.get("runs") if isinstance(info, dict) else None
    if (not isinstance(info, dict) or not isinstance(info.get("steps"), int)
            or isinstance(info.get("steps"), bool) or info["steps"] < 0
            or (runs is not None and not (isinstance(runs, list)
                                          and all(isinstance(r, dict) for r in runs)))):
        text = repr(info)
        raise GradStoreError(f"{where}: unreadable commit marker "
                             f"{text[:200] + '...' if len(text) > 200 else text}; accepted: "
                             '{"steps": <count, 0 or more>, "runs": [<run>, ...]} as probekit '
                             "writes it (the store is damaged)")
    return info


def read_json(path: str, fs=LOCAL):
    """The JSON document at ``path`` of a store; GradStoreError naming the file where it is not
    JSON (a damaged store). FileNotFoundError passes through."""
    return _json_of(fs.read(path), path, fs)


def group_attributes(meta, path: str) -> dict:
    """The attributes of a Zarr group's metadata ``meta`` (read from ``path``), checked."""
    if not isinstance(meta, dict) or not isinstance(meta.get("attributes", {}), dict):
        raise GradStoreError(f"{path}: not a Zarr group's metadata; the store is damaged")
    return dict(meta.get("attributes", {}))


def _json_of(raw, path: str, fs=LOCAL):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GradStoreError(f"{fs.url(path) if fs.remote else path}: not valid JSON ({exc}); "
                             "the store is damaged") from None


def read_commit(group_path: str, fs=LOCAL) -> dict:
    path = fs.join(group_path, COMMIT)
    try:
        info = read_json(path, fs)
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
        commit = None if raw_commit is None else parse_commit(
            _json_of(raw_commit, fs.join(g, COMMIT), fs), fs.join(g, COMMIT))
        attrs = {} if raw_meta is None else group_attributes(
            _json_of(raw_meta, fs.join(g, "zarr.json"), fs), fs.join(g, "zarr.json"))
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
    return store_segments(store_state(store, fs), fs, shards=shards)


def store_segments(state: dict, fs=LOCAL, *, shards: bool = False) -> list[Segment]:
    """``segments`` of a store's ``store_state``."""
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
             storage_options=None, sample: int = 0, restart: bool = False,
             why_restart: str = "") -> dict:
    """The record of a new run into ``dump_path``'s store (``GradWriter.begin``): its first
    step and from which step it supersedes what earlier runs recorded; decided once per job.

    **A run appends only when it is a restart** (``restart``: the caller's evidence, e.g. an
    elastic restart, ``resume=True``, an optimizer state restored from a checkpoint; a given
    ``start`` is one too). Its first step: ``start`` if given, else ``inferred`` (the training's
    own step count, ``why`` says whence), else the step after the newest one the store holds; a
    restart that would supersede every step the store holds (it starts at or before the first
    one) needs ``overwrite=True``. **Any other run into a store that holds steps replaces it**
    from step 0 when the store's last run ended cleanly (every group it wrote marks it
    ``closed``), and is refused (``GradStoreError`` naming ``resume=True`` and
    ``overwrite=True``) when it did not: a crashed run's steps are never lost silently. A new
    store numbers steps from 0, as msprobe does.

    A replacement (or ``overwrite=True``) of a job (``scope="job"``) moves the store aside
    (``move_aside``: ``grads.zarr.replaced``), records into a new one, and the deciding rank
    (``"by"``) deletes the old one once it committed its first step (``"aside"``): readers see
    the old store until then, and a run that dies before leaves it in place: the store as the
    readers see it, which the next run puts back before it decides. No rank of the job has written
    anything there yet (a writer creates its group at ``begin`` when the store holds steps;
    at once, with no step, into one that holds none). ``scope="rank"``: a process
    recording alone (no job to agree with): only ``rank``'s steps count and are superseded, in
    its own groups.

    ``sample``: the run's ``grad_probe.sample`` as its groups record it (0: every element). A
    store holds one sample: a restart of another one into a store holding steps is refused
    (``GradStoreError`` naming both) unless it replaces the recording, since its bits would be
    of other elements than the earlier steps' (a comparison over the store's steps would mix
    them), whichever layout folder it records into."""
    import time
    import uuid

    fs, root = location(dump_path, storage_options)
    main, aside = fs.join(root, STORE_NAME), fs.join(root, ASIDE)
    url = fs.url(main)
    job = scope == "job"
    who = None if job else rank
    restart = bool(restart) or start is not None
    run = {"run": uuid.uuid4().hex, "time": time.time_ns() // 1000}

    def read():
        fs.refresh()
        state = store_state(main, fs) if is_store(main, fs) else {}
        live = [g for g in store_segments(state, fs) if g.last_step >= g.first_step] \
            if state else []
        return state, live

    state, segs = read()
    first, last = first_live_step(segs, who), last_live_step(segs, who)
    has_aside = job and valid_aside(aside, fs)
    if has_aside and holds_steps(state):
        remove_aside(aside, fs)  # its replacement committed, then stopped before removing it
        has_aside = False
    elif has_aside:
        restore_aside(main, aside, fs)  # its replacement never committed: it is the store
        has_aside = False
        state, segs = read()
        first, last = first_live_step(segs, who), last_live_step(segs, who)
    replaced = None
    if start is not None:
        begin, how = int(start), "start_step"
    elif last is None or overwrite:
        begin, how = 0, "a new recording" + (" (overwrite=True)" if last is not None else "")
    elif restart:
        if inferred is not None:
            begin, how = int(inferred), why or "the training's step count"
        else:
            begin, how = int(last) + 1, "the step after the newest one recorded: the " \
                                        "optimizer keeps no step count; pass start_step= to " \
                                        "say where the checkpoint resumes"
    else:
        prev, closed = last_run(state, who)
        if closed is False:
            began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_time(prev) / 1e6))
            raise GradStoreError(
                f"grad_probe: {url} holds steps {first}..{last}, and its last run (begun "
                f"{began}) did not end cleanly: it crashed, was killed, or is still running. "
                "This run is not a restart (no start_step, no resume=True, no elastic restart, "
                "no optimizer state restored from a checkpoint), so it would replace them. "
                "Pass resume=True to continue that recording, overwrite=True to replace it, or "
                "record into another dump_path")
        begin, how = 0, "a new recording: this run is not a restart and the store's last run " \
                        "ended cleanly, so it replaces it (resume=True continues a store)"
        replaced = [int(first), int(last)]
    replace = overwrite or replaced is not None
    if not replace:
        held = sorted({int((g.attrs.get(r) or {}).get("sample") or 0) for g in segs
                       for r in g.groups} - {int(sample or 0)})
        if held:
            def what(k):
                return f"grad_probe.sample {k}" if k else "every element's bits (sample 0)"

            raise GradStoreError(
                f"grad_probe: {url} holds steps {first}..{last} recorded with {what(held[0])}, "
                f"and this run records {what(int(sample or 0))}: one store holds one sample. "
                f"Record with sample={held[0]} to continue it, pass overwrite=True to replace "
                "the recording, or record into another dump_path")
        if first is not None and begin <= first:
            raise GradStoreError(
                f"grad_probe: {url} already holds steps {first}..{last}, and this run starts at "
                f"step {begin} ({how}), so it would replace every one of them. Pass "
                "overwrite=True to replace the recording, start_step=N to continue it from step "
                "N (the step your checkpoint resumes at), or record into another dump_path")
    moved = replace and job and holds_steps(state)
    if moved:
        move_aside(main, aside, run, fs)
        has_aside = True
    # a replacement into a store moved aside records into a new one: nothing there to
    # supersede, and the store is then what a first run makes, byte for byte; a process
    # recording alone replaces its own steps in place (``from`` None: all of them)
    run.update(start=begin, **{"from": None if replace and not job else begin}, scope=scope,
               how=how,
               held=None if first is None else [int(first), int(last)], replaced=replaced,
               restart=why_restart if restart else "")
    if has_aside:
        run.update(aside=aside, by=rank)
    return run
