"""Reading a 0-dim CPU tensor's value on the host without an ATen operator.

``.item()`` and ``.tolist()`` dispatch operators (``aten::item``, ``aten::resolve_conj``...),
which the per-check operator counts pin (``tests/unit/test_freebench_ops.py``); a value in host
memory is read by its bits in place instead. Used where a CPU check reads what it just computed:
the comparison's fast values (``judge/deferred.py``) and the extremes that tell ``bit_noise``
whether anything can overflow (``perturb.py``).
"""
from __future__ import annotations

import ctypes
import struct

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
