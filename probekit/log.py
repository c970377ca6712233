"""One logger hierarchy, ``probekit``; every message is prefixed ``[probekit]``.

The prefix is part of the message itself, so it shows in any handler the user configured
(and in pytest's caplog). When nothing is configured at all, a plain stderr handler is attached
on first use so INFO lines (perturbation applied, preheat sampling...) are visible, as msprobe's are.
"""
from __future__ import annotations

import logging
import sys

ROOT = "probekit"
PREFIX = "[probekit] "


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return PREFIX + str(msg), kwargs


def get_logger(name: str = ROOT) -> logging.LoggerAdapter:
    """A logger under the ``probekit`` hierarchy whose messages carry the ``[probekit]`` prefix."""
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    return _Prefixed(logging.getLogger(name), {})


def ensure_handler() -> None:
    """Attach a stderr handler to ``probekit`` if neither it nor the root logger has one."""
    logger = logging.getLogger(ROOT)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


class Once:
    """Remembers keys already logged, so per-call messages appear once per key (clear() per step)."""

    def __init__(self) -> None:
        self._seen: set = set()

    def __call__(self, key) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def clear(self) -> None:
        self._seen.clear()
