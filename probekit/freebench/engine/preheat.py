"""Preheat: sample during the first steps, then keep checking only the APIs that showed risk.

The rule, exactly (``if_preheat``, ``preheat_step`` = P, ``max_sample`` = M):

1. Sampling, steps ``0 .. P-1``: call ``i`` (0-based, per API within the step) of an API is checked
   when ``(i - step * M) mod N < M``, where ``N`` is the number of calls of that API in the previous
   step (in the first step it is seen, or when ``N <= M``: the calls ``i < M``). So at most M calls
   per API per step are checked, and the window moves by M each step, covering every call
   position of a repeated API over the preheat steps.
2. Calibration: an API's risk is the largest ``ratio`` (``max_rel / threshold``) of its checked
   calls during preheat; a NaN/Inf mismatch or a sign flip counts as infinite risk.
3. From step P on: an API is checked at every call when its risk is ``>= RISK_RATIO`` (an error
   of at least that share of its threshold, findings included) or when it was never calibrated (first
   seen after preheat, or all its samples were cancelled). The others are skipped (reason
   ``preheat``).

Thresholds themselves do not change (msprobe moved per-API thresholds by factors of two; a fixed
threshold keeps the CSV comparable between runs).
"""
from __future__ import annotations

import math

RISK_RATIO = 0.5


class Preheat:
    def __init__(self, preheat_step: int, max_sample: int) -> None:
        self.preheat_step = preheat_step
        self.max_sample = max_sample
        self.risk: dict[str, float] = {}
        self.prev_counts: dict[str, int] = {}

    def in_preheat(self, step: int) -> bool:
        return step < self.preheat_step

    def sample(self, key: str, index: int, step: int) -> bool:
        """During preheat: is call ``index`` of API ``key`` in ``step`` one of the sampled ones?"""
        m = self.max_sample
        n = self.prev_counts.get(key, 0)
        if n <= m:
            return index < m
        return (index - step * m) % n < m

    def total(self, key: str):
        """Calls of ``key`` in the previous step ('?' when unknown), for the log line."""
        return self.prev_counts.get(key, "?")

    def record(self, key: str, ratio: float) -> None:
        if math.isnan(ratio):
            ratio = math.inf
        self.risk[key] = max(self.risk.get(key, 0.0), ratio)

    def wanted(self, key: str) -> bool:
        """After preheat: keep checking ``key``?"""
        r = self.risk.get(key)
        return r is None or r >= RISK_RATIO

    def end_step(self, counts: dict) -> None:
        self.prev_counts = dict(counts)

    def at_risk(self) -> list[str]:
        return sorted(k for k, r in self.risk.items() if r >= RISK_RATIO)

    def low_risk(self) -> list[str]:
        return sorted(k for k, r in self.risk.items() if r < RISK_RATIO)
