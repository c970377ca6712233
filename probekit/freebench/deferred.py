"""Deferred verdicts: comparisons stay on the device until the step's gather point.

A checked call leaves one ``Pending`` entry: what a row needs (name, step, stage, output index,
dtype, shape, call site, input dtype) and, per compared output, a few 0-dim tensors on the
output's device (``metric.device_stats``). Nothing is read back per call: ``Verdicts.gather()``
(at ``step()``, ``stop()`` and when results are read) stacks every pending value of a device and
reads it back in one transfer, then hands each entry and its ``Stats`` to the engine, which turns
only the findings into rows. ``syncs`` counts those device-to-host reads.

Exactness: a call site (``stage``, API, counter: ``Torch.matmul.3``) is compared exactly — NaN/Inf
mismatches and sign flips counted — the first time it is checked and the next time it runs after a
fast comparison was inconclusive (a non-finite difference, or an error of 1 or more, where a sign
flip is possible); otherwise with the fast metric (three reductions). An inconclusive fast verdict
is not reported: the site's next check, exact, reports it (``summary["inconclusive"]`` counts them).
The same mechanism is the hook for analysing a flagged call again: ``flagged_sites`` holds the sites
flagged at the last gather, and ``want_exact(site)`` can be extended to re-analyse them next time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .metric import stats_from


@dataclass
class Pending:
    """One checked call whose verdict is not read back yet."""

    site: tuple            # (stage, api key, counter)
    key: str
    name: str
    stage: str
    step: int
    call_site: str
    in_dtype: object
    #: (output_index, dtype, shape, floor) of each compared output
    outputs: list
    #: per output, the tuple of 0-dim tensors of ``metric.device_stats``
    values: list = field(default_factory=list)
    #: the innermost scoped module the call ran in ("" without module scope)
    module: str = ""


@dataclass(frozen=True)
class OutMeta:
    """What a row needs of a compared tensor, without keeping the tensor alive."""

    dtype: torch.dtype
    shape: tuple


class Verdicts:
    def __init__(self) -> None:
        self.pending: list[Pending] = []
        self.exact_done: set = set()      # sites compared exactly at least once
        self.recheck: set = set()         # sites whose last fast verdict was inconclusive
        self.flagged_sites: set = set()   # sites flagged at the last gather
        self.syncs = 0
        self.inconclusive = 0

    def want_exact(self, site) -> bool:
        return site not in self.exact_done or site in self.recheck

    def add(self, entry: Pending, exact: bool) -> None:
        if exact:
            self.exact_done.add(entry.site)
            self.recheck.discard(entry.site)
        self.pending.append(entry)

    def drop(self) -> None:
        self.pending.clear()

    def judge_now(self, entry: Pending):
        """The ``Stats`` of one exact check read back at once (one device-to-host read), for a
        call that is explained while its inputs exist; None when inconclusive."""
        self.exact_done.add(entry.site)
        self.recheck.discard(entry.site)
        done = self._read([entry])
        return done[0][1] if done else None

    def gather(self):
        """[(entry, [Stats per output])] of the conclusive pending entries; one device-to-host
        read per device holding pending values (``syncs`` counts them)."""
        entries, self.pending = self.pending, []
        self.flagged_sites = set()
        return self._read(entries)

    def _read(self, entries):
        if not entries:
            return []
        by_device: dict = {}
        for e in entries:
            for vals in e.values:
                for v in vals:
                    by_device.setdefault(v.device, []).append(v)
        read = {}
        for device, tensors in by_device.items():
            # stack promotes mixed float32/float64 values to float64 (exact)
            read[device] = iter(torch.stack(tensors).tolist())
            self.syncs += 1
        out = []
        for e in entries:
            stats = []
            ok = True
            for (_, _, _, floor), vals in zip(e.outputs, e.values):
                it = read[vals[0].device]
                st = stats_from([next(it) for _ in vals], floor)
                if st is None:
                    ok = False
                stats.append(st)
            if not ok:
                self.inconclusive += 1
                self.recheck.add(e.site)
                continue
            out.append((e, stats))
        return out
