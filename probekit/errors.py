"""probekit's error types: one base class, one subclass per kind of bad input.

Every error probekit raises on purpose is a ``ProbekitError``; each subclass is also a
``ValueError`` (bad input), so ``except ValueError`` written against earlier versions still works.

``ConfigError`` carries what was refused as attributes (``key``, ``value``, ``accepted``), so a
front-end (the notebook panels, the magics) can point at the offending control without parsing
the message. Its message always reads ``"KEY: VALUE is not valid; accepted: ACCEPTED"`` unless a
call site gives a more specific one.
"""
from __future__ import annotations

import re
from typing import Any

_KEY = re.compile(r"[A-Za-z_][\w.]*(?: key)?")

#: ``ConfigError.value`` when the error is about a missing key rather than a bad value
MISSING = type("Missing", (), {"__repr__": lambda self: "<missing>"})()


class ProbekitError(Exception):
    """Base class of every error probekit raises on purpose."""


class ConfigError(ProbekitError, ValueError):
    """A configuration value is not accepted.

    ``ConfigError(key=..., value=..., accepted=...)`` builds the standard message;
    ``ConfigError("message", key=...)`` keeps a specific message and still names the key. A
    message in the standard form given without ``key`` names its key by its first word
    (``"free_benchmark.module: ..."``), so every ConfigError has one.
    """

    def __init__(self, message: str | None = None, *, key: str | None = None,
                 value: Any = MISSING, accepted: str | None = None) -> None:
        if message is None:
            message = f"{key}: {value!r} is not valid; accepted: {accepted}"
        super().__init__(message)
        if key is None:
            head, sep, _ = message.partition(": ")
            key = head if sep and _KEY.fullmatch(head) else None
        self.key = key
        self.value = value
        self.accepted = accepted

    @property
    def field(self) -> str | None:
        """The config field behind ``key``: ``"free_benchmark.thresholds.float16"`` ->
        ``"thresholds"``, ``"free_benchmark.list key"`` -> ``"list"``, ``"rank"`` -> ``"rank"``."""
        if not self.key:
            return None
        parts = self.key.split(" ")[0].split(".")
        return parts[1] if len(parts) > 1 and parts[0] in ("free_benchmark", "grad_probe") \
            else parts[0]


class GradStoreError(ProbekitError, ValueError):
    """A grad-probe store (or a path given as a run) cannot be read as one."""


class GradCompareError(ProbekitError, ValueError):
    """Two grad-probe runs cannot be compared (no shared rank, parameter or step; sizes differ)."""


class MsprobeDumpError(ProbekitError, ValueError):
    """An msprobe dump folder or CSV does not have msprobe's layout."""


class UnsafePathError(ProbekitError, ValueError):
    """A file name taken from model data would land outside the dump folder."""


class ReproError(ProbekitError, ValueError):
    """A free-benchmark finding cannot be written as a standalone repro (no record of its call,
    an argument a script cannot spell, a row that names no finding)."""


class DumpError(ProbekitError, ValueError):
    """A free-benchmark dump folder cannot take this run as asked (its last run did not end
    cleanly and this run is not a restart: its findings would be replaced)."""


__all__ = ["ProbekitError", "ConfigError", "GradStoreError", "GradCompareError",
           "MsprobeDumpError", "UnsafePathError", "ReproError", "DumpError", "MISSING"]
