"""The registry of ``probekit`` subcommands (a leaf module: the feature CLIs and ``cli.py`` both
import it, neither imports the other's internals).

A command is a plain function taking the parsed arguments and returning an exit code; an optional
``declare(parser)`` attribute adds its arguments.
"""
from __future__ import annotations

#: (group, name) -> (function, help text)
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
