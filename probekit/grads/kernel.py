"""The fused chunk kernel of the grad probe's CPU path, and its numpy twin.

Functions on a contiguous 1-D float32 or float64 numpy array (a chunk of a gradient):

* ``minmax(a)`` -> (max, min, largest finite |x|, NaN count); max and min skip NaNs;
* ``chunk_stats(a, thr, signs, sig, bounds, want_counts)`` -> (sum of squares, counts): in one
  pass the float64 sum of squares, the sign bits ``a > 0`` into ``signs`` and the significance
  bits ``|a| > thr`` into ``sig`` (uint8 arrays of at least ``ceil(len(a)/8)`` bytes, or None),
  packed as ``numpy.packbits`` packs them, and with ``want_counts`` an int64 array of the counts
  of ``a <= b`` for each bound, then of zeros, then of NaNs (else None);
* ``chunk(...)``: both in one read, the significance bits against a provisional threshold and
  the elements near it listed; ``fix(...)`` sets the listed bits again against the real one.

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

from ..log import get_logger

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
    lib.pk_set_path.argtypes = [ctypes.c_int32]
    lib.pk_set_path.restype = ctypes.c_int32
    _lib = lib
    return lib


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
