"""What a finding means: the scale each call defines for itself, and thresholds from the unit
roundoff of the dtype the call computes in.

A check measures a deviation ``d = p - o`` between the original output ``o`` and the re-run's
``p``. It is judged relative to a scale the call itself defines (``scale_kind``):

* ``magnitude`` (accumulating, multilinear APIs: matmul, linear, conv, bmm, sum, mean, cumsum,
  index_add, scatter_add, index_put(accumulate=True), embedding_bag...; accuracy modes only):
  ``S_i`` = the same call on the absolute values of its floating inputs (``sum |a||b|``), one
  re-run. A correctly implemented sum of products rounds to within a small multiple of
  ``u * S_i`` whatever the cancellation, so the error of an output element that cancels to near
  zero is not mistaken for a bad kernel;
* ``element`` (``log_softmax``, accuracy modes): ``S_i = |p_i| + u_acc / u``: each output is a
  sum of two terms of the same sign (``x_i - max`` and ``-log sum exp``), so it never cancels and a
  correct kernel keeps it to a few ulps of itself; ``u_acc / u`` (float32 internal arithmetic
  for float16/bfloat16, 1 otherwise) is the absolute error of the log-sum a float32 kernel has;
* ``tensor`` (everything else, and every call in the noise modes and the backward stage): the
  scale of the output tensor, ``max |o|``.

``e = max_i |d_i| / S_i``, and the threshold comes from the unit roundoff ``u`` of the compute
dtype (the output dtype in the forward stage, autocast included; the dtype the forward call
computed in for its gradients in the backward stage; ``unit_roundoff``), or of the compared
tensor's or the perturbed input's dtype where that is less precise (``effective_dtype``):

* accuracy modes (improve_precision, to_cpu: ``d`` is the kernel's error against a more precise
  result): ``ACCURACY_UNITS * u`` -- a correct kernel rounds its output (at most ``u`` of the
  scale) and accumulates in a wider type (or, in float32, in blocks: measured at most 4 ``u`` of
  ``sum |a||b|`` and 6 ``u`` of the tensor scale for float32 GEMMs of k = 16..16384 on the AVX2 and
  default CPU kernels; bfloat16 SDPA 1.5 ``u`` of the row scale), so 16 units leave a margin of
  2.7x and more; a kernel accumulating in the low-precision type, or choosing an algorithm that
  cancels, exceeds it;
* sensitivity modes (bit_noise, add_noise, change_value: ``d`` is how far the output moves under a
  one-ulp change of an input, or under reordering): ``sqrt(u)`` -- the output has lost more than
  half of its significant bits relative to its own scale (a cancellation such as
  ``E[x^2] - E[x]^2``). Ordinary conditioning moves it by a few ulps of its scale: that is what
  the dtype predicts, not a finding (above ``ACCURACY_UNITS * u`` it is a hot spot, ``fb.hotspots``);
* no_change: 0 (any difference is non-determinism).

Both kinds of thresholds depend only on ``u``, never on the CPU's vector kernel path: errors of a
correct kernel differ between paths by a few ``u`` of the scale, far below either threshold.
"""
from __future__ import annotations

import math

import torch

from .modes import MODES

#: the accuracy threshold in units of the compute dtype's unit roundoff (see module doc)
ACCURACY_UNITS = 16.0

TENSOR, MAGNITUDE, ELEMENT = "tensor", "magnitude", "element"

#: accumulating APIs that are multilinear in their floating inputs with non-negative coefficients
#: (after ``alpha``/``beta`` are made positive): the call on absolute values is ``sum |a||b|``
MAGNITUDE_APIS = frozenset("""
matmul __matmul__ __rmatmul__ mm bmm mv dot vdot inner einsum tensordot linear bilinear addmm addmv
addbmm baddbmm addr conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
convolution sum nansum mean nanmean cumsum trace index_add index_add_ scatter_add scatter_add_
index_put index_put_ put put_ embedding_bag bincount scatter_reduce scatter_reduce_ index_reduce
index_reduce_ scatter scatter_ kron chain_matmul multi_dot _grouped_mm grouped_mm
""".split())
#: APIs whose every output element is a sum of same-signed terms (judged element by element)
ELEMENT_APIS = frozenset({"log_softmax"})
#: keyword coefficients made positive for the magnitude re-run
_COEFFICIENTS = ("alpha", "beta")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2`` of a floating dtype (bfloat16 2^-8, float16 2^-11, float32 2^-24); float32's
    for any other dtype."""
    if dtype not in _FLOATS:
        dtype = torch.float32
    return torch.finfo(dtype).eps / 2


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the arithmetic a correct kernel uses inside: float32 for the 16-bit
    types (PyTorch's ``opmath``), the dtype itself otherwise."""
    return unit_roundoff(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)


def scale_kind(mode_name: str, api_name: str) -> str:
    """How a forward check of API ``api_name`` in ``mode_name`` is scaled (module doc)."""
    if not MODES[mode_name].upcast:
        return TENSOR
    if api_name in MAGNITUDE_APIS:
        return MAGNITUDE
    if api_name in ELEMENT_APIS:
        return ELEMENT
    return TENSOR


def effective_dtype(mode_name: str, compute_dtype, tensor_dtype=None, in_dtype=None):
    """The dtype whose unit roundoff a check is judged with: the least precise of the dtype the
    call computes in, the compared tensor's own (a gradient stored in bf16 for a bf16 input of a
    float32 op is rounded to bf16) and, in the sensitivity modes, the perturbed input's (one ulp
    of a bf16 input is 2^-8 of it whatever the op computes in: its output cannot keep more)."""
    dtypes = [compute_dtype, tensor_dtype]
    if not MODES[mode_name].upcast:
        dtypes.append(in_dtype)
    best, worst = None, -1.0
    for d in dtypes:
        if isinstance(d, torch.dtype) and d.is_floating_point:
            u = unit_roundoff(d)
            if u > worst:
                best, worst = d, u
    return best if best is not None else compute_dtype


def threshold(mode_name: str, compute_dtype: torch.dtype, override=None) -> float:
    """The finding threshold of a mode for a call computing in ``compute_dtype``; ``override``
    (``free_benchmark.thresholds``) replaces it when given."""
    mode = MODES[mode_name]
    if mode.exact:
        return 0.0
    if override is not None:
        return float(override)
    u = unit_roundoff(compute_dtype)
    return ACCURACY_UNITS * u if mode.upcast else math.sqrt(u)


def hot_level(mode_name: str, compute_dtype: torch.dtype, thr: float) -> float:
    """The level above which a sensitivity check that is not a finding is a hot spot (moves by
    more than a correct kernel's rounding explains); the threshold itself for the other modes."""
    mode = MODES[mode_name]
    if mode.exact or mode.upcast:
        return thr
    return min(thr, ACCURACY_UNITS * unit_roundoff(compute_dtype))


def lost_bits_level(compute_dtype: torch.dtype) -> float:
    """``sqrt(u)``: an error above it (relative to the output's own scale) leaves fewer than half
    of the compute dtype's significant bits."""
    return math.sqrt(unit_roundoff(compute_dtype))


def element_offset(compute_dtype: torch.dtype) -> float:
    """``u_acc / u`` for the ``element`` scale (see module doc)."""
    return accumulation_roundoff(compute_dtype) / unit_roundoff(compute_dtype)


def magnitude_leaves(leaves: list) -> list:
    """The leaves with every floating tensor replaced by its absolute value (one fused
    ``_foreach_abs`` for all of them) and float scalars made positive."""
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    new = [abs(x) if type(x) is float else x for x in leaves]  # ints may be dims: kept
    if pos:
        for i, a in zip(pos, torch._foreach_abs([leaves[i] for i in pos])):
            new[i] = a
    return new


def magnitude_kwargs(kwargs: dict) -> dict:
    """``alpha``/``beta`` made positive (the other keyword arguments as they are)."""
    if not any(k in kwargs for k in _COEFFICIENTS):
        return kwargs
    return {k: (abs(v) if k in _COEFFICIENTS and isinstance(v, (int, float)) else v)
            for k, v in kwargs.items()}


def magnitude_run(func, args: tuple, kwargs: dict):
    """``S``: the call on absolute values (``sum`` family, ``matmul``...); ``sub``-like APIs are
    never in ``MAGNITUDE_APIS``, so no sign has to be flipped."""
    return func(*args, **magnitude_kwargs(kwargs))
