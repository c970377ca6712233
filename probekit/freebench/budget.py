"""The overhead budget and the coverage of call sites.

``Budget(fraction)``: checks may cost about ``fraction`` of the plain step time. The first step
checks every eligible call and measures what a check costs (host time of the re-run, the
perturbation and the comparison, plus the step's gather) and what the step costs without them
(time under the probe — between ``start()`` and ``stop()`` — minus the check time); both are then
followed with an exponential average. From the next step on, ``limit = max(1, floor(fraction * plain / per_check))``
calls are checked per step, chosen by a window over the step's eligible calls (in call order):
call ``i`` is checked when ``(i - offset) mod N < limit``, ``N`` being the number of eligible calls
in the previous step, and the window moves by ``limit`` each step, so with a stable call sequence
every call site is checked within ``ceil(N / limit)`` steps.

Host time is what probekit can measure without a sync; on accelerators the device time of a check
runs in parallel with the host and is of the same order for small kernels.

``Coverage``: per call site (``Torch.matmul.3``) how many times it was eligible and checked, and
the call sites never re-run because their random draws cannot be replayed, with the reason.
"""
from __future__ import annotations

import math
import time

#: weight of the newest step in the running averages
EMA = 0.3


class Budget:
    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.limit: int | None = None   # checks per step (None: calibrating, check all)
        self.offset = 0
        self.index = 0                  # eligible calls seen in this step
        self.prev_total = 0
        self.check_s = 0.0              # host seconds spent on checks in this step
        self.checks = 0
        self.per_check: float | None = None
        self.plain: float | None = None
        self.t0: float | None = None    # start() of the current active stretch (None: stopped)
        self.active_s = 0.0             # time between start() and stop() in this step

    def started(self) -> None:
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def stopped(self, now: float | None = None) -> None:
        if self.t0 is not None:
            self.active_s += (time.perf_counter() if now is None else now) - self.t0
            self.t0 = None

    def admit(self) -> bool:
        """Is the next eligible call of this step to be checked?"""
        i = self.index
        self.index = i + 1
        n = self.prev_total
        if self.limit is None or n <= self.limit:
            return True
        return (i - self.offset) % n < self.limit

    def spent(self, seconds: float, checks: int = 1) -> None:
        self.check_s += seconds
        self.checks += checks

    def end_step(self, now: float | None = None) -> None:
        """Close the step: ``plain`` = time under the probe (start() to stop(), or to now while
        active) minus the checks; the next step's limit follows."""
        now = time.perf_counter() if now is None else now
        wall = self.active_s
        if self.t0 is not None:
            wall += now - self.t0
            self.t0 = now
        self.active_s = 0.0
        if self.checks:
            self.per_check = _avg(self.per_check, self.check_s / self.checks)
        if wall > 0:
            self.plain = _avg(self.plain, max(wall - self.check_s, 0.0))
        if self.per_check and self.plain is not None:
            if self.limit is not None and self.prev_total:
                self.offset = (self.offset + self.limit) % self.prev_total
            self.limit = max(1, math.floor(self.fraction * self.plain / self.per_check))
        self.prev_total = self.index
        self.index = 0
        self.check_s = 0.0
        self.checks = 0


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class Coverage:
    """Per call site ``(api key, counter)``: times eligible and times checked (named
    ``Torch.matmul.3`` only when the table is built); and the sites skipped because their
    random draws cannot be replayed (``rng.py``): times seen and why."""

    def __init__(self) -> None:
        self.calls: dict[tuple, int] = {}
        self.checked: dict[tuple, int] = {}
        self.skipped: dict[tuple, int] = {}
        self.reasons: dict[tuple, str] = {}

    def seen(self, site: tuple) -> None:
        self.calls[site] = self.calls.get(site, 0) + 1

    def skip(self, site: tuple, reason: str) -> None:
        """A call of ``site`` that could not be checked, and why (the latest reason is kept)."""
        self.skipped[site] = self.skipped.get(site, 0) + 1
        self.reasons[site] = reason

    def check(self, site: tuple) -> None:
        self.checked[site] = self.checked.get(site, 0) + 1

    def share(self) -> float:
        """Share of the call sites seen that were checked at least once (1.0 when none seen)."""
        if not self.calls:
            return 1.0
        return sum(1 for k in self.calls if self.checked.get(k)) / len(self.calls)

    def frame(self):
        """``api_name, calls, checked, reason``: the eligible sites (reason empty), then the
        sites never checked because their draws cannot be replayed."""
        import pandas as pd

        sites = list(self.calls) + [s for s in self.skipped if s not in self.calls]
        calls = [self.calls.get(s, 0) + self.skipped.get(s, 0) for s in sites]
        return pd.DataFrame({"api_name": pd.Series([f"{k}.{n}" for k, n in sites],
                                                   dtype="object"),
                             "calls": pd.Series(calls, dtype="int64"),
                             "checked": pd.Series([self.checked.get(s, 0) for s in sites],
                                                  dtype="int64"),
                             "reason": pd.Series([self.reasons.get(s, "") for s in sites],
                                                 dtype="object")})
