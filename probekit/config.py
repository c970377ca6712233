"""Frozen, validated configuration objects and msprobe ``config.json`` reading/writing.

One ``Config`` holds the common keys of msprobe's config.json and the section of its task
(``free_benchmark`` or ``grad_probe``). Every object validates itself when built, so a config
that exists is a valid one: ``dataclasses.replace`` re-validates too. Errors are ``ConfigError``
(``probekit.errors``: a ``ProbekitError`` and a ``ValueError``) naming the key, the bad value and
what is accepted, also as its attributes ``key``, ``value``, ``accepted``.

Round trip: ``Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg``.

Over 400 lines because msprobe's config.json is one file: every section's keys, their
validation, the JSON mapping and the one coercion (``config_for``) stay together, so a key is
defined, checked and read in one place.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .atomic import atomic_write
from .errors import ConfigError
from .freebench.perturb.modes import FIX_PERT_MODES, MODES, PERT_MODES
from .log import get_logger

log = get_logger(__name__)

TASKS = ("free_benchmark", "grad_probe")
#: msprobe tasks probekit does not implement (their sections are accepted in a config and ignored)
MSPROBE_OTHER_TASKS = ("statistics", "tensor", "overflow_check", "run_ut")
LEVELS = ("L0", "L1", "L2", "mix")
HANDLER_TYPES = ("check", "fix")
FUZZ_STAGES = ("forward", "backward")
FUZZ_DEVICES = ("npu", "cpu")
FUZZ_LEVELS = ("L1",)
GRAD_LEVELS = ("L0", "L1", "L2")
#: which gradients the grad probe records: "step" (default) the ones the optimizer's step() is
#: handed (after gradient clipping and GradScaler unscaling, if the loop does them), "backward"
#: the raw ones at the end of the last backward pass before the step (before clipping)
GRAD_POINTS = ("step", "backward")
HASH_ALGORITHMS = ("md5", "xxh3")
#: a control run (``grads/control.py``): the precision under test, and how the test runs in it
#: (under autocast, the model cast to it, or as the reference does); ``"bf16"`` = bf16:autocast
CONTROL_DTYPES = ("bf16", "fp16", "fp32")
CONTROL_RECIPES = ("autocast", "cast", "none")
THRESHOLD_KEYS = ("float16", "bfloat16", "float32", "other")
#: no override: every threshold comes from the unit roundoff of the dtype a call computes in
#: (``probekit/freebench/judge/scales.py``); ``free_benchmark.thresholds`` overrides it per dtype
DEFAULT_THRESHOLDS: dict = {}


def _fail(key: str, value: Any, accepted: str) -> None:
    raise ConfigError(key=key, value=value, accepted=accepted)


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(key, value, ", ".join(choices))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(key, value, "true or false")


def _not_both(section: str, resume: bool, overwrite: bool, choice: str) -> None:
    """``resume`` and ``overwrite`` of one section (``section``: "grad_probe." ...) are not
    both true; ``choice`` says what each does."""
    if resume and overwrite:
        raise ConfigError(f"{section}resume and {section}overwrite: both true; accepted: one of "
                          f"them ({choice})", key=section + "resume", value=True,
                          accepted="resume or overwrite, not both")


def _positive_int(key: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        _fail(key, value, "an integer > 0")


def _str_tuple(key: str, value: Any) -> tuple:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        _fail(key, value, "a list of strings")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        _fail(key, bad[0], "non-empty strings (the list holds other items)")
    return tuple(value)


def _index_tuple(key: str, value: Any) -> tuple:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        _fail(key, value, "a list of integers >= 0 (empty = all)")
    bad = [v for v in value if not _is_int(v) or v < 0]
    if bad:
        _fail(key, bad[0], "integers >= 0 in the list")
    return tuple(value)


def _set(obj, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class FreeBenchmarkConfig:
    """The ``free_benchmark`` section. ``api_list`` is the JSON key ``list``."""

    scope: tuple = ()
    api_list: tuple = ()
    fuzz_device: str = "npu"
    pert_mode: str = "improve_precision"
    handler_type: str = "check"
    fuzz_level: str = "L1"
    fuzz_stage: str = "forward"
    if_preheat: bool = False
    preheat_step: int = 15
    max_sample: int = 20
    #: probekit extension: threshold overrides by compute dtype (default: none, every threshold
    #: derived from the dtype's unit roundoff)
    thresholds: Mapping = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    #: probekit extension: check only calls made inside these modules (names as in
    #: ``model.named_modules()``; a single name is accepted; empty = everywhere)
    module: tuple = ()
    #: probekit extension: checks may cost at most this fraction of the plain step time
    #: (None: every call is checked)
    budget: float | None = None
    #: probekit extension: a run into a dump folder that holds an earlier run's findings
    #: replaces them unless it is a restart (``resume``, or an elastic restart); ``overwrite``
    #: replaces them even when that run did not end cleanly (``freebench/report/runs.py``)
    resume: bool = False
    overwrite: bool = False

    JSON_KEYS = {"api_list": "list"}

    def __post_init__(self) -> None:
        s = "free_benchmark."
        _set(self, "scope", _str_tuple(s + "scope", self.scope))
        _set(self, "api_list", _str_tuple(s + "list", self.api_list))
        _choice(s + "fuzz_device", self.fuzz_device, FUZZ_DEVICES)
        _choice(s + "pert_mode", self.pert_mode, PERT_MODES)
        _choice(s + "handler_type", self.handler_type, HANDLER_TYPES)
        _choice(s + "fuzz_level", self.fuzz_level, FUZZ_LEVELS)
        _choice(s + "fuzz_stage", self.fuzz_stage, FUZZ_STAGES)
        _bool(s + "if_preheat", self.if_preheat)
        _positive_int(s + "preheat_step", self.preheat_step)
        _positive_int(s + "max_sample", self.max_sample)
        _bool(s + "resume", self.resume)
        _bool(s + "overwrite", self.overwrite)
        _not_both(s, self.resume, self.overwrite, "append to the dump, or replace it")
        if self.scope and self.api_list:
            raise ConfigError(
                f"free_benchmark.scope {list(self.scope)!r} and free_benchmark.list "
                f"{list(self.api_list)!r} were both given; accepted: one of them (or neither)",
                key=s + "scope", value=list(self.scope), accepted="one of scope, list (or neither)")
        needs = MODES[self.pert_mode].fuzz_device
        if needs != "npu" and self.fuzz_device != needs:
            raise ConfigError(
                f"free_benchmark.fuzz_device: {self.fuzz_device!r} is not valid with pert_mode "
                f"{self.pert_mode!r}; accepted: {needs!r}", key=s + "fuzz_device",
                value=self.fuzz_device, accepted=repr(needs))
        if self.fuzz_device != "npu" and needs != self.fuzz_device:
            fitting = ", ".join(repr(n) for n, m in MODES.items()
                                if m.fuzz_device == self.fuzz_device)
            raise ConfigError(
                f"free_benchmark.pert_mode: {self.pert_mode!r} is not valid with fuzz_device "
                f"{self.fuzz_device!r}; accepted: {fitting}", key=s + "pert_mode",
                value=self.pert_mode, accepted=fitting)
        if self.handler_type == "fix" and self.pert_mode not in FIX_PERT_MODES:
            raise ConfigError(
                f"free_benchmark.pert_mode: {self.pert_mode!r} is not valid with handler_type "
                f"'fix'; accepted: {', '.join(FIX_PERT_MODES)}", key=s + "pert_mode",
                value=self.pert_mode, accepted=", ".join(FIX_PERT_MODES))
        if self.if_preheat and self.handler_type == "fix":
            raise ConfigError(
                "free_benchmark.if_preheat: True is not valid with handler_type 'fix'; "
                "accepted: false (preheat only samples in check mode)", key=s + "if_preheat",
                value=True, accepted="false (preheat only samples in check mode)")
        _set(self, "thresholds", _thresholds(self.thresholds))
        module = (self.module,) if isinstance(self.module, str) else self.module
        _set(self, "module", tuple(dict.fromkeys(_str_tuple(s + "module", module))))
        if self.budget is not None:
            b = self.budget
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not (
                    b > 0 and math.isfinite(b)):
                _fail(s + "budget", b, "a finite number > 0 (a fraction of the plain step time, "
                      "e.g. 0.2), or null")
            _set(self, "budget", float(b))
            if self.handler_type == "fix":
                raise ConfigError(
                    f"free_benchmark.budget: {b!r} is not valid with handler_type 'fix'; "
                    "accepted: null (fix replaces every call it covers)")

    def threshold_for(self, dtype_name: str) -> float | None:
        """The threshold override for calls computing in ``dtype_name`` (e.g. ``"bfloat16"``;
        ``other`` covers the dtypes not named), or None: derived from the unit roundoff."""
        if dtype_name in self.thresholds:
            return self.thresholds[dtype_name]
        return self.thresholds.get("other")


def _thresholds(value: Any) -> Mapping:
    key = "free_benchmark.thresholds"
    if not isinstance(value, Mapping):
        _fail(key, value, f"a mapping with keys among {', '.join(THRESHOLD_KEYS)}")
    merged = dict(DEFAULT_THRESHOLDS)
    for k, v in value.items():
        _choice(f"{key} key", k, THRESHOLD_KEYS)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and math.isfinite(v)):
            _fail(f"{key}.{k}", v, "a finite number > 0")
        merged[k] = float(v)
    return _FrozenDict(merged)


class _FrozenDict(dict):
    """A dict that refuses mutation (keeps the config immutable) and stays JSON-serialisable."""

    def _readonly(self, *a, **k):
        raise TypeError("config mappings are read-only; use dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


@dataclass(frozen=True)
class GradProbeConfig:
    """The ``grad_probe`` section."""

    grad_level: str = "L1"
    param_list: tuple = ()
    bounds: tuple = (-1, 0, 1)
    #: probekit extensions: digest of the L0 hash column, steps buffered between flushes, and
    #: the longest a recorded step waits in memory before it is written (seconds)
    hash: str = "md5"
    flush_every: int = 50
    flush_seconds: float = 60.0
    #: a second bit per element: is it above its gradient's rounding level (the noise-aware
    #: comparison's default; False keeps msprobe's sign bits only, half the bytes)
    significance: bool = True
    #: where the gradients are taken (``GRAD_POINTS``): at the optimizer's step, after the loop
    #: clipped them, or at the end of the last backward pass before it, before clipping
    grad_point: str = "step"
    #: sign and significance bits of at most this many elements per parameter, a fixed
    #: pseudo-random sample chosen by global index (``grads/sampling.py``; 0: every element)
    sample: int = 0
    #: a restarted run continues the store: the step it starts at (None: in a store that holds
    #: steps, the optimizer's step count where it keeps one, else the step after the newest; in
    #: a new store 0), whether it may replace the whole recording, and whether each commit is
    #: flushed to the disk (survives a power loss, not only the death of the process)
    start_step: int | None = None
    overwrite: bool = False
    durable: bool = False
    #: this run continues the store (a restart), whatever else says so or not; without it a run
    #: appends only when it is a restart (start_step, an elastic restart, an optimizer state
    #: restored from a checkpoint) and otherwise replaces a store whose last run ended cleanly
    resume: bool = False
    #: record this run as a control for a test at that precision (``CONTROL_DTYPES``, optionally
    #: ``:recipe``): every low-precision op of the test's recipe computed wider and rounded at
    #: random by a generator of its own, seeded by ``control_seed`` (``grads/control.py``)
    control: str | None = None
    control_seed: int = 0
    #: replica agreement (``grads/record/replicas.py``): every parameter replicated over a
    #: group (DDP, HSDP, a DTensor ``Replicate`` mesh dimension, ``tied``) is checked across it
    #: at every step, the gradient the optimizer uses and the parameter, in one all-gather
    check_replicas: bool = True
    #: parameters that hold the same values wherever they are held, e.g. an embedding tied to
    #: the output layer of the last pipeline stage: a list of lists of names (with or without
    #: wrapper prefixes); a list of one name: that parameter is a replica on every rank holding it
    tied: tuple = ()

    def __post_init__(self) -> None:
        s = "grad_probe."
        _choice(s + "grad_level", self.grad_level, GRAD_LEVELS)
        _set(self, "param_list", _str_tuple(s + "param_list", self.param_list))
        _set(self, "bounds", _bounds(s + "bounds", self.bounds))
        _choice(s + "hash", self.hash, HASH_ALGORITHMS)
        _positive_int(s + "flush_every", self.flush_every)
        if (isinstance(self.flush_seconds, bool) or not isinstance(self.flush_seconds, (int, float))
                or not math.isfinite(self.flush_seconds) or self.flush_seconds <= 0):
            _fail(s + "flush_seconds", self.flush_seconds, "a finite number of seconds > 0")
        _bool(s + "significance", self.significance)
        _choice(s + "grad_point", self.grad_point, GRAD_POINTS)
        if not _is_int(self.sample) or self.sample < 0:
            _fail(s + "sample", self.sample, "an integer >= 0 (elements sampled per parameter; "
                  "0 records every element)")
        if self.start_step is not None and (not _is_int(self.start_step) or self.start_step < 0):
            _fail(s + "start_step", self.start_step, "an integer >= 0, or null (resuming a "
                  "store: the optimizer's step count, else the step after its newest)")
        _bool(s + "overwrite", self.overwrite)
        _bool(s + "resume", self.resume)
        _not_both(s, self.resume, self.overwrite, "continue the store, or replace it")
        _bool(s + "durable", self.durable)
        if self.control is not None:
            name, _, recipe = (self.control.partition(":") if isinstance(self.control, str)
                               else (None, "", ""))
            if name not in CONTROL_DTYPES or (recipe and recipe not in CONTROL_RECIPES):
                _fail(s + "control", self.control,
                      f"null (a plain run), or one of {', '.join(CONTROL_DTYPES)}, optionally "
                      f"followed by :{', :'.join(CONTROL_RECIPES)} (e.g. bf16, bf16:cast)")
        if not _is_int(self.control_seed) or self.control_seed < 0:
            _fail(s + "control_seed", self.control_seed, "an integer >= 0")
        _bool(s + "check_replicas", self.check_replicas)
        _set(self, "tied", _tied(s + "tied", self.tied))


def _tied(key: str, value: Any) -> tuple:
    """``grad_probe.tied``: a list of lists of parameter names, no name in two of them."""
    accepted = ("a list of lists of parameter names (each list: parameters holding the same "
                "values wherever they are held, e.g. [[\"embed.weight\", \"head.weight\"]])")
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        _fail(key, value, accepted)
    out, seen = [], {}
    for group in value:
        if isinstance(group, str) or not isinstance(group, (list, tuple)) or not group:
            _fail(key, group, accepted)
        names = _str_tuple(key, group)
        for n in names:
            if n in seen:
                _fail(key, n, f"each name in one list only ({n!r} is in {list(seen[n])!r} "
                      f"and {list(names)!r})")
            seen[n] = names
        out.append(names)
    return tuple(out)


def _bounds(key: str, value: Any) -> tuple:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        _fail(key, value, "a non-empty list of numbers in strictly ascending order")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            _fail(key, value, f"finite numbers only ({v!r} is not one)")
    if any(a >= b for a, b in zip(value, value[1:])):
        _fail(key, value, "numbers in strictly ascending order")
    return tuple(value)


SECTIONS = {"free_benchmark": FreeBenchmarkConfig, "grad_probe": GradProbeConfig}
COMMON_KEYS = ("task", "dump_path", "rank", "step", "level", "seed", "is_deterministic",
               "enable_dataloader", "acl_config")


def _unusable_folder(path: str) -> str:
    """Why a run cannot write into ``path`` ("" when it can: an existing writable folder, or
    one that can be created because its nearest existing ancestor is a writable folder). URLs
    (``s3://...``) are checked by the store when it opens them."""
    if "://" in path:
        return ""
    here = os.path.abspath(path)
    if os.path.exists(here):
        if not os.path.isdir(here):
            return "it is a file"
        return "" if os.access(here, os.W_OK | os.X_OK) else "it is not writable"
    parent = here
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return "none of its parents exists"
        parent = up
    if not os.path.isdir(parent):
        return f"{parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return ""


@dataclass(frozen=True)
class Config:
    """A whole probekit/msprobe configuration: common keys plus the section of ``task``."""

    task: str
    dump_path: str = "./dump_path"
    rank: tuple = ()
    step: tuple = ()
    level: str = "L1"
    seed: int = 1234
    is_deterministic: bool = False
    free_benchmark: FreeBenchmarkConfig = field(default_factory=FreeBenchmarkConfig)
    grad_probe: GradProbeConfig = field(default_factory=GradProbeConfig)

    def __post_init__(self) -> None:
        if self.task in MSPROBE_OTHER_TASKS:
            raise ConfigError(
                f"task: {self.task!r} is an msprobe task probekit does not implement; "
                f"accepted: {', '.join(TASKS)}", key="task", value=self.task,
                accepted=", ".join(TASKS))
        _choice("task", self.task, TASKS)
        if (not isinstance(self.dump_path, (str, os.PathLike)) or not str(self.dump_path)
                or "\0" in os.fspath(self.dump_path)):
            _fail("dump_path", self.dump_path, "a non-empty path string without NUL characters")
        _set(self, "dump_path", os.fspath(self.dump_path))
        why = _unusable_folder(self.dump_path)
        if why:
            _fail("dump_path", self.dump_path, f"a folder that exists or can be created "
                  f"(this one cannot: {why})")
        _set(self, "rank", _index_tuple("rank", self.rank))
        _set(self, "step", _index_tuple("step", self.step))
        _choice("level", self.level, LEVELS)
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            _fail("seed", self.seed, "an integer in [0, 2**63)")
        _bool("is_deterministic", self.is_deterministic)
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                _fail(name, getattr(self, name), f"a {cls.__name__}")

    @property
    def section(self):
        """The section object of this config's task."""
        return getattr(self, self.task)

    # -- dict / JSON ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "config") -> "Config":
        """Build from a msprobe-shaped dict; unknown keys are rejected, msprobe-only ones ignored."""
        if not isinstance(data, Mapping):
            _fail(source, data, "a JSON object")
        known = set(COMMON_KEYS) | set(SECTIONS) | set(MSPROBE_OTHER_TASKS)
        unknown = sorted(set(data) - known)
        if unknown:
            _fail(f"{source} key", unknown[0], ", ".join(sorted(known)))
        if "task" not in data:
            raise ConfigError(f"task: missing in {source}; accepted: {', '.join(TASKS)}",
                              key="task", accepted=", ".join(TASKS))
        if data.get("enable_dataloader", False) not in (False,):
            _fail("enable_dataloader", data["enable_dataloader"],
                  "false (probekit has no dataloader-driven mode: call start/stop/step)")
        acl = data.get("acl_config", "")
        if acl:
            log.info("acl_config %r is an Ascend dump setting; probekit ignores it", acl)
        top = {k: data[k] for k in ("task", "dump_path", "rank", "step", "level", "seed",
                                   "is_deterministic") if k in data}
        for name, section_cls in SECTIONS.items():
            if name in data:
                top[name] = _section_from_dict(section_cls, name, data[name])
        return cls(**top)

    def to_dict(self) -> dict:
        """msprobe-shaped dict (JSON-ready) holding every key, extensions included."""
        out = {
            "task": self.task, "dump_path": self.dump_path, "rank": list(self.rank),
            "step": list(self.step), "level": self.level, "seed": self.seed,
            "is_deterministic": self.is_deterministic,
        }
        for name in SECTIONS:
            out[name] = _section_to_dict(getattr(self, name))
        return out

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=4, ensure_ascii=False)
        if path is not None:
            atomic_write(path, text + "\n")
        return text

    def replace(self, **changes) -> "Config":
        """A new validated config with top-level or section keys changed (JSON key names).

        Section keys go to the section of the (possibly new) task; other sections are kept.
        """
        data = self.to_dict()
        task = changes.get("task", self.task)
        # whole sections first, so single keys given beside them win
        for key, value in sorted(changes.items(), key=lambda kv: kv[0] not in SECTIONS):
            if key in SECTIONS:
                if not isinstance(value, Mapping):
                    _fail(key, value, "a dict of that section's keys")
                data[key] = dict(value)
            elif key in COMMON_KEYS:
                data[key] = value
            elif task in SECTIONS:
                data[task]["list" if key == "api_list" else key] = value
            else:
                _choice("task", task, TASKS)
        return Config.from_dict(data, source="arguments")


def _section_from_dict(section_cls, name: str, data: Any):
    if not isinstance(data, Mapping):
        _fail(name, data, "a JSON object")
    rename = getattr(section_cls, "JSON_KEYS", {})
    to_field = {json_key: f for f, json_key in rename.items()}
    fields = {f.name for f in dataclasses.fields(section_cls)}
    kwargs = {}
    for key, value in data.items():
        fname = to_field.get(key, key)
        if fname not in fields or key in rename:
            accepted = sorted(rename.get(f, f) for f in fields)
            _fail(f"{name} key", key, ", ".join(accepted))
        kwargs[fname] = value
    return section_cls(**kwargs)


def _section_to_dict(section) -> dict:
    rename = getattr(type(section), "JSON_KEYS", {})
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[rename.get(f.name, f.name)] = value
    return out


def load_config(path: str | os.PathLike) -> Config:
    """Read a msprobe/probekit ``config.json``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        _fail("config_path", path, "an existing JSON file")
    try:
        with open(path, encoding="utf-8-sig") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config_path: {path!r} is not valid JSON ({exc}); accepted: a JSON "
                          "object as msprobe's config.json", key="config_path", value=path,
                          accepted="a JSON object as msprobe's config.json") from None
    return Config.from_dict(data, source=path)


def config_for(task: str, config: Any = None, /, **options) -> Config:
    """The one way from anything a user may hand over to a validated ``Config`` of ``task``.

    ``config``: ``None`` (the defaults), a ``Config``, a section object (``FreeBenchmarkConfig``
    / ``GradProbeConfig``), a msprobe-shaped dict, or the path of a config.json. ``options`` are
    then applied as ``make_config`` takes them. A config written for the other task keeps its
    common keys and its section for ``task`` (msprobe's config.json holds every section; the
    feature the user asked for decides which one applies), and says so in the log.
    """
    _choice("task", task, TASKS)
    if config is None:
        return make_config(task, **options)
    if isinstance(config, tuple(SECTIONS.values())):
        if not isinstance(config, SECTIONS[task]):
            _fail("config", config, f"a {SECTIONS[task].__name__} for task {task!r}")
        cfg = Config(task=task, **{task: config})
    elif isinstance(config, Config):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = Config.from_dict({"task": task, **config}, source="config")
    elif isinstance(config, (str, os.PathLike)):
        cfg = load_config(config)
    else:
        _fail("config", config, "None, a probekit Config, a FreeBenchmarkConfig or "
              "GradProbeConfig, a dict shaped like msprobe's config.json, or a path to one")
    if cfg.task != task:
        log.info("config of task %r used for %r: its common keys and its %s section apply",
                 cfg.task, task, task)
        cfg = cfg.replace(task=task)
    return cfg.replace(**options) if options else cfg


#: earlier keyword spellings of the grad probes' constructors -> msprobe's key (deprecated)
OLD_GRAD_KEYWORDS = {"level": "grad_level", "steps": "step", "ranks": "rank"}


def grad_probe_options(options: dict, owner: str = "GradProbe") -> dict:
    """Keyword options of a grad probe (PyTorch's or MindSpore's) with the old spellings renamed
    (a ``DeprecationWarning`` each) and ``None`` (= "all", as before) dropped."""
    import warnings

    out = {}
    for key, value in options.items():
        new = OLD_GRAD_KEYWORDS.get(key)
        if new is not None:
            warnings.warn(f"{owner}({key}=...) is deprecated; use {new}=... (msprobe's config "
                          f"key)", DeprecationWarning, stacklevel=3)
            if new in options:
                raise TypeError(f"{owner}: {key}= and {new}= were both given; use {new}=")
            key = new
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def make_config(task: str | None = None, **options) -> Config:
    """Build a config from keyword arguments.

    Common keys (``dump_path``, ``rank``, ``step``, ``level``, ``seed``, ``is_deterministic``)
    go to the top; every other key goes to the section of ``task`` and uses its JSON name
    (``list``, ``pert_mode``, ``grad_level``...; ``api_list`` is accepted for ``list``). A whole
    section may also be given as a dict: ``free_benchmark={...}``.
    """
    if task is None:
        raise ConfigError(f"task: missing; accepted: {', '.join(TASKS)}", key="task",
                          accepted=", ".join(TASKS))
    return Config.from_dict({"task": task}, source="arguments").replace(**options)
