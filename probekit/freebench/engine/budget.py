"""The overhead budget and the coverage of call sites.

``Budget(fraction)``: the probe may cost about ``fraction`` of the plain step time, end to end
(the interception of every call, the checks, the step's gather), averaged over the steps. Step 0
checks every eligible call and measures what a check costs (host time of the re-run, the
perturbation and the comparison, plus the step's gather). Step 1, and every ``REFERENCE_EVERY``-th
step after it, is a *reference step*: the session intercepts nothing (``reference``) and its time
under the probe — from ``start()`` to the end of ``stop()`` and ``step()`` — less the session's
own work there (``own``) is the plain step. A probed step's time minus its checks minus the
plain step is what the interception costs (every call seen, the unchecked ones handled); all
three are followed with an exponential average.

From then on one step in ``every`` is probed (``every`` a power of two, the smallest whose room
``every * fraction * plain - interception - (every - 1) * idle_own`` holds one check) and the
others are *quiet*: nothing intercepted, like a reference step (their time is the plain step's
too; ``idle_own``, the session's own start/stop/step work in such a step, is the probe's cost
and paid from the budget's room: 2-3 % of the small benchmark model's step). A probed step checks
``limit = floor(room / per_check)`` calls, chosen by a window over the step's eligible calls (in
call order): call ``i`` is checked when ``(i - offset) mod N < limit``, ``N`` being the number of
eligible calls in the last probed step, and the window moves by ``limit`` each probed step, so
with a stable call sequence every call site is checked within ``ceil(N / limit)`` probed steps.
Where the interception and one check fit in the budget ``every`` is 1 (every step probed, as
before quiet steps existed); where they do not (a small model, whose calls are cheap next to the
interception), probing one step in ``every`` keeps the promise instead of exceeding it, and the
probed step checks as many calls as the saved room pays for. The step is probed when
``step % every == 0``: on every rank the same steps (each rank's ``every`` is a power of two, so
a rank that probes less often probes a subset of the others' steps: the slow steps line up, and
ranks that synchronise every step run at the budget of the one with the smallest ``every``).

``cost()`` is what the budget really cost, end to end: the mean time of the steps after step 0
(reference, quiet and probed) over the mean of the unintercepted ones, minus one
(``summary["budget_cost"]``).

Host time is what probekit can measure without a sync; on accelerators the device time of a check
runs in parallel with the host and is of the same order for small kernels.

``Coverage``: per floating-point call site (``Torch.matmul.3``) how many times it ran and was
checked, and why not (the reason it was last skipped); the share of the floating-point calls
checked and a count per skip reason.
"""
from __future__ import annotations

import math
import time

#: weight of the newest step in the running averages
EMA = 0.3
#: a reference step (nothing intercepted: the plain step's time) is step 1 and every this many
#: steps after it
REFERENCE_EVERY = 10
#: the most steps between two probed steps (``every``): a budget too small for one check in this
#: many steps still probes one (the cost then says by how much the budget is exceeded)
MAX_EVERY = 1 << 12


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
        self.plain: float | None = None          # a reference step's time under the probe
        self.interception: float | None = None   # a probed step's, less its checks and plain
        self.steps = 0                  # steps closed
        self.references = 0             # reference steps closed
        self.quiet_steps = 0            # quiet steps closed
        self.probed_steps = 0           # probed steps closed (step 0 included)
        #: one step in this many is probed (a power of two; the others are quiet)
        self.every = 1
        #: this step intercepts nothing: a reference step, or a quiet one (``quiet``)
        self.reference = False
        self.quiet = False
        # the end-to-end cost: time of the steps after step 0, and of the unintercepted ones
        self._all = [0.0, 0]
        self._plain = [0.0, 0]
        self._calibration: tuple | None = None   # (time, check time) of step 0
        self._provisional = False       # the interception is still step 0's figure
        self.t0: float | None = None    # start() of the current active stretch (None: stopped)
        self.own_s = 0.0                # the session's own start/stop/step time in this step
        self.idle_own = 0.0             # its running average in the unintercepted steps
        self._own_t0: float | None = None   # when the session's step() began (``stepping``)
        self.active_s = 0.0             # time between start() and stop() in this step

    def started(self, now: float | None = None) -> None:
        if self.t0 is None:
            self.t0 = time.perf_counter() if now is None else now

    def stepping(self, now: float) -> None:
        """The session's step() began at ``now``: its work up to ``end_step`` is its own."""
        self._own_t0 = now

    def stepped(self, now: float) -> None:
        """The session's step() ended without closing a step (the optimizer's had): its work
        is still its own."""
        if self._own_t0 is not None:
            self.own_s += now - self._own_t0
            self._own_t0 = None

    def own(self, seconds: float) -> None:
        """The session's own work in this step (its start(), stop() and step()): part of a
        probed step's cost, and not of the plain step an unintercepted one measures."""
        self.own_s += seconds

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
        """Close the step: an unintercepted step's time is the plain step; a probed step's gives
        the cost of a check and of the interception; the next step's kind and limit follow."""
        now = time.perf_counter() if now is None else now
        wall = self.active_s
        if self.t0 is not None:
            wall += now - self.t0
            self.t0 = now
        self.active_s = 0.0
        self.stepped(now)
        if self.steps and wall > 0:
            self._all[0] += wall
            self._all[1] += 1
        if self.reference:
            if self.quiet:
                self.quiet_steps += 1
            else:
                self.references += 1
            if wall > 0:
                self.idle_own = _avg(self.idle_own if self._plain[1] else None, self.own_s)
                wall = max(wall - self.own_s, 0.0)   # the plain step: the session's work out
                self.plain = _avg(self.plain, wall)
                self._plain[0] += wall
                self._plain[1] += 1
                if self._calibration is not None:   # step 0's interception, now it is known
                    w, c = self._calibration
                    self.interception = max(w - c - self.plain, 0.0)
                    self._calibration = None
                    self._provisional = True
        else:
            self.probed_steps += 1
            if self.checks:
                self.per_check = _avg(self.per_check, self.check_s / self.checks)
            if wall > 0:
                if self.plain is None:
                    self._calibration = (wall, self.check_s)
                else:
                    seen = max(wall - self.check_s - self.plain, 0.0)
                    # step 0's figure holds its first calls' one-time work: replaced, not averaged
                    self.interception = seen if self._provisional else _avg(self.interception,
                                                                            seen)
                    self._provisional = False
            if self.limit is not None and self.prev_total:   # the window moves on
                self.offset = (self.offset + self.limit) % self.prev_total
            self.prev_total = self.index
        if self.per_check and self.plain is not None:
            # (quiet steps wait for an interception measured on a step after step 0)
            self.every, room = self.plan(self.fraction * self.plain, self.interception or 0.0,
                                         self.per_check, self._provisional, self.idle_own)
            self.limit = max(1, math.floor(room / self.per_check))
        self.steps += 1
        # (until a reference step ran under the probe, every step after the calibration is one)
        self.reference = self.steps % REFERENCE_EVERY == 1 or (self.plain is None and
                                                               self.per_check is not None)
        self.quiet = not self.reference and self.steps % self.every != 0
        self.reference = self.reference or self.quiet
        self.index = 0
        self.check_s = 0.0
        self.checks = 0
        self.own_s = 0.0

    @staticmethod
    def plan(allowed: float, interception: float, per_check: float,
             provisional: bool = False, idle_own: float = 0.0) -> tuple[int, float]:
        """``(every, room)``: the smallest power of two ``every`` (at most ``MAX_EVERY``; 1 while
        the interception is ``provisional``) whose room for checks in a probed step, ``every *
        allowed - interception - (every - 1) * idle_own``, holds one check, and that room.
        ``allowed``: the budget's share of a plain step; ``idle_own``: the session's own work in
        a quiet step (paid from the budget too)."""
        def room(every):
            return every * allowed - interception - (every - 1) * idle_own

        every = 1
        while not provisional and every < MAX_EVERY and room(every) < per_check:
            every *= 2
        return every, room(every)

    def cost(self) -> float | None:
        """What the budget cost, end to end: the mean time of the steps after step 0 over the
        mean of the unintercepted ones (reference and quiet), minus one (None until both were
        measured)."""
        if not (self._all[1] and self._plain[1]):
            return None
        plain = self._plain[0] / self._plain[1]
        return (self._all[0] / self._all[1]) / plain - 1.0 if plain > 0 else None


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class Coverage:
    """What share of the floating-point calls were checked, and why the others were not.

    A floating-point call is one that reaches the check's decision (inside ``scope``/``list``,
    the module scope and the step filter) with a floating-point tensor among its arguments and
    is not a metadata query (``size``, ``dim``...). Per call site ``(api key, counter)``, named
    ``Torch.matmul.3`` only when the table is built: times it ran, times it was checked, and the
    reason it was last not checked; per skip reason, how many floating-point calls it left
    unchecked. ``eligible``: the sites that passed every reason but the budget (the budget's
    rotation covers them)."""

    def __init__(self) -> None:
        self.calls: dict[tuple, int] = {}
        self.checked: dict[tuple, int] = {}
        self.reasons: dict[tuple, str] = {}
        self.eligible: dict[tuple, int] = {}
        self.float_calls = 0
        self.checks = 0
        self.by_reason: dict[str, int] = {}

    def seen(self, site: tuple) -> None:
        """A floating-point call of ``site`` reached the decision."""
        self.calls[site] = self.calls.get(site, 0) + 1
        self.float_calls += 1

    def admitted(self, site: tuple) -> None:
        """It passed every reason but the budget."""
        self.eligible[site] = self.eligible.get(site, 0) + 1

    def skip(self, site: tuple, reason: str, text: str | None = None) -> None:
        """A floating-point call of ``site`` that was not checked, and why (``reason``: the
        key of ``summary["float_skipped"]``; ``text``: what the table shows, default the key;
        the latest is kept). A site not seen yet is counted as seen."""
        if site not in self.calls:
            self.seen(site)
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        self.reasons[site] = text or reason

    def unchecked(self, site: tuple, reason: str, text: str | None = None,
                  admitted: bool = False) -> None:
        """``seen``, (``admitted``,) then ``skip``: one floating-point call not checked."""
        self.calls[site] = self.calls.get(site, 0) + 1
        self.float_calls += 1
        if admitted:
            self.eligible[site] = self.eligible.get(site, 0) + 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        self.reasons[site] = text or reason

    def check(self, site: tuple) -> None:
        self.checked[site] = self.checked.get(site, 0) + 1
        self.checks += 1

    def share(self) -> float:
        """Share of the eligible call sites checked at least once (1.0 when none): the budget's
        rotation."""
        if not self.eligible:
            return 1.0
        return sum(1 for k in self.eligible if self.checked.get(k)) / len(self.eligible)

    def checked_share(self) -> float:
        """Checks over floating-point calls (1.0 when there were none)."""
        return min(1.0, self.checks / self.float_calls) if self.float_calls else 1.0

    def frame(self):
        """``api_name, calls, checked, reason``: one row per floating-point call site, in the
        order they first ran; ``reason`` is why it was last not checked ("" when every run was
        checked)."""
        import pandas as pd

        sites = list(self.calls)
        return pd.DataFrame({"api_name": pd.Series([f"{k}.{n}" for k, n in sites],
                                                   dtype="object"),
                             "calls": pd.Series([self.calls[s] for s in sites], dtype="int64"),
                             "checked": pd.Series([self.checked.get(s, 0) for s in sites],
                                                  dtype="int64"),
                             "reason": pd.Series([self.reasons.get(s, "") for s in sites],
                                                 dtype="object")})
