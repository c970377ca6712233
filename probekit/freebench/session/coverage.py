"""No silent zero coverage: say so when a filter or the stage leaves nothing checked.

``FreeBench`` takes a snapshot of the engine's counters (``counters``) when a step (or a ``with``
block) begins and asks ``step_findings`` / ``block_findings`` at its end. Each returns
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


def counters(engine) -> dict:
    """The engine's running totals (cheap: a few ints and a small dict copy)."""
    return {"calls": engine.calls, "checked": engine.checked, "out_of_scope": engine.out_of_scope,
            "skipped": dict(engine.skipped)}


def _delta(before: dict, after: dict, key: str) -> int:
    return after[key] - before[key]


def step_kinds(config) -> tuple:
    """The kinds ``step_findings`` can report under ``config`` (none: nothing to count)."""
    fb = config.free_benchmark
    return (("rank",) if config.rank else ()) + (("step",) if config.step else ()) + \
        (("scope", "unchecked") if fb.scope or fb.api_list else ())


def step_findings(config, before: dict, after: dict, ended: int, rank_active: bool,
                  filtered: bool = False) -> list:
    """Triples for the step numbered ``ended`` that just finished (``filtered``: the step filter
    excluded it, and the session intercepted nothing in it)."""
    out = []
    if not rank_active:
        out.append(("rank", logging.WARNING,
                    f"Free benchmark: rank filter {list(config.rank)} excludes this process; "
                    f"0 calls checked."))
        return out
    calls = _delta(before, after, "calls")
    if config.step and filtered and after["checked"] == 0:
        later = sorted(s for s in config.step if s > ended)
        if later:
            out.append(("step", logging.INFO,
                        f"Free benchmark: step {ended} is not in the step filter; checking "
                        f"starts at step {later[0]} (0 calls checked so far)."))
        else:
            out.append(("step", logging.WARNING,
                        f"Free benchmark: the step filter {list(config.step)} selects no step "
                        f"after step {ended}; 0 calls checked."))
        return out
    fb = config.free_benchmark
    selective = bool(fb.scope or fb.api_list)
    reached = calls - _delta(before, after, "out_of_scope")
    if selective and calls and not filtered and reached == 0:
        what = f"scope {list(fb.scope)}" if fb.scope else f"list {list(fb.api_list)}"
        out.append(("scope", logging.WARNING,
                    f"Free benchmark: {what} matched none of the {calls} calls of step {ended}; "
                    f"0 calls checked (fb.api_counts without a filter lists the call names)."))
    elif selective and reached and _delta(before, after, "checked") == 0:
        reasons = {k: v - before["skipped"].get(k, 0) for k, v in after["skipped"].items()
                   if v - before["skipped"].get(k, 0) > 0}
        out.append(("unchecked", logging.WARNING,
                    f"Free benchmark: {reached} call(s) of step {ended} matched the filter but "
                    f"none was checked (skipped: {reasons}); 0 calls checked."))
    return out


def block_findings(config, before: dict, after: dict, watched: int) -> list:
    """Triples for a ``with`` block that just ended; ``watched``: backward hooks it registered."""
    if config.free_benchmark.fuzz_stage != "backward" or not watched:
        return []
    if _delta(before, after, "checked") == 0:
        return [("backward", logging.WARNING,
                 f"Free benchmark: fuzz_stage backward watched {watched} call(s) but no gradient "
                 f"reached them before stop(); 0 checked. Run loss.backward() inside the "
                 f"`with fb:` block (pending checks are dropped when the probe stops).")]
    return []
