"""Compare the gradient directions of two runs, vectorised over steps and parameters.

similarity(rank, step, param) = share of elements whose sign bit (``grad > 0``) is equal in both
runs; total(rank, step) = the same over all compared elements (the element-weighted mean).
A parameter is flagged at the first compared step if its similarity is below ``step0_threshold``
(0.97), and at a later step if it dropped by more than ``drop_threshold`` (0.03) since the
previous compared step; ``flag_total`` applies the same rule to ``total``. Parameters are paired
by name (without wrapper prefixes); those of one run only are named in the result and logged.

``compare_grads`` runs a dask graph on local threads or a ``dask.distributed`` cluster
(``engine.py``). Two stores are compared shard by shard, segment by segment (``plan_stage``:
the stores' segments, their rank groups opened, the plan of ``planner.py``; ``count_stage``:
``counting.count_task`` per slab set and chunk of steps, summed; ``finish_arrays``). Datasets
(and what the planner declines) block by block (``plan_pair``, ``count_block`` per block of
steps: the sign bits read as 64-bit words, XOR-ed, counted with ``np.bitwise_count`` and summed
per parameter; ``finish_pair``). Both give the same counts.
"""
from __future__ import annotations

import threading

import numpy as np

from ...errors import GradCompareError
from ...log import get_logger
from ..store.chunks import bit_reader
from .planner import check_sizes, match_params, pair_label, pair_labels, ranges_text
from ..numerics.sampling import CONFIDENCE, stratified_interval, wilson
from .unmatched import unmatched_vars

log = get_logger(__name__)

STEP0_THRESHOLD = 0.97
DROP_THRESHOLD = 0.03
_BLOCK_BYTES = 8 << 20  # sign bytes of one run per block (two runs' blocks are in memory)
_TASK_BYTES = 64 << 20  # sign bytes of one run per dask task (its blocks one after another)


_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _popcount_table(words: np.ndarray) -> np.ndarray:
    """Bits set per element of a uint64 array, for numpy < 2 (no ``np.bitwise_count``); the
    MindSpore venv needs numpy 1.26 (see docs/mindspore.md)."""
    w = np.ascontiguousarray(words)
    return _POPCOUNT8[w.view(np.uint8)].reshape(*w.shape, 8).sum(axis=-1, dtype=np.uint8)


_bitwise_count = getattr(np, "bitwise_count", _popcount_table)


def _bits(ds) -> np.ndarray:
    """Sign bits recorded per parameter: one per element, or its sample (``nbits``)."""
    return np.asarray((ds["nbits"] if "nbits" in ds.coords else ds["numel"]).values, np.int64)


def _word_index(ds, pos: np.ndarray) -> np.ndarray:
    """64-bit word indices (into one step's sign bits) of the parameters at positions ``pos``."""
    offsets = np.asarray(ds["offset"].values, np.int64)[pos] // 8
    words = -(-_bits(ds)[pos] // 64)
    return np.concatenate([np.arange(o, o + w) for o, w in zip(offsets, words)]) if len(
        pos) else np.zeros(0, np.int64)


def compare_rank(a, b, *, step0_threshold: float = STEP0_THRESHOLD,
                 drop_threshold: float = DROP_THRESHOLD, block_bytes: int = _BLOCK_BYTES,
                 noise_aware: bool = True):
    """Compare two Datasets of one rank (as ``open_grads`` returns) -> Dataset(step, param).

    When both runs hold significance bits (probekit stores), ``similarity_significant`` compares
    the signs of the elements significant in both runs only (elements whose magnitude is below
    the rounding level of their tensor have random signs), and with ``noise_aware`` the flags
    and the first divergence use it; ``similarity`` stays msprobe's plain sign similarity.

    In this process, block after block; ``compare_grads`` runs the same blocks as a dask
    graph."""
    a, b = match_samples(a, b)
    plan = plan_pair(a, b, block_bytes)
    src = bit_sources(a, b, plan)
    parts = [count_block(src, plan, s0, s1) for s0, s1 in plan["blocks"]]
    return finish_pair(plan, parts, step0_threshold, drop_threshold, noise_aware)


def match_samples(a, b) -> tuple:
    """Two Datasets on the same elements: a run that recorded every element's bits, compared
    with a sampled one (``grad_probe.sample``), is sampled the same way (``sampling.subsample``);
    anything else as it is."""
    from ..numerics.sampling import subsample

    ka, kb = int(a.attrs.get("sample", 0) or 0), int(b.attrs.get("sample", 0) or 0)
    if ka and not kb and "direction" in b:
        b = subsample(b, ka)
    elif kb and not ka and "direction" in a:
        a = subsample(a, kb)
    return a, b


def plan_pair(a, b, block_bytes: int = _BLOCK_BYTES, task_bytes: int = _TASK_BYTES, *,
              label: str = "", rename=None) -> dict:
    """What the comparison of two Datasets needs besides the sign bits (small arrays): shared
    parameters and steps, word layout, presence, blocks of steps, and the parameters found in
    one run only (logged as a warning, prefixed with ``label``). Raises on runs that cannot be
    compared."""
    for name, ds in (("first", a), ("second", b)):
        if "direction" not in ds:
            raise GradCompareError(
                f"the {name} run was recorded at grad_level {ds.attrs.get('level', '?')!r}, "
                "which keeps no direction data; accepted: runs recorded at L1 or L2")
    # names matched without wrapper prefixes (an msprobe dump of a DDP run has "module.*");
    # parameters of one run only by the names the run holds, and those a step before the
    # comparison left out (``left_out``: mindspore.align, a name mapping to no reference one)
    raw_a = [str(x) for x in a["param"].values]
    raw_b = [str(x) for x in b["param"].values]
    common, pos_a, pos_b, only_a, only_b, n_a, n_b = match_params(
        raw_a, raw_b, _left_out(a), _left_out(b), label, rename=rename)
    numel_a = np.asarray(a["numel"].values, np.int64)[pos_a]
    numel_b = np.asarray(b["numel"].values, np.int64)[pos_b]
    check_sizes(common, numel_a, numel_b, _shapes(a, pos_a), _shapes(b, pos_b),
                names_a=[raw_a[i] for i in pos_a], names_b=[raw_b[i] for i in pos_b])
    bits_a, bits_b = _bits(a)[pos_a], _bits(b)[pos_b]
    if a.attrs.get("sample", 0) != b.attrs.get("sample", 0) or np.any(bits_a != bits_b):
        raise GradCompareError(
            f"the runs sampled their sign bits differently (grad_probe.sample "
            f"{a.attrs.get('sample', 0)} vs {b.attrs.get('sample', 0)}); accepted: runs "
            "recording the same sample, or one recording every element (compare_grads "
            "samples it)")
    steps_a = np.asarray(a["step"].values, np.int64)
    steps_b = np.asarray(b["step"].values, np.int64)
    steps, rows_a, rows_b = np.intersect1d(steps_a, steps_b, assume_unique=True,
                                           return_indices=True)
    if steps.size == 0:
        raise GradCompareError(f"the runs share no step (first: {ranges_text(steps_a)}; "
                               f"second: {ranges_text(steps_b)})")
    nbytes_a, nbytes_b = a.sizes["byte"], b.sizes["byte"]
    off_a = np.asarray(a["offset"].values, np.int64)
    off_b = np.asarray(b["offset"].values, np.int64)
    # Same layout (the usual case: same model, same config): XOR whole rows, no gather.
    same_layout = bool(len(common) == len(raw_a) == len(raw_b)
                       and np.array_equal(pos_b, pos_a) and np.array_equal(off_a, off_b)
                       and nbytes_a == nbytes_b)
    nwords = -(-bits_a // 64)
    word0 = np.concatenate([[0], np.cumsum(nwords)[:-1]]).astype(np.int64)
    # Per-parameter sums of the per-word bit counts: a large parameter sums its own columns
    # (numpy's reduce is far faster than reduceat over long segments); the small ones are
    # gathered and summed with one reduceat.
    small = np.flatnonzero((nwords > 0) & (nwords < 1024))
    block = max(1, block_bytes // max(1, nbytes_a))
    per_task = max(1, task_bytes // max(1, nbytes_a))  # steps per task, whole blocks
    block = min(block, per_task)
    per_task = per_task // block * block
    return {
        "common": common, "only_a": only_a, "only_b": only_b, "n_a": n_a, "n_b": n_b,
        "steps": steps, "rows_a": rows_a, "rows_b": rows_b,
        "numel": numel_a, "nbits": bits_a, "sample": int(a.attrs.get("sample", 0)),
        "nwords": nwords, "word0": word0, "same_layout": same_layout,
        "words_a": None if same_layout else _word_index(a, pos_a),
        "words_b": None if same_layout else _word_index(b, pos_b),
        "big": np.flatnonzero(nwords >= 1024), "small": small,
        "small_cols": (np.concatenate([np.arange(word0[j], word0[j] + nwords[j]) for j in small])
                       if small.size else np.zeros(0, np.int64)),
        "small_starts": np.concatenate([[0], np.cumsum(nwords[small])[:-1]]).astype(np.int64),
        "use_sig": "significant" in a and "significant" in b,
        "present": _present(a, rows_a, pos_a) & _present(b, rows_b, pos_b),
        "block": block, "blocks": [(s0, min(s0 + per_task, steps.size))
                                   for s0 in range(0, steps.size, per_task)],
        "nbytes": (nbytes_a, nbytes_b)}


def _shapes(ds, pos):
    """The recorded shapes of the parameters at ``pos`` (None where not recorded or not a
    shape: an msprobe dump's are text the planner parses too)."""
    if "shape" not in ds.coords:
        return None
    from .planner import _shape

    out = []
    for x in np.asarray(ds["shape"].values)[pos]:
        try:
            out.append(_shape(str(x)))
        except (ValueError, SyntaxError):
            out.append(None)
    return out


def bit_sources(a, b, plan) -> tuple:
    """(direction a, direction b, significant a, significant b) as readers of rows: the chunk
    files straight (``RawChunks``, an assembled sharded run's ``AssembledBits``) while the
    Datasets hold exactly what ``open_grads`` read, else the variables' values."""
    sig = plan["use_sig"]
    return (bit_reader(a, "direction"), bit_reader(b, "direction"),
            bit_reader(a, "significant") if sig else None,
            bit_reader(b, "significant") if sig else None)


_TLS = threading.local()


def _buffer(shape, which: int) -> np.ndarray:
    """A per-thread buffer reused from block to block (fresh memory costs a page fault per
    page, which is most of a read from the page cache)."""
    bufs = getattr(_TLS, "bufs", None)
    if bufs is None:
        bufs = _TLS.bufs = {}
    buf = bufs.get(which)
    if buf is None or buf.shape[1] != shape[1] or buf.shape[0] < shape[0]:
        buf = bufs[which] = np.empty(shape, np.uint8)
    return buf[:shape[0]]


def _read(src, rows: np.ndarray, which: int) -> np.ndarray:
    lo, hi = int(rows.min()), int(rows.max()) + 1
    if hi - lo == rows.size and np.all(np.diff(rows) == 1):
        return src.read(lo, hi, out=_buffer((rows.size, src.shape[1]), which))
    return np.ascontiguousarray(src.read(lo, hi)[rows - lo])


def count_block(sources, plan, s0: int, s1: int) -> tuple:
    """(differ, differ_significant, significant_in_both) per (step, param) for the compared
    steps ``s0:s1``, a block of ``plan["block"]`` steps at a time (read into per-thread
    buffers, so a task's memory is two blocks). One task of the comparison's graph."""
    step = plan["block"]
    parts = [_count(sources, plan, b0, min(b0 + step, s1)) for b0 in range(s0, s1, step)]
    if len(parts) == 1:
        return parts[0]
    return tuple(None if p[0] is None else np.concatenate(p) for p in zip(*parts))


def _count(sources, plan, s0: int, s1: int) -> tuple:
    dir_a, dir_b, sig_a, sig_b = sources
    ra, rb = plan["rows_a"][s0:s1], plan["rows_b"][s0:s1]
    n = s1 - s0
    differ = np.zeros((n, len(plan["common"])), np.int64)
    differ_sig = np.zeros_like(differ) if plan["use_sig"] else None
    count_sig = np.zeros_like(differ) if plan["use_sig"] else None

    def words(src, rows, which, cols):
        w = _read(src, rows, which).view(np.uint64)
        return w if cols is None else w[:, cols]

    wa = words(dir_a, ra, 0, plan["words_a"])
    wb = words(dir_b, rb, 1, plan["words_b"])
    x = np.bitwise_xor(wa, wb, out=wa if plan["same_layout"] else None)
    if plan["use_sig"]:
        sa = words(sig_a, ra, 2, plan["words_a"])
        sb = words(sig_b, rb, 3, plan["words_b"])
        both = np.bitwise_and(sa, sb, out=sa if plan["same_layout"] else None)
        _per_param(both, count_sig, plan)
        _per_param(np.bitwise_and(x, both, out=sb if plan["same_layout"] else None),
                   differ_sig, plan)
    _per_param(x, differ, plan)
    if count_sig is not None:  # padding bits are ones in both runs: not elements
        count_sig -= plan["nwords"] * 64 - plan["nbits"]
    return differ, differ_sig, count_sig


def _per_param(words, target, plan) -> None:
    bits = _bitwise_count(words)
    small, nwords, word0 = plan["small"], plan["nwords"], plan["word0"]
    if small.size:
        target[:, small] = np.add.reduceat(bits[:, plan["small_cols"]], plan["small_starts"],
                                           axis=1, dtype=np.int64)
    for j in plan["big"]:  # uint32 cannot overflow below 2**26 words (2**32 bits)
        acc = np.uint32 if nwords[j] < 1 << 26 else np.int64
        target[:, j] = bits[:, word0[j]:word0[j] + nwords[j]].sum(axis=1, dtype=acc)


def finish_pair(plan, parts, step0_threshold: float = STEP0_THRESHOLD,
                drop_threshold: float = DROP_THRESHOLD, noise_aware: bool = True):
    """The comparison Dataset of one pair from its blocks' counts (exact element counts:
    differ, differ and significant in both, significant in both)."""
    import xarray as xr

    data, coords, attrs = finish_arrays(plan, parts, step0_threshold, drop_threshold,
                                        noise_aware)
    out = xr.Dataset(data, coords=coords)
    out.attrs.update(attrs)
    return out


def finish_arrays(plan, parts, step0_threshold: float = STEP0_THRESHOLD,
                  drop_threshold: float = DROP_THRESHOLD, noise_aware: bool = True) -> tuple:
    """``finish_pair``'s variables, coordinates and attributes as numpy arrays (many pairs are
    stacked into one Dataset without building one each)."""
    differ = np.concatenate([p[0] for p in parts])
    present, numel_a = plan["present"], plan["numel"]
    use_sig = plan["use_sig"]
    numel = numel_a.astype(np.float64)
    bits = np.asarray(plan.get("nbits", numel_a), np.int64)
    sampled = bool(np.any(bits != numel_a))
    n = bits.astype(np.float64)  # elements compared per parameter (all, or the sample)
    with np.errstate(invalid="ignore", divide="ignore"):
        similarity = np.where(present & (numel > 0), 1.0 - differ / n, np.nan)
        weight = np.where(present, numel, 0.0)
        if sampled:  # each parameter's share estimated from its sample, weighted by its size
            total = 1.0 - ((np.where(present, differ, 0) * (numel / n)).sum(1)
                           / weight.sum(1))
        else:
            total = 1.0 - (np.where(present, differ, 0).sum(1) / weight.sum(1))
    data = {"similarity": (("step", "param"), similarity),
            "differ": (("step", "param"), np.where(present, differ, -1)),
            "total": (("step",), total)}
    if sampled:  # the population's share within its confidence interval (sampling.py)
        low, high = wilson(n - differ, n, numel)
        data["similarity_low"] = (("step", "param"), np.where(present, low, np.nan))
        data["similarity_high"] = (("step", "param"), np.where(present, high, np.nan))
        low, high = stratified_interval(similarity, weight, n, numel)
        data["total_low"], data["total_high"] = (("step",), low), (("step",), high)
    judged, judged_total = similarity, total
    if use_sig:
        differ_sig = np.concatenate([p[1] for p in parts])
        count_sig = np.concatenate([p[2] for p in parts])
        with np.errstate(invalid="ignore", divide="ignore"):
            sim_sig = np.where(present & (count_sig > 0), 1.0 - differ_sig / count_sig, np.nan)
            scale = numel / n if sampled else 1.0  # significant elements of the population
            total_sig = 1.0 - ((np.where(present, differ_sig, 0) * scale).sum(1)
                               / (np.where(present, count_sig, 0) * scale).sum(1))
        data["similarity_significant"] = (("step", "param"), sim_sig)
        data["significant"] = (("step", "param"), np.where(present, count_sig, -1))
        data["total_significant"] = (("step",), total_sig)
        if sampled:
            with np.errstate(invalid="ignore", divide="ignore"):
                both = count_sig * (numel / n)  # significant in both, over all elements
            low, high = wilson(count_sig - differ_sig, count_sig, np.maximum(both, count_sig))
            data["similarity_significant_low"] = (("step", "param"),
                                                  np.where(present, low, np.nan))
            data["similarity_significant_high"] = (("step", "param"),
                                                   np.where(present, high, np.nan))
            low, high = stratified_interval(sim_sig, np.where(present, both, 0.0), count_sig,
                                            np.maximum(both, count_sig))
            data["total_significant_low"] = (("step",), low)
            data["total_significant_high"] = (("step",), high)
        if noise_aware:
            judged, judged_total = sim_sig, total_sig
    data["flag"] = (("step", "param"), flags(judged, step0_threshold, drop_threshold))
    data["flag_total"] = (("step",), flags(judged_total[:, None], step0_threshold,
                                           drop_threshold)[:, 0])
    data.update(unmatched_vars(plan["only_a"], plan["only_b"], plan["n_a"], plan["n_b"]))
    coords = {"step": plan["steps"], "param": np.array(plan["common"], dtype=str),
              "numel": ("param", numel_a)}
    attrs = {"noise_aware": int(bool(use_sig and noise_aware))}
    if sampled:
        coords["sampled"] = ("param", bits)
        attrs.update(sample=int(plan.get("sample", 0)), confidence=CONFIDENCE)
    return data, coords, attrs


def _first_divergence_arrays(data, coords, attrs) -> tuple[int, str]:
    """``first_divergence`` on ``finish_arrays``' output."""
    flag, flag_total = data["flag"][1], data["flag_total"][1]
    hits = np.flatnonzero(flag.any(axis=1) | flag_total)
    if hits.size == 0:
        return -1, ""
    i = int(hits[0])
    steps = np.asarray(coords["step"])
    if not flag[i].any():
        return int(steps[i]), ""
    name = ("similarity_significant" if attrs.get("noise_aware")
            and "similarity_significant" in data else "similarity")
    sims = np.where(flag[i], np.nan_to_num(data[name][1][i], nan=np.inf), np.inf)
    return int(steps[i]), str(coords["param"][int(np.argmin(sims))])


def _left_out(ds) -> list:
    return [str(n) for n in ds.attrs.get("left_out", ())]


def _present(ds, rows, pos) -> np.ndarray:
    if "present" not in ds:
        return np.ones((rows.size, pos.size), bool)
    return np.asarray(ds["present"].isel(step=rows, param=pos).values, bool)


def flags(sim: np.ndarray, step0_threshold: float, drop_threshold: float) -> np.ndarray:
    """The problem rule on a (step, param) array of similarities (NaN never flags)."""
    sim = np.asarray(sim, np.float64)
    out = np.zeros(sim.shape, bool)
    if sim.shape[0]:
        out[0] = sim[0] < step0_threshold
        out[1:] = (sim[:-1] - sim[1:]) > drop_threshold
    return out


def first_divergence(result) -> tuple[int, str]:
    """(step, param) of the first flag in a one-rank comparison; (-1, "") if none.

    The param is the flagged one with the lowest similarity at that step ("" when only the
    total was flagged).
    """
    any_flag = result["flag"].values.any(axis=1) | result["flag_total"].values
    hits = np.flatnonzero(any_flag)
    if hits.size == 0:
        return -1, ""
    i = int(hits[0])
    row_flags = result["flag"].values[i]
    if not row_flags.any():
        return int(result["step"].values[i]), ""
    name = ("similarity_significant" if result.attrs.get("noise_aware")
            and "similarity_significant" in result else "similarity")
    sims = np.where(row_flags, np.nan_to_num(result[name].values[i], nan=np.inf), np.inf)
    return int(result["step"].values[i]), str(result["param"].values[int(np.argmin(sims))])


def pair_runs(runs_a: dict, runs_b: dict, ranks=None, rename=None) -> list:
    """[(rank, Dataset a, Dataset b)] to compare (``planner.pair_labels``' rule). Two runs of
    one Dataset each (a single process, a DDP run written by one rank, a sharded run assembled)
    pair whatever rank recorded them: FSDP2 at 2 or 4 ranks, DDP and a single process line up
    parameter by parameter. One run against several: pipeline stages (disjoint parameters)
    as one Dataset (``union_datasets``), copies (every rank the whole model) each against the
    one. Several against several: rank r with rank r."""
    return _pairs(runs_a, runs_b, ranks, rename)[0]


def _pairs(runs_a: dict, runs_b: dict, ranks=None, rename=None) -> tuple:
    """(``pair_runs``' pairs, the labels compared with nothing: {"first", "second"})."""
    from ..store.names import canonical_names, renamed

    def names(runs):
        return {r: list(renamed(canonical_names(str(p) for p in ds["param"].values), rename,
                                "compare_grads(rename=)")) for r, ds in runs.items()}

    pairs, unpaired = pair_labels(runs_a, runs_b, ranks, names(runs_a), names(runs_b))

    from ..store.assemble import union_datasets

    def one(runs, label):
        if isinstance(label, tuple):
            return min(label), union_datasets([runs[x] for x in label])
        return label, runs[label]

    out = []
    for la, lb in pairs:
        _, ds_a = one(runs_a, la)
        _, ds_b = one(runs_b, lb)
        out.append((pair_label(la, lb, len(runs_a), len(runs_b)), ds_a, ds_b))
    return out, unpaired


def compare_grads(a, b, *, control=None, step0_threshold: float = STEP0_THRESHOLD,
                  drop_threshold: float = DROP_THRESHOLD, ranks=None, noise_aware: bool = True,
                  client=None, scheduler=None, progress=None, storage_options=None,
                  block_bytes: int = _BLOCK_BYTES, task_bytes: int = _TASK_BYTES,
                  rename=None):
    """Compare two runs (paths or fsspec URLs of probekit or msprobe dumps, or Datasets) ->
    xarray Dataset.

    Result: ``similarity(rank, step, param)``, ``total(rank, step)``, ``flag(rank, step, param)``,
    ``flag_total(rank, step)``, ``differ(rank, step, param)`` (elements whose sign differs,
    -1 where a run had no gradient), ``first_step(rank)`` (-1 if nothing was flagged) and
    ``first_param(rank)``, over the steps and parameters present in both runs. The parameters
    of one run only are named, never dropped silently (``unmatched.py``): ``only_in_first(rank,
    first_only)`` and ``only_in_second(rank, second_only)`` (names; "" pads a rank with fewer),
    ``n_only_in_first(rank)``, ``n_only_in_second(rank)``, and each run's parameter count
    ``n_params_first(rank)``, ``n_params_second(rank)``; a warning is logged. With significance
    bits in both runs also ``similarity_significant``, ``significant`` (elements significant in
    both) and ``total_significant``; ``noise_aware`` (default) judges flags and the first
    divergence on them, ``noise_aware=False`` on msprobe's plain ``similarity``.

    ``control``: a control run of ``a`` (``GradProbe(..., control="bf16")``: the reference's
    code trained again with its rounding drawn at random at the precision under test), or a
    list of them. Then a (step, param) is flagged only where ``b`` departs from ``a`` further
    than the control does (``verdict.py``: a count test on the judged similarity's sign flips
    against the control's share, and a test of the norms and max - min ranges, with margins
    that hold the chance of a false alarm anywhere in the comparison to 1 %), and the result
    holds ``flag_kind`` (0 none, 1 signs, 2 scale, 3 NaN/Inf),
    ``excess`` (how many times what the control allows), ``similarity_control`` and
    ``similarity_band`` (the lowest similarity the control allows), ``total_control``,
    ``total_band``, ``norm_ratio`` and ``norm_ratio_control`` (each run's norm over the
    reference's), ``range_ratio``, ``norm_dev``/``range_dev`` (``|ln|`` of those ratios) and
    ``norm_allowed``/``range_allowed``; the fixed-threshold flags stay as
    ``flag_threshold`` and ``flag_total_threshold``; ``first_param`` is the flagged parameter
    departing most at the first flagged step. Without it the flags are the fixed thresholds
    (uncalibrated). Either way the result's ``str`` and HTML begin with the verdict in words.

    Runs of one Dataset each (single process, DDP, a sharded run assembled) pair parameter by
    parameter whatever rank recorded them. A run recorded as several (pipeline stages, ranks
    recording their own copy) against one: stages whose parameters are disjoint are compared
    as one run (their union; record each stage under the model's names:
    ``GradProbe(..., rename=layer_offset(first_layer))``), copies each against the one, so
    every rank that recorded is compared; several against several pair rank r with rank r,
    and a rank with no counterpart is named (the attributes ``unpaired_first`` and
    ``unpaired_second``, and a warning), never dropped silently. ``rename``: a dict of names
    to names, or a function of a name (applied to both runs' names, after the wrapper
    prefixes are removed), for runs that name the same parameters differently (Megatron's
    names against a Hugging Face reference); a parameter paired by name whose shape differs
    between the runs is an error naming both sides.

    Two probekit stores (paths or URLs) are compared shard by shard: the counts are taken
    over the element ranges the two runs' rank groups share (``planner.py``), segment by
    segment of a restarted store (``restarts.segments``: 4 ranks for some steps, 2 for the
    next), so a sharded run is never assembled, and listing the segments, opening the rank
    groups and planning are tasks of the graph too. Datasets, msprobe dumps and layouts the
    planner does not handle are compared as Datasets (a sharded store assembled by
    ``open_grads``). Both give the same result. With ``control``, the comparisons of ``a``
    with ``b`` and with each control are one graph, and where those runs are stores laid out
    alike, ``a``'s bits are read once for all of them (``count_stages``): the same result as
    each comparison alone.

    Where it runs: a dask graph (each store's segments, their rank groups opened in batches,
    the plan, then one
    task per slab set and chunk of steps, summed per chunk; for Datasets one task per block of
    steps of each rank pair), on the local cores (dask's threads) by default, or on a
    ``dask.distributed`` cluster: ``client=`` (a ``distributed.Client``) or ``scheduler=`` (its
    address, ``"tcp://host:8786"``); the workers read the stores themselves (the same paths or
    URLs must reach them). ``progress``: None shows progress (finished tasks / all, the total
    growing as the stages are planned) on stderr once a comparison runs for 2 s, True at once,
    False never. ``storage_options``: for URLs (credentials, endpoint). ``block_bytes`` (8 MiB)
    and ``task_bytes`` (64 MiB): sign bytes of one run read at once, and per task.
    """
    from ..store.names import check_rename

    result = _compare_grads(a, b, control=control, step0_threshold=step0_threshold,
                            drop_threshold=drop_threshold, ranks=ranks,
                            noise_aware=noise_aware, client=client, scheduler=scheduler,
                            progress=progress, storage_options=storage_options,
                            block_bytes=block_bytes, task_bytes=task_bytes,
                            rename=check_rename(rename, "compare_grads(rename=)"))
    _check_rename_used(rename, result)
    return replica_attrs(result, a, b, storage_options)


def _check_rename_used(rename, result) -> None:
    """A dict ``rename`` whose keys name no parameter of either run is a mistake (a misspelt
    name leaves its parameter unpaired): an error naming them. A key was used when its new name
    was compared, or when the name itself is among the parameters of one run only."""
    from collections.abc import Mapping

    from ..store.names import canonical_name

    if not isinstance(rename, Mapping):
        return
    compared = {str(p) for p in result["param"].values}
    alone = set()
    for var in ("only_in_first", "only_in_second"):
        if var in result:
            alone |= {canonical_name(str(x)) for x in np.asarray(result[var].values).ravel()
                      if str(x)}
    unused = sorted(k for k, v in rename.items()
                    if v not in compared and canonical_name(k) not in alone)
    if unused:
        raise GradCompareError(f"compare_grads(rename=): {unused[:5]!r} name no parameter of "
                               "either run; accepted: names the runs record (open_grads(run)"
                               "['param'])")


def replica_attrs(result, a, b, storage_options=None):
    """``result`` with what each run's replica check says (``store/replicas.py``): the
    attributes ``replicas_first`` and ``replicas_second``, lines such as "replicas of `p`
    disagree from step 0 (tp ranks 0/1: gradients)" (absent when the run's replicas always
    agreed or were not checked); the verdict in words begins with them."""
    from ..store.replicas import replica_disagreements, replica_lines

    for key, run in (("replicas_first", a), ("replicas_second", b)):
        table = replica_disagreements(run, storage_options=storage_options)
        if len(table):
            result.attrs[key] = replica_lines(table, limit=5)
    return result


def _compare_grads(a, b, *, control=None, step0_threshold: float = STEP0_THRESHOLD,
                   drop_threshold: float = DROP_THRESHOLD, ranks=None,
                   noise_aware: bool = True, client=None, scheduler=None, progress=None,
                   storage_options=None, block_bytes: int = _BLOCK_BYTES,
                   task_bytes: int = _TASK_BYTES, rename=None, nonfinite: bool = True):
    """``compare_grads`` without the replica check's attributes (``rename``: checked).
    ``nonfinite``: NaN/Inf gradients of the second run flagged (``_flag_nonfinite``; off for a
    comparison a control's verdict judges, which judges them itself)."""
    from .engine import Session

    if control is not None:   # the comparisons with the test and each control, then judged
        from .opening import store_of
        from ..store.sources import load_runs, load_stats
        from .verdict import calibrate

        controls = list(control) if isinstance(control, (list, tuple)) else [control]
        given = [a, b, *controls]
        # the comparisons take the stores themselves where they are stores (shard by shard: no
        # bit assembled), in one graph that reads the reference's bits once for the test and
        # the controls laid out alike (_compare_joint), the Datasets otherwise; each run's
        # statistics read once for the judgement (load_stats: only what the verdict reads,
        # from the groups the comparison opened, else read straight or taken from Datasets)
        stores = [store_of(x, storage_options) is not None for x in given]
        sources = [x if st else load_runs(x, storage_options=storage_options)
                   for x, st in zip(given, stores)]
        options = dict(step0_threshold=step0_threshold, drop_threshold=drop_threshold,
                       ranks=ranks, noise_aware=noise_aware, client=client,
                       scheduler=scheduler, progress=progress,
                       storage_options=storage_options, block_bytes=block_bytes,
                       task_bytes=task_bytes, rename=rename)
        results, tables = _compare_joint(sources, options)
        runs = [t if t is not None else load_stats(x, storage_options=storage_options)
                for x, t in zip(sources, tables)]
        return calibrate(results[0], results[1:], runs[0], runs[1], runs[2:],
                         storage_options=storage_options)
    with Session(client=client, scheduler=scheduler, progress=progress,
                 label="compare") as session:
        results = None
        stores = _stores(a, b, storage_options)
        if stores is not None:
            results = _compare_stores(*stores, session=session, ranks=ranks,
                                      block_bytes=block_bytes, task_bytes=task_bytes,
                                      thresholds=(step0_threshold, drop_threshold),
                                      noise_aware=noise_aware, rename=rename)
        if results is None:
            results = _compare_datasets(a, b, session=session, ranks=ranks,
                                        block_bytes=block_bytes, task_bytes=task_bytes,
                                        thresholds=(step0_threshold, drop_threshold),
                                        noise_aware=noise_aware,
                                        storage_options=storage_options, rename=rename)
    results, unpaired, tables = (*results, None)[:3]
    out = _combine(results, step0_threshold, drop_threshold)
    if nonfinite:
        out = _flag_nonfinite(out, a, b, storage_options, rename, tables)
    return _unpaired(out, unpaired)


def _flag_nonfinite(result, a, b, storage_options, rename, tables=None):
    """An uncalibrated comparison's flags, plus every (step, parameter) whose gradient is NaN or
    Inf in the second run where the first run's is finite (``nonfinite``, also a variable of
    the result): the bits cannot show it (a NaN element is neither positive nor above the
    rounding level, so it drops out of the significant-sign similarity, which then reads 1 or
    nothing), the recorded norm does. A comparison with a control judges this in ``calibrate``
    (its "nonfinite" kind, where the control's norm is finite too). ``first_step`` and
    ``first_param`` follow the new flags. ``tables``: the runs' statistics tables where the
    comparison read them with the groups it opened (``plan_stages``), else read here."""
    from ..store.names import canonical_names, renamed
    from ..store.sources import load_stats

    tables = list(tables or [None, None])
    try:
        sa, sb = (t if t is not None else load_stats(x, storage_options=storage_options)
                  for x, t in zip((a, b), tables))
    except Exception as exc:   # the statistics of a run the comparison itself could read
        log.warning("compare: the runs' gradient norms could not be read (%s: %s); NaN/Inf "
                    "gradients are not checked", type(exc).__name__, exc)
        return result
    dims = ("rank", "step", "param")
    names = [str(p) for p in result["param"].values]
    steps = np.asarray(result["step"].values)
    bad = np.zeros([result.sizes[d] for d in dims], bool)
    for i, rank in enumerate(np.asarray(result["rank"].values)):
        ta, tb = sa.get(int(rank)), sb.get(int(rank))
        if ta is None or tb is None:
            continue
        got = []
        for t in (ta, tb):
            col = {n: k for k, n in enumerate(renamed(canonical_names(
                str(x) for x in t["param"]), rename, "compare_grads(rename=)"))}
            row = {int(x): k for k, x in enumerate(np.asarray(t["step"]))}
            ci = np.array([col.get(n, -1) for n in names], np.int64)
            ri = np.array([row.get(int(x), -1) for x in steps], np.int64)
            norm = np.asarray(t["norm"], np.float64)[np.ix_(np.maximum(ri, 0),
                                                            np.maximum(ci, 0))]
            pres = (np.ones(norm.shape, bool) if t.get("present") is None else
                    np.asarray(t["present"], bool)[np.ix_(np.maximum(ri, 0),
                                                          np.maximum(ci, 0))])
            known = (ri >= 0)[:, None] & (ci >= 0)[None, :]
            got.append((norm, pres & known))
        (na, pa), (nb, pb) = got
        bad[i] = pa & pb & np.isfinite(na) & ~np.isfinite(nb)
    result["nonfinite"] = (dims, bad)
    if not bad.any():
        return result
    flag = np.asarray(result["flag"].transpose(*dims).values) | bad
    result["flag"] = (dims, flag)
    # each rank's first flag now comes at or before its earlier one; where it is a NaN/Inf,
    # that parameter is the one named
    total = np.asarray(result["flag_total"].transpose("rank", "step").values)
    first = np.asarray(result["first_step"].values).copy()
    param = np.asarray(result["first_param"].values).astype(object)
    for i in range(bad.shape[0]):
        hits = np.flatnonzero(flag[i].any(axis=1) | total[i])
        if hits.size and bad[i, hits[0]].any():
            first[i] = int(steps[hits[0]])
            param[i] = names[int(np.flatnonzero(bad[i, hits[0]])[0])]
    result["first_step"] = (result["first_step"].dims, first)
    result["first_param"] = (result["first_param"].dims, param.astype(str))
    return result


def _compare_joint(sources: list, options: dict) -> tuple:
    """(``_compare_grads(sources[0], x)`` for every other source (a reference against its test
    and its controls), the results in order; the statistics the verdict reads of each source,
    ``sources.load_stats``' tables, None where not read here). Where the reference and others
    are stores, in one graph: the reference's segments listed and rank groups opened once
    (their statistics with them), every plan made in one stage and counted in one
    (``count_stages``: the reference's bits read once for the runs laid out alike). The rest
    (Datasets, what the planner declines) one comparison each."""
    from .engine import Session

    store = options["storage_options"]
    stores = [_stores(sources[0], x, store) for x in sources[1:]]
    joint = [k for k, st in enumerate(stores) if st is not None]
    out: list = [None] * len(stores)
    stats: list = [None] * len(sources)
    if len(joint) > 1:
        thresholds = (options["step0_threshold"], options["drop_threshold"])
        with Session(client=options["client"], scheduler=options["scheduler"],
                     progress=options["progress"], label="compare") as session:
            handles, tables = plan_stages(
                [stores[joint[0]][0]] + [stores[k][1] for k in joint], session=session,
                ranks=options["ranks"], block_bytes=options["block_bytes"],
                task_bytes=options["task_bytes"], rename=options["rename"], stats=True)
            for i, t in zip([0] + [k + 1 for k in joint], tables):
                stats[i] = t
            counted = count_stages(handles, session=session, thresholds=thresholds,
                                   noise_aware=options["noise_aware"])
            for k, handle, results in zip(joint, handles, counted):
                if results is not None:
                    unpaired = session.value(_plan_unpaired, handle)
                    # a control's comparison: only what the verdict reads of it
                    out[k] = _unpaired(_combine(results, *thresholds,
                                                keep=_JUDGED if k else None), unpaired)
    return [r if r is not None else _compare_grads(sources[0], x, **options, nonfinite=False)
            for r, x in zip(out, sources[1:])], stats


def _unpaired(result, unpaired: dict):
    """The ranks of each run compared with nothing, named in the result (``unpaired_first``,
    ``unpaired_second``) and in a warning."""
    for key, who in (("first", "first"), ("second", "second")):
        ranks = [int(r) for r in unpaired.get(key, [])]
        if ranks:
            result.attrs[f"unpaired_{key}"] = ranks
            log.warning("compare: rank%s %s of the %s run ha%s no counterpart in the other "
                        "run and %s not compared (the ranks compared: %s); ranks=[...] picks "
                        "ranks to compare", "s" if len(ranks) > 1 else "",
                        ", ".join(map(str, ranks)), who, "ve" if len(ranks) > 1 else "s",
                        "are" if len(ranks) > 1 else "is",
                        ", ".join(str(int(r)) for r in result["rank"].values))
    return result


def _stores(a, b, storage_options):
    from .opening import store_of

    sa = store_of(a, storage_options)
    if sa is None:
        return None
    sb = store_of(b, storage_options)
    return None if sb is None else (sa, sb)


def _plan_task(segs_a, segs_b, n_a: int, ranks, block_bytes, task_bytes, rename,
               *batches, like=None, share: bool = False) -> dict:
    """The comparison's plan from both runs' segments (``restarts.Segment``) and their opened
    rank groups (``opening.open_batch`` of each segment's ranks in order; a task of the
    graph). ``share``: the plan keeps its slab sets (``"memo"``) for the plans of the same
    reference after it; ``like``: such a plan, whose slab sets this one reuses where its pairs
    are laid out alike (``planner.plan_pair``'s ``memo``)."""
    from .opening import gc_held
    from .planner import plan

    def runs(segs, opened):
        groups = iter(g for batch in opened for g in batch)
        return [(seg, [next(groups) for _ in seg.ranks]) for seg in segs]

    memo = like.get("memo") if like is not None else ({} if share else None)
    with gc_held():  # many small containers: no collection of everything alive meanwhile
        out = plan(runs(segs_a, batches[:n_a]), runs(segs_b, batches[n_a:]), ranks=ranks,
                   block_bytes=block_bytes, task_bytes=task_bytes, rename=rename, memo=memo)
    if share:
        out["memo"] = memo
    return out


def _plan_shape(plan: dict):
    """What the caller needs to build the counting stage: per pair (slab sets, step chunks);
    or the reason the planner declined."""
    if "unsupported" in plan:
        return plan["unsupported"]
    return [(len(p["sets"]), p["chunks"]) for p in plan["pairs"]]


def _plan_finish(plan: dict) -> list:
    """The small part of each pair's plan that ``finish_pair`` needs."""
    keep = ("label", "common", "only_a", "only_b", "n_a", "n_b", "steps", "numel", "nbits",
            "sample", "present", "use_sig")
    return [{k: p[k] for k in keep} for p in plan["pairs"]]


def _tree_add(parts: list, fan: int = 32):
    """(a task summing ``parts``, the summing tasks below it): a tree of fan-in ``fan``; one
    part is its own sum."""
    import dask

    from .counting import add

    below, level = [], list(parts)
    while len(level) > fan:
        level = [dask.delayed(add, pure=False)(*level[i:i + fan])
                 for i in range(0, len(level), fan)]
        below += level
    if len(level) == 1:
        top = level[0]
        return top, [t for t in below if t is not top]
    return dask.delayed(add, pure=False)(*level), below


def plan_stage(sa, sb, *, session, ranks=None, block_bytes: int = _BLOCK_BYTES,
               task_bytes: int = _TASK_BYTES, rename=None):
    """The first stages of a comparison of two stores (``opening.store_of``), as tasks of
    ``session``'s graph: each store's layout segments (``restarts.segments``), then their rank
    groups opened in batches, then the plan; the plan (on a cluster: its future)."""
    return plan_stages([sa, sb], session=session, ranks=ranks, block_bytes=block_bytes,
                       task_bytes=task_bytes, rename=rename)[0]


def plan_stages(stores: list, *, session, ranks=None, block_bytes: int = _BLOCK_BYTES,
                task_bytes: int = _TASK_BYTES, rename=None, stats: bool = False):
    """``plan_stage`` of the first store against each of the others (a reference against its
    test and its controls) in one graph: every store's segments listed and rank groups opened
    once (the first store's shared by all its plans); the plans' handles, in order. ``stats``:
    (those handles, each store's ``sources.load_stats`` tables from the same opened groups,
    ``opening.stat_tables``: None where it does not read them straight)."""
    import dask

    from .opening import batches, open_batch, shape, stat_tables, store_segments

    # local stores are listed in this thread; opened and planned in it too while each is a
    # batch of rank groups (metadata parsed and plans made hold the GIL: two threads would
    # only take turns, and a graph of a few such tasks costs more than they do); as a graph
    # where a store has more ranks, for object stores (their round trips wait) and on a cluster
    local = not session.on_cluster and not any(fs.remote for fs, _ in stores)
    if local:
        listed = [store_segments(fs, store) for fs, store in stores]
    else:
        listed = session.run([dask.delayed(store_segments, pure=False)(fs, store)
                              for fs, store in stores], keep=True)
    shapes = [session.value(shape, h) for h in listed]
    eager = local and all(sum(len(batches(rks)) for _, _, rks in sh) <= 1 for sh in shapes)

    def call(fn, *args, **kwargs):
        return fn(*args, **kwargs) if eager else dask.delayed(fn, pure=False)(*args, **kwargs)

    segs = listed if eager or session.on_cluster else [
        dask.delayed(h, pure=False, traverse=False) for h in listed]
    opened = [[call(open_batch, fs, lazy, i, batch, stats)
               for i, (_, _, rks) in enumerate(sh) for batch in batches(rks)]
              for (fs, _), lazy, sh in zip(stores, segs, shapes)]
    # the first plan keeps its slab sets and each later plan starts from them: a test and its
    # controls recorded in one layout share the reference's geometry and their own (the
    # planning, most of this stage's time on a small model, once)
    planned = []
    for k in range(1, len(stores)):
        more = {"share": True} if len(stores) > 2 and k == 1 else (
            {"like": planned[0]} if k > 1 else {})
        planned.append(call(_plan_task, segs[0], segs[k], len(opened[0]), ranks, block_bytes,
                            task_bytes, rename, *opened[0], *opened[k], **more))
    tables = [call(stat_tables, lazy, *o) for lazy, o in zip(segs, opened)] if stats else []
    got = planned + tables if eager else session.run(
        planned + tables, keep=True, inner=[t for o in opened for t in o])
    if not stats:
        return got
    return got[:len(planned)], [session.value(_same, h) for h in got[len(planned):]]


def _same(x):
    return x


def _compare_stores(sa, sb, *, session, ranks, block_bytes, task_bytes, thresholds,
                    noise_aware, rename=None):
    """The range comparison of two stores (``planner.py``, ``counting.py``): ([(rank,
    result)], the ranks compared with nothing, both stores' statistics tables from the groups
    it opened: ``plan_stages``) or None when the planner declines (the Dataset path then)."""
    handles, tables = plan_stages([sa, sb], session=session, ranks=ranks,
                                  block_bytes=block_bytes, task_bytes=task_bytes,
                                  rename=rename, stats=True)
    handle = handles[0]
    results = count_stage(handle, session=session, thresholds=thresholds,
                          noise_aware=noise_aware)
    if results is None:
        return None
    return results, session.value(_plan_unpaired, handle), tables


def _plan_unpaired(plan: dict) -> dict:
    return plan.get("unpaired") or {"first": [], "second": []}


def count_stage(handle, *, session, thresholds=(STEP0_THRESHOLD, DROP_THRESHOLD),
                noise_aware: bool = True):
    """The comparison's counting from its plan (``plan_stage``'s, or ``planner.plan``'s for
    runs given as layout segments): one task per slab set and chunk of steps, summed per chunk;
    [(rank, (variables, coordinates, attributes))] for ``_combine``, or None when the planner
    declined."""
    return count_stages([handle], session=session, thresholds=thresholds,
                        noise_aware=noise_aware)[0]


def count_stages(handles: list, *, session, thresholds=(STEP0_THRESHOLD, DROP_THRESHOLD),
                 noise_aware: bool = True) -> list:
    """``count_stage`` of several plans of one reference (``plan_stages``: the reference
    against its test and its controls) in one graph: where a plan's pair has the first plan's
    reference side, slab sets and steps (``counting.twins``: a test and a control recorded in
    the same layout), one task reads the reference's bits once and counts them against every
    such plan's other run (``counting.count_many``); the rest as ``count_stage``. Per plan the
    same counts, hence the same result, as ``count_stage`` of it alone."""
    import dask

    from .counting import count_many, count_task, twins

    shapes = [session.value(_plan_shape, h) for h in handles]
    finish, lazy = {}, {}
    for k, (h, shape) in enumerate(zip(handles, shapes)):
        if isinstance(shape, str):
            log.info("compare: %s; the runs are compared as Datasets", shape)
            continue
        finish[k] = session.value(_plan_finish, h)
        lazy[k] = h if session.on_cluster else dask.delayed(h, pure=False, traverse=False)
    # per pair of the first plan, the other plans counted with it (their pair of that index)
    joined = {k: session.value(twins, handles[0], handles[k]) if 0 in finish else []
              for k in finish if k > 0}
    outputs, inner, where = [], [], []   # where: [(plan, pair)] of each output's parts
    for k in finish:
        for p, (nsets, chunks) in enumerate(shapes[k]):
            if k > 0 and p < len(joined[k]) and joined[k][p]:
                continue                    # counted with the first plan's pair p
            group = [k] + ([j for j in joined if p < len(joined[j]) and joined[j][p]]
                           if k == 0 else [])
            for s0, s1 in chunks:
                if len(group) == 1:
                    parts = [dask.delayed(count_task, pure=False)(lazy[k], p, s, s0, s1)
                             for s in range(nsets)]
                else:
                    parts = [dask.delayed(count_many, pure=False)(p, s, s0, s1,
                                                                  *(lazy[j] for j in group))
                             for s in range(nsets)]
                if not parts:
                    continue
                top, more = _tree_add(parts)
                outputs.append(top)
                inner += [t for t in parts if t is not top] + more
                where.append([(j, p) for j in group])
    counts = session.run(outputs, inner=inner)
    mine = {}
    for c, places in zip(counts, where):
        for i, place in enumerate(places):
            mine.setdefault(place, []).append(c if len(places) == 1 else c[i])
    out = []
    for k in range(len(handles)):
        if k not in finish:
            out.append(None)
            continue
        per_pair = []
        for p, info in enumerate(finish[k]):
            got = mine.get((k, p))
            if got:
                per_pair.append(np.concatenate(got, axis=1))
            else:  # no parameter with elements in both runs
                per_pair.append(np.zeros((3, info["steps"].size, len(info["common"])),
                                         np.int64))
        results = []
        for info, total in _by_label(finish[k], per_pair):
            parts = [(total[0], total[1] if info["use_sig"] else None,
                      total[2] if info["use_sig"] else None)]
            results.append((info["label"], _finished(info, parts, thresholds, noise_aware)))
        out.append(results)
    return out


def _by_label(finish: list, counts: list) -> list:
    """[(plan, counts)] with the pair plans of one rank label (one per layout segment, in step
    order) joined along the steps."""
    out = []
    for info, total in zip(finish, counts):
        if out and out[-1][0]["label"] == info["label"]:
            prev, ptotal = out[-1]
            if prev["common"] != info["common"] or not np.array_equal(prev["numel"],
                                                                      info["numel"]):
                raise GradCompareError(
                    f"rank {info['label']}: the parameters differ between layout segments of "
                    "the runs; accepted: runs whose layouts change, not their parameters")
            merged = dict(prev, steps=np.concatenate([prev["steps"], info["steps"]]),
                          present=np.concatenate([prev["present"], info["present"]]),
                          use_sig=prev["use_sig"] and info["use_sig"])
            out[-1] = (merged, np.concatenate([ptotal, total], axis=1))
        else:
            out.append((info, total))
    return out


def _finished(plan, parts, thresholds, noise_aware) -> tuple:
    """(variables, coordinates, attributes) of one pair, its first divergence included."""
    data, coords, attrs = finish_arrays(plan, parts, thresholds[0], thresholds[1], noise_aware)
    step, param = _first_divergence_arrays(data, coords, attrs)
    data["first_step"] = ((), step)
    data["first_param"] = ((), param)
    return data, coords, attrs


def _compare_datasets(a, b, *, session, ranks, block_bytes, task_bytes, thresholds,
                      noise_aware, storage_options, rename=None):
    """Datasets (or stores read as Datasets: ``load_runs``): per rank pair ``plan_pair`` here,
    then one task per block of steps."""
    import dask

    from ..store.sources import load_runs

    runs_a = load_runs(a, storage_options=storage_options)
    runs_b = load_runs(b, storage_options=storage_options)
    pairs, unpaired = _pairs(runs_a, runs_b, ranks, rename)
    plans, tasks = [], []
    for r, ds_a, ds_b in pairs:
        ds_a, ds_b = match_samples(ds_a, ds_b)
        plan = plan_pair(ds_a, ds_b, block_bytes, task_bytes, label=f"rank {r}: ",
                         rename=rename)
        src = dask.delayed(bit_sources(ds_a, ds_b, plan), pure=False, traverse=False)
        lazy_plan = dask.delayed(plan, pure=False, traverse=False)
        plans.append(plan)
        tasks += [dask.delayed(count_block, pure=True)(src, lazy_plan, s0, s1)
                  for s0, s1 in plan["blocks"]]
    counts = iter(session.run(tasks))
    return [(r, _finished(plan, [next(counts) for _ in plan["blocks"]], thresholds,
                          noise_aware)) for (r, _, _), plan in zip(pairs, plans)], unpaired


#: the variables of a control's comparison that the verdict reads (``verdict.counts``)
_JUDGED = ("similarity", "differ", "similarity_significant", "significant", "only_in_first",
           "only_in_second", "first_only", "second_only")


def _combine(results: list, step0_threshold: float, drop_threshold: float, keep=None):
    """One Dataset with a ``rank`` dimension from [(rank, (variables, coordinates, attributes))]:
    stacked straight when every pair has the same steps and parameters (a run of many ranks,
    or one rank), else one Dataset each, concatenated with an outer join. ``keep``: only
    these variables (the coordinates all)."""
    import xarray as xr

    from .verdict import GradComparison

    if keep is not None:
        results = [(r, ({k: v for k, v in d.items() if k in keep}, c, a))
                   for r, (d, c, a) in results]
    first = results[0][1]
    def value(c):
        return np.asarray(c[1] if isinstance(c, tuple) else c)

    same = all(
        c.keys() == first[1].keys()
        and all(np.array_equal(value(c[key]), value(first[1][key])) for key in c)
        and d.keys() == first[0].keys() and a == first[2] for _, (d, c, a) in results)
    if same:
        data = {}
        for name, (dims, _) in first[0].items():
            values = [d[name][1] for _, (d, _, _) in results]
            if name in ("only_in_first", "only_in_second"):
                width = max(len(v) for v in values)
                values = [np.concatenate([v, np.full(width - len(v), "", dtype=v.dtype)])
                          for v in values]
            elif name in ("first_only", "second_only"):
                continue
            data[name] = (("rank", *dims), np.stack([np.asarray(v) for v in values]))
        coords = {"rank": [r for r, _ in results]}   # the order one rank's Dataset had
        for dim, var in (("first_only", "only_in_first"), ("second_only", "only_in_second")):
            coords[dim] = (dim, np.arange(data[var][1].shape[1]))
        coords.update(first[1])
        out = GradComparison(data, coords=coords, attrs=dict(first[2]))
    else:
        parts = []
        for r, (data, coords, attrs) in results:
            ds = xr.Dataset(data, coords=coords)
            ds.attrs.update(attrs)
            parts.append(ds.expand_dims(rank=[r]))
        if len(parts) == 1:
            out = parts[0]
        else:
            out = xr.concat(parts, dim="rank", join="outer", fill_value={
                "similarity": np.nan, "total": np.nan, "flag": False, "flag_total": False,
                "differ": -1, "numel": 0, "similarity_significant": np.nan, "significant": -1,
                "total_significant": np.nan, "only_in_first": "", "only_in_second": ""},
                coords="different", compat="equals")
    out.attrs.update(step0_threshold=step0_threshold, drop_threshold=drop_threshold)
    return GradComparison.wrap(out)
