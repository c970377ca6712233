"""A CPU check's two passes over its tensors in one read each, in C (issue 38, point 3).

``compare(o, p)``: the fast comparison's values (``metric._fast`` with the tensor's scale:
``torch.aminmax(torch.sub(p, o))`` and ``torch.aminmax(o)``, three kernels, the difference
written to memory) read as four floats in one pass. ``bit_noise(t)``: ``perturb.bit_noise``
(``t.mul(m).div_(d)`` and ``_finite_as``: two or four kernels) in one pass, without the
extremes read that tells whether ``t`` may hold +-max. The same bits as the torch formulas
(``tests/unit/test_freebench_fused.py``: every bfloat16 value, float32 samples, edges); a
signed zero's sign among the extremes aside, which ATen's reduction order decides too and no
verdict reads.

Both answer None where they do not apply, and the caller runs the torch formulas: the kernel
not built (``setup.py``'s extension is optional; an older build lacks these functions),
another dtype than bfloat16 / float32, a tensor not contiguous or not on the CPU, an element
that is not finite (a NaN's payload, an inconclusive comparison: as before), more elements than
one torch thread takes (``GRAIN``) while torch runs several (its kernels split such a tensor
across threads; this pass is one thread's), an input that requires a gradient under grad mode.
"""
from __future__ import annotations

import ctypes
import importlib
import threading

import torch

#: below this many elements torch runs an element-wise kernel on one thread (ATen's grain size)
GRAIN = 32768

_lib = None


def _load():
    try:
        mod = importlib.import_module("probekit.grads.numerics._kernel")
        lib = ctypes.CDLL(mod.__file__)
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        for name in ("pk_fb_cmp_bf16", "pk_fb_cmp_f32"):
            fn = getattr(lib, name)
            fn.argtypes = [ptr, ptr, i64, ptr]
            fn.restype = i32
        for name in ("pk_fb_bitnoise_bf16", "pk_fb_bitnoise_f32"):
            fn = getattr(lib, name)
            fn.argtypes = [ptr, ptr, i64, i64, ctypes.c_float]
            fn.restype = i32
    except (ImportError, OSError, AttributeError):   # not built, or built before these
        return None
    return lib


_lib = _load()
#: dtype -> (comparison, bit_noise) of the kernel (empty without it; tests clear it to run the
#: torch formulas)
KERNELS: dict = {}
if _lib is not None:
    KERNELS = {torch.bfloat16: (_lib.pk_fb_cmp_bf16, _lib.pk_fb_bitnoise_bf16),
               torch.float32: (_lib.pk_fb_cmp_f32, _lib.pk_fb_bitnoise_f32)}

#: the comparison's four results, one buffer per thread (ctypes releases the GIL during the
#: call: two threads' checks would otherwise write one buffer at once)
_LOCAL = threading.local()


def _out():
    buf = getattr(_LOCAL, "out", None)
    if buf is None:
        buf = _LOCAL.out = (ctypes.c_double * 4)()
        _LOCAL.addr = ctypes.addressof(buf)
    return buf, _LOCAL.addr


def _small(n: int) -> bool:
    return n <= GRAIN or torch.get_num_threads() == 1


def compare(o: torch.Tensor, p: torch.Tensor):
    """``[dlo, dhi, olo, ohi]``: the extremes of ``p - o`` rounded in their dtype and of ``o``,
    all finite; None where the torch formulas run instead (module doc)."""
    k = KERNELS.get(o.dtype)
    if k is None or p.dtype is not o.dtype or not (o.is_cpu and p.is_cpu):
        return None
    n = o.numel()
    if n == 0 or p.shape != o.shape or not _small(n) or not o.is_contiguous() or \
            not p.is_contiguous():
        return None
    buf, addr = _out()
    if k[0](o.data_ptr(), p.data_ptr(), n, addr):
        return None   # a NaN/Inf: inconclusive, the torch formulas read it (as before)
    return buf[:]


def bit_noise(t: torch.Tensor, f: float):
    """``perturb.bit_noise(t)`` (``f``: ``1 - u`` of its dtype), or None where the torch formulas
    run instead (module doc)."""
    k = KERNELS.get(t.dtype)
    if k is None or not t.is_cpu or not t.is_contiguous():
        return None
    n = t.numel()
    if n == 0 or not _small(n) or (t.requires_grad and torch.is_grad_enabled()):
        return None
    cols = t.shape[-1] if t.dim() else 1
    out = torch.empty_like(t)
    if k[1](t.data_ptr(), out.data_ptr(), n // cols, cols, f):
        return None   # a NaN/Inf among the inputs
    return out
