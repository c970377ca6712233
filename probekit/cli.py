"""The ``probekit`` command: ``probekit --version``, ``probekit config check FILE``, ...

Each subcommand is a plain function taking the parsed arguments and returning an exit code,
registered in ``probekit.commands.COMMANDS``; the feature CLIs (``grads/cli.py``,
``freebench/cli.py``) are imported plainly when the parser is built.
"""
from __future__ import annotations

import argparse
import json
import sys

from ._version import __version__
from .commands import COMMANDS, command
from .config import load_config
from .errors import ProbekitError


def _args_config_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="msprobe/probekit config.json")


@command("config", "check", "validate a config.json and print the effective settings")
def config_check(args) -> int:
    cfg = load_config(args.file)
    print(f"{args.file}: OK (task {cfg.task})")
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


config_check.declare = _args_config_check


def build_parser() -> argparse.ArgumentParser:
    from .freebench.report import cli as _freebench_cli  # noqa: F401  (registers its commands)
    from .grads.compare import cli as _grads_cli  # noqa: F401
    from .mindspore import cli as _mindspore_cli  # noqa: F401  (needs no MindSpore)

    parser = argparse.ArgumentParser(prog="probekit", description="find numerical-precision "
                                     "problems in PyTorch training")
    parser.add_argument("--version", action="version", version=f"probekit {__version__}")
    groups = parser.add_subparsers(dest="group", metavar="GROUP")
    subs: dict = {}
    for (group, name), (func, help_text) in COMMANDS.items():
        if group not in subs:
            gp = groups.add_parser(group, help=f"{group} commands")
            subs[group] = gp.add_subparsers(dest="name", metavar="COMMAND", required=True)
        p = subs[group].add_parser(name, help=help_text, description=help_text)
        getattr(func, "declare", lambda _p: None)(p)
        p.set_defaults(func=func)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ProbekitError, FileNotFoundError, ValueError) as exc:
        print(f"probekit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
