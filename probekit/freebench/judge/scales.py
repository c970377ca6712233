"""What a finding means: one error model for every checked call, forward and backward.

Element ``i`` of a correct kernel's result is within ``u_out * |y_i| + gamma_k(u_acc) * S_i`` of
the exact ``y_i`` (docs/free_benchmark.md, "The error model"): ``u_out`` the unit roundoff of the
dtype the call computes its result in, ``u_acc`` that of what a correct kernel accumulates in
(float32 for float16/bfloat16, the dtype itself otherwise), ``gamma_k(u) = k u / (1 - k u)`` the
bound of a sequential sum of ``k`` terms (Higham, ch. 3-4), ``S_i`` the call's magnitude at
``i`` (the element if none of its terms cancelled) and ``k`` its reduction length. The accuracy
modes flag an output when ``max_i |d_i| / (u_out |p_i| + gamma_k S_i) > C``; the sensitivity
modes when the output moves by more than ``sqrt(u)`` of its tensor's scale (half its significant
bits). A flagged output is a finding only when the float64 analysis (``cause.py``) confirms it.

``S`` and ``k`` come from the call's family (``family``): the call on absolute values for the
multilinear calls (``magnitude_run``; in the backward stage: with ``|g|`` on ``|inputs|``, which
also covers ``mul``/``div``; ``add``/``sub``'s gradients are ``|g|`` summed over the broadcast
dims), ``|p|`` for element-wise functions, ``|x|`` for gelu, a formula for the
few families whose own arithmetic subtracts (softmax, log_softmax, normalisations, attention:
``magnitudes.py``), the output tensor's scale for everything else, and 0 for step functions. The
fast comparison (``metric.py``) divides ``d`` by a per-element scale, or by the tensor scale:

* ``MAGNITUDE``: the scale ``S`` itself when ``u_out <= u_acc`` (float32, float64: ``|p| <= S``
  puts the bound between ``gamma_k S`` and ``(u_out + gamma_k) S``, the threshold uses the
  larger), else ``|p| + gamma_k / u_out * S`` (two terms, threshold ``C u_out``);
* ``ELEMENT``: ``|p| + beta`` (a per-family absolute floor), threshold ``C (u_out + gamma_k)``;
* ``TENSOR``: ``max|d| / max|o|``, threshold ``C (u_out + gamma_k)`` in the accuracy modes,
  ``sqrt(u_in)`` in the sensitivity modes.
"""
from __future__ import annotations

import math

import torch

from ..perturb.modes import MODES
from ..names import ELEMENTWISE, MISSING, parameters

#: the model's margin: one bound for the kernel, one for the re-run (the fp32 re-run of a 16-bit
#: call is itself a correct fp32 computation)
C = 2.0
#: k of element-wise functions: a vector-math function is good to a few ulps (measured at most
#: 3.3 u in fp32 over 23 CPU functions: mish 3.3, silu 2.3, sigmoid 2.0, rsqrt 1.8)
ELEMENTWISE_K = 4
#: the least k of a call judged against its tensor's scale (an element-wise formula's few roundings)
TENSOR_MIN_K = 4

TENSOR, MAGNITUDE, ELEMENT = "tensor", "magnitude", "element"

#: multilinear in their floating inputs with non-negative coefficients (after ``alpha``/``beta``
#: are made positive): the call on absolute values is ``sum |a||b|``, forward and backward
MAGNITUDE_APIS = frozenset("""
matmul __matmul__ __rmatmul__ mm bmm mv dot vdot inner einsum tensordot linear bilinear addmm addmv
addbmm baddbmm addr conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
convolution sum nansum mean nanmean cumsum trace index_add index_add_ scatter_add scatter_add_
index_put index_put_ put put_ embedding_bag bincount scatter_reduce scatter_reduce_ index_reduce
index_reduce_ scatter scatter_ kron chain_matmul multi_dot _grouped_mm grouped_mm nll_loss
""".split())
#: element-wise products: correctly rounded forward (``|p|``), and a backward that is a product of
#: the upstream gradient with input values (the backward on absolute values is its magnitude)
ARITHMETIC = frozenset("""
mul multiply div divide true_divide addcmul addcdiv __mul__ __rmul__ __truediv__ __rtruediv__
__div__ __rdiv__
""".split())
#: element-wise sums: correctly rounded forward; each input's gradient is +-g summed over the
#: dims the input was broadcast along, so its magnitude is |g| summed alike (``magnitudes.py``,
#: no re-run)
ADDITIVE = frozenset("""
add sub subtract rsub neg negative __add__ __radd__ __sub__ __rsub__ __neg__
""".split())
#: gelu computes x/2 (1 + erf(x/sqrt 2)) (or the tanh form): 1 + erf cancels for x < 0 (10 %
#: relative error at x = -5 in fp32). Its two terms x/2 and x/2 erf(x/sqrt 2) are each at most
#: |x|/2, so S = |x|, the input itself (no re-run; the call on |x| would give the same within 2x)
GELU = frozenset({"gelu"})
SOFTMAX = frozenset({"softmax", "softmin", "_softmax"})
LOG_SOFTMAX = frozenset({"log_softmax", "_log_softmax"})
NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"})
ATTENTION = frozenset({"scaled_dot_product_attention"})
#: families whose correct kernels round an intermediate to the compute dtype before a product:
#: attention computes the probabilities P in fp32 and hands them to the second product in the
#: inputs' dtype (P V forward; P^T dO, dS K, dS^T Q backward: the flash-attention design, on the
#: CPU kernels too), so each term of those sums carries u_out of its own magnitude: the bound's
#: S term is (u_out + gamma_k(u_acc)) S for them (``accumulation_term``)
ROUNDED_OPERANDS = frozenset({"attention"})
#: element-wise functions whose backward reads the saved output y through a derivative that
#: vanishes where they saturate (sigmoid: g y (1 - y); tanh: g (1 - y^2)): their gradients are
#: judged per element against a formula (``magnitudes._saturating``) that bounds the gradient
#: there, the tensor's scale would not; the forward is element-wise
SATURATING = frozenset({"sigmoid", "tanh"})
#: (issue 26 bounded the rounding of a saved forward output y, which these families' backward
#: formulas read, by a term of their bound, m u_s S; since issue 34 every backward that reads
#: its saved output is found from autograd's saved tensors, and its reference reads the output
#: the kernel was handed: ``saved.py``. The formula families keep their S, which bounds the
#: gradient element by element: sigmoid's |g| y, tanh's |g| (1 + y^2), softmax's
#: y (|g| + sum|g| y))
#: piecewise constant (or jumping) in their floating inputs: exact at the same inputs, and a
#: one-ulp move only says on which side of a discontinuity an input lies (sensitivity modes skip)
STEP = frozenset("""
histc histogram histogramdd floor ceil round trunc fix frac sign sgn signbit heaviside
floor_divide __floordiv__ __rfloordiv__ remainder __mod__ __rmod__ fmod bucketize searchsorted
""".split())

#: the data-aware bound of a sum (issue 34, docs "The error model"): the least accurate correct
#: kernel adds the k terms one after the other in u_acc, and a sequential sum's error is at most
#: its running error bound u_acc sum_i |s_i| (s_i the partial sums: Higham, Accuracy and
#: Stability, 4.2). Averaged over the orders a kernel may take that do not depend on the values
#: (a random order of the terms), s_i has mean (i/k) T and variance below (i (k - i) / k) Q / k
#: (T = sum x, Q = sum x^2), so E sum_i |s_i| <= sum_i ((i/k) |T| + sqrt(i (k - i) / k^2 Q))
#: ~ k (|T| / 2 + (pi / 8) sqrt(Q)). T is the result itself; Q the call on squared inputs.
#: With |T| <= S and sqrt(Q) <= S it never exceeds gamma_k S, the worst case over all data,
#: which stays the cap; alike terms (|T| = S) keep half of it, random signs lose a factor
#: sqrt(k) of it (1/sqrt(k) of S for both |T| and sqrt(Q))
DATA_BETA = math.pi / 8
#: index-accumulating calls: how many terms land on one output element depends on the indices,
#: so each element's k is counted, by the call on ones (unit coefficients: a sum mode). Their
#: forms that average (a mean mode) or multiply keep the worst case gamma_k S
COUNTED = frozenset("""
index_put index_put_ put put_ index_add index_add_ scatter_add scatter_add_ scatter scatter_
scatter_reduce scatter_reduce_ index_reduce index_reduce_ embedding_bag bincount
""".split())
#: calls whose terms are x / k (a mean): the call on squared inputs is sum x^2 / k, the terms'
#: own sum of squares sum x^2 / k^2
MEANS = frozenset({"mean", "nanmean"})

#: keyword coefficients made positive for the magnitude re-run
_COEFFICIENTS = ("alpha", "beta", "value")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# -- unit roundoffs and gamma ---------------------------------------------------------------------
def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2`` of a floating dtype (bfloat16 2^-8, float16 2^-11, float32 2^-24), of a
    complex dtype's parts; float32's for any other dtype."""
    if isinstance(dtype, torch.dtype) and dtype.is_complex:
        dtype = dtype.to_real()
    if dtype not in _FLOATS:
        dtype = torch.float32
    return torch.finfo(dtype).eps / 2


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the arithmetic a correct kernel uses inside: float32 for the 16-bit
    types (PyTorch's ``opmath``), the dtype itself otherwise."""
    return unit_roundoff(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)


#: the smallest normal of the dtype whose unit roundoff is the key: float32 and bfloat16 share
#: float32's exponent range, float16 has its own
_TINY = {torch.finfo(t).eps / 2: torch.finfo(t).tiny
         for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def underflow(u: float) -> float:
    """``eta``: the absolute error one rounding may add below the normal range of the dtype
    whose unit roundoff is ``u``, ``tiny * u`` = half the smallest subnormal (2^-150 in float32,
    2^-134 in bfloat16, 2^-25 in float16). Higham's model of gradual underflow: ``fl(x op y) =
    (x op y)(1 + delta) + eta`` (Accuracy and Stability, 2.1): a result of ``1e-45`` in float32
    is 100 % off by one such unit, however correct the kernel."""
    return _TINY.get(u, torch.finfo(torch.float32).tiny) * u


def underflow_floor(k: float, u_out: float, u_acc: float) -> float:
    """The absolute part of a correct kernel's error: ``k eta(u_acc) + eta(u_out)``, one
    underflow per product it accumulates (additions of subnormals are exact) and one for the
    result's rounding to its dtype (issue 34, class U)."""
    return max(k, 1) * underflow(u_acc) + underflow(u_out)


def gamma(k: float, u: float) -> float:
    """``gamma_k(u) = k u / (1 - k u)`` (infinite once ``k u >= 1``)."""
    ku = k * u
    return math.inf if ku >= 1 else ku / (1 - ku)


# -- families ---------------------------------------------------------------------------------------
_FAMILIES: dict = {}


#: in-place Python operators and their out-of-place forms (an in-place call re-run on a copy
#: computes what the out-of-place one does)
_INPLACE_DUNDERS = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__",
                    "__itruediv__": "__truediv__", "__idiv__": "__div__", "__ipow__": "__pow__",
                    "__imatmul__": "__matmul__", "__ifloordiv__": "__floordiv__",
                    "__imod__": "__mod__"}


def _outplace(name: str):
    """The out-of-place form's name of an in-place API (``add_``, ``__iadd__``), else None."""
    base = _INPLACE_DUNDERS.get(name)
    if base is None and name.endswith("_") and not name.endswith("__"):
        base = name[:-1]
    return base


def family(name: str) -> str:
    """The error-model family of API ``name`` (module doc; docs/free_benchmark.md's table); an
    in-place form (``add_``, ``__iadd__``) has its out-of-place form's."""
    fam = _FAMILIES.get(name)
    if fam is None:
        fam = _family(name)
        if fam == "other":
            base = _outplace(name)
            if base is not None:
                fam = _family(base)
                if fam == "saturating":
                    # sigmoid_/tanh_: their re-run overwrites the input copy that the formula
                    # would read; judged as element-wise calls on the tensor's scale
                    fam = "elementwise"
        _FAMILIES[name] = fam
    return fam


def _family(name: str) -> str:
    if name in MAGNITUDE_APIS:
        return "multilinear"
    if name in ARITHMETIC:
        return "arithmetic"
    if name in ADDITIVE:
        return "additive"
    if name in GELU:
        return "gelu"
    if name in SOFTMAX:
        return "softmax"
    if name in LOG_SOFTMAX:
        return "log_softmax"
    if name in NORMS:
        return "norm"
    if name in ATTENTION:
        return "attention"
    if name in STEP:
        return "step"
    if name in SATURATING:
        return "saturating"
    if name in ELEMENTWISE:
        return "elementwise"
    return "other"


def data_variant(name: str, a: "Args", stage: str = "forward"):
    """How the data-aware bound applies to a multilinear call (``DATA_BETA``): True (each
    element's k is the argument k), ``"mean"`` (terms x / k), ``"count"`` (k counted per
    element: ``COUNTED``), or False (no data-aware bound: gamma_k S). In the backward stage only
    embedding_bag's weight gradient is an index accumulation (the others' gradients gather)."""
    base = _outplace(name) or name
    if stage == "backward":
        if base == "embedding_bag":
            return "count" if a.get("mode", 6) == "sum" else False
        return True
    if base in MEANS:
        return "mean"
    if base == "nll_loss":      # -sum w_t x_t / sum w_t: the terms of a mean (unit weights)
        return "mean" if a.get("reduction", 6) == "mean" else True
    if base not in COUNTED:
        return True
    if base in ("scatter_reduce", "index_reduce"):
        return "count" if a.get("reduce", 4) == "sum" else False
    if base == "scatter":
        return "count" if a.get("reduce", None) == "add" else False
    if base == "embedding_bag":
        return "count" if a.get("mode", 6) == "sum" else False
    return "count"


def is_step(name: str) -> bool:
    """A step function (``STEP``), or an in-place form of one (``floor_``, ``__imod__``: checked
    in place since issue 26)."""
    return name in STEP or _outplace(name) in STEP


#: families whose forward S is the call on absolute values
_ABS_FORWARD = frozenset({"multilinear"})
#: families whose forward S is the absolute value of their (first) input
_INPUT_FORWARD = frozenset({"gelu"})
#: families whose forward S is ``|p|`` plus a floor (no re-run)
_ELEMENT_FORWARD = frozenset({"arithmetic", "additive", "elementwise", "saturating", "softmax",
                              "log_softmax", "step"})
#: families whose gradients' S is the backward on absolute values
_ABS_BACKWARD = frozenset({"multilinear", "arithmetic"})
#: families whose gradients' S is a formula (``magnitudes.py``)
_FORMULA_BACKWARD = frozenset({"additive", "softmax", "log_softmax", "norm", "attention",
                               "saturating"})


# -- the call's arguments, read by name ------------------------------------------------------------
_PARAMS: dict = {}


def _params(func, name: str) -> dict:
    try:
        key = (name, func)
        p = _PARAMS.get(key)
    except TypeError:     # an unhashable callable
        key = (name, getattr(func, "__qualname__", None), getattr(func, "__module__", None))
        p = _PARAMS.get(key)
    if p is None:
        try:
            p = parameters(func, name)
        except Exception:
            p = {}
        _PARAMS[key] = p
    return p


class Args:
    """A call's arguments read by name (positions and defaults from ``names.parameters``)."""

    __slots__ = ("args", "kwargs", "params")

    def __init__(self, func, name: str, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs
        self.params = _params(func, name)

    def get(self, name: str, pos: int | None = None, default=None):
        if name in self.kwargs:
            return self.kwargs[name]
        p, dflt = self.params.get(name, (pos, MISSING))
        if p is None:
            p = pos
        if p is not None and len(self.args) > p:
            return self.args[p]
        return default if dflt is MISSING else dflt


def _numel(x) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 1


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _norm_count(name: str, a: Args, x: torch.Tensor) -> int:
    """Elements each normalisation statistic is taken over."""
    if name in ("layer_norm", "rms_norm"):
        shape = a.get("normalized_shape", 1)
        return _prod([shape] if isinstance(shape, int) else (shape or ()))
    if name == "group_norm":
        g = a.get("num_groups", 1) or 1
        return max(1, x.numel() // max(1, x.shape[0] * g)) if x.dim() else 1
    if name == "batch_norm":
        return max(1, x.numel() // x.shape[1]) if x.dim() > 1 else 1
    if name == "instance_norm":
        return _prod(x.shape[2:]) if x.dim() > 2 else 1
    return 1


def _einsum_length(a: Args) -> int:
    eq = a.get("equation", 0)
    ops = a.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    if not isinstance(eq, str) or "..." in eq:
        return 0
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if not rhs and "->" not in eq:
        rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    sizes = {}
    for term, t in zip(terms, ops):
        if isinstance(t, torch.Tensor):
            for c, n in zip(term, t.shape):
                sizes[c] = n
    return _prod(n for c, n in sizes.items() if c not in rhs)


def forward_length(name: str, a: Args, leaves: list, out: torch.Tensor) -> int:
    """``k`` of a forward call: the reduction length behind each output element (module doc)."""
    fam = family(name)
    x = next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if x is None:
        return TENSOR_MIN_K
    if fam == "multilinear":
        k = _multilinear_length(name, a, x, out)
        if k:
            return k
    elif fam in ("elementwise", "saturating", "gelu", "arithmetic", "additive"):
        return ELEMENTWISE_K
    elif fam == "step":
        return 0
    elif fam in ("softmax", "log_softmax"):
        dim = a.get("dim", 1)
        if isinstance(dim, int) and x.dim():
            return x.shape[dim] + 2
    elif fam == "norm":
        return 2 * _norm_count(name, a, x) + 4
    elif fam == "attention":
        q, kk, v = (a.get(n, i) for i, n in enumerate(("query", "key", "value")))
        if all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, kk, v)):
            return q.shape[-1] + kk.shape[-2] + 2
    return _generic_length(leaves, out)


def _generic_length(leaves: list, out: torch.Tensor) -> int:
    n_out = max(1, out.numel())
    k = TENSOR_MIN_K
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            k = max(k, t.numel() // n_out, n_out // t.numel())
    return k


def _multilinear_length(name: str, a: Args, x: torch.Tensor, out: torch.Tensor) -> int:
    if name in ("matmul", "__matmul__", "mm", "bmm", "mv", "dot", "vdot", "inner", "linear",
                "_grouped_mm", "grouped_mm"):
        return x.shape[-1] if x.dim() else 1
    if name == "__rmatmul__":
        other = a.args[1] if len(a.args) > 1 else None
        return other.shape[-1] if isinstance(other, torch.Tensor) and other.dim() else 1
    if name in ("addmm", "addmv", "baddbmm"):
        m = a.args[1] if len(a.args) > 1 else None
        return m.shape[-1] if isinstance(m, torch.Tensor) and m.dim() else 0
    if name == "addbmm":
        m = a.args[1] if len(a.args) > 1 else None
        return m.shape[0] * m.shape[-1] if isinstance(m, torch.Tensor) and m.dim() == 3 else 0
    if name in ("addr", "kron"):
        return 1
    if name == "bilinear":
        y = a.args[1] if len(a.args) > 1 else None
        return x.shape[-1] * (y.shape[-1] if isinstance(y, torch.Tensor) else 1)
    if name in ("chain_matmul", "multi_dot"):
        ms = a.args[0] if len(a.args) == 1 and isinstance(a.args[0], (list, tuple)) else a.args
        return sum(m.shape[-1] for m in list(ms)[:-1] if isinstance(m, torch.Tensor)) or 1
    if name == "einsum":
        return _einsum_length(a)
    if name == "tensordot":
        return max(1, x.numel() * _numel(a.args[1] if len(a.args) > 1 else None)
                   // max(1, out.numel())) if out.numel() else 1
    if name.startswith("conv"):
        w = a.get("weight", 1)
        if not isinstance(w, torch.Tensor) or w.dim() < 2:
            return 0
        kernel = _prod(w.shape[2:])
        transposed = "transpose" in name or (name == "convolution" and a.get("transposed", 6))
        groups = a.get("groups", None) or 1
        return (w.shape[0] // groups if transposed else w.shape[1]) * kernel
    if name in ("sum", "nansum", "mean", "nanmean", "trace"):
        return max(1, x.numel() // max(1, out.numel()))
    if name == "cumsum":
        dim = a.get("dim", 1)
        return x.shape[dim] if isinstance(dim, int) and x.dim() else x.numel()
    if name.startswith("index_put") or name.startswith("put"):
        idx = a.get("indices", 1) if name.startswith("index_put") else a.get("index", 1)
        idx = idx if isinstance(idx, (list, tuple)) else [idx]
        return max((_numel(t) for t in idx if isinstance(t, torch.Tensor)), default=1) + 1
    if name.startswith("index_add") or name.startswith("index_reduce"):
        return _numel(a.get("index", 2)) + 1
    if name.startswith("scatter"):
        idx, dim = a.get("index", 2), a.get("dim", 1)
        if isinstance(idx, torch.Tensor) and isinstance(dim, int) and idx.dim():
            return idx.shape[dim] + 1
        return _numel(idx) + 1
    if name == "embedding_bag":
        return x.numel() if x.dim() <= 1 else x.shape[-1]
    if name == "bincount":
        return _numel(a.get("weights", 1))
    if name == "nll_loss":
        # the selected log-probabilities behind each output element (N targets for a mean or
        # a sum; 1 for reduction="none"), and the mean's division by the weights' sum
        return max(1, _numel(a.get("target", 1)) // max(1, out.numel())) + 1
    return 0


#: the position of a bias-like input (added once per output element, not contracted)
_BIAS = {"linear": 2, "conv1d": 2, "conv2d": 2, "conv3d": 2, "conv_transpose1d": 2,
         "conv_transpose2d": 2, "conv_transpose3d": 2, "convolution": 2, "bilinear": 3,
         "addmm": 0, "addmv": 0, "addbmm": 0, "baddbmm": 0, "addr": 0, "index_add": 0,
         "index_add_": 0, "scatter_add": 0, "scatter_add_": 0, "index_put": 0,
         "index_put_": 0, "put": 0, "put_": 0, "scatter_reduce": 0, "index_reduce": 0,
         "scatter": 0}


def backward_length(name: str, a: Args, leaves: list, position: int, out: torch.Tensor,
                    k_fwd: int) -> int:
    """``k`` of the gradient of input ``position`` (module doc): the forward adds
    ``numel(out) * k`` terms, each holding one element of every contracted input, so each of the
    input's elements is in ``numel(out) * k / numel(x)`` of them; a bias (added once per output
    element) in ``numel(out) / numel(x)``; formula families by their formula."""
    x = leaves[position]
    fam = family(name)
    n_x = max(1, x.numel())
    spread = max(1, -(-out.numel() // n_x))
    if fam in ("multilinear", "arithmetic", "additive"):
        if fam != "multilinear" or _BIAS.get(name) == position:
            return spread
        return max(1, -(-out.numel() * max(1, k_fwd) // n_x))
    if fam in ("softmax", "log_softmax"):
        return k_fwd
    if fam == "norm":
        first = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor))
        return k_fwd if position == first else spread
    if fam == "attention":
        q, kk = a.get("query", 0), a.get("key", 1)
        v = a.get("value", 2)
        if all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, kk, v)):
            return q.shape[-1] + v.shape[-1] + q.shape[-2] + kk.shape[-2]
    return max(TENSOR_MIN_K, spread, k_fwd)


# -- how a check is judged --------------------------------------------------------------------------
class Judge:
    """How one compared output (or gradient) is judged: the comparison's scale kind, the
    threshold, the hot-spot level, and what the scale is made of."""

    __slots__ = ("kind", "thr", "hot", "source", "k", "lam", "beta", "u_out", "u_acc", "fam",
                 "upcast", "factor", "saved", "data", "dlam")

    def __init__(self, kind, thr, hot, source, k, lam=0.0, beta=0.0, u_out=0.0, u_acc=0.0,
                 fam="other", upcast=True, saved=0.0, data=False):
        self.kind = kind        # TENSOR | MAGNITUDE | ELEMENT (per-element scale)
        self.thr = thr
        self.hot = hot
        #: what the per-element scale is made of: None (tensor), "abs" (the call on absolute
        #: values), "formula" (magnitudes.py), "element" (|p| + beta)
        self.source = source
        self.k = k
        self.lam = lam          # two-term scale |p| + lam * S (0: the scale is S itself)
        self.beta = beta        # element scale |p| + beta
        self.u_out = u_out
        self.u_acc = u_acc
        self.fam = fam
        self.upcast = upcast    # judged in an accuracy mode
        #: a configured threshold relative to the model's (``free_benchmark.thresholds``): the
        #: float64 analysis scales its bound (or, in the sensitivity modes, its sqrt(u)) alike
        self.factor = 1.0
        #: the weight a rounded operand adds to S's (0 since issue 34: ``saved.py``)
        self.saved = saved
        #: the data-aware bound applies (``DATA_BETA``): True, ``"mean"`` (terms x / k),
        #: ``"count"`` (k counted per element), or False (gamma_k S)
        self.data = data
        #: the fast check's data-aware scale is ``sqrt(Q + dlam p^2)`` (``_judge``)
        self.dlam = 0.0

    def __repr__(self) -> str:
        return (f"Judge({self.kind}, thr={self.thr:.3g}, source={self.source}, k={self.k}, "
                f"lam={self.lam:.3g}, beta={self.beta:.3g})")


def _floor(dtype) -> float:
    """The absolute floor of an element scale: the dtype's smallest normal (gradual underflow)."""
    return torch.finfo(dtype if dtype in _FLOATS else torch.float32).tiny


def judge(mode_name: str, fam: str, k: int, judged_dtype, *, stage: str = "forward",
          in_dtype=None, override=None, formula_ok: bool = True) -> Judge:
    """The ``Judge`` of one compared output: ``fam`` its family, ``k`` its reduction length,
    ``judged_dtype`` the dtype it is judged in (``effective_dtype``), ``in_dtype`` the perturbed
    input's (sensitivity modes), ``override`` the configured threshold of that dtype.
    ``formula_ok``: the family's formula applies to this call (attention without dropout)."""
    j = _judge(mode_name, fam, k, judged_dtype, stage, formula_ok)
    if fam in _ABS_FORWARD or (stage == "backward" and fam in _ABS_BACKWARD):
        j.data = formula_ok     # the analysis' data-aware bound, in every mode
    if override is not None and not MODES[mode_name].exact:
        j.factor = float(override) / j.thr if j.thr > 0 else math.inf
        j.thr = float(override)
        j.hot = j.thr if j.upcast else min(j.hot, j.thr)
    return j


def _judge(mode_name, fam, k, judged_dtype, stage, formula_ok) -> Judge:
    mode = MODES[mode_name]
    u_out = unit_roundoff(judged_dtype)
    u_acc = accumulation_roundoff(judged_dtype)
    g = gamma(k, u_acc)
    rounding = C * (u_out + g)
    if mode.exact:
        return Judge(TENSOR, 0.0, 0.0, None, k, u_out=u_out, u_acc=u_acc, fam=fam, upcast=False)
    if not mode.upcast:
        thr = math.sqrt(u_out)    # hot spot: a move beyond two correct runs' rounding
        return Judge(TENSOR, thr, min(thr, 2 * rounding), None, k, u_out=u_out, u_acc=u_acc,
                     fam=fam, upcast=False)
    source = magnitude_source(fam, stage, formula_ok)
    if stage == "forward" and source == "formula":
        source = None     # forward formulas (normalisations) are for the analysis only
    if source is None or math.isinf(g):
        return Judge(TENSOR, rounding, rounding, None, k, u_out=u_out, u_acc=u_acc, fam=fam)
    if source == "count":   # per element: c (u_out |p| + K u_acc (|p| / 2 + beta sqrt(Q)))
        return Judge(MAGNITUDE, C, C, source, k, u_out=u_out, u_acc=u_acc, fam=fam, data=source)
    if source == "data":
        # c (a |p| + b sqrt(q Q)) >= c b sqrt(q) sqrt(Q + dlam p^2), dlam = (a / b)^2 / q: the
        # fast check divides by sqrt(Q + dlam p^2) (two kernels on the squares' re-run) and flags
        # above c b sqrt(q), at most sqrt 2 below the bound (a superset; the analysis decides)
        a, b = u_out + u_acc * k / 2, u_acc * k * DATA_BETA
        q = 1.0 / max(1, k) if formula_ok == "mean" else 1.0
        thr = C * b * math.sqrt(q)
        j = Judge(MAGNITUDE, thr, thr, source, k, u_out=u_out, u_acc=u_acc, fam=fam,
                  data="mean" if formula_ok == "mean" else True)
        j.dlam = (a / b) ** 2 / q
        return j
    if source == "element":
        beta = element_floor(fam, k, judged_dtype)
        beta = beta * g / (u_out + g) if fam in ("softmax", "log_softmax") else beta
        return Judge(ELEMENT, rounding, rounding, source, k, beta=beta, u_out=u_out, u_acc=u_acc,
                     fam=fam)
    if fam in ROUNDED_OPERANDS:   # its products take operands rounded to u_out (see there)
        g = g + u_out
        rounding = C * (u_out + g)
    saved = 0.0
    if u_out <= u_acc:          # float32 / float64: |p| <= S, the scale is S alone
        return Judge(MAGNITUDE, rounding, rounding, source, k, u_out=u_out, u_acc=u_acc, fam=fam,
                     saved=saved)
    return Judge(MAGNITUDE, C * u_out, C * u_out, source, k, lam=g / u_out, u_out=u_out,
                 u_acc=u_acc, fam=fam, saved=saved)


def accumulation_term(fam: str, k: int, u_out: float, u_acc: float, saved: float = 0.0) -> float:
    """The weight of ``S`` in the bound: ``gamma_k(u_acc)``, plus ``u_out`` for the families
    whose products take operands rounded to the compute dtype (``ROUNDED_OPERANDS``), plus
    ``saved`` (``Judge.saved``; 0 since issue 34, whose reference reads the saved output)."""
    g = gamma(k, u_acc)
    return (g + u_out if fam in ROUNDED_OPERANDS else g) + saved


def magnitude_source(fam: str, stage: str = "forward", formula_ok=True):
    """Where the fast check's scale of a family comes from: ``"data"`` (the data-aware bound
    from the call, or its backward, on squared inputs: ``DATA_BETA``; ``"count"`` with its k
    counted per element), ``"abs"`` (``S``: the call on absolute values), ``"element"``
    (``|p|`` plus a floor), ``"formula"`` (``magnitudes.py``), or None (the tensor's scale).
    ``formula_ok``: a formula family's formula applies; a multilinear call's ``data_variant``."""
    if fam in _ABS_FORWARD or (stage == "backward" and fam in _ABS_BACKWARD):
        if formula_ok == "count":
            return "count"
        return "data" if formula_ok else "abs"
    if stage == "forward":
        if fam in _ABS_FORWARD:
            return "abs"
        if fam in _INPUT_FORWARD:
            return "input"
        if fam in _ELEMENT_FORWARD:
            return "element"
        return "formula" if fam == "norm" else None
    if fam in _ABS_BACKWARD:
        return "abs"
    if fam in _FORMULA_BACKWARD and formula_ok:
        return "formula"
    return None


def data_bound(r_abs: torch.Tensor, Q: torch.Tensor, k, u_acc: float,
               mean: bool = False) -> torch.Tensor:
    """``u_acc k (|r| / 2 + beta sqrt(q Q))`` (``DATA_BETA``): the data-aware accumulation term
    of a sum of ``k`` terms (a number, or per element a tensor of counts) whose result is ``r``
    and whose call on squared inputs is ``Q`` (``q = 1/k`` for a mean's terms x / k)."""
    root = Q.clamp_min(0).sqrt()
    if mean:
        root = root / math.sqrt(max(1, k))
    return (r_abs * 0.5 + root * DATA_BETA) * (k * u_acc)


def element_floor(fam: str, k: int, dtype) -> float:
    """The absolute part of an element scale ``|p| + beta`` before weighting (module doc):
    softmax ``1 / (e k)``, log_softmax 1, element-wise calls the dtype's smallest normal."""
    if fam == "softmax":
        return 1.0 / (math.e * max(1, k))
    if fam == "log_softmax":
        return 1.0
    return _floor(dtype)


# -- the call on absolute values --------------------------------------------------------------------
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
    """``alpha``/``beta``/``value`` made positive (the other keyword arguments as they are)."""
    if not any(k in kwargs for k in _COEFFICIENTS):
        return kwargs
    return {k: (abs(v) if k in _COEFFICIENTS and isinstance(v, (int, float)) else v)
            for k, v in kwargs.items()}


def square_leaves(leaves: list) -> list:
    """The leaves with every floating tensor squared (one fused ``_foreach_mul``) and float
    scalars squared: the call on them is ``sum c x^2`` of its terms (``DATA_BETA``)."""
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    new = [x * x if type(x) is float else x for x in leaves]  # ints may be dims: kept
    if pos:
        ts = [leaves[i] for i in pos]
        for i, a in zip(pos, torch._foreach_mul(ts, ts)):
            new[i] = a
    return new


def square_kwargs(kwargs: dict) -> dict:
    """``alpha``/``beta``/``value`` squared: a term ``c x y`` squared is ``c^2 x^2 y^2``."""
    if not any(k in kwargs for k in _COEFFICIENTS):
        return kwargs
    return {k: (v * v if k in _COEFFICIENTS and isinstance(v, (int, float)) else v)
            for k, v in kwargs.items()}


def count_leaves(leaves: list) -> list:
    """The leaves with every floating tensor replaced by ones: the call on them counts the terms
    of each output element (a ``COUNTED`` call in a sum mode; ``alpha`` set to 1 by
    ``count_kwargs``)."""
    return [torch.ones_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in leaves]


def count_kwargs(kwargs: dict) -> dict:
    return {k: (1 if k in _COEFFICIENTS else v) for k, v in kwargs.items()} \
        if any(k in kwargs for k in _COEFFICIENTS) else kwargs


def magnitude_run(func, args: tuple, kwargs: dict):
    """``S``: the call on absolute values (``sum`` family, ``matmul``...); ``sub``-like APIs are
    never in ``MAGNITUDE_APIS``, so no sign has to be flipped."""
    return func(*args, **magnitude_kwargs(kwargs))


# -- dtypes ---------------------------------------------------------------------------------------------
def scale_kind(mode_name: str, api_name: str) -> str:
    """The comparison kind of a forward check of API ``api_name`` in ``mode_name`` (the dtype
    decides between ``S`` and the two-term scale, ``judge``)."""
    if not MODES[mode_name].upcast:
        return TENSOR
    fam = family(api_name)
    if fam in _ABS_FORWARD or fam in _INPUT_FORWARD:
        return MAGNITUDE
    if fam in _ELEMENT_FORWARD:
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


def lost_bits_level(compute_dtype: torch.dtype) -> float:
    """``sqrt(u)``: a move above it (relative to the output's own scale) leaves fewer than half
    of the dtype's significant bits."""
    return math.sqrt(unit_roundoff(compute_dtype))
