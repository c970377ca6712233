"""Deferred verdicts: comparisons stay on the device until the step's gather point.

A checked call leaves one ``Pending`` entry: what a row needs (name, step, stage, output index,
dtype, shape, call site, input dtype) and, per compared output, a few 0-dim tensors on the
output's device (``metric.device_stats``). Nothing is read back per call: ``Verdicts.gather()``
(at ``step()``, ``stop()`` and when results are read) stacks every pending value of a device and
reads it back in one transfer, then hands each entry and its ``Stats`` to the engine, which turns
only the findings into rows. ``syncs`` counts those device-to-host reads.

Exactness: a call site (``stage``, API, counter: ``Torch.matmul.3``) is compared exactly — NaN/Inf
mismatches counted — the first time it is checked, the next time it runs after it
was flagged with no cause known (``recheck``: the engine explains it then), and from its next run
on after a fast comparison was inconclusive (a non-finite difference, or an error of 1 or more,
or a zero per-element scale): such a site is ``unstable`` and stays exact, so its findings are
not lost every other step. Otherwise the fast metric (three kernels) is used. An inconclusive fast
verdict is not reported: the site's next check, exact, reports it (``summary["inconclusive"]``
counts them). ``flagged_sites`` holds the sites flagged at the last gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .metric import fast_error, stats_from


class Pending:
    """One checked call whose verdict is not read back yet (a slotted class: one is made per
    checked call)."""

    __slots__ = ("site", "key", "name", "stage", "step", "call_site", "in_dtype", "outputs",
                 "values", "module")

    def __init__(self, site, key, name, stage, step, call_site, in_dtype, outputs, values=None,
                 module=""):
        self.site = site              # (stage, api key, counter)
        self.key = key
        self.name = name
        self.stage = stage
        self.step = step
        self.call_site = call_site
        self.in_dtype = in_dtype
        #: (output_index, dtype, shape, scale kind, threshold, hot-spot level, compute dtype)
        #: of each compared output
        self.outputs = outputs
        #: per output, the tuple of 0-dim tensors of ``metric.device_stats``
        self.values = [] if values is None else values
        #: the innermost scoped module the call ran in ("" without module scope)
        self.module = module


@dataclass(frozen=True)
class OutMeta:
    """What a row needs of a compared tensor, without keeping the tensor alive."""

    dtype: torch.dtype
    shape: tuple


class Verdicts:
    def __init__(self) -> None:
        self.pending: list[Pending] = []
        self.exact_done: set = set()      # sites compared exactly at least once
        self.recheck: set = set()         # sites flagged with no cause known: explain next run
        self.unstable: set = set()        # sites with an inconclusive fast verdict: exact from now
        self.flagged_sites: set = set()   # sites flagged at the last gather
        self.syncs = 0
        self.inconclusive = 0

    def want_exact(self, site) -> bool:
        return site not in self.exact_done or site in self.recheck or site in self.unstable

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
        done = self._read([entry], full=True)
        return done[0][1] if done else None

    def gather(self, full: bool = False):
        """[(entry, [Stats per output])] of the conclusive pending entries that hold a finding
        (every conclusive entry when ``full``: preheat calibrates on the clean ones too); one
        device-to-host read per device holding pending values (``syncs`` counts them)."""
        entries, self.pending = self.pending, []
        self.flagged_sites = set()
        return self._read(entries, full)

    def _read(self, entries, full: bool):
        if not entries:
            return []
        by_device: dict = {}
        for e in entries:
            for vals in e.values:
                dev = vals[0].device
                flat = by_device.get(dev)
                if flat is None:
                    flat = by_device[dev] = []
                flat.extend(vals)
        read, pos = {}, {}
        for device, tensors in by_device.items():
            # stack promotes mixed float32/float64 values to float64 (exact)
            read[device] = torch.stack(tensors).tolist()
            pos[device] = 0
            self.syncs += 1
        out = []
        for e in entries:
            chunks = []
            ok, hit = True, full
            for desc, vals in zip(e.outputs, e.values):
                dev = vals[0].device
                i = pos[dev]
                k = len(vals)
                pos[dev] = i + k
                v = read[dev][i:i + k]
                chunks.append(v)
                if k != 5:  # fast values, judged without building Stats
                    err = fast_error(v)
                    if err is None:
                        ok = False
                    elif err > desc[5]:  # above the hot-spot level (= threshold but in
                        hit = True       # the sensitivity modes)
                else:
                    hit = True
            if not ok:
                self.inconclusive += 1
                self.unstable.add(e.site)
                continue
            if hit:
                out.append((e, [stats_from(v, o[3]) for o, v in zip(e.outputs, chunks)]))
        return out
