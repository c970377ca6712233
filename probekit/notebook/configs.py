"""Config helpers shared by the magics and the panels: coercion, text parsing, error keys."""
from __future__ import annotations

import re

from ..compat.msprobe import parse_number
from ..config import Config, ConfigError, FreeBenchmarkConfig, GradProbeConfig, load_config

#: "free_benchmark.thresholds.float16: ..." -> whole key "free_benchmark.thresholds.float16",
#: field "thresholds"; "rank: ..." -> "rank", "rank"
_ERROR_KEY = re.compile(r"^((?:free_benchmark\.|grad_probe\.)?(\w+)(?:\.\w+| key)?)")


def as_config(config, task: str) -> Config:
    """``Config`` | section object | path of a config.json -> a validated ``Config`` of ``task``
    (a config of the other task keeps its common keys and this task's section)."""
    if isinstance(config, (FreeBenchmarkConfig, GradProbeConfig)):
        return Config(task=task, **{task: config})
    if not isinstance(config, Config):
        config = load_config(config)
    return config if config.task == task else config.replace(task=task)


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
        raise ConfigError(f"{key}: {text!r} is not valid; accepted: {accepted}") from None


def parse_ints(key: str, text: str) -> list:
    """Comma-separated integers (``rank``/``step``); ``ConfigError`` naming ``key`` otherwise."""
    return _parse_list(key, text, int, "integers >= 0 separated by commas (empty = all)")


def parse_numbers(key: str, text: str) -> list:
    """Comma-separated numbers (``bounds``), ints kept as ints; ``ConfigError`` otherwise."""
    return _parse_list(key, text, parse_number,
                       "numbers in ascending order separated by commas, e.g. -1, 0, 1")


def error_key(message: str) -> tuple:
    """(whole key, field name) a ``ConfigError`` message starts with; ``("", "")`` if none."""
    match = _ERROR_KEY.match(message or "")
    return (match.group(1), match.group(2)) if match else ("", "")
