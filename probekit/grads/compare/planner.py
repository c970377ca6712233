"""Plan a comparison over the element ranges two runs' rank groups share: no parameter rebuilt.

The similarity of two runs is a count of equal bits, so it adds up over any partition of the
elements. Each run recorded every parameter as pieces (``opening.py``: one per rank group under
FSDP2 dim-0 sharding, a tensor-parallel column or row block, HSDP's first replica, the whole
parameter in a single process or under DDP), each a box of the parameter's index space stored in
the box's own C order. Wherever a piece of one run meets a piece of the other, the two count the
elements of that intersection between them: run sets (``geometry.py``) read straight from the
two groups' rows (``counting.py``). A 2-rank run against a 4-rank one, FSDP2 against tensor
parallel, DDP or a single process: the same counts as comparing the assembled parameters, bit
for bit, without assembling them.

Tasks. One side (the one of more rank groups, *F*) is cut into *slab sets*: consecutive pieces
of its groups' rows (a piece larger than a set is cut into slabs, flat ranges of its C order,
``geometry.flat_boxes``) of about ``block_bytes`` per step; each set reads its own bytes of F and
of the other side (*C*) the byte ranges its run sets touch (merged per group), a block of steps
at a time. A task is a slab set over a chunk of steps of about ``task_bytes``; its output is the
counts of its steps for every compared parameter, summed over the sets of the same steps
(``compare.py``'s reduce tasks).

What a run is follows the readers exactly, so the result is the assembled comparison's,
variable for variable: its segments are ``restarts.segments``' (a store restarted with another
layout, 4 ranks for some steps and 2 for the next, is several; each pair of segments of the two
runs that share steps is planned on its own and the counts join along the steps), and within a
segment which rank groups form one run, which pieces are taken once and which steps count
follow ``assemble.assemble_runs``. A layout this planner does not handle (a parameter whose
shapes differ between the runs while sharded, more than ``geometry.PREFIX + 1`` dimensions that
stay after merging, bits stored neither as plain chunk files nor as shards of steps) makes
``plan`` return the reason, and the comparison reads the runs as Datasets instead.
"""
from __future__ import annotations

import ast
import functools
import math

import numpy as np

from ...errors import GradCompareError
from ...log import get_logger
from ..numerics import geometry
from ..store.names import canonical_names, renamed
from ..numerics.sampling import sample_run
from .unmatched import unmatched_text

log = get_logger(__name__)

#: bytes between two needed ranges of a row below which they are read as one
_MERGE_GAP = 4096


class Unsupported(Exception):
    """A layout the range planner does not handle (the comparison reads Datasets instead)."""


class AmbiguousRuns(GradCompareError):
    """Several runs of one recording that are neither copies nor disjoint parts of one model
    (``pair_labels``). The planner hands such a recording to the Dataset path (which assembles
    shards the planner keeps apart, and says this if they still are)."""


@functools.lru_cache(maxsize=4096)
def _shape(text: str) -> tuple:
    value = ast.literal_eval(text)
    return tuple(int(x) for x in (value if isinstance(value, (tuple, list)) else (value,)))


def match_params(raw_a: list, raw_b: list, left_a: list, left_b: list, label: str = "",
                 rename=None):
    """Parameters of two runs paired by name without wrapper prefixes (then through ``rename``,
    ``names.check_rename``'s function, applied to both runs' names): (common names in the first
    run's order, their positions in a, in b, names of a only, of b only, parameter count of a,
    of b). Raises when none is shared; logs the unmatched ones (after ``label``; None: not
    logged, a caller that logged them already)."""
    names_a = list(renamed(canonical_names(raw_a), rename, "compare_grads(rename=)"))
    names_b = list(renamed(canonical_names(raw_b), rename, "compare_grads(rename=)"))
    index_a = {n: i for i, n in enumerate(names_a)}
    index_b = {n: i for i, n in enumerate(names_b)}
    common = [n for n in names_a if n in index_b]
    only_a = [r for r, n in zip(raw_a, names_a) if n not in index_b] + list(left_a)
    only_b = [r for r, n in zip(raw_b, names_b) if n not in index_a] + list(left_b)
    n_a, n_b = len(names_a) + len(left_a), len(names_b) + len(left_b)
    if not common:
        raise GradCompareError(f"the runs share no parameter (first: {names_a[:3]}..., second: "
                               f"{names_b[:3]}...)")
    if (only_a or only_b) and label is not None:
        log.warning("%s%s", label, unmatched_text(only_a, only_b, n_a, n_b))
    pos_a = np.array([index_a[n] for n in common], np.int64)
    pos_b = np.array([index_b[n] for n in common], np.int64)
    return common, pos_a, pos_b, only_a, only_b, n_a, n_b


def check_sizes(common, numel_a, numel_b, shapes_a=None, shapes_b=None, *, names_a=None,
                names_b=None) -> None:
    """A ``GradCompareError`` naming both sides where a paired parameter's size, or its shape
    (``shapes_a``/``shapes_b``: the full parameters' shapes, when both runs know them), differs
    between the runs; ``names_a``/``names_b``: each side's own names of the parameters (as
    recorded), said where they differ from the paired name."""
    bad = [int(i) for i in np.flatnonzero(numel_a != numel_b)]
    if shapes_a is not None and shapes_b is not None:
        bad += [i for i, (x, y) in enumerate(zip(shapes_a, shapes_b))
                if i not in bad and _differ(x, y)]
    if not bad:
        return

    def side(i, names, shapes, numel):
        own = f" (recorded as {names[i]!r})" if names is not None and str(names[i]) != \
            common[i] else ""
        shape = (f"shape {tuple(int(v) for v in shapes[i])}" if shapes is not None
                 else f"{int(numel[i])} elements")
        return f"{shape}{own}"

    parts = [f"{common[i]!r}: {side(i, names_a, shapes_a, numel_a)} in the first run, "
             f"{side(i, names_b, shapes_b, numel_b)} in the second" for i in sorted(bad)[:5]]
    raise GradCompareError("parameter shapes differ between the runs: " + "; ".join(parts)
                           + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
                           + ". Paired by name, they must be the same tensor: check the "
                           "names (rename=) and the layouts (a transposed or fused weight)")


def _differ(x, y) -> bool:
    """Two shapes of one size that are not the same tensor's: both of two or more dimensions
    (size-1 ones aside) and different. A flat one (a tool that records parameters flattened)
    is compared element by element in C order."""
    if x is None or y is None:
        return False
    x = tuple(int(v) for v in x if int(v) != 1)
    y = tuple(int(v) for v in y if int(v) != 1)
    return len(x) >= 2 and len(y) >= 2 and x != y


def ranges_text(values) -> str:
    v = np.asarray(values)
    if v.size == 0:
        return "none"
    if v.size <= 6:
        return ", ".join(str(x) for x in v)
    return f"{v[0]}..{v[-1]} ({v.size} values)"


# -- which groups form a run (as assemble.assemble_runs decides) --------------------------------
def boxes(names, numels, shapes, placement, sample: int = 0, nbits=None) -> dict:
    """Each parameter of a rank group as a box of its whole parameter's index space: {"off",
    "ext", "gshape": (P, ND) int64 (trailing dimensions padded with 0 / 1 / 1), "nd": (P,)
    dimensions, "whole": (P,) the group holds the whole parameter, "numel": (P,) the whole
    parameter's elements}. A whole parameter's box is its shape (its size flat where the
    recorded shape does not multiply to it). Sampled bits (``sample``, ``sampling.py``) of a
    parameter larger than the sample live in the 1-D space of its sample numbers, where an
    FSDP2 shard's (a flat range of the parameter) are a run; ``"scattered"``: True when a
    shard's are not (a tensor-parallel block: the planner declines it)."""
    p = len(names)
    places = placement if placement is not None else [None] * p
    off, ext, gsh, whole = [], [], [], []
    for j, place in enumerate(places):
        if place is None:
            shape = _shape(shapes[j])
            if math.prod(shape) != int(numels[j]):
                shape = (int(numels[j]),)
            off.append((0,) * len(shape))
            ext.append(shape)
            gsh.append(shape)
            whole.append(True)
        else:
            off.append(place["offset"])
            ext.append(place["local_shape"])
            gsh.append(place["global_shape"])
            whole.append(False)
    nd = np.fromiter((len(g) for g in gsh), np.int64, p)
    width = max(1, int(nd.max()) if p else 1)
    out = {}
    for key, rows, fill in (("off", off, 0), ("ext", ext, 1), ("gshape", gsh, 1)):
        arr = np.full((p, width), fill, np.int64)
        for d in np.unique(nd):  # parameters of one rank at once
            sel = np.flatnonzero(nd == d)
            if d:
                arr[sel, :d] = np.array([rows[j] for j in sel], np.int64).reshape(sel.size, d)
        out[key] = arr
    out["nd"] = nd
    out["whole"] = np.array(whole, bool)
    out["numel"] = out["gshape"].prod(axis=1)
    out["scattered"] = False
    if sample:
        _sample_space(out, sample, nbits)
    return out


def _sample_space(out: dict, sample: int, nbits) -> None:
    """Parameters larger than ``sample``: their boxes moved to the 1-D space of their sample
    numbers (``boxes``)."""
    for j in np.flatnonzero(out["numel"] > sample):
        d = int(out["nd"][j])
        if out["whole"][j]:
            off, ext = (0,), (sample,)
        else:
            run = sample_run(tuple(out["gshape"][j, :d]), sample, tuple(out["off"][j, :d]),
                             tuple(out["ext"][j, :d]))
            out["scattered"] |= run is None
            off, ext = ((run[0],), (run[1],)) if run else ((0,), (0,))
            if run and nbits is not None and int(nbits[j]) != run[1]:
                raise Unsupported("sampled bits that do not match their sample")
        for key, value, fill in (("off", off, 0), ("ext", ext, 1), ("gshape", (sample,), 1)):
            out[key][j] = fill
            out[key][j, 0] = value[0]
        out["nd"][j] = 1


def _pad(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    return a if a.shape[1] == width else np.pad(a, ((0, 0), (0, width - a.shape[1])),
                                                constant_values=fill)


def _table(groups: list, ids: list, rows=None) -> dict:
    """Every parameter of ``groups`` as one table: group index, parameter index in the group,
    name index, box (``boxes``), in the order of the groups, then of their parameters."""
    width = max(g["boxes"]["off"].shape[1] for g in groups)
    t = {"gi": np.concatenate([np.full(len(g["names"]), gi, np.int64)
                               for gi, g in enumerate(groups)]),
         "j": np.concatenate([np.arange(len(g["names"]), dtype=np.int64) for g in groups]),
         "k": np.concatenate(ids).astype(np.int64)}
    for key, fill in (("off", 0), ("ext", 1), ("gshape", 1)):
        t[key] = np.concatenate([_pad(g["boxes"][key], width, fill) for g in groups])
    t["nd"] = np.concatenate([g["boxes"]["nd"] for g in groups])
    t["whole"] = np.concatenate([g["boxes"]["whole"] for g in groups])
    t["numel"] = np.concatenate([g["boxes"]["numel"] for g in groups])
    if rows is not None:
        t = {k: v[rows] for k, v in t.items()}
    return t


def _by_name(t: dict, n: int) -> dict:
    """The table sorted by name (stable), with each name's row range."""
    order = np.argsort(t["k"], kind="stable")
    t = {k: v[order] for k, v in t.items()}
    t["start"] = np.searchsorted(t["k"], np.arange(n + 1))
    return t


def logical_runs(groups: list) -> dict:
    """{label rank: run} from one layout's rank groups: a sharded run's groups as one run of
    whole parameters under its lowest rank (its pieces taken once, as ``assemble._pieces``
    takes them: a group's whole parameter stands for all its shards, a replica's copy of a
    shard is dropped), every other group a run of its own; when a parameter's shards do not
    cover it (a ``rank`` filter), every group as recorded. A run: {"label", "groups", "names",
    "pieces": a table of its pieces sorted by name (``_by_name``), "steps", "used": indices of
    the groups holding pieces}."""
    sharded = sorted((g for g in groups if g["placement"] is not None), key=lambda g: g["rank"])
    out = {g["rank"]: _as_recorded(g) for g in groups if g["placement"] is None}
    if not sharded:
        return dict(sorted(out.items()))
    order, index, ids, last = [], {}, [], (None, None)
    for g in sharded:
        if g["names"] == last[0]:  # the usual case: every rank holds the same parameters
            ids.append(last[1])
            continue
        mine = np.empty(len(g["names"]), np.int64)
        for j, name in enumerate(g["names"]):
            k = index.get(name)
            if k is None:
                k = index[name] = len(order)
                order.append(name)
            mine[j] = k
        ids.append(mine)
        last = (g["names"], mine)
    t = _table(sharded, ids)
    n = len(order)
    keep = ~t["whole"]
    # a whole parameter in a shard group stands for all: the first such row, nothing else
    has_whole = np.zeros(n, bool)
    has_whole[t["k"][t["whole"]]] = True
    if has_whole.any():
        first_whole = np.unique(t["k"][t["whole"]], return_index=True)[1]
        keep &= ~has_whole[t["k"]]
        keep[np.flatnonzero(t["whole"])[first_whole]] = True
    size = t["ext"].prod(axis=1)
    total = t["gshape"].prod(axis=1)
    covered = np.bincount(t["k"][keep], size[keep], minlength=n)
    want = np.zeros(n)
    want[t["k"]] = total
    if np.any(covered > want):  # copies of shards (replicas recorded on purpose): once each
        cand = np.flatnonzero(keep & ~t["whole"])
        key = np.column_stack([t["k"][cand], t["off"][cand], t["ext"][cand]])
        _, first = np.unique(key, axis=0, return_index=True)
        keep[cand] = False
        keep[cand[first]] = True
        covered = np.bincount(t["k"][keep], size[keep], minlength=n)
    if np.any(covered != want):  # a rank filter left shards out: every group as recorded
        return dict(sorted({g["rank"]: _as_recorded(g) for g in groups}.items()))
    pieces = _by_name({k: v[keep] for k, v in t.items()}, n)
    used = np.unique(pieces["gi"]).tolist()
    steps = None
    for gi in used:
        s = sharded[gi]["steps"]
        steps = s if steps is None else np.intersect1d(steps, s)
    label = sharded[0]["rank"]
    out[label] = {"label": label, "groups": sharded, "names": order, "pieces": pieces,
                  "steps": steps, "used": used}
    return dict(sorted(out.items()))


def _as_recorded(g: dict) -> dict:
    """One rank group as a run of its own: each parameter one whole piece as the group holds
    it (its local shape and size; sampled bits: the 1-D space of the ones it holds)."""
    numels = np.asarray(g["numels"], np.int64)
    nbits = np.asarray(g["nbits"], np.int64)
    shapes = []
    for j, n in enumerate(numels):
        shape = _shape(g["shapes"][j])
        if nbits[j] != n:
            shape = (int(nbits[j]),)
        elif math.prod(shape) != int(n):
            shape = (int(n),)
        shapes.append(shape)
    nd = np.array([len(x) for x in shapes], np.int64)
    width = max(1, int(nd.max()) if nd.size else 1)
    ext = np.ones((len(shapes), width), np.int64)
    for j, x in enumerate(shapes):
        ext[j, :len(x)] = x
    t = {"gi": np.zeros(len(shapes), np.int64), "j": np.arange(len(shapes), dtype=np.int64),
         "k": np.arange(len(shapes), dtype=np.int64), "off": np.zeros_like(ext), "ext": ext,
         "gshape": ext.copy(), "nd": nd, "whole": np.ones(len(shapes), bool),
         "numel": numels}
    return {"label": g["rank"], "groups": [g], "names": list(g["names"]),
            "pieces": _by_name(t, len(shapes)), "steps": g["steps"], "used": [0]}


def pair_labels(labels_a, labels_b, ranks=None, names_a=None, names_b=None) -> tuple:
    """Which runs of two recordings are compared with which: ``(pairs, unpaired)``, ``pairs`` a
    list of (label of a, label of b), where a label may be a tuple of labels (those runs
    compared as one: their union), and ``unpaired`` {"first": [...], "second": [...]}: the
    labels of each recording compared with nothing (named in the result and a warning, never
    dropped silently). ``names_a``/``names_b``: {label: its parameter names} (as compared:
    without wrapper prefixes, renamed).

    * One run each: those two, whatever rank recorded them.
    * One run against several (``ranks``: only those): several runs whose parameters are
      disjoint (pipeline stages, recorded with global names) are one run, their union;
      several holding the same parameters (copies: every rank recorded the whole model) are
      each compared with the one; anything else is an error naming the overlap (stages
      recorded with their local layer names: ``rename=layer_offset(n)``).
    * Several against several: disjoint on both sides, the unions; else rank r with rank r.
    ``compare.pair_runs`` pairs Datasets by it too."""
    labels_a, labels_b = sorted(labels_a), sorted(labels_b)
    if ranks is not None:
        want = set(ranks)
        keep_a = [x for x in labels_a if x in want]
        keep_b = [x for x in labels_b if x in want]
        if len(labels_a) == 1 and len(labels_b) == 1:
            if not (keep_a or keep_b):
                raise GradCompareError(f"the runs share no rank (first: {labels_a}, second: "
                                       f"{labels_b}, asked: {list(ranks)})")
            return [(labels_a[0], labels_b[0])], {"first": [], "second": []}
        labels_a = keep_a if len(labels_a) > 1 else labels_a
        labels_b = keep_b if len(labels_b) > 1 else labels_b
        if not labels_a or not labels_b:
            raise GradCompareError(f"the runs share no rank (first: {sorted(keep_a)}, second: "
                                   f"{sorted(keep_b)}, asked: {list(ranks)})")
    none = {"first": [], "second": []}
    if len(labels_a) == 1 and len(labels_b) == 1:
        return [(labels_a[0], labels_b[0])], none
    strict = len(labels_a) == 1 or len(labels_b) == 1  # one against several: must be clear
    kind_a = _kind(labels_a, names_a, "first", strict)
    kind_b = _kind(labels_b, names_b, "second", strict)
    if strict:
        one, many, kind = ((labels_b[0], labels_a, kind_a) if len(labels_b) == 1
                           else (labels_a[0], labels_b, kind_b))
        if kind == "disjoint":
            pairs = [(tuple(many), one)]
        else:  # copies: each one compared with the single run
            pairs = [(m, one) for m in many]
        if len(labels_a) == 1:
            pairs = [(x, y) for y, x in pairs]
        return pairs, none
    if kind_a == "disjoint" and kind_b == "disjoint":
        return [(tuple(labels_a), tuple(labels_b))], none
    common = sorted(set(labels_a) & set(labels_b))
    if not common:
        raise GradCompareError(f"the runs share no rank (first: {labels_a}, second: "
                               f"{labels_b}" + (f", asked: {list(ranks)}" if ranks else "")
                               + ")")
    unpaired = {"first": [x for x in labels_a if x not in common],
                "second": [x for x in labels_b if x not in common]}
    return [(r, r) for r in common], unpaired


def pair_label(la, lb, n_a: int, n_b: int) -> int:
    """The rank a pair's result is labelled with: the label of the side of several runs (a
    union: its lowest), the first run's otherwise."""
    x = lb if n_a == 1 and n_b > 1 else la
    return min(x) if isinstance(x, tuple) else x


def _kind(labels, names, which: str, strict: bool = True) -> str:
    """How several runs of one recording relate by their parameters: "disjoint" (pipeline
    stages: compared as one), "same" (copies), or (``strict``) an error naming the overlap;
    not ``strict``: "mixed" instead."""
    if names is None or len(labels) < 2:
        return "same"
    sets = [set(names[x]) for x in labels]
    if all(s == sets[0] for s in sets):
        return "same"
    overlap = None
    for i, (x, sx) in enumerate(zip(labels, sets)):
        for y, sy in zip(labels[i + 1:], sets[i + 1:]):
            if sx & sy and (overlap is None or (overlap[3] and sx != sy)):
                overlap = (x, y, sorted(sx & sy)[0], sx == sy)
    if overlap is None:
        return "disjoint"
    if not strict:
        return "mixed"
    ra, rb, name, same = overlap
    if same:
        raise AmbiguousRuns(
            f"the {which} run's ranks {ra} and {rb} record the same parameters (copies) while "
            "others record other parameters (pipeline stages): a mix this comparison cannot "
            "pair on its own; pick the ranks of one copy with ranks=[...]")
    only_a = sorted(set(names[ra]) - set(names[rb]))[:2]
    only_b = sorted(set(names[rb]) - set(names[ra]))[:2]
    raise AmbiguousRuns(
        f"the {which} run's ranks {ra} and {rb} record overlapping but different parameters "
        f"(both hold {name!r}; rank {ra} also {only_a}, rank {rb} also {only_b}), so they are "
        "neither copies of one model nor parts of one: pipeline stages recorded with their "
        "local layer names? Record each stage with GradProbe(..., rename=probekit.grads."
        "layer_offset(first_layer)), or compare with rename=, or pick ranks with ranks=[...]")


def union_run(runs: list) -> dict:
    """Runs of disjoint parameters (``logical_runs``' runs of pipeline stages) as one run: their
    groups one after the other, their pieces in one table, the steps they all hold."""
    if len(runs) == 1:
        return runs[0]
    groups, names, tabs, used, steps = [], [], [], [], None
    for run in runs:
        g0, k0 = len(groups), len(names)
        t = {k: v for k, v in run["pieces"].items() if k != "start"}
        t["gi"] = t["gi"] + g0
        t["k"] = t["k"] + k0
        tabs.append(t)
        groups += run["groups"]
        names += list(run["names"])
        used += [g0 + u for u in run["used"]]
        steps = run["steps"] if steps is None else np.intersect1d(steps, run["steps"])
    width = max(t["off"].shape[1] for t in tabs)
    table = {}
    for key in tabs[0]:
        fill = {"off": 0, "ext": 1, "gshape": 1}.get(key)
        table[key] = np.concatenate([_pad(t[key], width, fill) if fill is not None else t[key]
                                     for t in tabs])
    return {"label": runs[0]["label"], "groups": groups, "names": names,
            "pieces": _by_name(table, len(names)), "steps": steps, "used": used}


# -- one comparison --------------------------------------------------------------------------
def plan(run_a: list, run_b: list, *, ranks=None, block_bytes: int = 8 << 20,
         task_bytes: int = 64 << 20, rename=None, memo: dict | None = None) -> dict:
    """The comparison of two runs, each given as its layout segments with their rank groups:
    ``[(restarts.Segment, [opening.open_group of each of its ranks])]`` -> {"pairs": [pair
    plan]} or {"unsupported": reason}.

    Each segment's groups form runs as ``logical_runs`` says (a sharded segment: one run under
    its lowest rank), labelled as the assembled readers label them; the runs of the two
    recordings are paired by label over all their segments (``pair_labels``: a run of one
    label each, whatever rank; else rank r with rank r), and each pair of segments of a paired
    label whose steps overlap is planned on its own over the steps both hold (``plan_pair``).
    The pair plans of one label are consecutive and in step order (``compare.py`` joins their
    counts along the steps). ``memo``: a dict shared by the plans of one reference against its
    test and its controls (``plan_pair``: a pair's slab sets computed once for runs laid out
    alike)."""
    groups = [g for _, gs in run_a + run_b for g in gs]
    if any(g is None for g in groups):
        return {"unsupported": "arrays stored neither as plain chunk files nor as shards of "
                               "steps"}
    try:
        sides = [[(seg, logical_runs(gs)) for seg, gs in run if seg.last_step >= seg.first_step]
                 for run in (run_a, run_b)]
        labels = [{label for _, runs in side for label in runs} for side in sides]
        if not labels[0] or not labels[1]:
            raise GradCompareError(f"the {'first' if not labels[0] else 'second'} run holds no "
                                   "committed step")
        names = [_label_names(side, rename) for side in sides]
        try:
            pairs, unpaired = pair_labels(labels[0], labels[1], ranks, names[0], names[1])
        except AmbiguousRuns as exc:
            raise Unsupported(str(exc)) from None
        out = []
        for la, lb in pairs:
            mine = []
            label = pair_label(la, lb, len(labels[0]), len(labels[1]))
            for seg_a, runs_a in sides[0]:
                for seg_b, runs_b in sides[1]:
                    ra, rb = _runs_of(runs_a, la), _runs_of(runs_b, lb)
                    if ra is None or rb is None:
                        continue
                    window = _overlap(seg_a, seg_b)
                    if window is None:
                        continue
                    got = plan_pair(label, ra, rb, block_bytes, task_bytes,
                                    prefix=None if mine else f"rank {label}: ", window=window,
                                    rename=rename, memo=memo)
                    if got is not None:
                        mine.append(got)
            if not mine:
                steps = [np.concatenate([_runs_of(r, x)["steps"] for _, r in side
                                         if _runs_of(r, x) is not None])
                         for side, x in zip(sides, (la, lb))]
                raise GradCompareError(f"the runs share no step (first: "
                                       f"{ranges_text(steps[0])}; second: "
                                       f"{ranges_text(steps[1])})")
            mine.sort(key=lambda q: int(q["steps"][0]))
            for prev, nxt in zip(mine, mine[1:]):
                if int(prev["steps"][-1]) >= int(nxt["steps"][0]):
                    raise Unsupported("layout segments of one run holding the same steps")
            out += mine
        return {"pairs": out, "unpaired": unpaired}
    except Unsupported as exc:
        return {"unsupported": str(exc)}


def _label_names(side, rename) -> dict:
    """{label: its parameter names as compared} over a recording's segments."""
    out: dict = {}
    for _, runs in side:
        for label, run in runs.items():
            if label not in out:
                names = canonical_names(run["names"])
                out[label] = list(renamed(names, rename, "compare_grads(rename=)"))
    return out


def _runs_of(runs: dict, label):
    """The run of ``label`` in one segment's runs (a tuple: the union of those runs), or
    None when the segment holds none of them."""
    if not isinstance(label, tuple):
        return runs.get(label)
    got = [runs[x] for x in label if x in runs]
    return union_run(got) if got else None


def _overlap(a, b):
    """The steps (first, last) two segments share, or None."""
    lo, hi = max(a.first_step, b.first_step), min(a.last_step, b.last_step)
    return (lo, hi) if lo <= hi else None


def _level_check(run, which: str) -> None:
    for gi in run["used"]:
        g = run["groups"][gi]
        if g["direction"] is None:
            if g.get("level") in ("L1", "L2"):
                raise GradCompareError(
                    f"the {which} run was recorded at grad_level {g['level']!r}, but its rank "
                    f"group of rank {g.get('rank', '?')} holds no direction array: the "
                    "store is damaged (a folder lost or removed, or a partial copy)")
            raise GradCompareError(
                f"the {which} run was recorded at grad_level {g.get('level') or '?'!r}, which "
                "keeps no direction data; accepted: runs recorded at L1 or L2")


def _gshape(run, k: int) -> tuple:
    """The shape of the index space of the run's parameter ``k`` (its first piece's): the
    parameter's, or its sample's."""
    t = run["pieces"]
    row = t["start"][k]
    return tuple(int(x) for x in t["gshape"][row, :t["nd"][row]])


def _numel(run, k: int) -> int:
    t = run["pieces"]
    return int(t["numel"][t["start"][k]])


def plan_pair(label, ra: dict, rb: dict, block_bytes: int, task_bytes: int, *,
              prefix: str | None = "", window=None, rename=None,
              memo: dict | None = None) -> dict | None:
    """The plan of one pair of runs (see the module docstring); ``prefix`` starts the
    unmatched-parameter warning (None: none logged); ``window``: (first, last) steps of a pair
    of layout segments, None when the runs share none of them. ``memo``: slab sets already
    computed (``_sets_key``: the same pieces, bit offsets and limits on both sides, as a
    reference's pairs with a test and a control recorded in one layout have), reused."""
    _level_check(ra, "first")
    _level_check(rb, "second")
    samples = []
    for run in (ra, rb):
        ks = {int(run["groups"][gi].get("sample") or 0) for gi in run["used"]}
        if len(ks) > 1 or any(run["groups"][gi]["boxes"]["scattered"] for gi in run["used"]):
            raise Unsupported("sampled bits of shards that are not flat ranges")
        samples.append(ks.pop())
    if samples[0] != samples[1]:
        if 0 in samples:  # one run records every element: the Dataset path samples it
            raise Unsupported("one run sampled, the other not")
        raise GradCompareError(
            f"the runs sampled their sign bits differently (grad_probe.sample {samples[0]} vs "
            f"{samples[1]}); accepted: runs recording the same sample, or one recording every "
            "element (compare_grads samples it)")
    common, pos_a, pos_b, only_a, only_b, n_a, n_b = match_params(
        ra["names"], rb["names"], [], [], prefix, rename=rename)
    numel_a = np.array([_numel(ra, k) for k in pos_a], np.int64)
    numel_b = np.array([_numel(rb, k) for k in pos_b], np.int64)
    check_sizes(common, numel_a, numel_b, [_gshape(ra, k) for k in pos_a],
                [_gshape(rb, k) for k in pos_b], names_a=[ra["names"][k] for k in pos_a],
                names_b=[rb["names"][k] for k in pos_b])
    nbits = np.array([math.prod(_gshape(ra, k)) for k in pos_a], np.int64)
    steps, _, _ = np.intersect1d(ra["steps"], rb["steps"], assume_unique=True,
                                 return_indices=True)
    if window is not None:
        steps = steps[(steps >= window[0]) & (steps <= window[1])]
        if steps.size == 0:
            return None
    if steps.size == 0:
        raise GradCompareError(f"the runs share no step (first: {ranges_text(ra['steps'])}; "
                               f"second: {ranges_text(rb['steps'])})")
    sides = []
    for run in (ra, rb):
        groups = []
        for gi, g in enumerate(run["groups"]):
            rows = (np.searchsorted(g["steps"], steps) if gi in run["used"]
                    else np.zeros(0, np.int64))
            groups.append({"rank": g["rank"], "rows": rows, "direction": g["direction"],
                           "significant": g["significant"], "offsets": g["offsets"]})
        sides.append(groups)
    present = np.ones((steps.size, len(common)), bool)
    for run, pos, groups in ((ra, pos_a, sides[0]), (rb, pos_b, sides[1])):
        t = run["pieces"]
        col = np.full(len(run["names"]), -1, np.int64)
        col[pos] = np.arange(len(pos))
        c = col[t["k"]]
        mine = c >= 0
        gis, cs, js = t["gi"][mine], c[mine], t["j"][mine]
        order = np.argsort(gis, kind="stable")
        gis, cs, js = gis[order], cs[order], js[order]
        bounds = np.flatnonzero(np.concatenate([[True], gis[1:] != gis[:-1], [True]]))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            pres = run["groups"][gis[lo]]["present"]
            if pres is not None:  # a group holds a parameter once: no column twice
                present[:, cs[lo:hi]] &= pres[groups[gis[lo]]["rows"]][:, js[lo:hi]]
    use_sig = all(ra["groups"][gi]["significant"] is not None for gi in ra["used"]) and all(
        rb["groups"][gi]["significant"] is not None for gi in rb["used"])
    f_side = 0 if len(ra["used"]) >= len(rb["used"]) else 1
    # a block of steps lies in one chunk file of every group where it can (the steps a chunk
    # holds: several of a small row, one of a large one; the fewest of both runs), so its
    # rows are mapped, not copied; the slab sets are sized to match
    block_rows = max(1, min([run["groups"][gi]["direction"].chunk_shape[0]
                             for run in (ra, rb) for gi in run["used"]] + [steps.size]))
    limit = max(64, block_bytes * 8 // block_rows)
    key = _sets_key(ra, rb, pos_a, pos_b, f_side, limit) if memo is not None else None
    known = memo.get(key) if memo is not None else None
    if known is None:
        sets = _slab_sets(ra, rb, pos_a, pos_b, sides, f_side, limit)
        if memo is not None:
            memo[key] = [dict(s) for s in sets]
    else:   # each set's dict its own ("block" is set below); the arrays are only read
        sets = [dict(s) for s in known]
    widest = max((s["bits"] for s in sets), default=1)
    per_task = max(1, (task_bytes * 8) // max(1, widest))
    if per_task >= block_rows:
        per_task -= per_task % block_rows
    chunks = [(s0, min(s0 + per_task, steps.size)) for s0 in range(0, steps.size, per_task)]
    for s in sets:
        s["block"] = max(1, min(per_task, (block_bytes * 8) // max(1, s["bits"])))
    return {"label": label, "common": common, "only_a": only_a, "only_b": only_b, "n_a": n_a,
            "n_b": n_b, "steps": steps, "numel": numel_a, "nbits": nbits,
            "sample": samples[0], "present": present,
            "use_sig": use_sig, "sides": sides, "sets": sets, "chunks": chunks,
            "f_side": f_side}


def _sets_key(ra, rb, pos_a, pos_b, f_side: int, limit: int) -> tuple:
    """What ``_slab_sets`` reads of a pair, as a dict key: both runs' piece tables, their groups'
    bit offsets, the compared parameters' positions, the F side and the slab limit."""
    def arr(a):
        a = np.asarray(a)
        return (a.dtype.str, a.shape, a.tobytes())

    key = [f_side, limit]
    for run, pos in ((ra, pos_a), (rb, pos_b)):
        t = run["pieces"]
        key += [arr(pos), *(arr(t[k]) for k in ("gi", "j", "off", "ext", "gshape", "nd",
                                                  "start")),
                tuple(None if g["offsets"] is None else arr(g["offsets"])
                      for g in run["groups"])]
    return tuple(key)


def _boxes(run, pos):
    """Per compared parameter (``pos``: indices into the run's names): (offsets, extents, group
    index, bit offset of the piece in its group's rows) arrays of its non-empty pieces, and the
    global shape."""
    groups = run["groups"]
    sizes = [len(g["offsets"]) if g["offsets"] is not None else 0 for g in groups]
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    flat = np.concatenate([g["offsets"] if g["offsets"] is not None
                           else np.zeros(0, np.int64) for g in groups]).astype(np.int64)
    t = run["pieces"]
    bit0 = flat[base[t["gi"]] + t["j"]] * 8
    size = t["ext"].prod(axis=1)
    out = []
    for k in pos:
        lo, hi = t["start"][k], t["start"][k + 1]
        nd = max(1, int(t["nd"][lo]))
        gshape = _gshape(run, k) or (1,)
        keep = np.flatnonzero(size[lo:hi] > 0) + lo
        out.append((t["off"][keep, :nd], t["ext"][keep, :nd], t["gi"][keep], bit0[keep],
                    gshape))
    return out


def _normalise(shape_a, shape_b, a, b):
    """The two sides' boxes of one parameter in one index space of at most PREFIX + 1
    dimensions: trailing dimensions whole in every piece merged into the one before them,
    dimensions of size 1 dropped. Raises Unsupported when that is not possible."""
    (oa, la), (ob, lb) = a, b
    if shape_a != shape_b:
        if len(oa) == len(ob) == 1 and np.array_equal(la[0], shape_a) and np.array_equal(
                lb[0], shape_b):  # one whole piece each, shaped differently: flat
            n = int(np.prod(shape_a, dtype=np.int64))
            one = np.zeros((1, 1), np.int64)
            return (one, np.array([[n]], np.int64)), (one.copy(), np.array([[n]], np.int64))
        raise Unsupported("a sharded parameter whose shapes differ between the runs")
    shape = np.asarray(shape_a, np.int64)
    keep = shape != 1
    if not keep.any():
        keep[-1] = True
    oa, la, ob, lb, shape = oa[:, keep], la[:, keep], ob[:, keep], lb[:, keep], shape[keep]
    nd = shape.size
    d0 = nd  # the first of the trailing dims whole everywhere
    while d0 > 1 and np.all(la[:, d0 - 1] == shape[d0 - 1]) and np.all(
            lb[:, d0 - 1] == shape[d0 - 1]):
        d0 -= 1
    if d0 < nd:
        inner = int(np.prod(shape[d0:], dtype=np.int64))
        oa = np.concatenate([oa[:, :d0 - 1], oa[:, d0 - 1:d0] * inner], axis=1)
        la = np.concatenate([la[:, :d0 - 1], la[:, d0 - 1:d0] * inner], axis=1)
        ob = np.concatenate([ob[:, :d0 - 1], ob[:, d0 - 1:d0] * inner], axis=1)
        lb = np.concatenate([lb[:, :d0 - 1], lb[:, d0 - 1:d0] * inner], axis=1)
        shape = np.concatenate([shape[:d0 - 1], [shape[d0 - 1] * inner]])
    if shape.size > geometry.PREFIX + 1:
        raise Unsupported(f"a sharded parameter of {shape.size} dimensions")
    return (oa, la), (ob, lb)


def _slabs(off, ext, gi, bit0, limit: int):
    """F pieces cut into slabs of at most ``limit`` elements (flat ranges of each piece's C
    order, each as its boxes): (offsets, extents, group index, bit offset) arrays."""
    size = ext.prod(axis=1)
    big = size > limit
    if not big.any():
        return off, ext, gi, bit0
    o, e, g, b = [off[~big]], [ext[~big]], [gi[~big]], [bit0[~big]]
    for k in np.flatnonzero(big):
        for x0 in range(0, int(size[k]), limit):
            pos = x0
            for sub_off, sub_ext in geometry.flat_boxes(tuple(ext[k]), x0,
                                                        min(int(size[k]), x0 + limit)):
                o.append(off[k] + np.asarray(sub_off, np.int64)[None, :])
                e.append(np.asarray(sub_ext, np.int64)[None, :])
                g.append(gi[k:k + 1])
                b.append(bit0[k:k + 1] + pos)
                pos += int(np.prod(sub_ext, dtype=np.int64))
    return np.concatenate(o), np.concatenate(e), np.concatenate(g), np.concatenate(b)


def _slab_sets(ra, rb, pos_a, pos_b, sides, f_side: int, limit: int) -> list:
    """The slab sets of one pair: per set the read ranges of both sides and its run sets in
    the kernel's layout (``kernel.RUN_FIELDS``), and its F bits per step."""
    box_a = _boxes(ra, pos_a)
    box_b = _boxes(rb, pos_b)
    f_base = 0
    tables_f = []  # (group, bit0, nbits) of every F sub-piece, all parameters
    all_runs = []
    for col, (pa, pb) in enumerate(zip(box_a, box_b)):
        (oa, la, ga, ba, sa), (ob, lb, gb, bb, sb) = pa, pb
        if not len(oa) or not len(ob):
            continue
        (oa, la), (ob, lb) = _normalise(sa, sb, (oa, la), (ob, lb))
        if f_side == 0:
            fo, fl, fg, fb, co, cl, cg, cb = oa, la, ga, ba, ob, lb, gb, bb
        else:
            fo, fl, fg, fb, co, cl, cg, cb = ob, lb, gb, bb, oa, la, ga, ba
        fo, fl, fg, fb = _slabs(fo, fl, fg, fb, limit)
        i, j = geometry.candidate_pairs(fo, fl, co, cl)
        rs = geometry.runsets(fo[i], fl[i], co[j], cl[j], np.full(i.size, col, np.int64))
        rs[:, 1] += fb[i]  # element offsets -> bit offsets in the groups' rows
        rs[:, 2] += cb[j]
        tables_f.append(np.stack([fg, fb, fl.prod(axis=1)], axis=1))
        all_runs.append((rs, f_base + i, fg[i], cg[j]))
        f_base += len(fo)
    if not tables_f:
        return []
    ftab = np.concatenate(tables_f)
    rs = np.concatenate([r[0] for r in all_runs])
    fsub = np.concatenate([r[1] for r in all_runs])
    fgrp = np.concatenate([r[2] for r in all_runs])
    cgrp = np.concatenate([r[3] for r in all_runs])
    # slab sets: F sub-pieces in the order of their groups' rows, cut every `limit` bits
    order = np.lexsort((ftab[:, 1], ftab[:, 0]))
    cum = np.cumsum(ftab[order, 2]) - ftab[order, 2]
    set_of = np.empty(len(ftab), np.int64)
    set_of[order] = cum // max(1, limit)
    _, set_of = np.unique(set_of, return_inverse=True)
    nsets = int(set_of.max()) + 1
    rs_set = set_of[fsub]
    by_set = np.argsort(rs_set, kind="stable")
    bounds = np.searchsorted(rs_set[by_set], np.arange(nsets + 1))
    sub_by_set = np.argsort(set_of, kind="stable")
    sub_bounds = np.searchsorted(set_of[sub_by_set], np.arange(nsets + 1))
    sets = []
    for s in range(nsets):
        mine = by_set[bounds[s]:bounds[s + 1]]
        runs, rf, rc = rs[mine], fgrp[mine], cgrp[mine]
        subs = ftab[sub_by_set[sub_bounds[s]:sub_bounds[s + 1]]]
        f_reads = _merge(subs[:, 0], subs[:, 1], subs[:, 1] + subs[:, 2], 64)
        span = geometry.runset_span(runs, 1)
        c_reads = _merge(rc, span[:, 0], span[:, 1], _MERGE_GAP)
        ka = _locate(f_reads, rf, runs[:, 1])
        kc = _locate(c_reads, rc, runs[:, 2])
        out = np.zeros((len(runs), 15), np.int64)
        out[:, 0] = runs[:, 0]
        a_cols, b_cols = (ka, kc) if f_side == 0 else (kc, ka)
        out[:, 1], out[:, 3] = a_cols
        out[:, 2], out[:, 4] = b_cols
        out[:, 5] = runs[:, 3]
        for k in range(geometry.PREFIX):
            out[:, 6 + 3 * k] = runs[:, 4 + 3 * k]
            if f_side == 0:
                out[:, 7 + 3 * k], out[:, 8 + 3 * k] = runs[:, 5 + 3 * k], runs[:, 6 + 3 * k]
            else:
                out[:, 7 + 3 * k], out[:, 8 + 3 * k] = runs[:, 6 + 3 * k], runs[:, 5 + 3 * k]
        reads = (f_reads, c_reads) if f_side == 0 else (c_reads, f_reads)
        sets.append({"reads": reads, "runs": out, "bits": int(subs[:, 2].sum())})
    return sets


def _merge(group, lo_bits, hi_bits, gap: int) -> np.ndarray:
    """(n, 3) int64 read ranges (group, first byte, end byte) covering the bit ranges
    [lo, hi) of each group, ranges closer than ``gap`` bytes merged, sorted."""
    if not len(group):
        return np.zeros((0, 3), np.int64)
    b0 = lo_bits // 8
    b1 = -(-hi_bits // 8)
    order = np.lexsort((b0, group))
    g, b0, b1 = group[order], b0[order], b1[order]
    big = np.int64(1) << 40  # groups sorted: the running maximum restarts with each group
    end = np.maximum.accumulate(b1 + g * big) - g * big
    brk = np.ones(len(g), bool)
    brk[1:] = (g[1:] != g[:-1]) | (b0[1:] > end[:-1] + gap)
    idx = np.flatnonzero(brk)
    stop = np.append(idx[1:], len(g))
    return np.stack([g[idx], b0[idx], end[stop - 1]], axis=1).astype(np.int64)


def _locate(reads: np.ndarray, group: np.ndarray, bit: np.ndarray):
    """(read range index, bit within that range's row) of each bit of a group's row."""
    key = reads[:, 0] * (1 << 40) + reads[:, 1]
    k = np.searchsorted(key, group * (1 << 40) + bit // 8, side="right") - 1
    return k.astype(np.int64), bit - reads[k, 1] * 8
