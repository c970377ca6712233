"""The text of a repro folder: ``repro.py`` (needs only torch) and ``REPORT.md``.

A script is constants (the case: stage, the judged outputs and their bounds, the inputs' layout
and how each is obtained), the call written as the training made it (``call_source``), the
measuring functions copied from ``repro/helpers.py`` (the code probekit itself runs to check
it), and a ``main`` that loads ``inputs.pt`` beside it, measures, prints the kernel's error against
a float64 recomputation in units of the dtype's ``u`` and against the bound the free benchmark
judged with, and exits 1 while the defect is present (0 when not, 2 when it cannot run).
"""
from __future__ import annotations

import math
import os
import pprint
import textwrap

from . import helpers as repro_helpers

MARKER = "# -- standalone"


def helpers_source() -> str:
    """``repro/helpers.py`` from its standalone marker on (imports and functions)."""
    path = os.path.splitext(repro_helpers.__file__)[0] + ".py"
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return text[text.index("\n" + MARKER) + 1:].split("\n", 1)[1]


# -- the call ---------------------------------------------------------------------------------------
def _leaf(meta, i: int) -> str:
    text = meta["leaves"][i]
    return f"x{i}" if text is None else text


def _node(meta, node, it) -> str:
    if node is None:
        return _leaf(meta, next(it))
    tp, items = node
    if tp == "dict":
        return "{" + ", ".join(f"{k!r}: {_node(meta, v, it)}" for k, v in items) + "}"
    parts = [_node(meta, o, it) for o in items]
    if tp == "list":
        return "[" + ", ".join(parts) + "]"
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def arguments(meta) -> tuple[list, list]:
    """(positional argument texts, ``name=value`` texts) of the call."""
    spec = meta["spec"]
    if spec == "flat":
        return [_leaf(meta, i) for i in range(len(meta["leaves"]))], []
    it = iter(range(len(meta["leaves"])))
    args = [_node(meta, o, it) for o in spec[0][1]]
    kwargs = [f"{k}={_node(meta, v, it)}" for k, v in spec[1][1]]
    return args, kwargs


def call_expression(meta) -> str:
    """The call as Python: ``x0.index_add_(0, x2, x3)`` for a method called on a tensor,
    ``torch.nn.functional.layer_norm(x0, (64,), x2, x3)`` otherwise."""
    args, kwargs = arguments(meta)
    if meta["method"] and args and args[0].startswith("x") and args[0][1:].isdigit():
        return f"{args[0]}.{meta['expr'].rsplit('.', 1)[1]}({', '.join(args[1:] + kwargs)})"
    return f"{meta['expr']}({', '.join(args + kwargs)})"


def call_source(meta) -> str:
    params = ", ".join(f"x{p}" for p in meta["case"]["tensor_pos"])
    return (f"def call({params}):\n"
            f"    \"\"\"The call as the training made it ({meta['key']}).\"\"\"\n"
            f"    return {call_expression(meta)}\n")


# -- words --------------------------------------------------------------------------------------------
def pow2(u: float) -> str:
    e = math.log2(u) if u > 0 else 0
    return f"2^{int(e)}" if u > 0 and e == int(e) else f"{u:.3g}"


def label(meta, i: int) -> str:
    """What judged index ``i`` is: an output, or (backward) the gradient of an input."""
    if meta["case"]["stage"] == "forward":
        return f"output {i}"
    name = meta.get("names", {}).get(str(i))
    return f"the gradient of x{i}" + (f" (`{name}`)" if name else "")


def environment_lines(env: dict, autocast) -> list:
    build = f"torch {env.get('torch')} (git {str(env.get('git'))[:12]})"
    build += f", CUDA {env.get('cuda') or 'none'}"
    if env.get("hip"):
        build += f", HIP {env['hip']}"
    build += f", debug build: {'yes' if env.get('debug') else 'no'}"
    dev = env.get("device", "cpu") + (f" ({env['device_name']})" if env.get("device_name") else "")
    return [build,
            f"CPU capability: {env.get('cpu_capability')}; MKL: {'yes' if env.get('mkl') else 'no'}"
            f"; oneDNN: {'yes' if env.get('mkldnn') else 'no'}; threads: {env.get('threads')}",
            f"device: {dev}; autocast: {autocast or 'off'}",
            f"Python {env.get('python')} on {env.get('platform')}"]


def input_lines(meta) -> list:
    out = []
    for n, spec in meta["tensors"].items():
        what = f"{n}: {spec['dtype']} {tuple(spec['shape'])}, stride {tuple(spec['stride'])}: "
        if spec["stored"] == "saved":
            what += "saved in inputs.pt"
        else:
            what += (f"generated (seed {spec['seed']}) from the recorded values' statistics: "
                     + _stats_text(spec))
        out.append(what)
    for a, n in meta.get("aliases", {}).items():
        out.append(f"{a}: the same tensor as {n} (the call was given it twice)")
    check = meta.get("generated_check")
    if check:
        if check.get("fallback") == "saved":
            out.append("generated inputs did not reproduce the finding; the inputs are saved")
        elif check.get("reproduced"):
            out.append("checked when recorded: the generated inputs reproduce the finding ("
                       + ", ".join(sorted(set(check["causes"].values()))) + ")")
        else:
            out.append("WARNING: the generated inputs did not reproduce the finding when "
                       "recorded (" + ", ".join(sorted(set(check["causes"].values())))
                       + "); the inputs were too large to save")
    return out


def _stats_text(spec) -> str:
    if spec.get("values") is not None:
        vals = ", ".join(f"{v:.4g}" for v in spec["values"][:8])
        more = "..." if len(spec["values"]) > 8 else ""
        return f"{len(spec['values'])} distinct values ({vals}{more})"
    if "mean" not in spec:
        return "no finite values"
    text = (f"mean {spec['mean']:.4g}, std {spec['std']:.4g}, in [{spec['min']:.4g}, "
            f"{spec['max']:.4g}] ({len(spec['quantiles'])} quantiles)")
    special = [f"{k} {spec[k]:.2%}" for k in ("nan", "posinf", "neginf") if spec.get(k)]
    return text + (f"; {', '.join(special)}" if special else "")


def stage_lines(meta) -> list:
    case = meta["case"]
    judged = ", ".join(label(meta, i) for i in case["judged"])
    if case["stage"] == "forward":
        return ["stage: forward", f"judged: {judged}"]
    g = meta["tensors"].get("g", {})
    return ["stage: backward (the call's input gradients)",
            f"the gradient fed into output {case['out_index']}: g, {g.get('dtype')} "
            f"{tuple(g.get('shape', ()))}",
            "inputs that need gradients: " + ", ".join(f"x{p}" for p in case["diff"]),
            f"judged: {judged}"]


def magnitude_text(fam: str, stage: str, formula_ok: bool = True) -> str:
    """What ``S`` is for a family (as ``cause.py`` computes it in float64)."""
    if stage == "forward":
        if fam in ("multilinear", "gelu"):
            return "S = the call on the absolute values of its inputs (Σ|a||b| for a product)"
        if fam in ("arithmetic", "elementwise", "saturating", "step"):
            return "S = |exact| (one result per element, nothing cancels)"
        if fam in ("softmax", "log_softmax"):
            return f"S = |exact| plus the {fam} floor"
        if fam == "norm":
            return "S = the normalisation's magnitude formula (no cancellation in x − mean)"
    else:
        if fam in ("multilinear", "arithmetic"):
            return "S = the backward on the absolute values of the inputs with |g| (Σ|g| for a " \
                   "bias gradient)"
        if fam in ("softmax", "log_softmax", "saturating") and formula_ok:
            return f"S = the {fam} family's magnitude formula; γ_k also carries the rounding " \
                   "of the forward output its backward reads (saved as the forward's dtype)"
        if fam in ("norm", "attention") and formula_ok:
            return f"S = the {fam} family's magnitude formula (Σ|g| for a norm's bias gradient)"
    return "S = max|exact| (the result tensor's scale)"


def expected_text(meta, i) -> str:
    b = meta["case"]["bound"][i]
    return (f"within {b['c']:g}·(u_out·|exact| + γ_k(u_acc)·S) of the exact result per element, "
            f"the bound of a correct kernel computing in {b['dtype']} (u_out = {pow2(b['u'])}) "
            f"and accumulating k = {b['k']} terms with u_acc = {pow2(b['u_acc'])}; "
            f"{b['s_text']}")


def actual_text(meta, i, res) -> str:
    b = meta["case"]["bound"][i]
    u = b["u"]
    scale = res["scale"] or 0.0
    in_u = res["max_error"] / (u * scale) if scale else math.inf
    at = res["exact"]
    rel = res["error"] / (u * abs(at)) if at else math.inf
    where = "[" + ", ".join(str(v) for v in res["index"]) + "]"
    return (f"max error {res['max_error']:.4g} = {in_u:.3g} u of max|exact|; at {where} error "
            f"{res['error']:.4g} = {rel:.3g} u of |exact| there, {res['accuracy']:.3g} × the "
            f"bound ({res['bound']:.3g}): {res['verdict']}")


# -- the script ---------------------------------------------------------------------------------------
_MAIN = '''

HERE = os.path.dirname(os.path.abspath(__file__))


def load(device):
    """(fresh, upstream gradient, S (with ``S["bound"]``: the bound's own S_b where written),
    expected outputs, CPU generator state) from inputs.pt."""
    data = torch.load(os.path.join(HERE, "inputs.pt"), map_location="cpu", weights_only=True)
    bases = {n: (data[n] if s["stored"] == "saved" else generate(s)) for n, s in INPUTS.items()}

    def build():
        built = {n: layout(bases[n], s["shape"], s["stride"], device) for n, s in INPUTS.items()}
        for alias, n in ALIASES.items():
            built[alias] = built[n]
        return built

    def fresh():   # new tensors for every run (an in-place call writes into its inputs)
        built = build()
        return [built.get(f"x{i}") for i in range(N_LEAVES)]

    g = build().get("g")
    S = {i: data[f"S{i}"] for i in CASE["judged"]}
    S["bound"] = {i: data[f"SB{i}"] for i in CASE["judged"] if f"SB{i}" in data}
    expected = {i: data[f"o{i}"] for i in CASE["judged"] if f"o{i}" in data}
    return fresh, g, S, expected, data.get("rng")


def environment(device) -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    where = device
    if device.startswith("cuda") and torch.cuda.is_available():
        where += f" ({torch.cuda.get_device_name()})"
    return (f"torch {torch.__version__} (git {torch.version.git_version[:12]}), CUDA "
            f"{torch.version.cuda or 'none'}, CPU capability {cap}, device {where}, "
            f"threads {torch.get_num_threads()}, autocast {CASE['autocast'] or 'off'}")


def describe(res, device) -> str:
    lines = [TITLE, "  here: " + environment(device),
             "  found: " + FOUND]
    for i, r in res.items():
        b = CASE["bound"][i]
        u = b["u"]
        in_u = r["max_error"] / (u * r["scale"]) if r["scale"] else math.inf
        rel = r["error"] / (u * abs(r["exact"])) if r["exact"] else math.inf
        at = "[" + ", ".join(str(v) for v in r["index"]) + "]"
        lines += [
            f"{LABELS[i]}: {r['verdict']}",
            f"  kernel vs float64 recomputation: max error {r['max_error']:.4g} = {in_u:.3g} u of "
            f"max|exact| (u = {b['u']:.3g}, {b['dtype']}'s unit roundoff)",
            f"  worst against the bound at {at}: error {r['error']:.4g} = {rel:.3g} u of |exact| "
            f"= {abs(r['exact']):.4g} there",
            f"  bound of a correct kernel there, {b['c']:g}·(u_out·|exact| + γ_k(u_acc)·S) with "
            f"k = {b['k']}, u_acc = {b['u_acc']:.3g}: {r['bound']:.4g}",
            f"  error / bound = {r['accuracy']:.4g}" + (
                "  (> 1: more than a correct kernel may be off)" if r["accuracy"] > 1 else ""),
            f"  one-ulp input nudges move the exact result by {r['moved']:.3g} of the bound; "
            f"lost {r['lost']:.3g} of its scale (half the bits: {b['lost_level']:.3g})"]
        if "vs_recorded" in r:
            lines.append("  the kernel's result equals the one recorded in the run" if
                         not r["vs_recorded"] else
                         f"  the kernel's result differs from the one recorded in the run by "
                         f"{r['vs_recorded']:.4g} (another kernel path or build?)")
    bad = [i for i, r in res.items() if r["verdict"] in DEFECTS]
    lines.append(("DEFECT PRESENT: " + ", ".join(f"{LABELS[i]} {res[i]['verdict']}" for i in bad))
                 if bad else "no defect: every judged result is within what a correct kernel "
                 "and the inputs' conditioning explain")
    lines.append("result: " + json.dumps({str(i): r for i, r in res.items()}))
    return "\\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=TITLE)
    p.add_argument("--device", default=CASE["device"], help="device to run on (default: the "
                   "recorded one)")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads (default: the "
                   "recorded run's)")
    args = p.parse_args(argv)
    try:
        torch.set_num_threads(args.threads)
        case = dict(CASE, device=torch.device(args.device).type)
        fresh, g, S, expected, rng = load(args.device)
        res = measure(call, fresh, case, S, g, rng, expected, S.pop("bound"))
    except Exception as exc:   # not a verdict: the script could not run here
        print(f"could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(describe(res, args.device))
    return 1 if any(r["verdict"] in DEFECTS for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _wrap(line: str, width: int = 96) -> str:
    if len(line) <= width:
        return line
    lead = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.fill(line, width, subsequent_indent=lead, break_long_words=False,
                         break_on_hyphens=False)


def _py(value) -> str:
    return pprint.pformat(value, width=96, sort_dicts=False)


def field(row: dict, key: str) -> str:
    """A text column of the finding's row, "" when missing (a CSV's empty cell reads as NaN)."""
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def title(meta) -> str:
    causes = sorted({e["cause"] for e in meta["judged"]})
    return f"{meta['api_name']}: {', '.join(label(meta, e['index']) for e in meta['judged'])} " \
           f"{' / '.join(causes)}"


def found_line(meta) -> str:
    env = meta["env"]
    return (f"torch {env.get('torch')}, CPU capability {env.get('cpu_capability')}, device "
            f"{env.get('device')}, threads {env.get('threads')}, autocast "
            f"{meta['case']['autocast'] or 'off'}")


def script(meta, row: dict, notes: list, results: dict | None = None) -> str:
    """The script's text. ``row``: the finding as the free benchmark reported it (CSV row);
    ``notes``: lines for the header (shrinking); ``results``: what it measured when written."""
    case = meta["case"]
    head = [title(meta), "",
            f"Found by probekit's free benchmark ({meta['pert_mode']}, {meta['stage']} stage)"
            + (f" at {field(row, 'call_site')}" if field(row, "call_site") else "")
            + f", step {meta['step']}, rank {meta['rank']}"
            + (f", module {field(row, 'module')}" if field(row, "module") else "") + ".",
            "", "Environment where it was found"]
    head += ["  " + s for s in environment_lines(meta["env"], case["autocast"])]
    head += ["", "The call"]
    head += ["  " + s for s in call_source(meta).splitlines()]
    head += ["  " + s for s in stage_lines(meta)]
    head += ["", "Inputs"] + ["  " + s for s in input_lines(meta)]
    head += ["  " + s for s in notes]
    if row.get("ratio") is not None:
        head += ["", f"The free benchmark's check: max_rel {row.get('max_rel', 0):.4g} against "
                     f"threshold {row.get('threshold', 0):.4g} (ratio {row['ratio']:.4g}), kind "
                     f"{row.get('kind')}, cause {row.get('cause')}"]
    for i in case["judged"]:
        head += ["", f"Expected ({label(meta, i)}): " + expected_text(meta, i)]
        if results and i in results:
            head += [f"Actual, when this script was written: " + actual_text(meta, i, results[i])]
    head += ["", "Run: python repro.py [--device DEVICE] [--threads N]; needs only torch. Exit "
                 "status 1 while the defect is present, 0 when not, 2 when it could not run."]
    doc = "\n".join(_wrap(s) for s in head)
    doc = doc.replace('"""', "'''").replace("\\", "\\\\")
    labels = {i: label(meta, i) for i in case["judged"]}
    consts = [f"TITLE = {title(meta)!r}", f"FOUND = {found_line(meta)!r}",
              f"THREADS = {int(meta['env'].get('threads') or 1)}",
              f"N_LEAVES = {len(meta['leaves'])}",
              f"CASE = {_py(case)}", f"INPUTS = {_py(meta['tensors'])}",
              f"ALIASES = {_py(meta.get('aliases', {}))}", f"LABELS = {_py(labels)}"]
    body = "\n".join([f'#!/usr/bin/env python3\n"""{doc}\n"""',
                      "import argparse\nimport json\nimport os\nimport sys\n",
                      helpers_source().rstrip() + "\n\n",
                      "# -- this case " + "-" * 80, *consts, "", "", call_source(meta).rstrip(),
                      _MAIN.rstrip() + "\n"])
    return body


def report(meta, row: dict, notes: list, results: dict, command: str) -> str:
    """``REPORT.md``: the issue text a kernel team expects (versions, minimal script, expected
    vs actual)."""
    case = meta["case"]
    verdicts = {r["verdict"] for r in results.values()}
    if "inaccurate" in verdicts:
        what = ("gives a result further from the exact one than a correct kernel may be (its "
                "error exceeds the bound below, and one-ulp changes of the inputs do not explain "
                "it)")
    elif "ill-conditioned" in verdicts:
        what = ("is ill-conditioned at these inputs: its exact result loses more than half its "
                "significant bits under a one-ulp change of an input (a numerical hazard of the "
                "computation, not a kernel error)")
    else:
        what = "shows no defect with these inputs (every result within the bound below)"
    out = [f"# {title(meta)}", "",
           f"`{call_expression(meta)}` ({meta['stage']} stage) {what}. Found by probekit's free "
           f"benchmark ({meta['pert_mode']}; step {meta['step']}, rank {meta['rank']}"
           + (f", {field(row, 'call_site')}" if field(row, "call_site") else "") + ").", "",
           "## Environment", ""]
    out += [f"- {s}" for s in environment_lines(meta["env"], case["autocast"])]
    out += ["", "## Minimal script", "", f"`{command}` (needs only torch; exits 1 while the "
            "defect is present). The call:", "", "```python", call_source(meta).rstrip(), "```",
            ""]
    out += [f"- {s}" for s in stage_lines(meta) + input_lines(meta) + notes]
    out += ["", "## Expected vs actual", ""]
    for i in case["judged"]:
        out += [f"**{label(meta, i)}**, {_judged_shape(meta, i)}", "",
                f"- expected: {expected_text(meta, i)}"]
        if i in results:
            r = results[i]
            b = case["bound"][i]
            out.append(f"- actual: {actual_text(meta, i, r)}")
            out.append(f"- one-ulp input nudges move the exact result by {r['moved']:.3g} × the "
                       f"bound and lose {r['lost']:.3g} of its scale (more than half its bits: "
                       f"above {b['lost_level']:.3g})")
        out.append("")
    out.append("Measured numbers: `result:` line of the script's output.")
    return "\n".join(out) + "\n"


def _judged_shape(meta, i) -> str:
    for e in meta["judged"]:
        if e["index"] == i:
            return f"{e['dtype']} {tuple(e['shape'])}"
    return ""

