"""The fused chunk kernel of the grad probe's CPU path, and its numpy twin.

Functions on a contiguous 1-D float32 or float64 numpy array (a chunk of a gradient):

* ``minmax(a)`` -> (max, min, largest finite |x|, NaN count); max and min skip NaNs;
* ``chunk_stats(a, thr, signs, sig, bounds, want_counts)`` -> (sum of squares, counts): in one
  pass the float64 sum of squares, the sign bits ``a > 0`` into ``signs`` and the significance
  bits ``|a| > thr`` into ``sig`` (uint8 arrays of at least ``ceil(len(a)/8)`` bytes, or None),
  packed as ``numpy.packbits`` packs them, and with ``want_counts`` an int64 array of the counts
  of ``a <= b`` for each bound, then of zeros, then of NaNs (else None);
* ``chunk(...)``: both in one read, the significance bits against a provisional threshold and
  the elements near it listed; ``fix(...)`` sets the listed bits again against the real one;
  ``chunk_many(...)`` and ``fix_many(...)``: the same of many chunks in one call, given by
  address (C only: one call per step instead of one per chunk);
* ``sample_hash(...)``: the replica check's exact hash of a strided sample of many tensors at
  once (C only: the numpy twin is ``record/replicas.SampleHash``'s own path);
* ``count_runs(...)``: the comparison's counts (bits that differ between two runs, and with
  significance bits those differing and significant in both, and those significant in both)
  over run sets of bits at any offsets (``geometry.py``); ``count_runs_many(...)``: the same of
  one run's bits against several runs' laid out alike, each piece of the first read once.

Comparisons are made in the array's own dtype (a float32 array against ``float32(thr)``,
``float32(b)``), as numpy and torch compare an array with a Python float.

The C version (``_kernel.c``, built with the package where a C compiler is found; AVX-512 or
AVX2 on x86-64 CPUs that have them) reads each element once; the numpy twin makes a pass per
statistic. Both give the same bits and counts; sums differ only in the order of float64
additions.
``PROBEKIT_GRADS_KERNEL=numpy`` (or ``c``, ``avx2``, ``avx512``) chooses one; ``set_path`` does
the same in a process.
"""
from __future__ import annotations

import ctypes
import importlib
import os

import numpy as np

from ...log import get_logger

log = get_logger(__name__)

_lib = None
PATHS = ("avx512", "avx2", "c", "numpy")
_LEVELS = {"c": 0, "avx2": 1, "avx512": 2, "auto": 2}
path = "numpy"  # the path in use


def _load():
    global _lib
    try:  # the optional compiled module; its init selects the CPU's path
        _kernel = importlib.import_module(__name__.rpartition(".")[0] + "._kernel")
    except ImportError:
        return None
    lib = ctypes.CDLL(_kernel.__file__)
    dbl_p, u8_p, i64_p = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
    for name in ("pk_minmax_f32", "pk_minmax_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, dbl_p]
        fn.restype = ctypes.c_int64
    for name in ("pk_stats_f32", "pk_stats_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, u8_p, u8_p, dbl_p,
                       ctypes.c_int32, i64_p, ctypes.c_int32]
        fn.restype = ctypes.c_double
    for name in ("pk_chunk_f32", "pk_chunk_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_double,
                       u8_p, u8_p, dbl_p, ctypes.c_int32, i64_p, ctypes.c_int32,
                       ctypes.c_double, ctypes.c_void_p, ctypes.c_int32, dbl_p, i64_p]
        fn.restype = None
    for name in ("pk_fix_f32", "pk_fix_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, u8_p]
        fn.restype = None
    lib.pk_count_runs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                                  ctypes.c_void_p, ctypes.c_int64]
    lib.pk_count_runs.restype = None
    lib.pk_sample_hash.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
    lib.pk_sample_hash.restype = None
    lib.pk_count_runs_many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64]
    lib.pk_count_runs_many.restype = None
    lib.pk_chunk_many.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_double] + [ctypes.c_void_p] * 4
    lib.pk_chunk_many.restype = None
    lib.pk_fix_many.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4
    lib.pk_fix_many.restype = None
    lib.pk_set_path.argtypes = [ctypes.c_int32]
    lib.pk_set_path.restype = ctypes.c_int32
    global _rounding
    try:   # a control run's rounding (record/control.py); absent from an older build
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        lib.pk_round_bf16.argtypes = [ptr, ptr, i64, i32, ctypes.c_uint32, i32, ptr, ptr]
        lib.pk_round_bf16.restype = i64
        lib.pk_fp32_range_f64.argtypes = [ptr, i64]
        lib.pk_fp32_range_f64.restype = i32
        lib.pk_round_f32_bits.argtypes = [ptr, ptr, i64, ctypes.c_uint64, i64, ptr]
        lib.pk_round_f32_bits.restype = None
        lib.pk_round_f32_general.argtypes = [ptr, ptr, i64, ctypes.c_double, ptr]
        lib.pk_round_f32_general.restype = None
        lib.pk_mt_draw.argtypes = [ptr, i64, i32, ptr]
        lib.pk_mt_draw.restype = i32
        _rounding = lib
    except AttributeError:
        _rounding = None
    _lib = lib
    return lib


_rounding = None


def rounding():
    """The compiled functions of a control run's random rounding (``pk_round_bf16``,
    ``pk_fp32_range_f64``, ``pk_round_f32_bits``, ``pk_round_f32_general``, and ``pk_mt_draw``,
    torch's CPU generator's draws from its state: record/control.py
    calls them with tensors' addresses), or None where the extension is not built or the numpy
    path is chosen (``PROBEKIT_GRADS_KERNEL=numpy``, ``set_path``): control.py's torch
    operations then, the same values."""
    return _rounding if path != "numpy" else None


def set_path(name: str) -> str:
    """Use ``name`` ("avx512", "avx2", "c" or "numpy"; "auto": the fastest here); returns the
    path in use (a vector path falls back to the best one the CPU has, "c" to "numpy" without
    the extension)."""
    global path
    if name not in (*PATHS, "auto"):
        raise ValueError(f"grad kernel path: {name!r} is not valid; accepted: auto, "
                         + ", ".join(PATHS))
    lib = _lib if _lib is not None else _load()
    if lib is None or name == "numpy":
        if name != "numpy":
            log.info("grad_probe: the compiled statistics kernel is not built; using numpy "
                     "(slower, same values)")
        path = "numpy"
        return path
    path = ("c", "avx2", "avx512")[lib.pk_set_path(_LEVELS[name])]
    return path


def _ptr(a) -> int | None:
    return None if a is None else a.__array_interface__["data"][0]


def minmax(a: np.ndarray) -> tuple:
    if path != "numpy":
        out = np.empty(3, np.float64)
        fn = _lib.pk_minmax_f32 if a.dtype == np.float32 else _lib.pk_minmax_f64
        nans = fn(_ptr(a), a.size, _ptr(out))
        return float(out[0]), float(out[1]), float(out[2]), int(nans)
    return _minmax_numpy(a)


def chunk_stats(a: np.ndarray, thr: float, signs, sig, bounds: np.ndarray,
                want_counts: bool) -> tuple:
    if path != "numpy":
        counts = np.empty(len(bounds) + 2, np.int64) if want_counts else None
        fn = _lib.pk_stats_f32 if a.dtype == np.float32 else _lib.pk_stats_f64
        total = fn(_ptr(a), a.size, float(thr), _ptr(signs), _ptr(sig), _ptr(bounds),
                   len(bounds), _ptr(counts), int(want_counts))
        return float(total), counts
    return _stats_numpy(a, thr, signs, sig, bounds, want_counts)


def sample_hash(addr: np.ndarray, stride: np.ndarray, count: np.ndarray, width: np.ndarray,
                out: np.ndarray) -> bool:
    """The replica check's sample hash (``record/replicas.SampleHash``) of every tensor at once:
    per tensor at address ``addr[i]`` (contiguous memory; 0: none), its ``count[i]`` elements
    ``stride[i]`` apart read as signed integers of ``width[i]`` bytes, times ``2j + 1``, summed
    in int64 (wrapping) into ``out``. int64 arrays (``width`` int32). False, and ``out``
    untouched, on the numpy path: the caller hashes with numpy (the same values)."""
    if path == "numpy":
        return False
    _lib.pk_sample_hash(_ptr(addr), _ptr(stride), _ptr(count), _ptr(width), len(addr),
                        _ptr(out))
    return True


BAND = 4.0  # chunk(): elements within this factor of the provisional threshold are listed


def chunk(a: np.ndarray, unit: float, hint: float, signs, sig, bounds: np.ndarray,
          want_counts: bool, cand) -> tuple:
    """``minmax`` and ``chunk_stats`` of one chunk in one read: the significance bits against
    the provisional threshold ``t = unit * max(largest finite |a|, hint)``, and in ``cand`` (an
    int32 array, or None) the indices of the elements with ``t / BAND < |a| <= t * BAND``.
    Returns (max, min, largest finite |a|, sum of squares, t, NaNs, counts, band elements
    found: more than ``len(cand)`` means the list is incomplete)."""
    if path != "numpy":
        out = np.empty(5, np.float64)
        ints = np.empty(2, np.int64)
        counts = np.empty(len(bounds) + 2, np.int64) if want_counts else None
        fn = _lib.pk_chunk_f32 if a.dtype == np.float32 else _lib.pk_chunk_f64
        fn(_ptr(a), a.size, float(unit), float(hint), _ptr(signs), _ptr(sig), _ptr(bounds),
           len(bounds), _ptr(counts), int(want_counts), BAND, _ptr(cand),
           0 if cand is None else cand.size, _ptr(out), _ptr(ints))
        return (float(out[0]), float(out[1]), float(out[2]), float(out[3]), float(out[4]),
                int(ints[0]), counts, int(ints[1]))
    mx, mn, amax, nans = _minmax_numpy(a)
    t = unit * max(amax, hint)
    total, counts = _stats_numpy(a, t, signs, sig, bounds, want_counts)
    found = 0
    if sig is not None and cand is not None and unit > 0:
        mag = np.abs(a)
        idx = np.flatnonzero((mag > a.dtype.type(t / BAND)) & (mag <= a.dtype.type(t * BAND)))
        found = idx.size
        cand[:min(found, cand.size)] = idx[:cand.size]
    return mx, mn, amax, total, t, nans, counts, found


def chunk_many(addr: np.ndarray, lens: np.ndarray, is64: np.ndarray, unit: np.ndarray,
               hint: np.ndarray, bounds: np.ndarray, want_counts: bool, cap: np.ndarray,
               out: np.ndarray, ints: np.ndarray, counts) -> bool:
    """``chunk`` of many chunks in one call (C only; False on the numpy path, nothing done):
    chunk ``c`` is the contiguous float64 (``is64[c]``) or float32 memory of ``lens[c]``
    elements at address ``addr[c, 0]``, its sign and significance bytes at ``addr[c, 1]`` and
    ``addr[c, 2]`` (0: none), its list of ``cap[c]`` int32 at ``addr[c, 3]`` (0: none).
    Results as ``chunk``'s, per chunk: ``out[c]`` (max, min, largest finite |x|, sum of
    squares, t), ``ints[c]`` (NaNs, band elements found), with ``want_counts`` ``counts[c]``
    (``len(bounds) + 2``). int64 ``addr`` (m, 4), ``lens``; int32 ``is64``, ``cap``; float64
    ``unit``, ``hint``, ``out`` (m, 5); int64 ``ints`` (m, 2), ``counts``: all C-contiguous."""
    if path == "numpy":
        return False
    _lib.pk_chunk_many(len(lens), _ptr(addr), _ptr(lens), _ptr(is64), _ptr(unit), _ptr(hint),
                       _ptr(bounds), len(bounds), int(want_counts), BAND, _ptr(cap), _ptr(out),
                       _ptr(ints), _ptr(counts) if want_counts else None)
    return True


def fix_many(addr: np.ndarray, k: np.ndarray, thr: np.ndarray, is64: np.ndarray) -> bool:
    """``fix`` of many chunks in one call (C only; False on the numpy path, nothing done): for
    each ``c``, the ``k[c]`` listed elements (int32 at ``addr[c, 1]``) of the float64
    (``is64[c]``) or float32 chunk at ``addr[c, 0]`` set again against ``thr[c]`` in the
    significance bytes at ``addr[c, 2]``. int64 ``addr`` (m, 3), ``k``; float64 ``thr``; int32
    ``is64``."""
    if path == "numpy":
        return False
    _lib.pk_fix_many(len(k), _ptr(addr), _ptr(k), _ptr(thr), _ptr(is64))
    return True


def fix(a: np.ndarray, cand: np.ndarray, thr: float, sig) -> None:
    """Set the significance bits of the elements ``cand`` of ``a`` against ``thr``."""
    if path != "numpy":
        fn = _lib.pk_fix_f32 if a.dtype == np.float32 else _lib.pk_fix_f64
        fn(_ptr(a), _ptr(cand), cand.size, float(thr), _ptr(sig))
        return
    t = a.dtype.type(thr)
    v = a[cand]
    on = (v > t) | (v < -t)
    byte, bit = cand >> 3, (0x80 >> (cand & 7)).astype(np.uint8)
    np.bitwise_or.at(sig, byte[on], bit[on])
    np.bitwise_and.at(sig, byte[~on], ~bit[~on])


#: columns of a kernel run set: output column, range of side a, range of side b, first bit in
#: each range's row, run length (bits), then (count, bit step in a, bit step in b) per leading
#: loop (``geometry.PREFIX`` of them)
RUN_FIELDS = 15


def count_runs(side_a: list, side_b: list, runs: np.ndarray, nrows: int,
               out: np.ndarray) -> None:
    """Add to ``out`` ((3, nrows, ncols) int64: differ, differ and significant in both,
    significant in both) the counts of the run sets ``runs`` ((n, RUN_FIELDS) int64) between
    the ranges ``side_a`` and ``side_b``: lists of (sign rows, significance rows or None), 2-D
    uint8 arrays of at least ``nrows`` rows, each row contiguous (any row stride, 0 included).
    Significance is counted when every range has it."""
    use_sig = all(s is not None for _, s in side_a) and all(s is not None for _, s in side_b)
    runs = np.ascontiguousarray(runs, np.int64)
    if not len(runs) or not nrows:
        return
    if out.dtype != np.int64 or not out.flags.c_contiguous or out.shape[:2] != (3, nrows):
        raise ValueError(f"out: {out.dtype} {out.shape}; expected C-contiguous int64 "
                         f"(3, {nrows}, ncols)")
    if path != "numpy":
        ta, tb = _table(side_a, use_sig), _table(side_b, use_sig)
        _lib.pk_count_runs(_ptr(ta), _ptr(tb), _ptr(runs), len(runs), nrows, int(use_sig),
                           _ptr(out), out.shape[2])
        return
    _count_runs_numpy(side_a, side_b, runs, nrows, out, use_sig)


def count_runs_many(side_a: list, sides: list, runs: np.ndarray, nrows: int,
                    out: np.ndarray) -> None:
    """``count_runs(side_a, sides[i], runs, nrows, out[i])`` for every ``i``: one run's bits
    (a reference's) against several runs' laid out alike (a test's and its controls'), into
    ``out`` ((len(sides), 3, nrows, ncols) int64)."""
    if (out.dtype != np.int64 or not out.flags.c_contiguous or out.ndim != 4
            or out.shape[:3] != (len(sides), 3, nrows)):
        raise ValueError(f"out: {out.dtype} {out.shape}; expected C-contiguous int64 "
                         f"({len(sides)}, 3, {nrows}, ncols)")
    use_sig = all(s is not None for _, s in side_a) and all(
        s is not None for side in sides for _, s in side)
    runs = np.ascontiguousarray(runs, np.int64)
    if not len(runs) or not nrows or not sides:
        return
    if path != "numpy":
        ta = _table(side_a, use_sig)
        tbs = [_table(side, use_sig) for side in sides]
        ptrs = np.array([_ptr(t) for t in tbs], np.int64)
        _lib.pk_count_runs_many(_ptr(ta), _ptr(ptrs), len(sides), _ptr(runs), len(runs), nrows,
                                int(use_sig), _ptr(out), out.shape[3])
        return
    for i, side_b in enumerate(sides):
        _count_runs_numpy(side_a, side_b, runs, nrows, out[i], use_sig)


def _table(side: list, use_sig: bool) -> np.ndarray:
    t = np.zeros((max(1, len(side)), 5), np.int64)
    for k, (d, s) in enumerate(side):
        if d.ndim != 2 or (d.shape[1] > 1 and d.strides[1] != 1):
            raise ValueError("count_runs: each range is a 2-D uint8 array, rows contiguous")
        t[k] = (_ptr(d), d.strides[0], _ptr(s) if use_sig else 0,
                s.strides[0] if use_sig else 0, d.shape[1])
        if use_sig and (s.shape[1] != d.shape[1] or (s.shape[1] > 1 and s.strides[1] != 1)):
            raise ValueError("count_runs: a range's significance rows differ from its signs'")
    return t


_POP8 = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _popcount_rows(x: np.ndarray) -> np.ndarray:
    """Set bits per row of an (nrows, ...) uint8 array (int64)."""
    x = x.reshape(x.shape[0], -1)
    if hasattr(np, "bitwise_count"):  # numpy >= 2
        return np.bitwise_count(x).sum(axis=1, dtype=np.int64)
    return _POP8[x].sum(axis=1, dtype=np.int64)  # numpy 1 (the MindSpore venv)


def _take_bits(rows: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """(nrows, len(starts), ceil(length / 8)) uint8: the ``length`` bits from each start (bits,
    MSB-first) of every row, moved to bit 0, bits past ``length`` cleared; bytes past a row's
    end read as 0."""
    nb = -(-length // 8)
    first = starts >> 3
    shift = (starts & 7).astype(np.uint16)[None, :, None]
    if starts.size == 1:  # one run: a slice (and a zero byte past the row's end)
        f = int(first[0])
        g = np.zeros((rows.shape[0], 1, nb + 1), np.uint16)
        part = rows[:, f:f + nb + 1]
        g[:, 0, :part.shape[1]] = part
    else:
        idx = first[:, None] + np.arange(nb + 1)[None, :]
        inside = idx < rows.shape[1]
        g = rows[:, np.where(inside, idx, 0)].astype(np.uint16)
        g[:, ~inside] = 0
    out = (((g[:, :, :-1] << shift) | (g[:, :, 1:] >> (8 - shift))) & 0xFF).astype(np.uint8)
    if length % 8:
        out[:, :, -1] &= np.uint8((0xFF << (8 - length % 8)) & 0xFF)
    return out


def _same_phase(rows_a, rows_b, a0: int, b0: int, length: int):
    """The bytes of one run starting at the same bit of a byte in both rows, XOR-ready: (bytes
    of a, bytes of b, mask of the bits that belong to the run) as (nrows, nbytes) arrays."""
    head = a0 & 7
    nbytes = (head + length + 7) // 8
    mask = np.full(nbytes, 0xFF, np.uint8)
    mask[0] &= np.uint8(0xFF >> head)
    tail = (head + length) % 8
    if tail:
        mask[-1] &= np.uint8((0xFF << (8 - tail)) & 0xFF)
    return (rows_a[:, a0 >> 3:(a0 >> 3) + nbytes], rows_b[:, b0 >> 3:(b0 >> 3) + nbytes], mask)


def _count_runs_numpy(side_a, side_b, runs, nrows, out, use_sig) -> None:
    from .geometry import expand

    for row in runs:  # one run set at a time, its runs and the rows vectorised
        col, ra, rb = int(row[0]), int(row[1]), int(row[2])
        one = row[[0, 3, 4, 5, *range(6, RUN_FIELDS)]][None, :]  # the geometry.FIELDS layout
        _, sa, sb, lengths = expand(one)
        if not lengths.size:
            continue
        length = int(lengths[0])
        da, sga = side_a[ra]
        db, sgb = side_b[rb]
        if sa.size == 1 and (sa[0] & 7) == (sb[0] & 7):  # one run, same phase: no shifting
            xa, xb, mask = _same_phase(da[:nrows], db[:nrows], int(sa[0]), int(sb[0]), length)
            x = (xa ^ xb) & mask
            if use_sig:
                ma, mb, _ = _same_phase(sga[:nrows], sgb[:nrows], int(sa[0]), int(sb[0]),
                                        length)
                m = ma & mb & mask
        else:
            x = _take_bits(da[:nrows], sa, length) ^ _take_bits(db[:nrows], sb, length)
            if use_sig:
                m = _take_bits(sga[:nrows], sa, length) & _take_bits(sgb[:nrows], sb, length)
        out[0, :, col] += _popcount_rows(x)
        if use_sig:
            out[2, :, col] += _popcount_rows(m)
            out[1, :, col] += _popcount_rows(x & m)


def _minmax_numpy(a: np.ndarray) -> tuple:
    if a.size == 0:
        return -np.inf, np.inf, 0.0, 0
    nan = np.isnan(a)
    nans = int(np.count_nonzero(nan))
    if nans == a.size:
        return -np.inf, np.inf, 0.0, nans
    b = a[~nan] if nans else a
    mag = np.abs(b)
    finite = mag[np.isfinite(mag)]
    return (float(b.max()), float(b.min()), float(finite.max()) if finite.size else 0.0, nans)


def _stats_numpy(a, thr, signs, sig, bounds, want_counts) -> tuple:
    wide = a.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # Inf and NaN propagate, as in C
        total = float(np.dot(wide, wide))
    k = -(-a.size // 8)
    if signs is not None:
        signs[:k] = np.packbits(a > 0)
    t = a.dtype.type(thr)
    if sig is not None:
        sig[:k] = np.packbits((a > t) | (a < -t))
    counts = None
    if want_counts:
        counts = np.array([np.count_nonzero(a <= a.dtype.type(b)) for b in bounds]
                          + [np.count_nonzero(a == 0), np.count_nonzero(np.isnan(a))],
                          np.int64)
    return total, counts


set_path(os.environ.get("PROBEKIT_GRADS_KERNEL", "auto"))
