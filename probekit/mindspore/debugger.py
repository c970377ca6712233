"""``PrecisionDebugger`` for MindSpore, as msprobe's ``msprobe.mindspore.PrecisionDebugger``.

msprobe's MindSpore users write::

    debugger = PrecisionDebugger(config_path="./config.json")
    debugger.monitor(optimizer)        # after the optimizer is built
    ...train...
    debugger.stop()                    # msprobe needs it in static graph mode; harmless otherwise

Only the ``grad_probe`` task exists for MindSpore here; any other task is refused when the
debugger is created. ``start()`` and ``step()`` are accepted and do nothing (msprobe's grad probe
is driven by ``monitor`` alone). Calls on the class go to the newest debugger, as in msprobe.
"""
from __future__ import annotations

import atexit
import random
import weakref

import numpy as np

from ..config import Config, ConfigError, load_config, make_config
from ..log import ensure_handler, get_logger
from .recorder import GradProbe, get_rank

log = get_logger(__name__)


def seed_all(seed: int, deterministic: bool) -> None:
    """msprobe's ``seed`` / ``is_deterministic`` for MindSpore: Python, numpy and MindSpore."""
    import mindspore as ms

    random.seed(seed)
    np.random.seed(seed)
    ms.set_seed(seed)
    if deterministic:
        ms.set_context(deterministic="ON")


def _before_executors_shut_down(func) -> None:
    """Run ``func`` at interpreter exit *before* ``concurrent.futures`` refuses new work: Zarr
    writes through an executor, so a flush from a plain ``atexit`` handler fails with "cannot
    schedule new futures after interpreter shutdown" and the last, unflushed steps are lost.
    ``threading._register_atexit`` callbacks run in reverse order of registration, ahead of
    the executors' own (registered when ``concurrent.futures`` was imported, earlier)."""
    import threading

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(func)
        except RuntimeError:  # pragma: no cover - already shutting down
            pass


class _ClassOrInstance:
    """A method callable on an instance, or on the class (then on the newest instance)."""

    def __init__(self, func):
        self.func = func
        self.__doc__ = func.__doc__

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


class PrecisionDebugger:
    """msprobe's MindSpore ``PrecisionDebugger`` for the grad probe.

    ``PrecisionDebugger(config_path="config.json")`` or
    ``PrecisionDebugger(task="grad_probe", dump_path="./out", grad_level="L2", ...)``.
    """

    _newest = None

    def __init__(self, config_path=None, task=None, dump_path=None, *, config: Config | None = None,
                 **options):
        ensure_handler()
        if config is not None:
            if config_path or options:
                raise ValueError("pass either config=... or config_path/keyword options, not both")
            cfg = config
        elif config_path is not None:
            cfg = load_config(config_path)
            if task is not None or dump_path is not None or options:
                cfg = cfg.replace(**({"task": task} if task else {}),
                                  **({"dump_path": dump_path} if dump_path else {}), **options)
        else:
            cfg = make_config(task or "grad_probe",
                              **({"dump_path": dump_path} if dump_path else {}), **options)
        if cfg.task != "grad_probe":
            raise ConfigError(f"task: {cfg.task!r} is not valid for probekit's MindSpore "
                              "PrecisionDebugger; accepted: grad_probe")
        self.config: Config = cfg
        self.probe: GradProbe | None = None
        self._closed = False
        seed_all(cfg.seed, cfg.is_deterministic)
        type(self)._newest = weakref.ref(self)
        atexit.register(self._close_quietly)
        _before_executors_shut_down(self._close_quietly)

    @property
    def task(self) -> str:
        return self.config.task

    @property
    def active(self) -> bool:
        """False when the ``rank`` filter excludes this process: every call is then a no-op."""
        return not self.config.rank or get_rank() in self.config.rank

    @_ClassOrInstance
    def monitor(self, optimizer):
        """Record gradient statistics at every call of ``optimizer`` (a mindspore.nn.Optimizer)."""
        if self._closed:
            raise RuntimeError("this PrecisionDebugger was closed")
        if not self.active:
            log.info("grad_probe: rank %d is not in rank filter %s; nothing is recorded",
                     get_rank(), list(self.config.rank))
            return
        if self.probe is not None:
            self.probe.stop()
        self.probe = GradProbe(optimizer, config=self.config).start()

    @_ClassOrInstance
    def start(self, model=None):
        """Accepted for msprobe's loops; the grad probe is driven by ``monitor`` alone."""

    @_ClassOrInstance
    def step(self):
        """Accepted for msprobe's loops; steps are the optimizer's calls."""

    @_ClassOrInstance
    def stop(self):
        """End the monitoring: hook removed, buffered steps written."""
        if self.probe is not None:
            self.probe.stop()

    @property
    def results(self):
        """The recorded steps of this rank as an xarray Dataset (None before ``monitor``)."""
        return self.probe.dataset() if self.probe is not None and self.probe.has_store else None

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            atexit.unregister(self._close_quietly)

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception as exc:  # at interpreter exit: report, never raise
            log.warning("closing the debugger at exit failed: %s", exc)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("active" if self.active else "inactive (rank)")
        return (f"PrecisionDebugger[MindSpore](task={self.task!r}, "
                f"dump_path={self.config.dump_path!r}, {state})")
