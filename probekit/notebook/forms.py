"""Text parsing and config descriptions shared by the magics and the panels (coercion is
``probekit.config.config_for``; a ``ConfigError`` names its key as ``.key`` / ``.field``)."""
from __future__ import annotations

import re

from ..grads.store.msprobe import parse_number
from ..config import Config, ConfigError

def describe(config: Config) -> str:
    """The settings that differ from the defaults, ``key=value, ...`` (JSON names), or
    ``"the defaults"``."""
    base = Config(task=config.task).to_dict()
    cur = config.to_dict()
    diff = [f"{k}={cur[k]!r}" for k in ("dump_path", "rank", "step") if cur[k] != base[k]]
    diff += [f"{k}={v!r}" for k, v in cur[config.task].items() if v != base[config.task][k]]
    return ", ".join(diff) if diff else "the defaults"


def split(text: str) -> list:
    """``"a, b c"`` -> ``["a", "b", "c"]``."""
    return [v for v in re.split(r"[,\s]+", text.strip()) if v]


def _parse_list(key: str, text: str, convert, accepted: str) -> list:
    try:
        return [convert(v) for v in split(text)]
    except ValueError:
        raise ConfigError(key=key, value=text, accepted=accepted) from None


def parse_ints(key: str, text: str) -> list:
    """Comma-separated integers (``rank``/``step``); ``ConfigError`` naming ``key`` otherwise."""
    return _parse_list(key, text, int, "integers >= 0 separated by commas (empty = all)")


def parse_numbers(key: str, text: str) -> list:
    """Comma-separated numbers (``bounds``), ints kept as ints; ``ConfigError`` otherwise."""
    return _parse_list(key, text, parse_number,
                       "numbers in ascending order separated by commas, e.g. -1, 0, 1")
