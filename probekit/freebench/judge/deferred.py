"""Deferred verdicts: comparisons stay on the device until the step's gather point.

A checked call leaves one ``Pending`` entry: what a row needs (name, step, stage, output index,
dtype, shape, call site, input dtype) and, per compared output, a few 0-dim tensors on the
output's device (``metric.device_stats``). Nothing is read back per call: ``Verdicts.gather()``
(at ``step()``, ``stop()`` and when results are read) stacks every pending value of a device and
reads it back in one transfer, then hands each entry and its ``Stats`` to the engine, which turns
only the findings into rows. ``syncs`` counts those device-to-host reads
(one per device per gather; on the CPU the values lie in host memory and are read in place, by
their bits, without the stack).

Exactness: a call site (``stage``, API, counter: ``Torch.matmul.3``) is compared exactly — NaN/Inf
mismatches counted — the first time it is checked, the next time it runs after it
was flagged with no cause known (``recheck``: the engine explains it then), and from its next run
on after a fast comparison was inconclusive (a non-finite difference, or ``0 / 0`` where a
per-element scale is zero): such a site is ``unstable`` and stays exact. Otherwise the fast metric
(three kernels) is used.

An inconclusive fast verdict is **resolved**, never dropped (``stats``, which every comparison
goes through; ``summary["inconclusive"]`` counts them):

* on the CPU its values are host memory: they are read as they are computed, by their bits
  (``host_value``: no ATen operator, no copy; the error kept as ``Read.err``, which lets the
  engine explain a flagged check in its own call), and an inconclusive one is compared again
  at once in the exact form, while the original and the re-run exist;
* on an accelerator reading them would be a sync per check. A whole (unblocked) check keeps
  references to its original output, re-run output and scale (``Held``) until its values are
  read at the gather, which redoes the inconclusive ones exactly before judging (one more
  transfer, only then). The held re-runs are bounded: beyond ``HOLD_BYTES`` the held values
  are read early (``flush``: one transfer). An original output overwritten in place before the
  gather is re-pointed to the clone the in-place check took of it (``rebind``); one overwritten
  by a call the probe did not check cannot be redone: ``summary["unresolved"]`` counts it and a
  warning names the API (never seen on the CPU). A blocked check (a large output, compared
  block by block so that one block exists at a time) is compared in the exact form on an
  accelerator instead.

``flagged_sites`` holds the sites flagged at the last gather.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ...log import get_logger
from ..perturb.host import host_value
from ..perturb.host import note as note_extremes
from ..perturb.fused import compare as fused_compare
from .metric import EXACT
from .metric import combine as _combine
from .metric import device_stats, fast_error, stats_from

log = get_logger("probekit.freebench")

#: bytes of re-run outputs and scales an accelerator's fast checks may hold until the gather
HOLD_BYTES = 256 << 20

#: dtype -> (unsigned integer of its width, exponent mask): a value is finite unless its
#: exponent bits are all set
_EXPONENT = {torch.float32: (ctypes.c_uint32, 0x7F800000),
             torch.float64: (ctypes.c_uint64, 0x7FF0000000000000),
             torch.float16: (ctypes.c_uint16, 0x7C00), torch.bfloat16: (ctypes.c_uint16, 0x7F80)}


def _finite(values) -> bool:
    """Are these 0-dim CPU tensors all finite? Read by their bits in place (``.item()`` and
    ``.tolist()`` dispatch ATen operators, and the per-check count is pinned)."""
    for v in values:
        kind = _EXPONENT.get(v.dtype)
        if kind is None:
            return bool(torch.isfinite(v))
        uint, mask = kind
        if uint.from_address(v.data_ptr()).value & mask == mask:
            return False
    return True


class Read(tuple):
    """Fast values of a CPU check, with their ``fast_error`` and the floats they hold, read on
    the host as they were computed (``err``, ``floats``; ``Verdicts.stats``)."""

    err = None
    floats = None


#: the values of a ``Read`` made from floats (``fused.compare``): CPU 0-dim tensors in the fast
#: tensor-scale layout that nothing reads (``Read.floats`` and ``Read.err`` answer; NaN, were
#: one read, an inconclusive verdict rather than a wrong one)
_NOT_READ = tuple(torch.full((), float("nan"), dtype=torch.float64) for _ in range(4))


def _host_read(vals) -> list | None:
    """The floats a compared output's values hold when they lie in host memory (read by their
    bits in place: the floats ``torch.stack(...).tolist()`` gives, without the stack), else None
    (an accelerator's values, a dtype ``host_value`` does not read)."""
    got = getattr(vals, "floats", None)
    if got is not None:
        return got
    if not vals[0].is_cpu:
        return None
    got = [host_value(v) for v in vals]
    return None if None in got else got


def host_errors(values) -> list | None:
    """``fast_error`` of each compared output's fast values, read on the host as they are
    computed (the CPU: no transfer, no ATen operator; ``Read`` values carry it already); None
    when they cannot be read now (held values of an accelerator, an exact form, another
    dtype)."""
    out = []
    for vals in values:
        err = getattr(vals, "err", None)
        if err is None:
            if isinstance(vals, Held) or len(vals) >= EXACT or not vals[0].is_cpu:
                return None
            read = [host_value(v) for v in vals]
            if None in read:
                return None
            err = fast_error(read)
        out.append(err)
    return out


class Held(tuple):
    """Fast values of an accelerator check, with what its exact form needs until they are read:
    the original output (and its version), the re-run output, the scale."""

    o = p = scale = exact = operands = versions = None
    version = nbytes = 0
    lam = 0.0

    def redo(self):
        """The exact form, or None when the original was overwritten since."""
        o = self.o
        if o is None or o._version != self.version:
            return None
        ops = self.operands
        if ops and any(isinstance(x, torch.Tensor) and x._version != v
                       for x, v in zip(ops, self.versions)):
            ops = None   # an operand overwritten since: read without it (a row, not a silence)
        return device_stats(o, self.p, self.scale, True, self.lam, ops)

    def release(self) -> int:
        n = self.nbytes
        self.o = self.p = self.scale = self.operands = self.versions = None
        self.nbytes = 0
        return n


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def combine(parts: list) -> tuple:
    """``metric.combine`` of per-block values, fast and exact ones mixed (a block whose fast
    values were inconclusive was compared exactly, ``Verdicts.stats``): the fast ones are put
    in the exact layout first (conclusive fast values are all finite, so no mismatch)."""
    if len({len(p) for p in parts}) > 1:
        parts = [p if len(p) >= EXACT else _as_exact(p) for p in parts]
    return _combine(parts)


def _as_exact(values) -> tuple:
    zero = torch.zeros((), dtype=values[0].dtype, device=values[0].device)
    if len(values) == 4:                # tensor scale: (dlo, dhi, olo, ohi) + no mismatch
        return (*values, zero, zero)    # (+ max|p|: not kept by the fast form)
    nan = torch.full((), float("nan"), dtype=values[0].dtype, device=values[0].device)
    return (*values, nan, nan, zero, zero)   # per-element: max_abs, max|p| not kept either


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
        #: (output_index, dtype, shape, scale kind, threshold, hot-spot level, judged dtype,
        #: ``scales.Judge``) of each compared output
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
        self.inconclusive = 0             # fast verdicts that were inconclusive (resolved)
        self.unresolved = 0               # ... whose original was overwritten (accelerators)
        #: hold fast values for a later exact form even on the CPU (tests of the accelerator
        #: path); None: only on accelerators
        self.hold = None
        self.held: list = []              # Held values not read back yet
        self.held_bytes = 0

    def stats(self, o, p, scale=None, exact: bool = False, whole: bool = True,
              lam: float = 0.0, operands=None, note: bool = False) -> tuple:
        """``metric.device_stats`` of one comparison, its verdict never left inconclusive (module
        doc). ``whole``: the check's own output (False: one block of a blocked check). ``lam``:
        the error model's two-term scale ``|p| + lam * scale`` (``scales.Judge``).
        ``operands``: ``metric.stand_in_operands`` of an element-wise call (its exact form
        reads them after a NaN/Inf mismatch; held with the re-run on an accelerator).
        ``note``: a CPU fast comparison with the tensor's scale hands ``o``'s extremes, read on
        the host, to ``host.note`` (a forward check's output: the next call's input).

        A whole CPU check's fast comparison with the tensor's scale is one pass in C where the
        kernel is built (``fused.compare``: the same floats, no ATen operator); its ``Read``
        holds them, with stand-ins for the 0-dim tensors nothing reads then (``_NOT_READ``)."""
        if scale is None and not exact and whole and not self.hold:
            read = fused_compare(o, p)   # None: not applicable (fused.py), the torch formulas
            if read is not None:
                if note:
                    note_extremes(o, read[2], read[3])   # aminmax(o): bit_noise of the next call
                vals = Read(_NOT_READ)
                vals.err, vals.floats = fast_error(read), read
                return vals
        vals = device_stats(o, p, scale, exact, lam, operands)
        if exact:
            return vals
        hold = self.hold if self.hold is not None else not vals[0].is_cpu
        if not hold:
            read = [host_value(v) for v in vals]    # host memory: read as it is computed
            if note and len(read) == 4 and read[2] is not None and read[3] is not None:
                note_extremes(o, read[2], read[3])   # aminmax(o): bit_noise of the next call
            err = fast_error(read) if None not in read else None
            if err is not None:
                vals = Read(vals)
                vals.err, vals.floats = err, read
                return vals
            if None in read and _finite(vals):
                return vals
            self.inconclusive += 1
            return device_stats(o, p, scale, True, lam, operands)
        if not whole:       # a block: its re-run is freed before the next one
            return device_stats(o, p, scale, True, lam, operands)
        held = Held(vals)
        held.o, held.version, held.p, held.scale, held.lam = o, o._version, p, scale, lam
        held.nbytes = _nbytes(p) + (_nbytes(scale) if scale is not o else 0)
        if operands:   # the call's inputs: held alive until the gather, so counted (their
            held.operands = operands   # storage, kept whole whatever part of it is read)
            held.versions = [getattr(x, "_version", 0) for x in operands]
            held.nbytes += sum(x.untyped_storage().nbytes() for x in operands
                               if isinstance(x, torch.Tensor))
        self.held.append(held)
        self.held_bytes += held.nbytes
        if self.held_bytes > HOLD_BYTES:
            self.flush()
        return held

    def rebind(self, tensor, clone) -> None:
        """``tensor`` is about to be overwritten in place; ``clone`` holds its values: held
        checks of it use the clone."""
        for h in self.held:
            if h.o is tensor and tensor._version == h.version:
                h.o, h.version = clone, clone._version

    def flush(self) -> None:
        """Read the held fast values now (one transfer per device) and resolve the inconclusive
        ones; the held tensors are released."""
        held, self.held = self.held, []
        self.held_bytes = 0
        if not held:
            return
        by_device: dict = {}
        for h in held:
            by_device.setdefault(h[0].device, []).append(h)
        for device, hs in by_device.items():
            read = torch.stack([v.to(torch.float64) for h in hs for v in h]).tolist()
            self.syncs += 1
            pos = 0
            for h in hs:
                vals = read[pos:pos + len(h)]
                pos += len(h)
                if fast_error(vals) is None:
                    self._redo(h)
                else:
                    h.release()

    def _redo(self, h) -> None:
        self.inconclusive += 1
        h.exact = h.redo()
        if h.exact is None:
            self.unresolved += 1
        h.release()

    def want_exact(self, site) -> bool:
        return site not in self.exact_done or site in self.recheck or site in self.unstable

    def add(self, entry: Pending, exact: bool) -> None:
        if exact:
            self.exact_done.add(entry.site)
            self.recheck.discard(entry.site)
        elif any(len(v) >= EXACT for v in entry.values):   # an inconclusive fast comparison was
            self.unstable.add(entry.site)                # redone exactly: exact from now on
        self.pending.append(entry)

    def drop(self) -> None:
        self.pending.clear()
        for h in self.held:
            h.release()
        self.held, self.held_bytes = [], 0

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
        for e in entries:       # held values resolved early (flush): their exact form
            if any(getattr(v, "exact", None) is not None for v in e.values):
                e.values = [getattr(v, "exact", None) or v for v in e.values]
        by_device: dict = {}
        on_host = []   # per compared output: its values read on the host, else None (stacked)
        for e in entries:
            for vals in e.values:
                dev = vals[0].device
                flat = by_device.get(dev)
                if flat is None:
                    flat = by_device[dev] = []
                got = _host_read(vals)
                on_host.append(got)
                if got is None:
                    flat.extend(vals)
        read, pos = {}, {}
        for device, tensors in by_device.items():
            # stack promotes mixed float32/float64 values to float64 (exact); values in host
            # memory are read in place, by their bits (the same floats: ``host_value``)
            if tensors:
                read[device] = torch.stack(tensors).tolist()
            pos[device] = 0
            self.syncs += 1
        out, retry = [], []
        n = 0
        for e in entries:
            chunks = []
            ok, hit = True, full
            for desc, vals in zip(e.outputs, e.values):
                k = len(vals)
                v = on_host[n]
                n += 1
                if v is None:
                    dev = vals[0].device
                    i = pos[dev]
                    pos[dev] = i + k
                    v = read[dev][i:i + k]
                chunks.append(v)
                if k < EXACT:  # fast values, judged without building Stats
                    err = fast_error(v)
                    if err is None:
                        ok = False
                    elif err > desc[5]:  # above the hot-spot level (= threshold but in
                        hit = True       # the sensitivity modes)
                else:
                    hit = True
            if not ok:
                self.unstable.add(e.site)
                if self._resolve(e):
                    retry.append(e)
                continue
            if hit:
                out.append((e, [stats_from(v, o[3]) for o, v in zip(e.outputs, chunks)]))
        for h in (v for e in entries for v in e.values):   # read: release what was held
            if isinstance(h, Held):
                h.release()
        self.held = [h for h in self.held if h.o is not None]
        self.held_bytes = sum(h.nbytes for h in self.held)
        return out + self._read(retry, full)

    def _resolve(self, e) -> bool:
        """An entry read back inconclusive: its held values redone exactly (True: read again)."""
        redone = []
        for v in e.values:
            if len(v) >= EXACT or not isinstance(v, Held):
                if len(v) < EXACT:   # fast, not held: cannot be redone (not expected)
                    redone = None
                    break
                redone.append(v)
                continue
            self.inconclusive += 1
            x = v.redo()
            v.release()
            if x is None:
                redone = None
                break
            redone.append(x)
        if redone is None:
            self.unresolved += 1
            log.warning("Free benchmark: the check of %s was inconclusive (NaN/Inf) and its "
                        "output was overwritten in place by a call the probe did not check; "
                        "it is compared exactly from its next run on.", e.name)
            return False
        e.values = redone
        return True
