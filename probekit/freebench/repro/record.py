"""A repro record: what a free-benchmark finding's call needs to be run again by a script.

The session saves one when the float64 analysis (``cause.py``) confirms a finding while the
call's inputs exist -- once per call site (a site is analysed once), from the engine's
``_explain`` (``Recorder``). ``folder.py`` turns a record into a standalone folder, in the session
(``fb.repro(row)``) or later from the dump folder alone (``probekit freebench repro DUMP ROW``).

What a record holds (``capture``):

* the call: the torch expression of the API (``torch.nn.functional.layer_norm``), its arguments
  as the call made them (positional and keyword, nested lists/tuples/dicts; non-tensor values
  as Python literals), the stage and, for the backward stage, the upstream gradient, the inputs
  whose gradients were computed and the output they flow from; the autocast dtype in force, the
  device type, and for a random call the CPU generator's state before it;
* the inputs as the op computed with them (autocast's casts included; the tensors a call writes
  as they were before it): each distinct tensor saved (its storage span, so shape, dtype and
  strides are kept, aliasing too) while the record's tensors stay within ``SAVE_LIMIT``, the
  smallest first; above it a tensor is described by its value statistics (``value_stats``) and
  generated with a seed (``repro_helpers.generate``), and the record is checked to still
  reproduce with the generated inputs (the same ``cause`` analysis); if not, the inputs are
  saved after all up to ``FALLBACK_LIMIT``, else the record says it did not reproduce;
* each confirmed output's cause, dtype, shape and the ``Judge`` it was judged with (family,
  reduction length, the dtype, the configured threshold), from which ``folder.py`` rebuilds the
  bound with ``scales.judge``; the outputs the run computed, when small (``EXPECTED_LIMIT``);
* the environment where it was found (torch version and build, CPU capability, device,
  threads, Python, platform).

On disk: ``{dump_path}/repro/records/{safe_name(api_name)}.rank{rank}.pt``, one file replaced
atomically (``atomic_write``), readable with ``torch.load(weights_only=True)``: ``{"format",
"version", "meta": JSON text, "tensors": {name: tensor}}``. A session saves at most
``SESSION_LIMIT`` bytes of tensors over all its records; after that its records hold statistics
only (a few KB each).
"""
from __future__ import annotations

import ast
import io
import json
import math
import os
import platform
import re

import torch

from ...atomic import atomic_write
from ...errors import ReproError
from ...log import Once, get_logger
from ...paths import safe_join, safe_name
from ..judge import cause, handlers
from .. import names
from ..perturb import perturb
from . import helpers as repro_helpers
from ..engine import state
from ..judge.guards import modes_off, no_autocast
from ..judge.judging import Judging

log = get_logger("probekit.freebench")

FORMAT = "probekit-repro-record"
VERSION = 1
#: a record's inputs are saved as they were up to this many bytes (smallest tensors first)
SAVE_LIMIT = 4 << 20
#: ... and up to this many when generated inputs do not reproduce the finding
FALLBACK_LIMIT = 32 << 20
#: the outputs the run computed are kept (to compare a script's recomputation) up to this size
EXPECTED_LIMIT = 1 << 20
#: the tensors of every record of one session together
SESSION_LIMIT = 256 << 20
#: a saved tensor whose strides reach more than this many times its elements is saved compact
SPARSE_FACTOR = 4
#: value statistics: quantiles of the finite values, elements sampled, most distinct values
#: a tensor is drawn from as discrete values
QUANTILES = 65
SAMPLE = 1 << 20
DISCRETE = 32
SEED = 1000


def records_dir(dump_path: str) -> str:
    return safe_join(dump_path, "repro", "records")


def record_path(dump_path: str, api_name: str, rank: int) -> str:
    """Where the record of ``api_name`` on ``rank`` lives (the name through ``safe_name``)."""
    return os.path.join(records_dir(dump_path), safe_name(f"{api_name}.rank{int(rank)}") + ".pt")


# -- the call's expression and arguments ------------------------------------------------------------
_NAMESPACES = ("linalg", "special", "fft")


def _resolve(text: str):
    obj = torch
    for part in text.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def expression(func, info) -> tuple[str, bool]:
    """(``torch...`` expression of the API, whether it is a ``Tensor`` method). The callable
    must be the object that expression names in a fresh ``import torch``; a probekit wrapper of
    a random call (its replay) is named by the API's name."""
    name = info.name
    cands = []
    if info.prefix == "Tensor":
        cands.append((f"torch.Tensor.{name}", True))
    elif info.prefix == "Functional":
        cands += [(f"torch.nn.functional.{name}", False), (f"torch._C._nn.{name}", False)]
    elif info.prefix == "Torch":
        module = getattr(func, "__module__", "") or ""
        if module == "torch._ops.aten" or module.startswith("torch._ops.aten"):
            cands.append((f"torch.ops.aten.{name}", False))
        cands.append((f"torch.{name}", False))
        for ns in _NAMESPACES:
            if name.startswith(ns + "_"):
                cands.append((f"torch.{ns}.{name[len(ns) + 1:]}", False))
        cands.append((f"torch.nn.functional.{name}", False))
    for text, method in cands:
        if _resolve(text) is func:
            return text, method
    wrapper = getattr(func, "__module__", "") or ""
    if wrapper.startswith("probekit."):
        for text, method in cands:
            if _resolve(text) is not None:
                return text, method
    raise ReproError(f"{info.key}: {func!r} is not a torch API a script can call with only torch "
                     "imported (a custom op or a callable outside torch)")


def literal(v) -> str:
    """``v`` as Python source a script evaluates with ``torch`` and ``math`` imported."""
    if isinstance(v, float):
        text = ("math.nan" if math.isnan(v) else ("math.inf" if v > 0 else "-math.inf")) \
            if not math.isfinite(v) else repr(v)
    elif v is None or isinstance(v, (bool, int, str, complex, slice, range)) or v is Ellipsis:
        text = repr(v)
    elif isinstance(v, torch.dtype) or isinstance(v, (torch.memory_format, torch.layout)):
        text = str(v)
    elif isinstance(v, torch.device):
        text = f"torch.device({str(v)!r})"
    elif isinstance(v, torch.Size):
        text = f"torch.Size({list(v)!r})"
    else:
        raise ReproError(f"an argument of type {type(v).__name__} ({v!r:.60}) cannot be written "
                         "into a script; accepted: tensors, numbers, strings, None, dtypes, "
                         "devices, sizes, slices, and lists/tuples/dicts of them")
    back = parse_literal(text)
    if not (back == v or (isinstance(v, float) and math.isnan(v) and math.isnan(back))):
        raise ReproError(f"the argument {v!r:.60} does not survive being written as {text!r}")
    return text


#: what ``literal`` writes besides Python's own literals: names of ``torch`` and ``math``
_NAMES = {"math.nan": math.nan, "math.inf": math.inf}
_CALLS = {"slice": slice, "range": range}


def parse_literal(text: str):
    """The value of a text ``literal`` wrote, parsed, never evaluated (a record is data: a dump
    folder comes from elsewhere). Accepted: numbers (a sign, ``math.nan``/``math.inf``, a
    complex ``(a+bj)``), strings, booleans, None, ``...``, ``torch.<dtype>`` (and memory
    formats, layouts), ``torch.device('...')``, ``torch.Size([ints])``, ``slice(...)`` and
    ``range(...)`` of integers or None; anything else raises ``ReproError`` naming it."""
    import ast

    if not isinstance(text, str) or len(text) > 4096:
        raise ReproError(f"{text!r:.80} is not a literal a repro record holds (a string of at "
                         "most 4096 characters)")
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ReproError(f"{text!r:.80} is not a literal a repro record holds") from None

    def bad():
        return ReproError(f"{text!r:.80} is not a literal a repro record holds; accepted: "
                          "numbers, strings, booleans, None, torch dtypes, torch.device('...'), "
                          "torch.Size([...]), slice(...), range(...)")

    def number(n):
        if isinstance(n, ast.Constant) and type(n.value) in (int, float, complex):
            return n.value
        if isinstance(n, ast.Attribute) and _dotted(n) in _NAMES:
            return _NAMES[_dotted(n)]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = number(n.operand)
            return -v if isinstance(n.op, ast.USub) else +v
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):
            a, b = number(n.left), number(n.right)   # a complex: (a+bj)
            if not (isinstance(b, complex) and not isinstance(a, complex)):
                raise bad()
            return a + b if isinstance(n.op, ast.Add) else a - b
        raise bad()

    def small(n):   # an argument of slice / range: an integer or None
        if isinstance(n, ast.Constant) and n.value is None:
            return None
        v = number(n)
        if type(v) is not int:
            raise bad()
        return v

    if isinstance(node, ast.Constant):
        if node.value is Ellipsis or type(node.value) in (str, bool, int, float,
                                                          complex, type(None)):
            return node.value
        raise bad()
    if isinstance(node, ast.Name) and node.id == "Ellipsis":
        return Ellipsis
    if isinstance(node, ast.Attribute):
        name = _dotted(node)
        if name in _NAMES:
            return _NAMES[name]
        if name and name.count(".") == 1 and name.startswith("torch."):
            value = getattr(torch, name[6:], None)
            if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
                return value
        raise bad()
    if isinstance(node, ast.Call) and not node.keywords:
        name = _dotted(node.func)
        args = node.args
        if name == "torch.device" and len(args) == 1 and isinstance(args[0], ast.Constant) \
                and isinstance(args[0].value, str):
            return torch.device(args[0].value)
        if name == "torch.Size" and len(args) == 1 and isinstance(args[0], ast.List):
            dims = [small(a) for a in args[0].elts]
            if any(d is None for d in dims):
                raise bad()
            return torch.Size(dims)
        if name in _CALLS and 1 <= len(args) <= 3:
            return _CALLS[name](*[small(a) for a in args])
        raise bad()
    return number(node)


def _dotted(node) -> str | None:
    """``a.b.c`` of a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def spec_json(spec):
    """``perturb.flatten``'s spec as JSON (``"flat"``, or nested ``[type, items]``)."""
    if spec == perturb.flatten((), {})[1]:
        return "flat"

    def walk(node):
        if node is None:
            return None
        tp, items = node
        if tp is dict:
            return ["dict", [[k, walk(v)] for k, v in items]]
        return [tp.__name__, [walk(o) for o in items]]

    return [walk(spec[0]), walk(spec[1])]


def argument_names(api, name: str, spec, n_leaves: int) -> dict:
    """``{leaf position: argument name}`` of the top-level arguments (from the API's signature
    or ATen schema, ``names.parameters``; keyword arguments by their keyword)."""
    try:
        params = names.parameters(api, name)
    except Exception:
        params = {}
    by_pos = {pos: n for n, (pos, _) in params.items() if pos is not None}
    if spec == perturb.flatten((), {})[1]:
        return {i: by_pos[i] for i in range(n_leaves) if i in by_pos}
    out, leaf = {}, 0

    def count(node) -> int:
        if node is None:
            return 1
        tp, items = node
        return sum(count(v[1] if tp is dict else v) for v in items)

    for k, node in enumerate(spec[0][1]):
        if node is None and k in by_pos:
            out[leaf] = by_pos[k]
        leaf += count(node)
    for key, node in spec[1][1]:
        if node is None:
            out[leaf] = key
        leaf += count(node)
    return out


# -- the tensors ------------------------------------------------------------------------------------
def span(t: torch.Tensor) -> int:
    """Elements of storage the tensor's strides reach (from its offset)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def storage(t: torch.Tensor):
    """(1-D CPU copy of the storage span, shape, stride): ``repro_helpers.layout`` rebuilds the
    tensor with its strides. A tensor whose strides reach far more than its elements (a sparse
    slice) is stored compact, with the dense strides of its dimension order."""
    t = t.detach()
    if span(t) > SPARSE_FACTOR * max(1, t.numel()):
        t = torch.empty_like(t, memory_format=torch.preserve_format).copy_(t)
        if span(t) != t.numel():
            t = t.contiguous()
    n = span(t)
    base = t.as_strided((n,), (1,)).clone().cpu() if n else t.new_empty(0).cpu()
    return base, list(t.shape), list(t.stride())


def value_stats(t: torch.Tensor) -> dict:
    """What ``repro_helpers.generate`` draws from: the shares of NaN/+Inf/-Inf, and the finite
    values' quantiles, or the values and frequencies of a tensor with at most ``DISCRETE``
    distinct ones; mean, std, min and max for the script's header. At most ``SAMPLE`` elements
    are read (drawn with a generator of its own: the training's random stream is not touched)."""
    flat = t.detach().reshape(-1)
    if flat.numel() > SAMPLE:
        gen = torch.Generator(device=flat.device).manual_seed(0)
        flat = flat[torch.randint(0, flat.numel(), (SAMPLE,), generator=gen,
                                  device=flat.device)]
    x = flat.to(torch.float64).cpu()
    n = max(1, x.numel())
    out = {"nan": float(x.isnan().sum()) / n, "posinf": float((x == math.inf).sum()) / n,
           "neginf": float((x == -math.inf).sum()) / n}
    finite = x[x.isfinite()]
    if finite.numel():
        out.update(mean=finite.mean().item(), std=finite.std(unbiased=False).item(),
                   min=finite.min().item(), max=finite.max().item())
    values, counts = torch.unique(finite, return_counts=True)
    if 0 < values.numel() <= DISCRETE:
        out["values"] = values.tolist()
        out["freqs"] = (counts.double() / counts.sum()).tolist()
    elif finite.numel():
        q = torch.linspace(0, 1, QUANTILES, dtype=torch.float64)
        out["quantiles"] = torch.quantile(finite, q).tolist()
    else:
        out["quantiles"] = []
    return out


def environment(device: str = "cpu") -> dict:
    """The environment a kernel team asks for: torch version and build, CPU capability, device,
    threads, Python, platform."""
    env = {"torch": torch.__version__, "git": torch.version.git_version,
           "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
           "debug": bool(torch.version.debug),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "mkl": torch.backends.mkl.is_available(),
           "mkldnn": torch.backends.mkldnn.is_available(),
           "threads": torch.get_num_threads(), "python": platform.python_version(),
           "platform": platform.platform(), "device": device}
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
    return env


# -- capture ----------------------------------------------------------------------------------------
def judge_entry(index, o, desc, why, fb, plan=None) -> dict:
    """A confirmed output's cause and the ``Judge`` it was judged with (``scales.judge``'s
    arguments, so ``folder.py`` can rebuild it for other shapes)."""
    j = desc[7] if len(desc) > 7 and desc[7] is not None else cause.judge_of(desc)
    judged = desc[6]
    formula_ok = True
    if plan is not None and plan.get(index) is not None:
        formula_ok = plan[index][2]
    if j.fam == "multilinear" or (j.fam == "arithmetic" and desc[7] is not None and
                                  j.source in ("data", "count")):
        formula_ok = j.data            # its data-aware bound's variant (scales.data_variant)
    formula_ok = formula_ok if isinstance(formula_ok, str) else bool(formula_ok)
    return {"index": int(index), "cause": str(why), "dtype": str(o.dtype).replace("torch.", ""),
            "shape": list(o.shape), "judged_dtype": str(judged).replace("torch.", ""),
            "fam": j.fam, "k": int(j.k), "kind": j.kind, "thr": float(j.thr),
            "source": j.source, "upcast": bool(j.upcast), "factor": float(j.factor),
            "override": fb.threshold_for(handlers.dtype_key(judged)), "formula_ok": formula_ok}


def make_call(func, spec, leaves: list, tensor_pos: list):
    """``call(*tensors)``: ``func`` on ``leaves`` with the tensors at ``tensor_pos`` replaced."""
    def call(*tensors):
        full = list(leaves)
        for p, t in zip(tensor_pos, tensors):
            full[p] = t
        a, kw = perturb.unflatten(full, spec)
        return func(*a, **kw)
    return call


class Captured:
    """A record in memory: ``meta`` (JSON-able) and ``tensors`` (name -> CPU tensor)."""

    __slots__ = ("meta", "tensors")

    def __init__(self, meta: dict, tensors: dict) -> None:
        self.meta, self.tensors = meta, tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _tensor_names(leaves: list, g) -> tuple[dict, dict, list]:
    """(name -> tensor, alias name -> name, tensor positions): one name per distinct tensor
    (``x<position of first use>``; ``g`` the upstream gradient)."""
    named, aliases, pos, seen = {}, {}, [], {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            pos.append(i)
            name = f"x{i}"
            first = seen.get(id(x))
            if first is None:
                seen[id(x)] = name
                named[name] = x
            else:
                aliases[name] = first
    if g is not None:
        named["g"] = g
    return named, aliases, pos


def capture(info: dict, findings: list, *, name: str, mode_name: str, fb, step: int, rank: int,
            budget: int = SAVE_LIMIT, fallback: int = FALLBACK_LIMIT) -> Captured:
    """The record of one analysed call (``info``: what ``intercept.py`` / ``backward.py`` attach
    to their ``explain``; ``findings``: ``[(output index, original output, descriptor,
    cause)]``). ``budget``: bytes of tensors this record may save; ``fallback``: how many when
    generated inputs do not reproduce the finding."""
    call_obj = info["call"]
    api, api_info = info.get("api") or info["func"], call_obj.info
    if call_obj.called is not None:   # in place / out=: the script makes the call the user made
        api, api_info = call_obj.called
    expr, method = expression(api, api_info)
    stage = info["stage"]
    spec = info["spec"]
    leaves = list(info["fresh"]())
    g = info.get("g")
    if call_obj.replay is not None and (len(call_obj.replay.gens) != 1 or
                                        call_obj.replay.gens[0] is not torch.default_generator):
        raise ReproError(f"{name}: a random call drawing from a CUDA or explicit generator (a "
                         "script replays the CPU generator only)")
    texts = [None if isinstance(x, torch.Tensor) else literal(x) for x in leaves]
    named, aliases, tensor_pos = _tensor_names(leaves, g)
    device = next((x.device.type for x in named.values() if perturb.is_float(x)), "cpu")
    autocast = info.get("autocast") if stage == "backward" else call_obj.autocast
    plan = info.get("plan")
    judged = [judge_entry(i, o, desc, why, fb, plan) for i, o, desc, why in findings]
    case = {"stage": stage, "device": device,
            "autocast": None if autocast is None else str(autocast).replace("torch.", ""),
            "tensor_pos": tensor_pos, "judged": [e["index"] for e in judged],
            "diff": list(info.get("diff") or []), "out_index": int(info.get("out_index") or 0)}
    if call_obj.called is not None:   # it writes its inputs: differentiated on copies of them
        case["writes"] = True
    sizes = {n: span(t) * t.element_size() for n, t in named.items()}
    saved, used = set(), 0
    for n in sorted(named, key=lambda k: (sizes[k], k)):
        if used + sizes[n] <= budget or named[n].is_complex():   # complex: never generated
            saved.add(n)
            used += sizes[n]
    arg_names = argument_names(api, api_info.name, spec, len(leaves))
    meta = {"format": FORMAT, "version": VERSION, "api_name": name, "key": call_obj.info.key,
            "api": call_obj.info.name, "expr": expr, "method": method, "stage": stage,
            "step": int(step), "rank": int(rank), "pert_mode": mode_name,
            "leaves": texts, "spec": spec_json(spec), "aliases": aliases, "case": case,
            "names": {str(i): n for i, n in arg_names.items()},
            "judged": judged, "env": environment(device), "rng": call_obj.replay is not None,
            "tensors": {}, "generated_check": None, "expected": []}
    tensors = {}
    gen_specs = {}
    for k, (n, t) in enumerate(named.items()):
        if n in saved:
            base, shape, stride = storage(t)
            tensors[n] = base
            meta["tensors"][n] = {"stored": "saved", "shape": shape, "stride": stride,
                                  "dtype": str(t.dtype).replace("torch.", "")}
        else:
            spec_n = {"stored": "generated", "shape": list(t.shape), "stride": list(t.stride()),
                      "dtype": str(t.dtype).replace("torch.", ""), "span": span(t),
                      "seed": SEED + k}
            spec_n.update(value_stats(t))
            meta["tensors"][n] = gen_specs[n] = spec_n
    if call_obj.replay is not None:
        tensors["rng"] = call_obj.replay.before[0].clone()
    if gen_specs:
        check = _check_generated(info, findings, meta, tensors, leaves, g)
        meta["generated_check"] = check
        if not check["reproduced"]:
            total = sum(sizes.values())
            if total <= fallback:
                for n, t in named.items():
                    if n in gen_specs:
                        base, shape, stride = storage(t)
                        tensors[n] = base
                        meta["tensors"][n] = {"stored": "saved", "shape": shape,
                                              "stride": stride,
                                              "dtype": str(t.dtype).replace("torch.", "")}
                check["fallback"] = "saved"
                gen_specs = {}
    if not gen_specs:   # the outputs the run computed, within what the budget leaves
        left = budget - sum(t.numel() * t.element_size() for t in tensors.values())
        for i, o, _, _ in findings:
            n = o.numel() * o.element_size() if isinstance(o, torch.Tensor) else left + 1
            if n <= min(EXPECTED_LIMIT, left):
                tensors[f"o{i}"] = o.detach().contiguous().cpu().clone()
                meta["expected"].append(int(i))
                left -= n
    return Captured(meta, tensors)


def _check_generated(info, findings, meta, tensors, leaves, g) -> dict:
    """Does the finding reproduce with the generated inputs? The same ``cause`` analysis on
    them (the kernel's result recomputed): ``{"reproduced", "causes"}``."""
    gen_leaves, gen_g = materialize(meta, tensors, leaves, g)
    case = meta["case"]
    func = info["func"]
    called = info["call"].called   # an in-place call's kernel is the call the user made
    kernel = called[0] if called is not None and info["call"].replay is None else func
    call = make_call(kernel, info["spec"], gen_leaves, case["tensor_pos"])
    causes = analyse(func, info["spec"], gen_leaves, gen_g, case, call,
                     [(i, desc) for i, _, desc, _ in findings],
                     meta["api"])
    return {"reproduced": any(Judging.confirmed(c) for c in causes.values()),
            "causes": {str(i): str(c) for i, c in causes.items()}}


def materialize(meta: dict, tensors: dict, leaves: list, g=None, device=None) -> tuple:
    """(leaves, upstream gradient) of a record: its saved tensors laid out with their strides,
    generated ones drawn (``repro_helpers``); ``leaves`` supplies the non-tensor values."""
    device = device or meta["case"]["device"]
    built = {}
    for n, spec in meta["tensors"].items():
        if spec["stored"] == "saved":
            base = tensors[n]
        else:
            base = repro_helpers.generate(spec)
        built[n] = repro_helpers.layout(base, spec["shape"], spec["stride"], device)
    for alias, n in meta.get("aliases", {}).items():
        built[alias] = built[n]
    out = list(leaves)
    for p in meta["case"]["tensor_pos"]:
        out[p] = built[f"x{p}"]
    return out, built.get("g", g)


def analyse(func, spec, leaves, g, case, call, items, api, o=None) -> dict:
    """``{index: cause}`` on ``leaves``: the kernel's results ``o`` (recomputed with
    ``repro_helpers.run`` when not given), then ``cause.analyse`` / ``cause.analyse_backward``
    (the session's own analysis). ``items``: ``[(index, descriptor)]``, or a function of ``o``
    giving them (the bound of other shapes)."""
    with modes_off():
        if o is None:
            o = repro_helpers.run(call, _clones(leaves), case, g)
        if callable(items):
            items = items(o)
        got = [(i, o[i], desc) for i, desc in items if o.get(i) is not None]
        if not got:
            return {}
        if case["stage"] == "forward":
            with torch.no_grad(), no_autocast(True):
                return cause.analyse(func, lambda: _clones(leaves), spec, got, api=api)
        return cause.analyse_backward(func, lambda: _clones(leaves), spec, case["diff"],
                                      case["out_index"], g, got, api=api)


def _clones(leaves: list) -> list:
    """Fresh copies of the tensors (an in-place call writes into them), aliasing kept."""
    seen = {}
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            c = seen.get(id(x))
            if c is None:
                c = seen[id(x)] = x.detach().clone()
            out.append(c)
        else:
            out.append(x)
    return out


# -- a record read from disk is data: every field checked before it is used -----------------------
_API = re.compile(r"[A-Za-z0-9_.]{1,200}")
_EXPR = re.compile(r"torch(\.[A-Za-z_][A-Za-z0-9_]*){1,4}")
_TENSOR = re.compile(r"x[0-9]{1,6}|g")
_DEVICE = re.compile(r"[a-z_]{1,16}(:[0-9]{1,4})?")


def validate(meta) -> dict:
    """``meta`` of a record read from disk, checked field by field: what a script's call is made
    of (the torch expression, the argument texts, the keyword names) must be exactly what
    ``capture`` writes, so a crafted record cannot put code into the script or into probekit
    (``ReproError`` naming the field and the value). The argument texts are parsed
    (``parse_literal``) and written again by ``literal``: the script holds probekit's text of
    the value, never the record's."""
    def fail(field, value, accepted):
        raise ReproError(f"repro record: {field} {value!r:.80} is not valid; accepted: "
                         f"{accepted}")

    def ints(field, value, low=0):
        if not isinstance(value, list) or not all(type(v) is int and v >= low for v in value):
            fail(field, value, f"a list of integers >= {low}")
        return value

    def dtype(field, value, none=False):
        if none and value is None:
            return value
        if not (isinstance(value, str) and isinstance(getattr(torch, value, None),
                                                      torch.dtype)):
            fail(field, value, "a torch dtype's name (float32, bfloat16, ...)")
        return value

    if not isinstance(meta, dict):
        fail("meta", meta, "a JSON object")
    for field in ("api_name", "key", "api"):
        if not (isinstance(meta.get(field), str) and _API.fullmatch(meta[field])):
            fail(field, meta.get(field), "letters, digits, '_' and '.'")
    expr = meta.get("expr")
    if not (isinstance(expr, str) and _EXPR.fullmatch(expr) and _resolve(expr) is not None
            and callable(_resolve(expr))):
        fail("expr", expr, "a callable torch API's dotted name (torch.nn.functional.relu)")
    if not isinstance(meta.get("method"), bool):
        fail("method", meta.get("method"), "true or false")
    if meta.get("stage") not in ("forward", "backward"):
        fail("stage", meta.get("stage"), "'forward', 'backward'")
    for field in ("step", "rank"):
        if type(meta.get(field)) is not int:
            fail(field, meta.get(field), "an integer")
    from ..perturb.modes import MODES

    if meta.get("pert_mode") not in MODES:
        fail("pert_mode", meta.get("pert_mode"), ", ".join(MODES))
    leaves = meta.get("leaves")
    if not isinstance(leaves, list):
        fail("leaves", leaves, "a list")
    meta["leaves"] = [None if t is None else literal(parse_literal(t)) for t in leaves]
    _check_spec(meta.get("spec"), len(leaves), fail)
    case = meta.get("case")
    if not isinstance(case, dict) or case.get("stage") != meta["stage"]:
        fail("case", case, "an object whose stage is the record's")
    if not (isinstance(case.get("device"), str) and _DEVICE.fullmatch(case["device"])):
        fail("case.device", case.get("device"), "a device type (cpu, cuda, cuda:1, ...)")
    dtype("case.autocast", case.get("autocast"), none=True)
    pos = ints("case.tensor_pos", case.get("tensor_pos"))
    if any(p >= len(leaves) or leaves[p] is not None for p in pos):
        fail("case.tensor_pos", pos, "positions of the leaves that are tensors")
    ints("case.judged", case.get("judged"))
    ints("case.diff", case.get("diff", []))
    if type(case.get("out_index", 0)) is not int:
        fail("case.out_index", case.get("out_index"), "an integer")
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict):
        fail("tensors", tensors, "an object")
    for n, spec in tensors.items():
        if not (_TENSOR.fullmatch(n) and isinstance(spec, dict)
                and spec.get("stored") in ("saved", "generated")):
            fail("tensors", n, "x<position> or g, each saved or generated")
        ints(f"tensors.{n}.shape", spec.get("shape"))
        ints(f"tensors.{n}.stride", spec.get("stride"))
        dtype(f"tensors.{n}.dtype", spec.get("dtype"))
    aliases = meta.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
            isinstance(a, str) and _TENSOR.fullmatch(a) and n in tensors
            for a, n in aliases.items()):
        fail("aliases", aliases, "{x<position>: a tensor's name}")
    names_ = meta.get("names", {})
    if not isinstance(names_, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, str) and v.isidentifier()
            for k, v in names_.items()):
        fail("names", names_, "{position: an argument's name}")
    judged = meta.get("judged")
    if not isinstance(judged, list) or not all(isinstance(e, dict) for e in judged):
        fail("judged", judged, "a list of objects")
    for e in judged:
        if type(e.get("index")) is not int or type(e.get("k")) is not int:
            fail("judged", e, "entries with an integer index and k")
        dtype("judged.dtype", e.get("dtype"))
        dtype("judged.judged_dtype", e.get("judged_dtype"))
    if not isinstance(meta.get("env", {}), dict):
        fail("env", meta.get("env"), "an object")
    ints("expected", meta.get("expected", []))
    return meta


def _check_spec(spec, n_leaves: int, fail) -> None:
    """``spec_json``'s form: "flat", or [positional node, keyword node] of nested
    ``[tuple|list|dict, items]`` nodes (dict keys strings; the call's keywords identifiers)
    whose leaves number ``n_leaves``."""
    def walk(node, depth=0) -> int:
        if node is None:
            return 1
        if depth > 32 or not (isinstance(node, list) and len(node) == 2
                              and node[0] in ("tuple", "list", "dict")
                              and isinstance(node[1], list)):
            fail("spec", node, "[tuple|list|dict, items]")
        if node[0] == "dict":
            if not all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)
                       for kv in node[1]):
                fail("spec", node, "dict items [string key, node]")
            return sum(walk(v, depth + 1) for _, v in node[1])
        return sum(walk(v, depth + 1) for v in node[1])

    if spec == "flat":
        return
    if not (isinstance(spec, list) and len(spec) == 2):
        fail("spec", spec, "'flat' or [positional node, keyword node]")
    args, kwargs = spec
    if not (isinstance(args, list) and args and args[0] == "tuple" and isinstance(kwargs, list)
            and kwargs and kwargs[0] == "dict"):
        fail("spec", spec, "[[tuple, ...], [dict, ...]]")
    if not all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)
               and kv[0].isidentifier() for kv in kwargs[1]):
        fail("spec keywords", kwargs[1], "argument names (identifiers)")
    if walk(args) + walk(kwargs) != n_leaves:
        fail("spec", spec, f"a structure of the record's {n_leaves} leaves")


# -- on disk ------------------------------------------------------------------------------------------
def save(path: str, rec: Captured) -> int:
    """Write the record atomically; its size in bytes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "meta": json.dumps(rec.meta),
                "tensors": rec.tensors}, buf)
    data = buf.getvalue()
    atomic_write(path, data)
    return len(data)


def load(path: str) -> Captured:
    """A record from disk (``ReproError`` for a file that is not one)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise ReproError(f"{path}: not a repro record ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ReproError(f"{path}: not a repro record (format {obj.get('format')!r}; accepted: "
                         f"{FORMAT!r})" if isinstance(obj, dict) else f"{path}: not a repro record")
    if obj.get("version") != VERSION:
        raise ReproError(f"{path}: repro record version {obj.get('version')!r} is not valid; "
                         f"accepted: {VERSION}")
    if not isinstance(obj.get("meta"), str) or not isinstance(obj.get("tensors"), dict) or \
            not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                    for k, t in obj["tensors"].items()):
        raise ReproError(f"{path}: not a repro record (meta text and named tensors expected)")
    try:
        meta = json.loads(obj["meta"])
    except ValueError as exc:
        raise ReproError(f"{path}: unreadable repro record meta ({exc})") from None
    return Captured(validate(meta), dict(obj["tensors"]))


# -- the session's hook ---------------------------------------------------------------------------
def call_info(attached):
    """What the engine attached to a call's ``explain`` as a dict: a forward check attaches
    ``(func, call, spec, leaves)`` (a tuple: it is made at every checked call), the backward
    check a dict with the stage, the upstream gradient and the inputs whose gradients it took."""
    if attached is None or isinstance(attached, dict):
        return attached
    func, call, spec, base = attached
    return {"stage": "forward", "func": func, "call": call, "spec": spec,
            "fresh": lambda: state.restore(base, call.snap)}


class Recorder:
    """``engine.repro_capture``: after a call site's analysis, save the record of its call when a
    cause confirms a finding (once per API call name per session; never raises into the
    training: a failure is logged once per API)."""

    def __init__(self, engine, dump_path: str) -> None:
        self.engine = engine
        self.dump_path = dump_path
        self.done: set = set()
        self.used = 0
        self.once = Once()
        self.written: dict = {}      # api_name -> path

    def __call__(self, name: str, explain, items: list, causes: dict) -> None:
        info = call_info(getattr(explain, "repro", None))
        if info is None:
            return
        findings = [(i, o, desc, causes[i]) for i, o, desc in items
                    if Judging.confirmed(causes.get(i, ""))]
        if not findings or name in self.done:
            return
        self.done.add(name)
        e = self.engine
        try:
            left = max(0, SESSION_LIMIT - self.used)
            budget = min(SAVE_LIMIT, left)
            with modes_off(), torch.no_grad():
                rec = capture(info, findings, name=name, mode_name=e.mode_name, fb=e.fb,
                              step=e.step, rank=e.rank, budget=budget,
                              fallback=min(FALLBACK_LIMIT, left))
                path = record_path(self.dump_path, name, e.rank)
                save(path, rec)
            self.used += rec.nbytes
            self.written[name] = path
            limited = budget < SAVE_LIMIT and any(
                s["stored"] == "generated" for s in rec.meta["tensors"].values())
            if limited and self.once("budget"):
                log.info("Free benchmark: repro records of this session reached %g MiB; later "
                         "records keep their inputs' statistics only", SESSION_LIMIT / 2 ** 20)
        except Exception as exc:   # never reaches the training code
            if self.once(("repro", name.rsplit(".", 2)[0])):
                log.info("Free benchmark: no repro record for %s (%s: %s)", name,
                         type(exc).__name__, exc)


