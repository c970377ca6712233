"""Reading a 0-dim CPU tensor's value on the host without an ATen operator.

``.item()`` and ``.tolist()`` dispatch operators (``aten::item``, ``aten::resolve_conj``...),
which the per-check operator counts pin (``tests/unit/test_freebench_ops.py``); a value in host
memory is read by its bits in place instead. Used where a CPU check reads what it just computed:
the comparison's fast values (``judge/deferred.py``) and the extremes that tell ``bit_noise``
whether anything can overflow (``perturb.py``).

A forward check's comparison reads its original output's extremes (``aminmax(o)``, the fast
form's ``olo, ohi``) on the host; the next call usually takes that output as its first input,
and ``bit_noise`` would read the same extremes again (``perturb._may_overflow``). ``note`` keeps
them per tensor object (a weak reference and its version counter), ``noted`` answers for the
same tensor unchanged since (issue 38: one ``aminmax`` fewer per chained check).
"""
from __future__ import annotations

import ctypes
import struct
import weakref

import torch


class _Bits(ctypes.Union):
    _fields_ = [("i", ctypes.c_uint32), ("f", ctypes.c_float)]


_BITS = _Bits()


def host_value(v):
    """The float a 0-dim CPU tensor holds, read by its bits in place (no ATen operator); None
    for a dtype not read this way."""
    dt = v.dtype
    if dt == torch.float32:
        return ctypes.c_float.from_address(v.data_ptr()).value
    if dt == torch.float64:
        return ctypes.c_double.from_address(v.data_ptr()).value
    if dt == torch.bfloat16:   # the upper half of a float32
        _BITS.i = ctypes.c_uint16.from_address(v.data_ptr()).value << 16
        return _BITS.f
    if dt == torch.float16:
        return struct.unpack("<e", struct.pack("<H", ctypes.c_uint16.from_address(
            v.data_ptr()).value))[0]
    return None


#: id(tensor) -> (weak reference, its version when read, lo, hi): extremes read on the host
_EXTREMES: dict = {}
_EXTREMES_MAX = 1024


def note(t, lo, hi) -> None:
    """``t``'s extremes (``torch.aminmax(t)``'s values, as floats) were read on the host."""
    try:
        entry = (weakref.ref(t), t._version, lo, hi)
    except (RuntimeError, TypeError):   # an inference tensor has no version counter
        return
    if len(_EXTREMES) >= _EXTREMES_MAX:
        # the tensors that died go; all of them when most are alive (amortised: a purge every
        # half of the bound at least), so a live tensor's entry stays while there is room
        for k in [k for k, e in _EXTREMES.items() if e[0]() is None]:
            del _EXTREMES[k]
        if len(_EXTREMES) >= _EXTREMES_MAX // 2:
            _EXTREMES.clear()
    _EXTREMES[id(t)] = entry


def noted(t):
    """``(lo, hi)`` of ``note`` when ``t`` is the tensor noted and unchanged since (its version
    counter, which every in-place write through torch moves), else None."""
    entry = _EXTREMES.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    try:
        if t._version != entry[1]:
            return None
    except RuntimeError:
        return None
    return entry[2], entry[3]
