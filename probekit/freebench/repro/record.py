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

import io
import json
import math
import os
import platform

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
    back = eval(text, {"torch": torch, "math": math})  # noqa: S307 (our own literal)
    if not (back == v or (isinstance(v, float) and math.isnan(v) and math.isnan(back))):
        raise ReproError(f"the argument {v!r:.60} does not survive being written as {text!r}")
    return text


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
    return Captured(json.loads(obj["meta"]), dict(obj["tensors"]))


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


