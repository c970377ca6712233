"""``PrecisionDebugger`` for MindSpore, as msprobe's ``msprobe.mindspore.PrecisionDebugger``.

msprobe's MindSpore users write::

    debugger = PrecisionDebugger(config_path="./config.json")
    debugger.monitor(optimizer)        # after the optimizer is built
    ...train...
    debugger.stop()                    # msprobe needs it in static graph mode; harmless otherwise

Only the ``grad_probe`` task exists for MindSpore here; any other task is refused when the
debugger is created. ``start()`` and ``step()`` are accepted and do nothing (msprobe's grad probe
is driven by ``monitor`` alone). Calls on the class go to the newest debugger, as in msprobe.
As for PyTorch, ``seed`` is not applied (an observer leaves the random streams alone);
``is_deterministic: true`` is.
"""
from __future__ import annotations

import atexit
import weakref

from ..config import Config, ConfigError
from ..debugger import ClassOrInstance, debugger_config
from ..log import ensure_handler, get_logger
from .recorder import GradProbe, get_rank

log = get_logger(__name__)


def set_deterministic() -> None:
    """msprobe's ``is_deterministic`` for MindSpore (no random generator is touched)."""
    import mindspore as ms

    ms.set_context(deterministic="ON")


class PrecisionDebugger:
    """msprobe's MindSpore ``PrecisionDebugger`` for the grad probe.

    ``PrecisionDebugger(config_path="config.json")`` or
    ``PrecisionDebugger(task="grad_probe", dump_path="./out", grad_level="L2", ...)``.
    """

    _newest = None

    def __init__(self, config_path=None, task=None, dump_path=None, *, config: Config | None = None,
                 **options):
        ensure_handler()
        cfg = debugger_config(config_path, task, dump_path, config, options, "grad_probe")
        if cfg.task != "grad_probe":
            raise ConfigError(f"task: {cfg.task!r} is not valid for probekit's MindSpore "
                              "PrecisionDebugger; accepted: grad_probe")
        self.config: Config = cfg
        self.probe: GradProbe | None = None
        self._closed = False
        if cfg.is_deterministic:  # an explicit request; the seed is never applied (an observer)
            set_deterministic()
        type(self)._newest = weakref.ref(self)
        atexit.register(self._close_quietly)

    @property
    def task(self) -> str:
        return self.config.task

    @property
    def active(self) -> bool:
        """False when the ``rank`` filter excludes this process: every call is then a no-op."""
        return not self.config.rank or get_rank() in self.config.rank

    @ClassOrInstance
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

    @ClassOrInstance
    def start(self, model=None):
        """Accepted for msprobe's loops; the grad probe is driven by ``monitor`` alone."""

    @ClassOrInstance
    def step(self):
        """Accepted for msprobe's loops; steps are the optimizer's calls."""

    @ClassOrInstance
    def stop(self):
        """End the monitoring: hook removed, buffered steps written."""
        if self.probe is not None:
            self.probe.stop()

    @property
    def results(self):
        """The recorded steps of this rank as an xarray Dataset (None before ``monitor``)."""
        return self.probe.dataset() if self.probe is not None and self.probe.has_store else None

    @property
    def summary(self):
        """The probe's ``ProbeSummary``: steps, parameters, bytes, where the store is; ``str()``
        is one line (None before ``monitor``)."""
        return self.probe.summary if self.probe is not None else None

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
