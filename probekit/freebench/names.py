"""API naming and classification: which torch call is this, and may it be re-run?

A ``TorchFunctionMode`` hands us the callable the user invoked. ``classify(func)`` turns it into an
``ApiInfo`` once (cached per callable): the msprobe-style prefix and name (``Torch.matmul``,
``Tensor.sum``, ``Functional.linear``), and, when the API must never be re-run, the reason.
Python operators reach the mode as the plain method (``x + y`` arrives as ``TensorBase.add``), so
``operator_key`` reads the calling instruction to name them as msprobe does (``Tensor.__add__``).

Reasons a call is never re-run (the keys of ``FreeBench.summary["skipped"]``):
view, copy, conversion, creation, metadata, inplace, random, collective, autograd, private,
side_effect, other. Dynamic ones (``inplace=True``, ``out=``) are decided per call by
``dynamic_skip``. Arguments are read by name (``arg``): the positions and defaults come from the
callable's Python signature or, for torch's builtins, from its ATen schemas (``parameters``).

Calls that draw from a generator (``RANDOM_RULES``: dropout and friends, ``rrelu`` in training,
``bernoulli``, ``normal``, ``gumbel_softmax``, attention with ``dropout_p > 0``...) are checked:
``random_draw`` says whether this call draws, and ``rng.py`` replays the generator's stream for
the re-runs. Only draws that cannot be replayed are skipped as ``random`` (``rng.WHY``).

Some APIs are classified by what they compute with their actual arguments (``ARG_RULES``):
``index_put(accumulate=True)``, ``scatter(reduce="add")``, ``scatter_reduce("sum")``,
``embedding_bag(mode="sum")`` sum and are checked, while the same APIs that only move data
(``accumulate=False``, ``reduce="amax"``...) are exact copies. Their in-place forms
(``index_put_``, ``index_add_``, ``put_``...) and calls that also write a buffer (batch norm in
training updates running statistics, ``embedding(max_norm=...)`` renormalises the weight) are
checked too: ``state_positions`` names the tensors such a call writes, and the engine re-runs it
on clones of them taken before the real call, so live state is never written twice.

Over 600 lines because it is mostly tables and small per-API rules (the torch API's views, copies,
creators, element-wise ops, reductions, accumulating calls, random calls) and the argument
binding they share: one place answers "may this call be re-run".
"""
from __future__ import annotations

import dis
import inspect
import os
import sys
import torch

#: explanation of every skip reason (log line: "For X, <reason>. Cancel perturbation.")
REASONS = {
    "view": "a view/metadata-only call is exact (a perturbation would pass through unchanged)",
    "copy": "an exact copy/data-movement call (a perturbation would pass through unchanged)",
    "conversion": "a dtype/device conversion is a plain copy or rounding",
    "creation": "a tensor-creation call has no input to perturb",
    "metadata": "not a numerical call",
    "inplace": "an in-place call that fix cannot replace (it would have to write the upcast "
               "result into the tensor), or one with no out-of-place form (backward stage)",
    "random": "a random call whose draws cannot be replayed for a re-run",
    "collective": "a distributed collective is never re-run",
    "autograd": "autograd machinery is never re-run",
    "private": "a private torch API (called by torch itself, e.g. inside optimizers)",
    "side_effect": "the call updates state in place (running statistics / embedding renorm)",
    "no_float64": "an upcast re-run needs a float64 kernel this API does not have (its float32 "
                  "calls are checked by the noise modes; float16/bfloat16 ones upcast to float32)",
    "other": "not a torch API",
    "optimizer": "an optimizer update under no_grad",
}

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PROBEKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: torch frames between a Python operator and the mode (skipped when reading the instruction)
_DISPATCH_FILES = frozenset({os.path.join(_TORCH_DIR, "overrides.py"),
                             os.path.join(_TORCH_DIR, "_tensor.py")})

# -- static classification sets (API base names, without prefix) ----------------------------------
VIEW = frozenset("""
__getitem__ view view_as reshape reshape_as flatten unflatten ravel t T mT H mH adjoint transpose
swapaxes swapdims permute movedim moveaxis squeeze unsqueeze expand expand_as broadcast_to narrow
select diagonal as_strided unfold split split_with_sizes tensor_split hsplit vsplit dsplit chunk
unbind detach alias real imag view_as_real view_as_complex indices values crow_indices
col_indices atleast_1d atleast_2d atleast_3d broadcast_tensors contiguous resolve_conj resolve_neg
conj align_as align_to rename refine_names
""".split())
COPY = frozenset("""
clone cat concat concatenate stack hstack vstack dstack column_stack row_stack flip fliplr flipud
roll rot90 repeat tile repeat_interleave index_select gather take take_along_dim masked_select
tril triu diag diag_embed diagflat block_diag narrow_copy select_scatter slice_scatter
diagonal_scatter as_strided_scatter pad constant_pad_nd zero_pad2d embedding one_hot
where masked_fill masked_scatter index_fill index_copy sort msort topk kthvalue
__deepcopy__ __reduce_ex__ __setstate__ __getstate__ data_ptr
""".split())
CONVERSION = frozenset("""
to type type_as float double half bfloat16 cpu cuda npu xpu mps int long short bool byte char
numpy tolist item __array__ __array_wrap__ __float__ __int__ __index__ __bool__ __complex__
__nonzero__ pin_memory share_memory_ to_dense to_sparse __dlpack__ __dlpack_device__
""".split())
CREATION = frozenset("""
zeros ones empty full arange range linspace logspace eye tensor as_tensor asarray from_numpy
frombuffer zeros_like ones_like empty_like full_like new_zeros new_ones new_empty new_full
new_tensor empty_strided scalar_tensor tril_indices triu_indices complex polar
""".split())
METADATA = frozenset("""
size dim ndimension numel nelement stride storage_offset is_contiguous element_size
is_floating_point is_complex is_signed is_nonzero get_device __len__ __repr__ __str__
__format__ __hash__ __iter__ __contains__ __reversed__ __dir__ __sizeof__ storage
untyped_storage is_set_to is_shared is_pinned is_same_size requires_grad_ retain_grad
register_hook register_post_accumulate_grad_hook backward dim_order __torch_function__
is_inference has_names __eq__ equal allclose isclose result_type can_cast promote_types
is_tensor is_storage is_grad_enabled
""".split())
#: random APIs whose output does not depend on their input's values (only on its shape): nothing
#: to check (``rand_like``; ``bernoulli(x, p=0.3)`` by its rule); ``uniform_``... are in-place
RANDOM_CREATION = frozenset("""
rand rand_like randint randint_like randn randn_like randperm
""".split())
#: the in-place forms of the Python operators (``x += y`` arrives as ``add_``)
INPLACE_DUNDERS = frozenset("""
__iadd__ __isub__ __imul__ __itruediv__ __idiv__ __ifloordiv__ __imod__ __ipow__ __imatmul__
__iand__ __ior__ __ixor__ __ilshift__ __irshift__ __setitem__ __delitem__
""".split())
#: private torch APIs that models reach through public ones (the mode sees only the private call:
#: the public wrapper is plain Python without a ``__torch_function__`` dispatch): checked like
#: public ones. ``F.grouped_mm`` -> ``torch._grouped_mm`` (the expert GEMMs of Mixture-of-Experts
#: layers, e.g. transformers' default ``grouped_mm`` experts), ``nn.utils.weight_norm`` /
#: ``parametrizations.weight_norm`` -> ``torch._weight_norm`` (wav2vec2's positional conv). The
#: other private calls are skipped as ``private`` and named in ``fb.coverage``
PUBLIC_PRIVATE = frozenset({"_grouped_mm", "_weight_norm"})
#: APIs without a float64 kernel: their float32 calls cannot be upcast (``no_float64``)
NO_FLOAT64 = frozenset({"_grouped_mm", "grouped_mm"})
#: in-place calls that write values not computed from the tensor's own: copies, fills, resizes
#: (exact: ``copy``), and the random fills, whose output does not depend on the input's values
#: (``creation``); the other in-place calls are checked (the original runs on the real tensor,
#: the re-runs on copies: ``state.py``)
INPLACE_COPY = frozenset("""
copy_ fill_ zero_ set_ resize_ resize_as_ fill_diagonal_ __setitem__ __delitem__
""".split())
RANDOM_FILLS = frozenset("""
uniform_ normal_ bernoulli_ exponential_ geometric_ cauchy_ log_normal_ random_
""".split())

# -- change_value: APIs whose result is invariant (or equivariant) to swapping two elements -------
#: element-wise on a single tensor (output elements follow the input's)
ELEMENTWISE = frozenset("""
abs neg negative exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square reciprocal sin cos tan
asin acos atan sinh cosh tanh asinh acosh atanh sigmoid logit erf erfc erfinv relu relu6 gelu silu
mish softplus softsign elu selu celu leaky_relu hardtanh hardswish hardsigmoid logsigmoid
tanhshrink softshrink hardshrink threshold sign sgn floor ceil round trunc frac clamp clip
clamp_min clamp_max pow add sub mul div true_divide __add__ __sub__ __mul__ __truediv__ __pow__
__neg__ __radd__ __rsub__ __rmul__ __rdiv__ __rpow__ softmax log_softmax softmin
""".split())
#: reductions: API name -> positional index of ``dim``
REDUCTIONS = {"sum": 1, "mean": 1, "nansum": 1, "nanmean": 1, "amax": 1, "amin": 1, "max": 1,
              "min": 1, "logsumexp": 1, "std": 1, "var": 1, "prod": 1, "norm": 2}

class ApiInfo:
    """What one torch callable is. ``skip`` is a key of ``REASONS`` or None (may be checked)."""

    __slots__ = ("prefix", "name", "key", "skip", "operators", "inplace_pos", "rule", "random",
                 "params", "inplace", "outplace", "autograd")

    def __init__(self, prefix: str, name: str, skip: str | None = None,
                 operators: dict | None = None, inplace_pos: int | None = None,
                 rule=None, random=None, params: dict | None = None,
                 inplace: bool = False) -> None:
        self.prefix = prefix            # Torch | Tensor | Functional | Other
        self.name = name                # API name as the user spells it (matmul, __add__)
        self.key = f"{prefix}.{name}"   # msprobe's name without counter and stage
        self.skip = skip
        #: (opcode, arg) -> full operator key, for methods Python operators arrive as
        self.operators = operators or {}
        #: positional index of an ``inplace`` parameter (Python functionals), or None
        self.inplace_pos = inplace_pos
        #: ``ARG_RULES`` entry: decided per call from the actual arguments (None: static only)
        self.rule = rule
        #: ``RANDOM_RULES`` entry: does this call draw from a generator (None: never)
        self.random = random
        #: argument name -> (position or None, default or ``MISSING``) (``parameters``), for
        #: the APIs whose rules read arguments; empty otherwise
        self.params = params or {}
        #: an in-place API by name (``add_``, ``relu_``, ``__iadd__``): it writes its first
        #: argument (``inplace_target``)
        self.inplace = inplace
        #: the out-of-place API computing what this in-place one writes (``state.out_of_place``
        #: fills it on first use; None: not looked up yet, False: there is none)
        self.outplace = None
        #: runs a backward pass (``Tensor.backward``, ``torch.autograd.backward`` / ``grad``):
        #: the mode stays active inside it (``intercept._Mode``), so the calls a custom
        #: ``autograd.Function.backward`` or a gradient hook makes are seen
        self.autograd = name in ("backward", "grad") and (
            prefix == "Tensor" or skip == "autograd")

    def __repr__(self) -> str:
        return f"ApiInfo({self.key!r}, skip={self.skip!r})"


#: an ApiInfo for property getters/setters (``x.shape``, ``p.grad``): not counted as calls
PROPERTY = ApiInfo("Tensor", "__get__", "metadata")

_OPNAMES = {0: "__add__", 1: "__and__", 2: "__floordiv__", 3: "__lshift__", 4: "__matmul__",
            5: "__mul__", 6: "__mod__", 7: "__or__", 8: "__pow__", 9: "__rshift__", 10: "__sub__",
            11: "__truediv__", 12: "__xor__", 13: "__iadd__", 14: "__iand__", 15: "__ifloordiv__",
            16: "__ilshift__", 17: "__imatmul__", 18: "__imul__", 19: "__imod__", 20: "__ior__",
            21: "__ipow__", 22: "__irshift__", 23: "__isub__", 24: "__itruediv__", 25: "__ixor__"}
#: torch method name -> the operator names that reach the mode as that method
_METHOD_OPERATORS = {
    "add": ("__add__",), "sub": ("__sub__",), "mul": ("__mul__",), "div": ("__truediv__",),
    "matmul": ("__matmul__",), "pow": ("__pow__",), "bitwise_and": ("__and__",),
    "__and__": ("__and__",), "bitwise_or": ("__or__",), "__or__": ("__or__",),
    "bitwise_xor": ("__xor__",), "__xor__": ("__xor__",), "floor_divide": ("__floordiv__",),
    "remainder": ("__mod__",), "__lshift__": ("__lshift__",), "__rshift__": ("__rshift__",),
    "bitwise_left_shift": ("__lshift__",), "bitwise_right_shift": ("__rshift__",),
    "add_": ("__iadd__",), "sub_": ("__isub__",), "mul_": ("__imul__",), "div_": ("__itruediv__",),
    "pow_": ("__ipow__",), "bitwise_and_": ("__iand__",), "__iand__": ("__iand__",),
    "bitwise_or_": ("__ior__",), "__ior__": ("__ior__",), "bitwise_xor_": ("__ixor__",),
    "__ixor__": ("__ixor__",), "floor_divide_": ("__ifloordiv__",), "remainder_": ("__imod__",),
    "__ilshift__": ("__ilshift__",), "__irshift__": ("__irshift__",),
    "lt": ("__lt__",), "le": ("__le__",), "eq": ("__eq__",), "__eq__": ("__eq__",),
    "ne": ("__ne__",), "__ne__": ("__ne__",), "gt": ("__gt__",), "ge": ("__ge__",),
    "neg": ("__neg__",), "bitwise_not": ("__invert__",),
}
_CMP = ("__lt__", "__le__", "__eq__", "__ne__", "__gt__", "__ge__")
_BINARY_OP = dis.opmap.get("BINARY_OP")
_COMPARE_OP = dis.opmap.get("COMPARE_OP")
_UNARY_NEGATIVE = dis.opmap.get("UNARY_NEGATIVE")
_UNARY_INVERT = dis.opmap.get("UNARY_INVERT")
_CMP_SHIFT = 0 if sys.version_info < (3, 12) else (4 if sys.version_info < (3, 13) else 5)


def _operators_for(name: str) -> dict:
    """(opcode, arg) -> ``Tensor.<operator>`` for a method Python operators reach the mode as."""
    ops = _METHOD_OPERATORS.get(name, ())
    table = {}
    for op in ops:
        full = f"Tensor.{op}"
        if op in _CMP and _COMPARE_OP is not None:
            table[(_COMPARE_OP, _CMP.index(op))] = full
        elif op == "__neg__" and _UNARY_NEGATIVE is not None:
            table[(_UNARY_NEGATIVE, None)] = full
        elif op == "__invert__" and _UNARY_INVERT is not None:
            table[(_UNARY_INVERT, None)] = full
        elif _BINARY_OP is not None:
            for arg, opname in _OPNAMES.items():
                if opname == op:
                    table[(_BINARY_OP, arg)] = full
    return table


def _prefix(func) -> tuple[str, str | None]:
    """(prefix, skip reason decided by origin alone)."""
    objclass = getattr(func, "__objclass__", None)
    qual = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", None) or ""
    if objclass is not None and issubclass(objclass, torch._C.TensorBase) or \
            qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor", None
    if module in ("torch._C._nn", "torch.nn.functional"):
        return "Functional", None
    if module.startswith("torch.distributed"):
        return "Torch", "collective"
    if module.startswith("torch.autograd"):
        return "Torch", "autograd"
    if module == "torch" or module.startswith(("torch._C", "torch.functional")) or \
            qual.startswith("_VariableFunctionsClass."):
        return "Torch", None
    if module.startswith("torch"):
        return "Torch", None
    return "Other", "other"


def _inplace_position(func) -> int | None:
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


#: an argument without a default
MISSING = object()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def parameters(func, name: str) -> dict:
    """``{argument name: (position or None, default or MISSING)}`` of a callable the mode sees:
    from its Python signature, or for a torch builtin (no signature) from the ATen schemas of
    ``aten::<name>`` (``self`` first, as a method's arguments arrive). An argument at different
    positions in two overloads has no position (read by keyword only), one with different
    defaults none; keyword-only arguments have no position."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        return {p.name: (i if p.kind in _POSITIONAL else None,
                         MISSING if p.default is p.empty else p.default)
                for i, p in enumerate(sig.parameters.values())}
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except Exception:  # no such operator
        return {}
    table: dict = {}
    for schema in schemas:
        if schema.overload_name == "out" or schema.overload_name.endswith("_out"):
            continue
        for i, a in enumerate(schema.arguments):
            if a.is_out:
                continue
            pos = None if a.kwarg_only else i
            default = a.default_value if a.has_default_value() else MISSING
            if a.name not in table:
                table[a.name] = (pos, default)
                continue
            have_pos, have_default = table[a.name]
            if have_pos != pos:
                have_pos = None
            if have_default is not MISSING and not _same(have_default, default):
                have_default = MISSING
            table[a.name] = (have_pos, have_default)
    return table


def _same(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def classify(func) -> ApiInfo:
    """The ``ApiInfo`` of a callable the mode saw (not cached here; see ``Classifier``)."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name in ("__get__", "__set__", "__delete__"):
        return PROPERTY
    prefix, skip = _prefix(func)
    rule = random = None
    if skip is None:
        rule = ARG_RULES.get(name)
        random = RANDOM_RULES.get(name)
        skip = None if rule is not None or random is not None else static_skip(name)
    inplace_pos = _inplace_position(func) if prefix == "Functional" else None
    params = parameters(func, name) if rule is not None or random is not None else None
    return ApiInfo(prefix, name, skip, _operators_for(name), inplace_pos, rule, random, params,
                   inplace=is_inplace_name(name))


def is_inplace_name(name: str) -> bool:
    """``add_``, ``relu_``, ``__iadd__``: an API that writes its first argument."""
    return name in INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def static_skip(name: str) -> str | None:
    """The reason an API of this name is never re-run, or None."""
    if name in VIEW:
        return "view"
    if name in METADATA:
        return "metadata"
    if name in CONVERSION:
        return "conversion"
    if is_inplace_name(name):
        if name.startswith("_") and not name.startswith("__"):
            return "private"
        if name in INPLACE_COPY:
            return "copy"
        if name in RANDOM_FILLS:
            return "creation"
        base = static_skip(name[:-1]) if not name.startswith("__") else None
        return base if base in _EXACT_KINDS else None   # checked: runs on copies (state.py)
    if name in CREATION or name in RANDOM_CREATION:
        return "creation"
    if name in COPY:
        return "copy"
    if name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and \
            name not in PUBLIC_PRIVATE:
        return "private"
    return None


#: skip reasons of calls whose result is exact (an in-place form of one is exact too)
_EXACT_KINDS = frozenset({"view", "copy", "conversion", "creation", "metadata"})


class Classifier:
    """``classify`` with a per-callable cache. ``cache`` (callable -> ``ApiInfo``) is public so
    the interception hot path can look a callable up with one ``dict.get`` before calling this."""

    def __init__(self) -> None:
        self.cache: dict = {}

    def __call__(self, func) -> ApiInfo:
        try:
            info = self.cache.get(func)
        except TypeError:  # unhashable callable: classified every time
            info = None
        if info is None:
            try:
                info = classify(func)
            except Exception:  # an odd callable: never re-run it
                info = ApiInfo("Other", getattr(func, "__name__", "unknown"), "other")
            try:
                self.cache[func] = info
            except TypeError:  # unhashable callable
                pass
        return info


_INSTRUCTIONS: dict = {}


def _instruction(code, i: int):
    """(opcode, arg) at byte ``i`` of ``code`` (cached: ``co_code`` builds a new bytes object)."""
    key = (code, i)
    ins = _INSTRUCTIONS.get(key)
    if ins is None:
        raw = code.co_code
        op = raw[i]
        if op == _BINARY_OP:
            ins = (op, raw[i + 1])
        elif op == _COMPARE_OP:
            ins = (op, raw[i + 1] >> _CMP_SHIFT)
        else:
            ins = (op, None)
        if len(_INSTRUCTIONS) < 100_000:
            _INSTRUCTIONS[key] = ins
    return ins


def operator_key(info: ApiInfo, frame) -> str:
    """``Tensor.__add__`` for ``x + y`` (read from the calling instruction), else ``info.key``."""
    try:
        while frame is not None and frame.f_code.co_filename in _DISPATCH_FILES:
            frame = frame.f_back
        if frame is None:
            return info.key
        return info.operators.get(_instruction(frame.f_code, frame.f_lasti), info.key)
    except Exception:
        return info.key


#: code object -> is it torch's or probekit's (skipped by ``call_site``)
_INTERNAL_CODE: dict = {}


def call_site(frame) -> str:
    """``file.py:123`` of the first frame outside torch and probekit (the user's line)."""
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:
            fname = code.co_filename
            internal = fname.startswith(_TORCH_DIR) or fname.startswith(_PROBEKIT_DIR)
            if len(_INTERNAL_CODE) < 100_000:
                _INTERNAL_CODE[code] = internal
        if not internal:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


# -- per-call decisions ---------------------------------------------------------------------------
def arg(info: ApiInfo, args: tuple, kwargs: dict, name: str, default=None):
    """The value of argument ``name`` in this call: by keyword, else at its position in the
    callable's signature (``info.params``), else its default there, else ``default``."""
    if name in kwargs:
        return kwargs[name]
    pos, dflt = info.params.get(name, (None, MISSING))
    if pos is not None and len(args) > pos:
        return args[pos]
    return default if dflt is MISSING else dflt


def dynamic_skip(info: ApiInfo, args: tuple, kwargs: dict) -> str | None:
    """A reason decided by this call's arguments (``accumulate``, ``reduce``...)."""
    if info.rule is not None:
        return info.rule(info, args, kwargs)[0]
    return None


def inplace_flag(info: ApiInfo, args: tuple, kwargs: dict) -> bool:
    """``inplace=True`` given to a functional that has the parameter (``F.relu``, ``F.silu``,
    ``F.dropout``...)."""
    pos = info.inplace_pos
    if pos is None:
        return False
    return bool(kwargs["inplace"] if "inplace" in kwargs else (len(args) > pos and args[pos]))


def written(info: ApiInfo, args: tuple, kwargs: dict) -> tuple:
    """The tensors this call writes: ``self`` of an in-place API (``add_``, ``relu_``,
    ``index_put_``), the input of a functional called with ``inplace=True``, the ``out=``
    tensors, the running statistics of a training batch norm, the weight of
    ``embedding(max_norm=...)`` (empty for nearly every call)."""
    tensors = list(state_positions(info, args, kwargs)) if info.rule is not None else []
    if info.inplace and args and isinstance(args[0], torch.Tensor):
        if not any(args[0] is t for t in tensors):
            tensors.append(args[0])
    elif info.inplace_pos is not None and inplace_flag(info, args, kwargs):
        x = kwargs["input"] if "input" in kwargs else (args[0] if args else None)
        if isinstance(x, torch.Tensor):
            tensors.append(x)
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        tensors.extend(t for t in (out if isinstance(out, (tuple, list)) else (out,))
                       if isinstance(t, torch.Tensor))
    return tuple(tensors)


def random_draw(info: ApiInfo, args: tuple, kwargs: dict):
    """For a random API (``RANDOM_RULES``): a ``Draw`` when this call draws from a generator, a
    skip reason when there is nothing to check (an eval dropout is the identity: ``copy``;
    ``bernoulli(x, p)`` does not depend on ``x``: ``creation``), None when it draws nothing with
    these arguments (``rrelu`` in eval: a plain call). None for every other API."""
    if info.random is None:
        return None
    return info.random(info, args, kwargs)


def state_positions(info: ApiInfo, args: tuple, kwargs: dict) -> tuple:
    """The tensors this call writes in place (``self`` of ``index_put_``, the running statistics of
    a training batch norm, the weight of ``embedding(max_norm=...)``), to be cloned for re-runs."""
    if info.rule is None:
        return ()
    return tuple(t for t in info.rule(info, args, kwargs)[1] if isinstance(t, torch.Tensor))


# -- classification by actual arguments -----------------------------------------------------------
# Each rule returns (skip reason or None, tensors the call writes in place).
def _inplace_self(info: ApiInfo, args: tuple) -> tuple:
    return (args[0],) if info.name.endswith("_") and args else ()


def _always_sums(info, args, kwargs):
    """index_add, scatter_add: the source is summed into the destination."""
    return None, _inplace_self(info, args)


def _accumulate_flag(info, args, kwargs):
    """index_put / put: a sum with ``accumulate=True``, an exact copy otherwise."""
    if not arg(info, args, kwargs, "accumulate", False):
        return "copy", ()
    return None, _inplace_self(info, args)


#: reductions that select one of the values (exact) rather than combine them
_EXACT_REDUCE = frozenset({"amax", "amin", "max", "min"})


def _reduce_arg(info, args, kwargs):
    """scatter(reduce=...), scatter_reduce, index_reduce: exact for amax/amin and plain scatter."""
    reduce = arg(info, args, kwargs, "reduce", None)
    if reduce is None or reduce in _EXACT_REDUCE:
        return "copy", ()
    return None, _inplace_self(info, args)


def _embedding(info, args, kwargs):
    """F.embedding: a lookup (exact) unless ``max_norm`` renormalises the weight in place."""
    if info.prefix != "Functional" or arg(info, args, kwargs, "max_norm", None) is None:
        return "copy", ()
    return None, (arg(info, args, kwargs, "weight"),)


def _embedding_bag(info, args, kwargs):
    """embedding_bag: sum/mean bags are sums; max bags are exact unless weighted/renormalised."""
    mode = arg(info, args, kwargs, "mode", "mean" if info.prefix == "Functional" else 0)
    mode = {0: "sum", 1: "mean", 2: "max"}.get(mode, mode)   # torch.embedding_bag: 0/1/2
    max_norm = arg(info, args, kwargs, "max_norm", None)
    weighted = arg(info, args, kwargs, "per_sample_weights", None) is not None
    state = (arg(info, args, kwargs, "weight"),) if max_norm is not None else ()
    if mode == "max" and max_norm is None and not weighted:
        return "copy", ()
    return None, state


def _batch_norm(info, args, kwargs):
    """Training batch norm normalises with batch statistics and updates the running ones
    (``F.batch_norm(input, running_mean, running_var, ...)``, ``torch.batch_norm(input, weight,
    bias, running_mean, running_var, training, ...)``: read by name)."""
    if not arg(info, args, kwargs, "training", False):
        return None, ()
    return None, (arg(info, args, kwargs, "running_mean"), arg(info, args, kwargs, "running_var"))


def _instance_norm(info, args, kwargs):
    """instance_norm with running statistics and use_input_stats updates them."""
    if not arg(info, args, kwargs, "use_input_stats", True):
        return None, ()
    return None, (arg(info, args, kwargs, "running_mean"), arg(info, args, kwargs, "running_var"))


#: API name -> rule(info, args, kwargs) -> (skip reason or None, tensors written in place)
ARG_RULES = {
    "index_add": _always_sums, "index_add_": _always_sums,
    "scatter_add": _always_sums, "scatter_add_": _always_sums,
    "index_put": _accumulate_flag, "index_put_": _accumulate_flag,
    "put": _accumulate_flag, "put_": _accumulate_flag,
    "scatter": _reduce_arg, "scatter_": _reduce_arg,
    "scatter_reduce": _reduce_arg, "scatter_reduce_": _reduce_arg,
    "index_reduce": _reduce_arg, "index_reduce_": _reduce_arg,
    "embedding": _embedding, "embedding_bag": _embedding_bag,
    "batch_norm": _batch_norm, "instance_norm": _instance_norm,
}


# -- random calls ----------------------------------------------------------------------------------
class Draw:
    """A call that draws from a generator: its API name (what ``rng.py`` knows of its draws),
    the explicit ``generator=`` it draws from (None: the device's default generator), and
    whether it was found by watching the generators rather than by a rule."""

    __slots__ = ("name", "generator", "detected")

    def __init__(self, name: str, generator=None, detected: bool = False) -> None:
        self.name = name
        self.generator = generator
        #: found drawing by watching the generators (``rng.observe``), not by a rule: nothing
        #: is known of its draws (``DTYPE_FREE``, ``VALUE_DRAWS``), its re-runs are verified
        self.detected = detected


def _draw(info, args, kwargs) -> Draw:
    return Draw(info.name, arg(info, args, kwargs, "generator", None))


def _dropout(info, args, kwargs):
    """The dropout family draws a mask in training with ``p > 0``; otherwise it returns its input
    (an identity: nothing to check). ``training`` (Python functionals) or ``train`` (torch's)."""
    train = arg(info, args, kwargs, "training", MISSING) if "training" in info.params else \
        arg(info, args, kwargs, "train", True)
    if train is MISSING or train is None:   # native_dropout(train=None): training
        train = True
    if not train or not arg(info, args, kwargs, "p", 0.5):
        return "copy"
    return _draw(info, args, kwargs)


def _training(info, args, kwargs):
    """rrelu: a random slope per negative element in training, a fixed one otherwise."""
    if not arg(info, args, kwargs, "training", False):
        return None
    return _draw(info, args, kwargs)


def _bernoulli(info, args, kwargs):
    """bernoulli(p_tensor) draws with the input's probabilities; with a float ``p`` the output
    does not depend on the input's values (nothing to check)."""
    if arg(info, args, kwargs, "p", None) is not None:
        return "creation"
    return _draw(info, args, kwargs)


def _sdpa(info, args, kwargs):
    """scaled_dot_product_attention draws a dropout mask when ``dropout_p > 0``."""
    if not arg(info, args, kwargs, "dropout_p", 0.0):
        return None
    return _draw(info, args, kwargs)


def _mha(info, args, kwargs):
    """multi_head_attention_forward draws a dropout mask with ``dropout_p > 0`` in training."""
    if not arg(info, args, kwargs, "dropout_p", 0.0) or not arg(info, args, kwargs, "training",
                                                                True):
        return None
    return _draw(info, args, kwargs)


def _fractional(info, args, kwargs):
    """fractional max pooling draws its pooling regions unless ``_random_samples`` is given."""
    if arg(info, args, kwargs, "_random_samples", None) is not None:
        return None
    return _draw(info, args, kwargs)


#: APIs that may draw from a generator -> rule(info, args, kwargs) -> ``Draw`` (it draws), a skip
#: reason (nothing to check), or None (it draws nothing with these arguments: a plain call)
RANDOM_RULES = {
    **{name: _dropout for name in ("dropout", "dropout1d", "dropout2d", "dropout3d",
                                   "alpha_dropout", "feature_alpha_dropout", "feature_dropout",
                                   "native_dropout", "dropout_", "alpha_dropout_",
                                   "feature_alpha_dropout_", "feature_dropout_")},
    "rrelu": _training, "rrelu_": _training, "bernoulli": _bernoulli,
    "normal": _draw, "gumbel_softmax": _draw, "multinomial": _draw,
    "poisson": _draw, "binomial": _draw,
    "scaled_dot_product_attention": _sdpa, "multi_head_attention_forward": _mha,
    **{name: _fractional for name in ("fractional_max_pool2d", "fractional_max_pool3d",
                                      "fractional_max_pool2d_with_indices",
                                      "fractional_max_pool3d_with_indices",
                                      "_fractional_max_pool2d", "_fractional_max_pool3d")},
}
#: random APIs whose CPU kernels draw the same numbers whatever the floating dtype (fp16/bf16,
#: fp32, fp64; pinned per dtype pair by tests/unit/test_freebench_random.py): an upcast re-run
#: (improve_precision, to_cpu) replays their draws. ``bernoulli``, ``normal`` and fractional
#: pooling draw differently per dtype
DTYPE_FREE = frozenset("""
dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout feature_dropout
native_dropout rrelu gumbel_softmax scaled_dot_product_attention multi_head_attention_forward
dropout_ alpha_dropout_ feature_alpha_dropout_ feature_dropout_ rrelu_
""".split())
#: random APIs whose number of draws depends on the input's values (rejection sampling): a
#: re-run on changed values falls out of step with the real call's stream
VALUE_DRAWS = frozenset({"poisson", "binomial"})
#: attention: on CUDA its backends (flash, memory-efficient, cuDNN, math) each draw their own
#: dropout stream and are chosen by dtype, layout and grad mode
ATTENTION = frozenset({"scaled_dot_product_attention", "multi_head_attention_forward"})
