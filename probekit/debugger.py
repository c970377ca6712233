"""``PrecisionDebugger``: msprobe's entry point, dispatching to probekit's features.

msprobe users write::

    debugger = PrecisionDebugger(config_path="./config.json")
    debugger.start(); ...; debugger.stop(); debugger.step()      # free_benchmark
    debugger.monitor(model)                                       # grad_probe

(for grad_probe, msprobe's documented loop keeps the start/stop/step calls around every
iteration: they do nothing for it, in msprobe and here, so every step is recorded)

and some call the methods on the class (``PrecisionDebugger.start()``), which msprobe allows
because it keeps one instance. Both spellings work here: a call on the class goes to the most
recently created debugger. Unlike msprobe, creating a second debugger makes a new one (it does not
silently return the first with the first's config).

Features register a factory in ``FEATURES`` (task name -> "module:function"); the factory takes the
validated ``Config`` and returns a session with ``start()``, ``stop()``, ``step()``,
``monitor(model, optimizer=None)``, ``close()`` and the properties ``results`` and ``summary``.
"""
from __future__ import annotations

import atexit
import importlib
import weakref

from .config import TASKS, Config, load_config, make_config
from .dist import get_rank, rank_selected
from .log import ensure_handler, get_logger
from .seed import seed_all, set_deterministic

log = get_logger(__name__)

#: task -> "module:factory" of the feature implementing it
FEATURES = {
    "free_benchmark": "probekit.freebench.session.bench:open_session",
    "grad_probe": "probekit.grads.record.task:open_session",
}


def _feature_factory(task: str):
    target = FEATURES.get(task)
    if target is None:
        raise NotImplementedError(
            f"probekit: task {task!r} has no feature registered; accepted: {', '.join(TASKS)}")
    module_name, func = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise NotImplementedError(
                f"probekit: the {task} feature is not implemented in this version") from None
        raise
    return getattr(module, func)


class ClassOrInstance:
    """A method that works on an instance, or on the class (then on the newest instance)."""

    def __init__(self, func):
        self.func = func
        self.__doc__ = func.__doc__
        self.__name__ = func.__name__

    def __get__(self, obj, cls):
        if obj is None:
            ref = cls._newest
            obj = ref() if ref is not None else None
            if obj is None:
                name = self.func.__name__

                def missing(*args, **kwargs):
                    raise RuntimeError(
                        f"PrecisionDebugger.{name}(): no PrecisionDebugger has been created yet")

                return missing
        return self.func.__get__(obj, cls)


def debugger_config(config_path=None, task=None, dump_path=None, config: Config | None = None,
                    options: dict | None = None, default_task: str | None = None) -> Config:
    """msprobe's ``PrecisionDebugger(config_path, task, dump_path, **options)`` arguments -> a
    validated ``Config``: ``task``/``dump_path``/options given with a config file override the
    file's values (as in msprobe); ``config=`` takes a ready ``Config`` instead."""
    options = options or {}
    if config is not None:
        if config_path or options:
            raise ValueError("pass either config=... or config_path/keyword options, not both")
        return config
    if config_path is not None:
        cfg = load_config(config_path)
        if task is not None or dump_path is not None or options:
            cfg = cfg.replace(**({"task": task} if task else {}),
                              **({"dump_path": dump_path} if dump_path else {}), **options)
        return cfg
    return make_config(task or default_task, **({"dump_path": dump_path} if dump_path else {}),
                       **options)


class PrecisionDebugger:
    """Run one probekit feature as msprobe's ``PrecisionDebugger`` would.

    ``PrecisionDebugger(config_path="config.json")`` or
    ``PrecisionDebugger(task="free_benchmark", dump_path="./out", pert_mode="bit_noise", ...)``.
    ``task``/``dump_path`` given with a config file override the file's values (as in msprobe).
    ``seed``/``is_deterministic`` are applied when the debugger is created, except for the grad
    probe (as in msprobe): an observer leaves the run's random streams alone, so ``seed`` is not
    applied (``is_deterministic: true`` still is, being an explicit request).
    """

    _newest = None

    def __init__(self, config_path=None, task=None, dump_path=None, *, config: Config | None = None,
                 model=None, **options):
        ensure_handler()
        cfg = debugger_config(config_path, task, dump_path, config, options)
        self.config: Config = cfg
        self.model = model
        self._session = None
        self._closed = False
        if cfg.task != "grad_probe":
            seed_all(cfg.seed, cfg.is_deterministic)
        elif cfg.is_deterministic:  # an explicit request; the seed is never applied (observer)
            set_deterministic()
        type(self)._newest = weakref.ref(self)
        self._atexit = atexit.register(self._close_quietly)

    # -- the feature session ----------------------------------------------------------------
    @property
    def task(self) -> str:
        return self.config.task

    @property
    def active(self) -> bool:
        """False when the ``rank`` filter excludes this process: every call is then a no-op."""
        return rank_selected(self.config.rank)

    def _get_session(self):
        if self._closed:
            raise RuntimeError("this PrecisionDebugger was closed")
        if self._session is None:
            factory = _feature_factory(self.task)
            self._session = factory(self.config)
        return self._session

    def _skip(self, what: str) -> bool:
        if self.active:
            return False
        log.debug("%s skipped: rank %d is not in rank filter %s", what, get_rank(),
                  list(self.config.rank))
        return True

    # -- msprobe API ------------------------------------------------------------------------
    @ClassOrInstance
    def start(self, model=None):
        """Begin probing (free_benchmark: intercept API calls until ``stop()``)."""
        if self._skip("start"):
            return
        self._get_session().start(model if model is not None else self.model)

    @ClassOrInstance
    def stop(self):
        """Stop probing (free_benchmark: intercepting ends until the next ``start()``). For
        grad_probe it does nothing, as in msprobe: recording goes on until ``close()``."""
        if self._skip("stop") or self._session is None:
            return
        self._session.stop()

    @ClassOrInstance
    def step(self):
        """Mark the end of a training step (free_benchmark: per-step counters reset, the step
        number + 1, as in msprobe also before the first ``start()``, with a warning; grad_probe:
        nothing, the probe counts the optimizer's steps)."""
        if self._skip("step"):
            return
        if self._session is None and self.task == "grad_probe":
            return
        self._get_session().step()

    @ClassOrInstance
    def monitor(self, model, optimizer=None, scaler=None):
        """grad_probe: record gradient statistics of ``model`` at every training iteration
        (``scaler``: the run's GradScaler, so the steps it skips keep their place)."""
        if self.task != "grad_probe":
            log.warning("monitor() only applies to task 'grad_probe' (this debugger's task is %r)",
                        self.task)
            return
        if self._skip("monitor"):
            return
        if scaler is not None:
            self._get_session().monitor(model, optimizer=optimizer, scaler=scaler)
        else:
            self._get_session().monitor(model, optimizer=optimizer)

    # -- probekit additions ------------------------------------------------------------------
    @property
    def results(self):
        """The feature's results (free_benchmark: DataFrame of findings; grad_probe: Dataset)."""
        return self._get_session().results if self.active else None

    @property
    def summary(self):
        """What the run found or wrote, a dict whose ``str()`` is one line (free_benchmark:
        calls seen, checked, skipped, flagged, steps; grad_probe: steps, parameters, bytes,
        where the store is); None on a rank the filter excludes (grad_probe: before
        ``monitor``)."""
        return self._get_session().summary if self.active else None

    def close(self) -> None:
        """Stop, flush and remove every hook; the debugger cannot be used afterwards."""
        if self._closed:
            return
        try:
            if self._session is not None:
                self._session.close()
        finally:
            self._closed = True
            atexit.unregister(self._close_quietly)

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception as exc:  # at interpreter exit: report, never raise
            log.warning("closing the debugger at exit failed: %s", exc)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        return None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("active" if self.active else "inactive (rank)")
        return f"PrecisionDebugger(task={self.task!r}, dump_path={self.config.dump_path!r}, {state})"
