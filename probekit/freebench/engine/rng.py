"""Random calls are re-run on the same random stream: found by watching the generators, replayed.

A call that draws from a generator must be re-run on the numbers the real call drew, or the
comparison would measure two different masks, and a re-run must not advance the training's
stream. Which calls draw is **observed**, not listed: the first checked call of each call
signature (``signature``: the API, the devices of its tensors, its non-tensor arguments -- a
training flag, whether a probability is 0 -- not the tensors' values or shapes) is run with the
states of the generators it could draw from saved just before it (``observe``); if one of them
moved across the real call, the call draws. The answer is cached per signature, so the
generators are compared once per signature, not per call: ``torch.lstm`` / ``torch.gru`` with
dropout between layers (whose masks are drawn inside the one call), a dropout, attention with
dropout, ``rrelu`` in training, or any API nobody listed. ``names.RANDOM_RULES`` still decides
the listed APIs up front (a dropout in eval is an identity; ``bernoulli(x, p)`` does not depend on
``x``; what is known of their draws: ``names.DTYPE_FREE``, ``names.VALUE_DRAWS``) and they are
never observed.

The generators a call may draw from (``generators``): the CPU default generator always; the
default generator of each accelerator its tensors live on (``torch.cuda.default_generators``, and
the same attribute of any backend module that has it: xpu, npu...); an explicit ``generator=``.
Reading one is a host-side copy of its state (5 KB for the CPU's Mersenne twister, 16 bytes for a
CUDA Philox seed and offset): no kernel and no device sync.

A ``Replay``

1. saves their states just before the real call (``save``);
2. after it (``bind``): for an observed call, compares them with the saved ones -- nothing moved:
   a plain call, the re-runs run as they are; moved: a random call -- and wraps the API so that
   every re-run (the check's, the magnitude re-run, the cause analysis, the backward stage's
   re-runs in the backward pass) first reads the generators' current states, sets the saved
   ones, runs, and sets the current ones back. So each re-run draws exactly what the real call
   drew, and the training's stream is left as the real call left it.

For a random call found by observation (``verify``), nobody has checked that a re-run in another
dtype or on perturbed values draws the same numbers, so each replayed re-run is checked to end
at the state the real call ended at (the same number of draws: a kernel drawing doubles instead
of floats, or drawing per value, consumes another amount of the stream -- fp32 vs fp64
``bernoulli``/``normal`` on the CPU do). A re-run that does not cancels the check (``Cancel``)
and its signature is skipped from then on (``draws``).

What cannot be replayed (skipped as ``random``, the reason logged and shown in ``fb.coverage``):

* ``values``: the number of draws depends on the input's values (``poisson``, ``binomial``);
  only ``no_change`` re-runs the same values;
* ``dtype``: an upcast re-run (improve_precision, to_cpu) of an API whose draws depend on the
  dtype (``bernoulli``, ``normal``, fractional pooling; ``names.DTYPE_FREE`` lists those that do
  not, on the CPU);
* ``draws``: an observed random call whose re-run drew another amount of random numbers;
* ``cuda_upcast``: an upcast re-run on an accelerator (its kernels for another dtype draw their
  own way: not verified, so not replayed); the modes that keep the dtype replay such calls;
* ``cuda_attention``: attention with dropout on an accelerator (the backend, and with it the
  dropout stream, is chosen by dtype, layout and grad mode);
* ``device``: to_cpu re-runs a call of another device on the CPU, whose generator is another;
* ``generator``: a device without a generator probekit can save and restore, or a CUDA graph
  being captured;
* ``fix``: ``handler_type="fix"`` of an observed random call (its upcast run may draw other
  numbers than the call it replaces; fix replaces only the listed dtype-free ones).

On a device whose generator cannot be read (not CPU, not a backend with ``default_generators``)
nothing is observed: only the listed APIs are known to draw there.

A replayed call is never re-run in blocks (``blocks.py``): a block's re-run would draw the first
elements of the stream, not its own part of the mask.
"""
from __future__ import annotations

import torch

from .. import names
from ..perturb.modes import MODES
from ..perturb.perturb import Cancel

#: why a call's draws cannot be replayed (the log line and ``fb.coverage``'s ``reason``)
WHY = {
    "values": "its number of draws depends on the input values, so a re-run on perturbed "
              "inputs falls out of step with the real call's random stream",
    "dtype": "its draws depend on the dtype, so an upcast re-run would draw other numbers than "
             "the real call",
    "draws": "its re-run drew another amount of random numbers than the real call (its draws "
             "depend on the dtype or on the input values)",
    "cuda_upcast": "an upcast re-run on cuda draws through another kernel (not known to draw "
                   "the same numbers; the modes that keep the dtype replay it)",
    "cuda_attention": "attention with dropout on cuda: the backend, and with it the dropout "
                      "stream, depends on dtype, layout and grad mode",
    "device": "the re-run runs on another device, whose generator draws other numbers",
    "generator": "its generator cannot be saved and restored (only CPU and CUDA generators, "
                 "outside CUDA graph capture)",
    "fix": "fix would replace it by an upcast run that may draw other numbers (fix replaces "
           "only the random APIs known to draw the same numbers in every dtype)",
}

#: the most call signatures whose answer is kept (beyond it, a new signature is observed at
#: each of its calls: correct, only slower)
MAX_SIGNATURES = 100_000


def why_text(why: str) -> str:
    return f"a random call whose draws cannot be replayed: {WHY.get(why, why)}"


# -- the call signature --------------------------------------------------------------------------
_KEPT = frozenset({bool, int, str, type(None)})


def signature(key: str, leaves: list) -> tuple:
    """What decides whether a call of API ``key`` draws: the devices of its tensors (CPU ones
    are left out), its non-tensor arguments -- booleans, integers, strings, dtypes as they are,
    a float as whether it is non-zero (a dropout probability), anything else by its type -- but
    not the tensors' values, dtypes or shapes."""
    sig = [key]
    for x in leaves:
        tp = type(x)
        if tp is torch.Tensor or isinstance(x, torch.Tensor):
            if not x.is_cpu:
                sig.append(x.device)
        elif tp is float:
            sig.append(x != 0.0)
        elif tp in _KEPT or tp is torch.dtype:
            sig.append(x)
        else:
            sig.append(tp)
    return tuple(sig)


def explicit_generator(leaves: list):
    """An explicit ``generator=`` among a call's arguments, or None."""
    for x in leaves:
        if isinstance(x, torch.Generator):
            return x
    return None


# -- the generators ------------------------------------------------------------------------------
def device_generator(device: torch.device):
    """The default generator of an accelerator device, or None when it cannot be saved and
    restored (a backend without ``default_generators``, a CUDA graph being captured)."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    try:
        module = torch.get_device_module(device.type)
        gens = module.default_generators
        index = device.index if device.index is not None else module.current_device()
        return gens[index]
    except Exception:   # no such backend module, or it keeps no default generators
        return None


def _devices(leaves: list, explicit) -> list:
    """The devices other than the CPU that a call's tensors (or its generator) live on."""
    others = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and not x.is_cpu and x.device not in others:
            others.append(x.device)
    if explicit is not None and explicit.device.type != "cpu" and explicit.device not in others:
        others.append(explicit.device)
    return others


def generators(leaves: list, explicit=None):
    """The generators a call with these arguments may draw from, or ``"generator"`` when one of
    its devices has none probekit can read."""
    gens = [torch.default_generator]
    for d in _devices(leaves, explicit):
        if d.type == "meta":
            return "generator"
        g = device_generator(d)
        if g is None:
            return "generator"
        if all(g is not have for have in gens):
            gens.append(g)
    if explicit is not None and all(explicit is not g for g in gens):
        gens.append(explicit)
    return gens


def _states(gens: list) -> list:
    return [g.get_state() for g in gens]


def _moved(gens: list, states: list) -> bool:
    return any(not torch.equal(g.get_state(), s) for g, s in zip(gens, states))


class Replay:
    """The generators one call may draw from, their states saved just before the real call.

    ``detect``: None for a call known to draw; for a call observed at its first run (its
    signature's answer not known yet), ``""`` when it can be replayed if it draws, else the
    ``WHY`` key saying why not. ``verify``: each replayed re-run must end where the real call
    ended (an observed random call). ``report(outcome)``: told what ``bind`` found -- False (no
    draw), True (a random call, replayed), or a ``WHY`` key (skipped)."""

    __slots__ = ("gens", "before", "after", "detect", "verify", "report", "drew")

    def __init__(self, gens: list, detect: str | None = None, verify: bool = False,
                 report=None) -> None:
        self.gens = gens
        self.before: list | None = None
        self.after: list | None = None
        self.detect = detect
        self.verify = verify
        self.report = report
        #: what the real call did: None until ``bind``, then whether it drew
        self.drew: bool | None = None if detect is not None else True

    def save(self) -> None:
        """Just before the real call: the states the re-runs start from."""
        self.before = _states(self.gens)

    def moved(self) -> bool:
        """Has a generator moved since ``save``?"""
        return _moved(self.gens, self.before)

    def rewind(self) -> None:
        """Set the saved states (a fix whose upcast call drew: the original call then draws
        what it would have drawn)."""
        for g, s in zip(self.gens, self.before):
            g.set_state(s)

    def _tell(self, outcome) -> None:
        if self.report is not None:
            self.report(outcome)

    def bind(self, func):
        """Right after the real call: ``func`` itself for a call that drew nothing, ``func`` run
        on the saved stream (leaving the generators as it found them) for a random call, or None
        when the call drew and its draws cannot be replayed (the check is skipped)."""
        if self.before is None:
            raise RuntimeError("Replay.bind before save()")
        if self.detect is not None:
            self.drew = self.moved()
            if not self.drew:
                self._tell(False)
                return func
            if self.detect:
                self._tell(self.detect)
                return None
        self._tell(True)
        gens, before = self.gens, self.before
        if self.verify:
            self.after = _states(gens)
            return self._verified(func)
        if len(gens) == 1:   # the CPU generator alone: the common case, without the lists
            (gen,), (saved,) = gens, before

            def replayed_one(*args, **kwargs):
                now = gen.get_state()
                gen.set_state(saved)
                try:
                    return func(*args, **kwargs)
                finally:
                    gen.set_state(now)

            return replayed_one

        def replayed(*args, **kwargs):
            now = _states(gens)
            for g, s in zip(gens, before):
                g.set_state(s)
            try:
                return func(*args, **kwargs)
            finally:
                for g, s in zip(gens, now):
                    g.set_state(s)

        return replayed

    def _verified(self, func):
        gens, before, after = self.gens, self.before, self.after

        def replayed_verified(*args, **kwargs):
            now = _states(gens)
            for g, s in zip(gens, before):
                g.set_state(s)
            try:
                out = func(*args, **kwargs)
                if _moved(gens, after):   # not where the real call ended: other draws,
                    if not _moved(gens, before):   # or none at all: the generators moved
                        self._tell(False)          # across the real call for another reason
                        return out                 # (a thread drawing at the same time)
                    self._tell("draws")
                    raise Cancel(why_text("draws"))
                return out
            finally:
                for g, s in zip(gens, now):
                    g.set_state(s)

        return replayed_verified


# -- plans ---------------------------------------------------------------------------------------
def _why(draw, others: list, mode_name: str) -> str | None:
    """The ``WHY`` key saying why ``draw``'s draws cannot be replayed in ``mode_name``, or None.
    An observed draw (``draw.detected``) has no table entry: its re-runs are verified instead."""
    mode = MODES[mode_name]
    name = draw.name
    if not draw.detected and name in names.VALUE_DRAWS and not mode.exact:
        return "values"
    if mode.upcast:
        if others:
            return "device" if mode.fuzz_device == "cpu" else "cuda_upcast"
        if not draw.detected and name not in names.DTYPE_FREE:
            return "dtype"
    elif others and name in names.ATTENTION:
        return "cuda_attention"
    return None


def plan(draw, leaves: list, mode_name: str, report=None):
    """A ``Replay`` for a call known to draw (``draw``: ``names.Draw``), or the key of ``WHY``
    saying why its draws cannot be replayed in ``mode_name``."""
    gens = generators(leaves, draw.generator)
    if isinstance(gens, str):
        return gens
    why = _why(draw, _devices(leaves, draw.generator), mode_name)
    if why is not None:
        return why
    return Replay(gens, verify=draw.detected, report=report)


def observe(draw, leaves: list, mode_name: str, report=None):
    """A ``Replay`` that watches the first call of a signature (whether it draws is not known),
    or None when its generators cannot be read (nothing observed: a plain call)."""
    gens = generators(leaves, draw.generator)
    if isinstance(gens, str):
        return None
    why = _why(draw, _devices(leaves, draw.generator), mode_name)
    return Replay(gens, detect=why or "", verify=True, report=report)
