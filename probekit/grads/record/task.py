"""The grad probe behind ``PrecisionDebugger(task="grad_probe")``.

msprobe's grad probe is driven by ``monitor(model)`` alone: ``start()``, ``stop()`` and ``step()``
do nothing for it (msprobe 1.0.4 returns from them at once for task grad_probe), so a loop
written in msprobe's documented shape -- ``monitor`` once, ``start``/``stop``/``step`` around
every iteration -- records every step. The recording ends with ``close()`` (or at process exit),
which removes the hooks and writes the buffered steps. ``start(model)`` before any ``monitor``
monitors that model.
"""
from __future__ import annotations

from .recorder import GradProbe


class GradSession:
    def __init__(self, config) -> None:
        self.config = config
        self.probe: GradProbe | None = None

    def start(self, model=None) -> None:
        if model is not None and self.probe is None:
            self.monitor(model)

    def step(self) -> None:
        """Nothing to do: the probe counts the optimizer's steps itself."""

    def stop(self) -> None:
        """Nothing to do (as in msprobe): recording goes on until ``close()``."""

    def monitor(self, model, optimizer=None, scaler=None) -> None:
        if self.probe is not None:
            self.probe.stop()
        self.probe = GradProbe(model, optimizer, config=self.config, scaler=scaler).start()

    def close(self) -> None:
        if self.probe is not None:
            self.probe.stop()

    @property
    def results(self):
        return self.probe.dataset() if self.probe is not None and self.probe.has_store else None

    @property
    def summary(self):
        """The probe's ``ProbeSummary`` (None before ``monitor``); the buffered steps are written
        first, so it counts every step recorded so far."""
        if self.probe is None:
            return None
        self.probe.flush()
        return self.probe.summary


def open_session(config) -> GradSession:
    return GradSession(config)
