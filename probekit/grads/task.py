"""The grad probe behind ``PrecisionDebugger(task="grad_probe")``.

msprobe's grad probe is driven by ``monitor(model)`` alone; ``start()`` and ``step()`` do nothing
for it (they are accepted, so a loop written for the free benchmark runs unchanged) and
``stop()`` ends the monitoring: hooks removed, buffered steps written.
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
        pass

    def monitor(self, model, optimizer=None, scaler=None) -> None:
        if self.probe is not None:
            self.probe.stop()
        self.probe = GradProbe(model, optimizer, config=self.config, scaler=scaler).start()

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.stop()

    def close(self) -> None:
        self.stop()

    @property
    def results(self):
        return self.probe.dataset() if self.probe is not None and self.probe.has_store else None

    @property
    def summary(self):
        """The probe's ``ProbeSummary`` (None before ``monitor``)."""
        return self.probe.summary if self.probe is not None else None


def open_session(config) -> GradSession:
    return GradSession(config)
