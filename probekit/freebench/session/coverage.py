"""No silent zero coverage: say so when a filter or the stage leaves nothing checked.

``FreeBench`` takes a snapshot of the engine's running totals (``Engine.totals``: calls,
checked, out of scope, the skip counts) when a step (or a ``with`` block) begins and asks
``step_findings`` / ``block_findings`` at its end; once every kind its filters can give was
logged it takes none (right after a training step every Python call runs cold: issue 38, the
snapshot and its helpers cost 35-40 us a step as a dict). Each returns
``(kind, level, message)`` triples; the session logs each kind once per session. Kinds:

* ``rank``: this process's rank is not in ``rank``: it never checks anything;
* ``step``: the step just ended was excluded by ``step`` and nothing was checked yet (a WARNING
  when no selected step is left, else INFO naming the next selected step);
* ``scope``: the step saw calls but ``scope``/``list`` matched none of them;
* ``unchecked``: calls matched ``scope``/``list`` but none could be checked (skip reasons given);
* ``backward``: ``fuzz_stage="backward"`` watched calls in a ``with`` block but no gradient reached
  them before it ended (the backward ran outside the block, or not at all).
"""
from __future__ import annotations

import logging


def step_kinds(config) -> tuple:
    """The kinds ``step_findings`` can report under ``config`` (none: nothing to count)."""
    fb = config.free_benchmark
    return (("rank",) if config.rank else ()) + (("step",) if config.step else ()) + \
        (("scope", "unchecked") if fb.scope or fb.api_list else ())


def step_findings(config, before: tuple, after: tuple, ended: int, rank_active: bool,
                  filtered: bool = False) -> list:
    """Triples for the step numbered ``ended`` that just finished (``before``/``after``:
    ``Engine.totals`` at its start and end; ``filtered``: the step filter excluded it, and the
    session intercepted nothing in it)."""
    if not rank_active:
        return [("rank", logging.WARNING,
                 f"Free benchmark: rank filter {list(config.rank)} excludes this process; "
                 f"0 calls checked.")]
    calls = after[0] - before[0]
    checked = after[1] - before[1]
    if filtered:
        if not config.step or after[1]:
            return []
        later = sorted(s for s in config.step if s > ended)
        if later:
            return [("step", logging.INFO,
                     f"Free benchmark: step {ended} is not in the step filter; checking "
                     f"starts at step {later[0]} (0 calls checked so far).")]
        return [("step", logging.WARNING,
                 f"Free benchmark: the step filter {list(config.step)} selects no step "
                 f"after step {ended}; 0 calls checked.")]
    fb = config.free_benchmark
    if not (calls and (fb.scope or fb.api_list)):
        return []
    reached = calls - (after[2] - before[2])
    if reached == 0:
        what = f"scope {list(fb.scope)}" if fb.scope else f"list {list(fb.api_list)}"
        return [("scope", logging.WARNING,
                 f"Free benchmark: {what} matched none of the {calls} calls of step {ended}; "
                 f"0 calls checked (fb.api_counts without a filter lists the call names).")]
    if checked == 0:
        reasons = {k: v - before[3].get(k, 0) for k, v in after[3].items()
                   if v - before[3].get(k, 0) > 0}
        return [("unchecked", logging.WARNING,
                 f"Free benchmark: {reached} call(s) of step {ended} matched the filter but "
                 f"none was checked (skipped: {reasons}); 0 calls checked.")]
    return []


def block_findings(config, before: tuple, after: tuple, watched: int) -> list:
    """Triples for a ``with`` block that just ended; ``watched``: backward hooks it registered."""
    if config.free_benchmark.fuzz_stage != "backward" or not watched:
        return []
    if after[1] == before[1]:
        return [("backward", logging.WARNING,
                 f"Free benchmark: fuzz_stage backward watched {watched} call(s) but no gradient "
                 f"reached them before stop(); 0 checked. Run loss.backward() inside the "
                 f"`with fb:` block (pending checks are dropped when the probe stops).")]
    return []
