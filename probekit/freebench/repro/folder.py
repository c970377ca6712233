"""From a free-benchmark finding to a bug report: a standalone repro folder per finding.

``fb.repro(row)`` (``FreeBench.repro``) and ``probekit freebench repro DUMP ROW -o DIR`` write a
folder holding

* ``repro.py``: a script that needs only torch: the call exactly as the training made it, its
  inputs, the stage (backward: the gradient fed in and which inputs' gradients are judged), and
  the measurement: the kernel's result against a float64 recomputation, in units of the dtype's
  ``u`` and against the bound the free benchmark judged with; exit status 1 while the defect is
  present, 0 when not, 2 when it could not run. Its header records the environment where the
  finding was made (torch version and build, CPU capability, device, threads, autocast dtype);
  it prints the one it runs in;
* ``inputs.pt``: the saved inputs (or none: generated ones are drawn from a seed), the
  magnitude ``S`` of each judged output (the bound's second term, computed by probekit's own
  ``cause`` / ``magnitudes`` code), the outputs the run computed when they were small, the CPU
  generator's state of a random call;
* ``REPORT.md``: the issue text: versions, the minimal script, expected vs actual.

Both read the call from the **repro record** the session saved when it confirmed the finding
(``repro/record.py``: ``{dump_path}/repro/records/``), so a dump folder on disk is enough. A
record holds a call site's first confirmed finding; the rows of later steps at the same call site
share it.

Writing a folder: the record's inputs are rebuilt (saved or generated), the bound is rebuilt
with ``scales.judge`` for their shapes and the finding is checked to reproduce with the session's
own analysis (``cause.analyse``); with ``shrink=True`` the inputs are made smaller while it still
reproduces (``repro/shrink.py``); ``S`` and the bound's coefficients come from ``cause``'s
functions (the coefficients read off ``cause.Score.bound`` itself); then the script is written,
and run in-process (its own code) for the numbers of ``REPORT.md``. ``check=True`` also runs it in
a fresh, isolated Python (``-I``: no probekit on its path).

``of_call(func, *args, out=..., **kwargs)`` writes the same folder for any call, flagged or not
(a healthy call's script reports no defect).
"""
from __future__ import annotations

import io
import math
import numbers
import os
import runpy
import subprocess
import sys

import torch

from ...atomic import atomic_write
from ...errors import ReproError
from ...paths import safe_join
from ..judge import cause, scales
from ..judge.guards import modes_off, no_autocast
from ..judge.judging import Judging
from ..perturb import perturb
from . import helpers as repro_helpers, record as repro_record
from . import script as repro_script, shrink as repro_shrink

SCRIPT, DATA, REPORT = "repro.py", "inputs.pt", "REPORT.md"


class Repro:
    """A written repro folder: ``path``, ``script``, ``command`` (how to run it), ``results``
    (``{judged index: measures and verdict}`` as the script computes them), ``defect`` (does
    it exit 1), ``notes`` (shrinking, generated inputs), ``check`` (``(exit status, output)`` of
    the run in a fresh process, when asked)."""

    def __init__(self, path, meta, results, notes, check=None) -> None:
        self.path = path
        self.script = os.path.join(path, SCRIPT)
        self.command = f"python {self.script}"
        self.meta = meta
        self.results = results
        self.notes = notes
        self.check = check

    @property
    def defect(self) -> bool:
        return any(r["verdict"] in repro_helpers.DEFECTS for r in self.results.values())

    def __str__(self) -> str:
        meta = self.meta
        lines = [f"repro of {meta['api_name']} (rank {meta['rank']}) in {self.path}"]
        for i, r in self.results.items():
            lines.append(f"  {repro_script.label(meta, i)}: {r['verdict']}, error / bound "
                         f"{r['accuracy']:.3g}")
        lines += [f"  {n}" for n in self.notes]
        lines.append(f"  run: {self.command}  (exit 1 while the defect is present)")
        if self.check is not None:
            lines.append(f"  checked in a fresh process: exit {self.check[0]}")
        return "\n".join(lines)

    __repr__ = __str__


# -- finding a row's record -------------------------------------------------------------------------
def row_dict(row) -> dict:
    """A results row (pandas Series, dict) as a dict."""
    if hasattr(row, "to_dict"):
        row = row.to_dict()
    if not isinstance(row, dict) or "api_name" not in row:
        raise ReproError(f"row: {row!r:.80} is not valid; accepted: a row of fb.results or the "
                         "CSV (a Series or dict with api_name and rank), its position, or an "
                         "api_name")
    return row


def select(results, row) -> dict:
    """The row ``row`` names in ``results`` (a DataFrame): a position (int), an api_name, or
    the row itself."""
    if isinstance(row, numbers.Integral) and not isinstance(row, bool):
        row = int(row)
        if not 0 <= row < len(results):
            raise ReproError(f"row: {row} is not valid; accepted: 0 to {len(results) - 1} (the "
                             f"row's position in the findings)" if len(results) else
                             f"row: {row} is not valid: there are no findings")
        return row_dict(results.iloc[row])
    if isinstance(row, str):
        hits = results[results["api_name"] == row] if len(results) else results
        if not len(hits):
            names = sorted(set(results["api_name"])) if len(results) else []
            more = "..." if len(names) > 8 else ""
            raise ReproError(f"row: {row!r} is not valid; accepted: an api_name of the findings"
                             f" ({', '.join(names[:8]) or 'none'}{more})")
        return row_dict(hits.iloc[0])
    return row_dict(row)


def record_for(dump_path: str, row: dict) -> str:
    """The path of the record of ``row`` (``ReproError`` when there is none)."""
    rank = int(row.get("rank", 0) or 0)
    path = repro_record.record_path(dump_path, row["api_name"], rank)
    if not os.path.isfile(path):
        raise ReproError(
            f"no repro record for {row['api_name']} (rank {rank}) in "
            f"{repro_record.records_dir(dump_path)}: a record is saved when the float64 analysis "
            "confirms a finding while the call's inputs exist (once per call site); a site "
            "flagged first by a deferred check is analysed at its next run, and an API a script "
            "cannot call with only torch (a custom op) has none (the log says why)")
    return path


def default_folder(dump_path: str, row: dict) -> str:
    """``{dump_path}/repro/{api_name}.rank{r}`` (the name through ``safe_name``)."""
    rank = int(row.get("rank", 0) or 0)
    return safe_join(dump_path, "repro", f"{row['api_name']}.rank{rank}")


def for_row(dump_path: str, row, out=None, *, results=None, shrink: bool = False,
            check: bool = False) -> Repro:
    """Write the repro folder of a finding (``row``: a row, its position in ``results``, or its
    api_name) into ``out`` (default: under ``dump_path/repro/``)."""
    if results is not None and not isinstance(row, dict) and not hasattr(row, "to_dict"):
        row = select(results, row)
    row = row_dict(row)
    with modes_off():
        rec = repro_record.load(record_for(dump_path, row))
    out = default_folder(dump_path, row) if out is None else os.fspath(out)
    return write(rec, out, row=row, shrink=shrink, check=check)


# -- rebuilding the call -------------------------------------------------------------------------------
def _spec(js):
    if js == "flat":
        return perturb.flatten((), {})[1]

    def walk(node):
        if node is None:
            return None
        tp, items = node
        if tp == "dict":
            return (dict, [(k, walk(v)) for k, v in items])
        return ({"tuple": tuple, "list": list}[tp], [walk(o) for o in items])

    return (walk(js[0]), walk(js[1]))


def _template(meta) -> list:
    """The call's non-tensor arguments, parsed from their texts (never evaluated)."""
    return [None if t is None else repro_record.parse_literal(t) for t in meta["leaves"]]


class _Case:
    """A record made runnable: the API, its arguments, the script's ``call``, the judges."""

    def __init__(self, rec) -> None:
        self.meta, self.tensors = rec.meta, rec.tensors
        meta = self.meta
        api = repro_record._resolve(meta["expr"])
        if api is None:
            raise ReproError(f"{meta['expr']} is not in this torch ({torch.__version__})")
        self.api = api
        self.rng = self.tensors.get("rng") if meta.get("rng") else None
        self.func = api if self.rng is None else self._replayed(api, self.rng)
        if meta["case"].get("writes") and meta["stage"] == "backward":
            self.func = self._on_copies(self.func)   # as the script differentiates it
        self.spec = _spec(meta["spec"])
        self.template = _template(meta)
        # the script's ``call`` as a function: the API on the parsed arguments (what the
        # script's source says, built without executing any text)
        self.call = repro_record.make_call(api, self.spec, self.template,
                                           meta["case"]["tensor_pos"])
        self.case = dict(meta["case"])
        self.entries = {e["index"]: e for e in meta["judged"]}

    @staticmethod
    def _on_copies(api):
        """An API that writes its inputs, run on copies of the leaves that require grad
        (autograd refuses an in-place call on such a leaf; the copy's gradient is the leaf's)."""
        def on_copies(*a, **k):
            leaves, spec = perturb.flatten(a, k)
            leaves = [x.clone() if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf
                      else x for x in leaves]
            a, k = perturb.unflatten(leaves, spec)
            return api(*a, **k)
        return on_copies

    @staticmethod
    def _replayed(api, state):
        def replayed(*a, **k):
            torch.set_rng_state(state)
            return api(*a, **k)
        return replayed

    def judge(self, i: int, k: int) -> scales.Judge:
        e = self.entries[i]
        return scales.judge(self.meta["pert_mode"], e["fam"], k, getattr(torch, e["judged_dtype"]),
                            stage=self.meta["stage"], override=e["override"],
                            formula_ok=e["formula_ok"])

    def lengths(self, leaves, g, o) -> dict:
        """``k`` of each judged output for these inputs (``scales.forward_length`` /
        ``backward_length``, as the session computes them)."""
        name = self.meta["api"]
        a = scales.Args(self.api, name, *perturb.unflatten(leaves, self.spec))
        if self.meta["stage"] == "forward":
            return {i: scales.forward_length(name, a, leaves, o[i]) for i in o}
        k_fwd = scales.forward_length(name, a, leaves, g)
        return {i: scales.backward_length(name, a, leaves, i, g, k_fwd) for i in o}

    def judges(self, leaves, g, o, recorded: bool) -> dict:
        if recorded:
            return {i: self.judge(i, self.entries[i]["k"]) for i in o}
        return {i: self.judge(i, k) for i, k in self.lengths(leaves, g, o).items()}

    def items(self, judges: dict) -> list:
        return [(i, (i, None, None, j.kind, j.thr, j.hot,
                     getattr(torch, self.entries[i]["judged_dtype"]), j))
                for i, j in judges.items()]

    def analyse(self, leaves, g, recorded: bool = False) -> dict:
        """``{index: cause}`` on these inputs, judged with the bound of their shapes."""
        with _rng_kept(self.rng):
            o = repro_helpers.run(self.call, repro_record._clones(leaves), self.case, g, self.rng)
            o = {i: t for i, t in o.items() if t is not None}
            judges = self.judges(leaves, g, o, recorded)
            return repro_record.analyse(self.func, self.spec, leaves, g, self.case, self.call,
                                        self.items(judges), self.meta["api"], o=o)

    def reproduces(self, leaves, g, recorded: bool = False) -> bool:
        return any(Judging.confirmed(c) for c in self.analyse(leaves, g, recorded).values())


class _rng_kept:
    """Set the CPU generator back after a random call's replays."""

    def __init__(self, state) -> None:
        self.state = state

    def __enter__(self):
        self.saved = torch.get_rng_state() if self.state is not None else None

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.set_rng_state(self.saved)


# -- S and the bound ----------------------------------------------------------------------------------
def magnitudes(c: _Case, leaves, g, judges: dict) -> tuple[dict, dict]:
    """``({index: S}, {index: S_b})`` of the judged outputs in float64, by ``cause``'s functions
    (a 0-dim tensor for the tensor scale): ``S_b`` where the analysis' bound reads more than
    ``gamma_k S`` (``cause.forward_bounds`` / ``backward_bounds``: ``B`` over the bound's weight
    of ``S``, so that the script's ``a |r| + b S_b`` is the analysis' bound)."""
    meta = c.meta
    api = meta["api"]
    with modes_off(), _rng_kept(c.rng), no_autocast(True):
        x64 = [cause.to64(t) for t in repro_record._clones(leaves)]
        if meta["stage"] == "forward":
            with torch.no_grad():
                r = dict(cause.outputs(c.func, x64, c.spec, compared=True))
                S = cause.forward_magnitudes(judges, api, c.func, x64, c.spec, r)
                B = cause.forward_bounds(judges, c.func, x64, c.spec, r, S, api)
        else:
            case = c.case
            with torch.enable_grad():
                ref = cause.grads64(c.func, x64, c.spec, case["diff"], case["out_index"], g)
                S = cause.backward_magnitudes(c.func, api, x64, c.spec, case["diff"],
                                              case["out_index"], g.to(torch.float64), judges)
                pos = {i: k for k, i in enumerate(case["diff"])}
                B = cause.backward_bounds(c.func, x64, c.spec, case["diff"], case["out_index"],
                                          g.to(torch.float64), judges,
                                          {i: ref[pos[i]] for i in case["diff"]}, S)
            S = {i: (S[i] if S.get(i) is not None else ref[pos[i]].abs().amax())
                 for i in judges}
    SB = {}
    for i, b in B.items():
        j = judges[i]
        w = scales.accumulation_term(j.fam, j.k, j.u_out, j.u_acc, j.saved)
        if i in judges and w:
            SB[i] = _stored_tensor(b.detach().to(torch.float64) / w)
    return {i: _stored_tensor(s) for i, s in S.items()}, SB


def _stored_tensor(s):
    """A float64 scale as ``inputs.pt`` keeps it (one number for an expanded tensor scale;
    float32 above ``SAVE_LIMIT``)."""
    s = s.detach().to(torch.float64)
    if s.dim() and s.numel() > 1 and all(st == 0 for st in s.stride()):
        s = s.as_strided((), ())        # the tensor scale, expanded: one number
    return s.cpu().clone() if s.numel() * 8 <= repro_record.SAVE_LIMIT else \
        s.to(torch.float32).cpu().clone()


def bound_entry(judge: scales.Judge, leaves, e: dict, stage: str) -> dict:
    """The script's bound of one judged output: coefficients of ``|exact|`` and ``S`` read off
    ``cause.Score.bound`` (the analysis' own bound) and of float64's floor off ``floor64``, the
    lost-bits level of ``cause``'s verdict, and the words the script prints."""
    judged = getattr(torch, e["judged_dtype"])
    u_in = cause.input_roundoff(leaves, judged)
    sc = cause.Score(judge, u_in)
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    c = scales.C * (judge.factor if judge.upcast else 1.0)
    floor = sc.bound(zero, zero).item()     # the underflow floor (an absolute term)
    return {"a": sc.bound(one, zero).item() - floor, "b": sc.bound(zero, one).item() - floor,
            "f": floor,
            "a64": sc.floor64(one, zero).item(), "b64": sc.floor64(zero, one).item(),
            "lost_level": math.sqrt(u_in) * (1.0 if judge.upcast else judge.factor),
            "upcast": bool(judge.upcast), "u": judge.u_out, "u_acc": judge.u_acc,
            "dtype": e["judged_dtype"], "k": int(judge.k), "c": c, "fam": judge.fam,
            "gamma": scales.accumulation_term(judge.fam, judge.k, judge.u_out, judge.u_acc,
                                              judge.saved),
            "s_text": repro_script.magnitude_text(judge.fam, stage, e["formula_ok"])}


# -- the folder ------------------------------------------------------------------------------------------
def _nbytes(leaves, g) -> int:
    seen, n = set(), 0
    for x in list(leaves) + [g]:
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            n += repro_record.span(x) * x.element_size()
    return n


def _stored(c: _Case, leaves, g, shrunk: bool, notes: list) -> tuple[dict, dict]:
    """(``INPUTS`` of the script, tensors of ``inputs.pt``): the record's own when not shrunk;
    shrunk inputs saved when they fit ``SAVE_LIMIT``, else generated from the record's
    statistics with the new shapes (checked to reproduce, saved up to ``FALLBACK_LIMIT``)."""
    meta = c.meta
    named = {}
    for p in c.case["tensor_pos"]:
        if f"x{p}" not in meta.get("aliases", {}):
            named[f"x{p}"] = leaves[p]
    if g is not None:
        named["g"] = g
    if not shrunk:
        return dict(meta["tensors"]), {n: c.tensors[n] for n, s in meta["tensors"].items()
                                       if s["stored"] == "saved"}
    total = _nbytes(leaves, g)

    def saved_all():
        specs, data = {}, {}
        for n, t in named.items():
            base, shape, stride = repro_record.storage(t)
            specs[n] = {"stored": "saved", "shape": shape, "stride": stride,
                        "dtype": str(t.dtype).replace("torch.", "")}
            data[n] = base
        return specs, data

    gen = [n for n, s in meta["tensors"].items() if s["stored"] == "generated"]
    if total <= repro_record.SAVE_LIMIT or not gen:
        return saved_all()
    specs, data = saved_all()
    for n in gen:
        t = named[n]
        spec = dict(meta["tensors"][n], shape=list(t.shape), stride=list(t.stride()),
                    span=repro_record.span(t))
        specs[n] = spec
        del data[n]
    trial = dict(meta, tensors=specs)
    lv, gg = repro_record.materialize(trial, data, c.template)
    if c.reproduces(lv, gg):
        notes.append("the shrunk inputs above the save limit are generated with the recorded "
                     "statistics; checked to reproduce")
        return specs, data
    if total <= repro_record.FALLBACK_LIMIT:
        notes.append("generated shrunk inputs did not reproduce: saved")
        return saved_all()
    notes.append("WARNING: generated shrunk inputs did not reproduce and are too large to save")
    return specs, data


def write(rec, out: str, *, row: dict | None = None, shrink: bool = False,
          check: bool = False) -> Repro:
    """Write the repro folder of record ``rec`` (``repro_record.Captured``) into ``out``. The
    CPU generator is left as it was (a random call's replays set it), and no function mode sees
    the work (``fb.repro`` inside ``with fb:`` checks nothing of its own)."""
    with modes_off(), _rng_kept(torch.get_rng_state()):
        return _write(rec, out, row=row, shrink=shrink, check=check)


def _write(rec, out: str, *, row: dict | None, shrink: bool, check: bool) -> Repro:
    row = dict(row or {})
    c = _Case(rec)
    meta = c.meta
    leaves, g = repro_record.materialize(meta, c.tensors, c.template)
    notes = []
    with modes_off():
        causes = c.analyse(leaves, g, recorded=True)
    if not any(Judging.confirmed(v) for v in causes.values()):
        notes.append("probekit's analysis of the recorded inputs here: "
                     + ", ".join(f"{repro_script.label(meta, i)} {v}" for i, v in causes.items())
                     + " (no defect)")
    shrunk = False
    if shrink:
        before = _nbytes(leaves, g)
        with modes_off():
            leaves, g, steps = repro_shrink.shrink(leaves, g, lambda lv, gg: c.reproduces(lv, gg))
        shrunk = bool(steps)
        notes.append(repro_shrink.describe(steps, before, _nbytes(leaves, g)))
    with modes_off():
        o = repro_helpers.run(c.call, repro_record._clones(leaves), c.case, g, c.rng)
        o = {i: t for i, t in o.items() if t is not None}
        judges = c.judges(leaves, g, o, recorded=not shrunk)
        S, SB = magnitudes(c, leaves, g, judges)
    specs, data = _stored(c, leaves, g, shrunk, notes)
    case = dict(c.case, judged=[i for i in c.case["judged"] if i in judges])
    case["bound"] = {i: bound_entry(judges[i], leaves, c.entries[i], meta["stage"])
                     for i in case["judged"]}
    case["blame"] = cause.BLAME_FACTOR
    final = dict(meta, case=case, tensors=specs,
                 judged=[e for e in meta["judged"] if e["index"] in judges])
    for i, s in S.items():
        data[f"S{i}"] = s
    for i, s in SB.items():
        data[f"SB{i}"] = s
    if not shrunk:
        for i in meta.get("expected", []):
            if f"o{i}" in c.tensors and i in judges:
                data[f"o{i}"] = c.tensors[f"o{i}"]
    if c.rng is not None:
        data["rng"] = c.rng
    os.makedirs(out, exist_ok=True)
    buf = io.BytesIO()
    torch.save(data, buf)
    atomic_write(os.path.join(out, DATA), buf.getvalue())
    script_path = os.path.join(out, SCRIPT)
    atomic_write(script_path, repro_script.script(final, row, notes))
    results = run_here(script_path, final)
    if not shrunk:    # the script's verdicts are the session's analysis' (cause.py)
        differ = [i for i, v in causes.items() if i in results and
                  results[i]["verdict"] != str(v) + (" (mild)" if getattr(v, "mild", False)
                                                     else "")]
        if differ:
            notes.append("WARNING: probekit's analysis and the script disagree on "
                         + ", ".join(f"{repro_script.label(meta, i)} ({causes[i]} / "
                                     f"{results[i]['verdict']})" for i in differ))
    command = f"python {script_path}"
    atomic_write(script_path, repro_script.script(final, row, notes, results))
    atomic_write(os.path.join(out, REPORT), repro_script.report(final, row, notes, results,
                                                                  command))
    done = Repro(out, final, results, notes)
    if check:
        done.check = run_fresh(script_path)
    return done


def run_here(script_path: str, meta) -> dict:
    """Run the written script's own ``load`` and ``measure`` in this process as its ``main``
    runs them (the recorded run's thread count, ``THREADS``: a CPU reduction's order depends on
    it; function modes off, the CPU generator and this process's thread count set back): what it
    prints, as numbers."""
    ns = runpy.run_path(script_path, run_name="probekit_repro")
    device = meta["case"]["device"]
    threads = torch.get_num_threads()
    torch.set_num_threads(int(ns["THREADS"]))
    try:
        with modes_off(), _rng_kept(torch.get_rng_state()):
            fresh, g, S, expected, rng = ns["load"](device)
            return ns["measure"](ns["call"], fresh, meta["case"], S, g, rng, expected,
                                 S.pop("bound"))
    finally:
        torch.set_num_threads(threads)


#: runs a script in a fresh Python with probekit made unimportable (an editable install puts it
#: on every interpreter's path): a script that reached for it fails with exit status 3
FRESH_DRIVER = """
import runpy, sys, traceback
class NoProbekit:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "probekit":
            raise ImportError("a repro script must need only torch: it imported " + name)
sys.meta_path.insert(0, NoProbekit())
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    raise
except BaseException:
    traceback.print_exc()
    sys.exit(3)
"""


def run_fresh(script_path: str, *args: str, python: str | None = None,
              timeout: float = 600) -> tuple:
    """``(exit status, output)`` of the script in a fresh, isolated Python: ``-I`` (neither
    PYTHONPATH nor the working directory on its path) and probekit unimportable, so it has
    torch and the standard library only. Exit 3: the script failed outside its own ``main``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python or sys.executable, "-I", "-c", FRESH_DRIVER, script_path,
                           *args], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.abspath(script_path)), timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


# -- any call, flagged or not -------------------------------------------------------------------------------
def of_call(func, *args, out, stage: str = "forward", grad=None, judged=None,
            pert_mode: str = "improve_precision", shrink: bool = False, check: bool = False,
            **kwargs) -> Repro:
    """The repro folder of ``func(*args, **kwargs)`` whatever the free benchmark would say (a
    healthy call's script reports no defect). ``stage="backward"`` judges the gradients of the
    floating inputs that require grad, with upstream gradient ``grad`` (default: ones) through
    the first floating output; ``judged``: the output indices (forward; default: every floating
    output) or input positions (backward) to judge. Judged as ``pert_mode`` judges."""
    from ...config import make_config
    from ..names import classify

    if stage not in ("forward", "backward"):
        raise ReproError(f"stage: {stage!r} is not valid; accepted: 'forward', 'backward'")
    fb = make_config("free_benchmark", pert_mode=pert_mode).free_benchmark
    info = classify(func)
    call = perturb.Call(info, args, kwargs)
    call.autocast = None
    leaves, spec = perturb.flatten(args, kwargs)
    with modes_off(), torch.no_grad():
        o = repro_helpers.float_outputs(func(*args, **kwargs))
    rec_info = {"stage": stage, "func": func, "call": call, "spec": spec,
                "fresh": lambda: leaves}
    if stage == "forward":
        idx = list(o) if judged is None else list(judged)
        comp = {i: o[i] for i in idx}
        lengths = {i: scales.forward_length(info.name, scales.Args(func, info.name, args, kwargs),
                                            leaves, o[i]) for i in idx}
    else:
        diff = [i for i, x in enumerate(leaves) if perturb.is_float(x) and x.requires_grad]
        out_index = min(o)
        gy = torch.ones_like(o[out_index]) if grad is None else grad
        with torch.enable_grad(), modes_off():
            y = dict(repro_helpers.float_outputs(func(*args, **kwargs)))[out_index]
            grads = torch.autograd.grad(y, [leaves[i] for i in diff], gy, allow_unused=True)
        comp = {i: gr for i, gr in zip(diff, grads) if gr is not None}
        if judged is not None:
            comp = {i: comp[i] for i in judged}
        a = scales.Args(func, info.name, args, kwargs)
        k_fwd = scales.forward_length(info.name, a, leaves, gy)
        lengths = {i: scales.backward_length(info.name, a, leaves, i, gy, k_fwd) for i in comp}
        rec_info.update(g=gy.detach(), diff=diff, out_index=out_index, api=func)
    findings = []
    for i, t in comp.items():
        dt = scales.effective_dtype(pert_mode, t.dtype, t.dtype)
        j = scales.judge(pert_mode, scales.family(info.name), lengths[i], dt, stage=stage,
                         override=fb.threshold_for(str(dt).replace("torch.", "")))
        desc = (i, t.dtype, tuple(t.shape), j.kind, j.thr, j.hot, dt, j)
        findings.append((i, t, desc, "forced"))
    with modes_off(), torch.no_grad():
        rec = repro_record.capture(rec_info, findings, name=f"{info.key}.0.{stage}",
                                   mode_name=pert_mode, fb=fb, step=0, rank=0)
    return write(rec, os.fspath(out), row={"cause": "forced (of_call)"}, shrink=shrink,
                 check=check)

