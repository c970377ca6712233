"""The ``probekit`` command: ``probekit --version``, ``probekit config check FILE``, ...

Each subcommand is a plain function taking the parsed arguments and returning an exit code;
``COMMANDS`` maps ``(group, name)`` to it together with a function that declares its arguments.
"""
from __future__ import annotations

import argparse
import json
import sys

from ._version import __version__
from .config import ConfigError, load_config

COMMANDS: dict = {}


def command(group: str, name: str, help: str):
    """Register ``probekit GROUP NAME``; the decorated function gets ``args``, returns an exit code."""

    def deco(func):
        key = (group, name)
        if key in COMMANDS:
            raise ValueError(f"command {group} {name} registered twice")
        COMMANDS[key] = (func, help)
        return func

    return deco


def _args_config_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="msprobe/probekit config.json")


@command("config", "check", "validate a config.json and print the effective settings")
def config_check(args) -> int:
    cfg = load_config(args.file)
    print(f"{args.file}: OK (task {cfg.task})")
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


config_check.declare = _args_config_check


def _load_feature_commands() -> None:
    for module in ("probekit.grads.cli", "probekit.freebench.cli", "probekit.mindspore.cli"):
        try:
            __import__(module)
        except ModuleNotFoundError as exc:
            if not (exc.name and module.startswith(exc.name)):
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_feature_commands()
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
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"probekit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    # run through the imported module, so feature commands register in the same registry
    from probekit.cli import main as _main

    sys.exit(_main())
