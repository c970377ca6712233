"""``%%freebench`` and ``%freebench_config``: a thin adapter over ``probekit.FreeBench``.

``%load_ext probekit`` registers them. The cell magic builds a validated config (options on top of
``--config FILE`` or of the session defaults), runs the cell body in the user namespace under
``FreeBench`` (``with``: the probe is removed whatever happens), stores the ``FreeBench`` object
in the user namespace (``-o NAME``, default ``_freebench``; inside the cell it is already there, so
a training loop can call ``_freebench.step()``) and displays the findings. Bad options raise
``UsageError`` naming the option and the accepted values.
"""
from __future__ import annotations

import argparse
import io
import logging
import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import DumpError
from ..config import FIX_PERT_MODES, PERT_MODES, THRESHOLD_KEYS, Config, ConfigError, config_for, make_config
from ..log import ROOT as LOGGER
from .forms import describe, parse_ints
from .display import Findings

TASK = "free_benchmark"
DEFAULT_NAME = "_freebench"

#: option -> config key (JSON name) it sets; used for values and to name options in errors
OPTION_KEYS = {
    "--pert-mode": "pert_mode", "--handler": "handler_type", "--stage": "fuzz_stage",
    "--device": "fuzz_device", "--scope": "scope", "--list": "list", "--preheat": "if_preheat",
    "--preheat-step": "preheat_step", "--max-sample": "max_sample", "--threshold": "thresholds",
    "--dump-path": "dump_path", "--rank": "rank", "--step": "step", "--module": "module",
    "--budget": "budget", "--resume": "resume", "--overwrite": "overwrite",
}
_KEY_OPTIONS = {key: opt for opt, key in OPTION_KEYS.items()}
_KEY_OPTIONS["api_list"] = "--list"


def _config_options(func):
    """The options shared by ``%%freebench`` and ``%freebench_config``."""
    decorators = [
        argument("--pert-mode", metavar="MODE",
                 help=f"perturbation: {', '.join(PERT_MODES)}"),
        argument("--handler", metavar="TYPE", help="check (record findings) or fix (use the "
                 f"improved output; {' and '.join(FIX_PERT_MODES)} only)"),
        argument("--stage", metavar="STAGE", help="forward or backward"),
        argument("--device", metavar="DEVICE", help="npu (perturb in place) or cpu (to_cpu)"),
        argument("--scope", action="append", metavar="NAMES",
                 help="API call names to check, comma separated (Torch.matmul.0.forward,...); "
                      "repeatable"),
        argument("--list", action="append", metavar="NAMES",
                 help="API names to check (every call whose name contains one), comma separated; "
                      "repeatable"),
        argument("--module", action="append", metavar="NAMES",
                 help="module names (as in model.named_modules()); only calls made inside "
                      "them are checked, submodules included; comma separated, repeatable; "
                      "the model is --model NAME or the one nn.Module in the namespace that "
                      "has them"),
        argument("--preheat", action=argparse.BooleanOptionalAction, default=None,
                 help="sample calls during the first steps, then check the risky APIs only"),
        argument("--preheat-step", type=int, metavar="N", help="steps of preheat sampling"),
        argument("--max-sample", type=int, metavar="N", help="calls sampled per API per "
                 "preheat step"),
        argument("--threshold", action="append", metavar="DTYPE=VALUE",
                 help=f"relative-error threshold for an output dtype "
                      f"({', '.join(THRESHOLD_KEYS)}); repeatable"),
        argument("--budget", type=float, metavar="FRACTION",
                 help="overhead budget: the probe costs about this fraction of the plain step "
                      "time on average, checks rotating through the call sites; where the "
                      "interception alone costs more, only some steps are probed (e.g. 0.2)"),
        argument("--dump-path", metavar="PATH", help="folder for free_benchmark.csv"),
        argument("--resume", action="store_true", default=None,
                 help="append to the dump folder's findings (default: a cell run again "
                      "replaces those of the last run, if it ended cleanly)"),
        argument("--overwrite", action="store_true", default=None,
                 help="replace the dump folder's findings even if their run did not end "
                      "cleanly"),
        argument("--rank", metavar="RANKS", help="ranks to probe, comma separated (default all)"),
        argument("--step", metavar="STEPS", help="steps to probe, comma separated (default all)"),
        argument("--config", metavar="FILE", help="msprobe/probekit config.json to start from"),
    ]
    for deco in reversed(decorators):
        func = deco(func)
    return func


def _names(values):
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def _thresholds(values) -> dict:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--threshold: {item!r} is not valid; accepted: DTYPE=VALUE with "
                             f"DTYPE among {', '.join(THRESHOLD_KEYS)} and VALUE a number > 0, "
                             f"e.g. --threshold float16=0.001") from None
    return out


def changes_from_args(args) -> dict:
    """Config keys (JSON names) set by the parsed options, ``None`` options left out."""
    changes = {}
    simple = {"pert_mode": args.pert_mode, "handler_type": args.handler,
              "fuzz_stage": args.stage, "fuzz_device": args.device, "if_preheat": args.preheat,
              "preheat_step": args.preheat_step, "max_sample": args.max_sample,
              "dump_path": args.dump_path, "budget": args.budget, "resume": args.resume,
              "overwrite": args.overwrite}
    changes.update({k: v for k, v in simple.items() if v is not None})
    if args.scope is not None:
        changes["scope"] = _names(args.scope)
    if args.list is not None:
        changes["list"] = _names(args.list)
    if args.module is not None:
        changes["module"] = _names(args.module)
    if args.threshold is not None:
        changes["thresholds"] = _thresholds(args.threshold)
    try:
        if args.rank is not None:
            changes["rank"] = parse_ints("rank", args.rank)
        if args.step is not None:
            changes["step"] = parse_ints("step", args.step)
    except ConfigError as exc:
        raise usage_error(exc) from None
    return changes


def usage_error(exc: ConfigError, source: str | None = None) -> UsageError:
    """A ``UsageError`` whose message names the magic option behind the config key."""
    message = str(exc)
    key = exc.key or ""
    source = source or _KEY_OPTIONS.get(exc.field)
    if not source:
        return UsageError(message)
    if key and message.startswith(key + ":"):
        return UsageError(f"{source} ({key}){message[len(key):]}")
    return UsageError(f"{source}: {message}")


@magics_class
class FreeBenchMagics(Magics):
    """Holds the session defaults of ``%%freebench`` (``None``: the config defaults)."""

    def __init__(self, shell):
        super().__init__(shell)
        self.defaults: Config | None = None

    # -- config --------------------------------------------------------------------------------
    def build_config(self, args) -> Config:
        if args.config:
            try:
                base = config_for(TASK, args.config)
            except ConfigError as exc:
                raise usage_error(exc, "--config") from None
        else:
            base = self.defaults or make_config(TASK)
        changes = changes_from_args(args)
        if not changes:
            return base
        try:
            return base.replace(**changes)
        except ConfigError as exc:
            raise usage_error(exc) from None

    # -- magics --------------------------------------------------------------------------------
    @magic_arguments()
    @argument("-o", dest="name", metavar="NAME", default=DEFAULT_NAME,
              help=f"user-namespace variable that receives the FreeBench (default {DEFAULT_NAME})")
    @argument("--top", type=int, default=25, metavar="N", help="rows shown in the table")
    @argument("--plot", action="store_true", help="also show the findings ranked in a chart")
    @argument("--hotspots", action="store_true",
              help="also show the hot spots: what the dtype predicts, not findings")
    @argument("--quiet", action="store_true", help="display nothing (results still stored)")
    @argument("--model", metavar="NAME", help="user-namespace variable holding the model "
              "whose modules --module names")
    @argument("--verbose", action="store_true",
              help="show probekit's INFO log lines (perturbation of each API...) while the "
                   "cell runs; by default only warnings")
    @_config_options
    @cell_magic
    def freebench(self, line, cell):
        """Run the cell under the free benchmark and show its findings.

        Options override ``--config FILE`` if given, else the session defaults set with
        ``%freebench_config`` or a ``FreeBenchPanel``'s Apply button. The ``FreeBench`` object
        is stored as ``-o NAME`` before the cell runs, so a loop in the cell can call
        ``NAME.step()`` at the end of each training step.
        """
        args = _parse(self.freebench, line)
        if args.top < 0:
            raise UsageError(f"--top: {args.top} is not valid; accepted: an integer >= 0 (0: "
                             "the summary line alone)")
        if not args.name.isidentifier():
            raise UsageError(f"-o: {args.name!r} is not valid; accepted: a Python identifier")
        config = self.build_config(args)
        from ..freebench.session.bench import FreeBench

        model = self._model(args, config)
        try:
            bench = FreeBench(config=config, model=model)
        except ConfigError as exc:
            raise usage_error(exc) from None
        self.shell.user_ns[args.name] = bench
        code = self._compile(line, cell)
        logger = logging.getLogger(LOGGER)
        level = logger.level
        if not args.verbose:         # the findings table says it all; keep warnings
            logger.setLevel(logging.WARNING)
        started = False
        try:
            with bench:
                started = True
                exec(code, self.shell.user_global_ns, self.shell.user_ns)
        except DumpError as exc:
            if started:
                raise
            # the dump folder's rule refused the run at its start: nothing ran, nothing to show
            raise UsageError(str(exc).replace("resume=True", "--resume").replace(
                "overwrite=True", "--overwrite").replace("use another dump_path",
                                                         "another --dump-path")) from None
        finally:
            logger.setLevel(level)
            if started and not args.quiet:
                self._show(bench, args)

    def _model(self, args, config):
        """The model for ``--module``: ``--model NAME``, else the one ``nn.Module`` of the
        user namespace that has every named module (None without module scope)."""
        names = config.free_benchmark.module
        ns = self.shell.user_ns
        if args.model is not None:
            model = ns.get(args.model)
            if not hasattr(model, "named_modules"):
                raise UsageError(f"--model: {args.model!r} is not valid; accepted: the name of "
                                 "a torch.nn.Module variable")
            return model
        if not names:
            return None
        import torch

        found = {}
        for var, value in ns.items():
            if not var.startswith("_") and isinstance(value, torch.nn.Module):
                have = dict(value.named_modules())
                if all(n in have for n in names):
                    found.setdefault(id(value), (var, value))
        if len(found) == 1:
            return next(iter(found.values()))[1]
        if not found:   # no model has them: a name is wrong (or the model is not a variable)
            models = sorted(v for v, x in ns.items()
                            if not v.startswith("_") and isinstance(x, torch.nn.Module))
            raise UsageError(f"--module ({', '.join(names)}): no nn.Module variable has "
                             f"{'this module' if len(names) == 1 else 'all these modules'} "
                             f"(nn.Module variables: {', '.join(models) or 'none'}); accepted: "
                             "names as model.named_modules() gives them (--model NAME names "
                             "the model and lists its modules)")
        which = ", ".join(sorted(v for v, _ in found.values()))
        raise UsageError(f"--module ({', '.join(names)}): the model is ambiguous (nn.Module "
                         f"variables having these modules: {which}); accepted: --model NAME")

    def _compile(self, line: str, cell: str):
        """Compile the body as part of the running cell: cached for tracebacks under the cell's
        number, with a first line standing for the magic line, so line numbers (in tracebacks
        and call sites) are those the user sees in the cell."""
        source = f"# %%freebench {line}\n{self.shell.transform_cell(cell)}"
        # the running cell was cached last; ipykernel has already advanced execution_count
        numbers = getattr(self.shell.compile, "_filename_map", None)
        number = max(numbers.values()) if numbers else self.shell.execution_count
        filename = self.shell.compile.cache(source, number, raw_code=cell)
        return compile(source, filename, "exec")

    def _show(self, bench, args) -> None:
        from IPython.display import Image, display

        display(Findings.of(bench, hotspots=args.hotspots, top=args.top, name=args.name))
        if args.plot and len(bench.results):
            display(Image(data=findings_png(bench, top=args.top)))

    @magic_arguments()
    @argument("--clear", action="store_true", help="forget the session defaults")
    @argument("--save", metavar="FILE", help="write the defaults to a config.json")
    @_config_options
    @line_magic
    def freebench_config(self, line):
        """Show, change, clear or save the defaults of ``%%freebench``.

        ``%freebench_config`` shows them; with options it changes them (validated, on top of
        the current defaults); ``--clear`` goes back to the config defaults; ``--save FILE``
        writes them as a msprobe-compatible config.json.
        """
        args = _parse(self.freebench_config, line)
        if args.clear:
            if changes_from_args(args) or args.config or args.save:
                raise UsageError("--clear: combined with other options; accepted: --clear alone")
            self.defaults = None
        elif changes_from_args(args) or args.config:
            self.defaults = self.build_config(args)
        config = self.defaults or make_config(TASK)
        if args.save:
            try:
                config.to_json(args.save)
            except OSError as exc:
                raise UsageError(f"--save: {args.save!r} cannot be written "
                                 f"({exc.strerror or exc}); accepted: a file path in a folder "
                                 "that exists") from None
            print(f"%%freebench defaults written to {args.save}")
        print(f"%%freebench defaults: {describe(config)}")


def _parse(magic, line: str):
    """A magic's options with the shell's quoting: ``--scope 'a b'`` or ``"a b"`` is one value
    without its quotes (IPython's ``parse_argstring`` keeps them on POSIX, so a quoted scope
    matched nothing and a quoted path made folders named with quotes). On Windows, where a
    backslash is a path separator, quotes stay as IPython splits them."""
    from IPython.utils.process import arg_split

    return magic.parser.parse_args(arg_split(line, posix=os.name != "nt"))


def findings_png(bench_or_results, top: int = 25) -> bytes:
    """The findings chart as PNG bytes (no pyplot state involved)."""
    from matplotlib.figure import Figure

    from ..freebench.report.view import merged_findings
    from ..plot import findings

    n = min(len(merged_findings(bench_or_results)), top)       # one bar per API call
    fig = Figure(figsize=(9, 0.9 + 0.38 * max(n, 2)), layout="constrained")
    findings(bench_or_results, ax=fig.add_subplot(), top=top)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96)
    return buf.getvalue()


def _instance(shell) -> FreeBenchMagics | None:
    return shell.magics_manager.registry.get(FreeBenchMagics.__name__)


def register(ipython) -> FreeBenchMagics:
    """Register the magics on ``ipython`` (once; a second call returns the same instance)."""
    magics = _instance(ipython)
    if magics is None:
        magics = FreeBenchMagics(ipython)
        ipython.register_magics(magics)
    return magics


def unregister(ipython) -> None:
    magics = _instance(ipython)
    if magics is None:
        return
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
    ipython.magics_manager.registry.pop(FreeBenchMagics.__name__, None)


def _shell(shell=None):
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    if shell is None:
        raise RuntimeError("no IPython shell is running: %%freebench defaults need one")
    return shell


def set_defaults(config, shell=None) -> Config:
    """Make ``config`` (Config, FreeBenchmarkConfig or path) the defaults of ``%%freebench``
    (registers the magics if ``%load_ext probekit`` was not run yet). ``None`` clears them."""
    magics = register(_shell(shell))
    magics.defaults = None if config is None else config_for(TASK, config)
    return magics.defaults


def get_defaults(shell=None) -> Config | None:
    """The current ``%%freebench`` defaults, or ``None`` if none were set."""
    try:
        shell = _shell(shell)
    except RuntimeError:
        return None
    magics = _instance(shell)
    return magics.defaults if magics is not None else None
