"""Compare the gradient directions of two runs, vectorised over steps and parameters.

similarity(rank, step, param) = share of elements whose sign bit (``grad > 0``) is equal in both
runs; total(rank, step) = the same over all compared elements (the element-weighted mean).
A parameter is flagged at the first compared step if its similarity is below ``step0_threshold``
(0.97), and at a later step if it dropped by more than ``drop_threshold`` (0.03) since the
previous compared step; ``flag_total`` applies the same rule to ``total``.

The sign bits are read in blocks of steps as 64-bit words, XOR-ed, counted with
``np.bitwise_count`` and summed per parameter with ``np.add.reduceat``: no loop over files,
steps or parameters in Python.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import GradCompareError
from ..log import get_logger
from .names import canonical_names
from .chunks import raw_bits

log = get_logger(__name__)

STEP0_THRESHOLD = 0.97
DROP_THRESHOLD = 0.03
_BLOCK_BYTES = 8 << 20  # sign bytes of one run per block (two runs' blocks are in memory)


_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _popcount_table(words: np.ndarray) -> np.ndarray:
    """Bits set per element of a uint64 array, for numpy < 2 (no ``np.bitwise_count``); the
    MindSpore venv needs numpy 1.26 (see docs/mindspore.md)."""
    w = np.ascontiguousarray(words)
    return _POPCOUNT8[w.view(np.uint8)].reshape(*w.shape, 8).sum(axis=-1, dtype=np.uint8)


_bitwise_count = getattr(np, "bitwise_count", _popcount_table)


def _ranges(values) -> str:
    v = np.asarray(values)
    if v.size == 0:
        return "none"
    if v.size <= 6:
        return ", ".join(str(x) for x in v)
    return f"{v[0]}..{v[-1]} ({v.size} values)"


def _word_index(ds, pos: np.ndarray) -> np.ndarray:
    """64-bit word indices (into one step's sign bits) of the parameters at positions ``pos``."""
    offsets = np.asarray(ds["offset"].values, np.int64)[pos] // 8
    words = -(-np.asarray(ds["numel"].values, np.int64)[pos] // 64)
    return np.concatenate([np.arange(o, o + w) for o, w in zip(offsets, words)]) if len(
        pos) else np.zeros(0, np.int64)


def _read_rows(da, rows: np.ndarray) -> np.ndarray:
    """Rows of a (step, byte) DataArray as one contiguous uint8 array (slices when contiguous)."""
    if rows.size and np.all(np.diff(rows) == 1):
        sel = da.isel(step=slice(int(rows[0]), int(rows[-1]) + 1))
    else:
        sel = da.isel(step=rows)
    return np.ascontiguousarray(sel.values, dtype=np.uint8)


def compare_rank(a, b, *, step0_threshold: float = STEP0_THRESHOLD,
                 drop_threshold: float = DROP_THRESHOLD, block_bytes: int = _BLOCK_BYTES,
                 noise_aware: bool = True):
    """Compare two Datasets of one rank (as ``open_grads`` returns) -> Dataset(step, param).

    When both runs hold significance bits (probekit stores), ``similarity_significant`` compares
    the signs of the elements significant in both runs only (elements whose magnitude is below
    the rounding level of their tensor have random signs), and with ``noise_aware`` the flags
    and the first divergence use it; ``similarity`` stays msprobe's plain sign similarity."""
    import xarray as xr

    for name, ds in (("first", a), ("second", b)):
        if "direction" not in ds:
            raise GradCompareError(
                f"the {name} run was recorded at grad_level {ds.attrs.get('level', '?')!r}, "
                "which keeps no direction data; accepted: runs recorded at L1 or L2")
    # names matched without wrapper prefixes (an msprobe dump of a DDP run has "module.*")
    names_a = list(canonical_names(str(x) for x in a["param"].values))
    names_b = list(canonical_names(str(x) for x in b["param"].values))
    index_b = {n: i for i, n in enumerate(names_b)}
    common = [n for n in names_a if n in index_b]
    if not common:
        raise GradCompareError(f"the runs share no parameter (first: {names_a[:3]}..., second: "
                               f"{names_b[:3]}...)")
    index_a = {n: i for i, n in enumerate(names_a)}
    pos_a = np.array([index_a[n] for n in common])
    pos_b = np.array([index_b[n] for n in common])
    numel_a = np.asarray(a["numel"].values, np.int64)[pos_a]
    numel_b = np.asarray(b["numel"].values, np.int64)[pos_b]
    if np.any(numel_a != numel_b):
        bad = [(common[i], int(numel_a[i]), int(numel_b[i])) for i in
               np.flatnonzero(numel_a != numel_b)[:5]]
        raise GradCompareError("parameter sizes differ between the runs (name, first, second): "
                               + "; ".join(f"{n}: {x} vs {y}" for n, x, y in bad))
    steps_a = np.asarray(a["step"].values, np.int64)
    steps_b = np.asarray(b["step"].values, np.int64)
    steps, rows_a, rows_b = np.intersect1d(steps_a, steps_b, assume_unique=True,
                                           return_indices=True)
    if steps.size == 0:
        raise GradCompareError(f"the runs share no step (first: {_ranges(steps_a)}; second: "
                               f"{_ranges(steps_b)})")

    nbytes_a, nbytes_b = a.sizes["byte"], b.sizes["byte"]
    off_a = np.asarray(a["offset"].values, np.int64)
    off_b = np.asarray(b["offset"].values, np.int64)
    # Same layout (the usual case: same model, same config): XOR whole rows, no gather.
    same_layout = (len(common) == len(names_a) == len(names_b) and np.array_equal(pos_b, pos_a)
                   and np.array_equal(off_a, off_b) and nbytes_a == nbytes_b)
    if not same_layout:
        words_a, words_b = _word_index(a, pos_a), _word_index(b, pos_b)
    nwords = -(-numel_a // 64)
    word0 = np.concatenate([[0], np.cumsum(nwords)[:-1]]).astype(np.int64)
    # Per-parameter sums of the per-word bit counts: a large parameter sums its own columns
    # (numpy's reduce is far faster than reduceat over long segments); the small ones are
    # gathered and summed with one reduceat.
    big = np.flatnonzero(nwords >= 1024)
    small = np.flatnonzero((nwords > 0) & (nwords < 1024))
    small_cols = (np.concatenate([np.arange(word0[j], word0[j] + nwords[j]) for j in small])
                  if small.size else np.zeros(0, np.int64))
    small_starts = np.concatenate([[0], np.cumsum(nwords[small])[:-1]]).astype(np.int64)
    differ = np.zeros((steps.size, len(common)), np.int64)
    use_sig = "significant" in a and "significant" in b
    differ_sig = np.zeros_like(differ) if use_sig else None
    count_sig = np.zeros_like(differ) if use_sig else None
    block = max(1, block_bytes // max(1, nbytes_a))

    def sig_rows(ra, rb):
        if not use_sig:
            return None, None
        sa = _read_rows(a["significant"], ra).view(np.uint64)
        sb = _read_rows(b["significant"], rb).view(np.uint64)
        return (sa, sb) if same_layout else (sa[:, words_a], sb[:, words_b])

    def one_block(s0: int) -> None:
        ra, rb = rows_a[s0:s0 + block], rows_b[s0:s0 + block]
        wa = _read_rows(a["direction"], ra).view(np.uint64)
        wb = _read_rows(b["direction"], rb).view(np.uint64)
        if not same_layout:
            wa, wb = wa[:, words_a], wb[:, words_b]
        count_block(s0, wa, wb, *sig_rows(ra, rb))

    def per_param(words, target, rows) -> None:
        bits = _bitwise_count(words)
        if small.size:
            target[rows, small] = np.add.reduceat(bits[:, small_cols], small_starts, axis=1,
                                                  dtype=np.int64)
        for j in big:  # uint32 cannot overflow below 2**26 words (2**32 bits)
            acc = np.uint32 if nwords[j] < 1 << 26 else np.int64
            target[rows, j] = bits[:, word0[j]:word0[j] + nwords[j]].sum(axis=1, dtype=acc)

    def count_block(s0: int, wa, wb, sa=None, sb=None) -> None:
        rows = slice(s0, s0 + wa.shape[0])
        x = np.bitwise_xor(wa, wb, out=wa)
        if sa is not None:
            both = np.bitwise_and(sa, sb, out=sa)
            per_param(both, count_sig, rows)
            per_param(np.bitwise_and(x, both, out=sb), differ_sig, rows)
        per_param(x, differ, rows)

    blocks = range(0, steps.size, block)
    raw_a, raw_b = raw_bits(a), raw_bits(b)
    if raw_a is not None and raw_b is not None and not same_layout:
        raw_a = raw_b = None
    if raw_a is not None and raw_b is not None:
        # straight from the chunk files into two buffers reused for every block
        bufs = [np.empty((block, nbytes_a), np.uint8) for _ in range(2)]

        def read_rows(raw, rows, buf):
            if rows.size and np.all(np.diff(rows) == 1):
                return raw.read(int(rows[0]), int(rows[-1]) + 1, out=buf[:rows.size])
            return raw.read(int(rows.min()), int(rows.max()) + 1)[rows - rows.min()]

        for s0 in blocks:
            ra, rb = rows_a[s0:s0 + block], rows_b[s0:s0 + block]
            wa = read_rows(raw_a, ra, bufs[0]).view(np.uint64)
            wb = read_rows(raw_b, rb, bufs[1]).view(np.uint64)
            count_block(s0, wa, wb, *sig_rows(ra, rb))
        blocks = ()
    workers = min(len(blocks), os.cpu_count() or 1, 4)
    if workers > 1:  # file reads and the numpy loops release the GIL: blocks in parallel
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers, thread_name_prefix="probekit-compare") as pool:
            list(pool.map(one_block, blocks))
    else:
        for s0 in blocks:
            one_block(s0)
    present = _present(a, rows_a, pos_a) & _present(b, rows_b, pos_b)
    numel = numel_a.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        similarity = np.where(present & (numel > 0), 1.0 - differ / numel, np.nan)
        weight = np.where(present, numel, 0.0)
        total = 1.0 - (np.where(present, differ, 0).sum(1) / weight.sum(1))
    data = {"similarity": (("step", "param"), similarity),
            "differ": (("step", "param"), np.where(present, differ, -1)),
            "total": (("step",), total)}
    judged, judged_total = similarity, total
    if use_sig:
        count_sig -= nwords * 64 - numel_a  # padding bits are ones in both runs
        with np.errstate(invalid="ignore", divide="ignore"):
            sim_sig = np.where(present & (count_sig > 0), 1.0 - differ_sig / count_sig, np.nan)
            total_sig = 1.0 - (np.where(present, differ_sig, 0).sum(1)
                               / np.where(present, count_sig, 0).sum(1))
        data["similarity_significant"] = (("step", "param"), sim_sig)
        data["significant"] = (("step", "param"), np.where(present, count_sig, -1))
        data["total_significant"] = (("step",), total_sig)
        if noise_aware:
            judged, judged_total = sim_sig, total_sig
    data["flag"] = (("step", "param"), flags(judged, step0_threshold, drop_threshold))
    data["flag_total"] = (("step",), flags(judged_total[:, None], step0_threshold,
                                           drop_threshold)[:, 0])
    out = xr.Dataset(data, coords={"step": steps, "param": np.array(common, dtype=str),
                                   "numel": ("param", numel_a)})
    out.attrs["noise_aware"] = int(bool(use_sig and noise_aware))
    return out


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


def compare_grads(a, b, *, step0_threshold: float = STEP0_THRESHOLD,
                  drop_threshold: float = DROP_THRESHOLD, ranks=None, noise_aware: bool = True):
    """Compare two runs (paths to probekit or msprobe dumps, or Datasets) -> xarray Dataset.

    Result: ``similarity(rank, step, param)``, ``total(rank, step)``, ``flag(rank, step, param)``,
    ``flag_total(rank, step)``, ``differ(rank, step, param)`` (elements whose sign differs,
    -1 where a run had no gradient), ``first_step(rank)`` (-1 if nothing was flagged) and
    ``first_param(rank)``; only steps and parameters present in both runs. With significance
    bits in both runs also ``similarity_significant``, ``significant`` (elements significant in
    both) and ``total_significant``; ``noise_aware`` (default) judges flags and the first
    divergence on them, ``noise_aware=False`` on msprobe's plain ``similarity``.
    """
    import xarray as xr

    from .sources import load_runs

    runs_a, runs_b = load_runs(a), load_runs(b)
    common = sorted(set(runs_a) & set(runs_b))
    if ranks is not None:
        common = [r for r in common if r in set(ranks)]
    if not common:
        raise GradCompareError(f"the runs share no rank (first: {sorted(runs_a)}, second: "
                               f"{sorted(runs_b)}" + (f", asked: {list(ranks)}" if ranks else "")
                               + ")")
    parts = []
    for r in common:
        res = compare_rank(runs_a[r], runs_b[r], step0_threshold=step0_threshold,
                           drop_threshold=drop_threshold, noise_aware=noise_aware)
        step, param = first_divergence(res)
        res["first_step"] = ((), step)
        res["first_param"] = ((), param)
        parts.append(res.expand_dims(rank=[r]))
    if len(parts) == 1:
        out = parts[0]
    else:
        out = xr.concat(parts, dim="rank", join="outer", fill_value={
            "similarity": np.nan, "total": np.nan, "flag": False, "flag_total": False,
            "differ": -1, "numel": 0, "similarity_significant": np.nan, "significant": -1,
            "total_significant": np.nan}, coords="different", compat="equals")
    out.attrs.update(step0_threshold=step0_threshold, drop_threshold=drop_threshold)
    return out
