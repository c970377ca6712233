"""One logger hierarchy, ``probekit``; every message is prefixed ``[probekit]``.

The prefix is part of the message itself, so it shows in any handler the user configured
(and in pytest's caplog). When nothing is configured at all, a plain handler is attached on first
use so INFO lines (perturbation applied, preheat sampling...) are visible, as msprobe's are: to
stderr in a script; in a notebook kernel INFO goes to stdout (a front-end shows stderr as a red
box, which would make every INFO line look like an error) and WARNING and above to stderr.
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


class ConsoleHandler(logging.StreamHandler):
    """stderr, except INFO and below in a notebook kernel (stdout). The streams are looked up
    at each record, so a kernel's (or pytest's) replaced ``sys.stdout``/``sys.stderr`` is used."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stdout if record.levelno < logging.WARNING and in_kernel()
                       else sys.stderr)
        super().emit(record)


def in_kernel() -> bool:
    """True in a Jupyter kernel (its ``sys.stdout`` is ipykernel's stream; nothing imported)."""
    return type(sys.stdout).__module__.startswith("ipykernel")


def ensure_handler() -> None:
    """Attach a ``ConsoleHandler`` to ``probekit`` if neither it nor the root logger has one."""
    logger = logging.getLogger(ROOT)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = ConsoleHandler()
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

    def seen(self, key) -> bool:
        """Was ``key`` logged already (without marking it)?"""
        return key in self._seen

    def clear(self) -> None:
        self._seen.clear()
