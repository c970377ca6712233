"""Random calls are re-run on the same random stream: save the generators before, replay them.

A call that draws from a generator (``names.random_draw``: a dropout in training, attention with
``dropout_p > 0``, ``rrelu`` in training, ``bernoulli``...) is checked like any other call, with
one difference: its re-runs must draw the numbers the real call drew, or the comparison would
measure two different masks. ``plan`` names the generators the call draws from -- the explicit
``generator=``, the default generator of each device its tensors live on (the CPU's always) --
or says why its draws cannot be replayed in this mode. A ``Replay``

1. saves their states just before the real call (``save``: ``Generator.get_state``, a 5 KB copy
   for the CPU generator, 16 bytes for a CUDA one);
2. wraps the API (``bind``) so that every re-run -- the check's, the magnitude re-run, the cause
   analysis, the backward stage's re-runs in the backward pass -- first reads the generators'
   current states, sets the saved ones, runs, and sets the current ones back. So each re-run
   draws exactly what the real call drew (the same dropout mask, in the forward check and in the
   backward check alike), and the training's stream is left as the real call left it: no re-run
   advances it.

What cannot be replayed (skipped as ``random``, the reason logged and shown in ``fb.coverage``):

* ``values``: the number of draws depends on the input's values (``poisson``, ``binomial``);
  only ``no_change`` re-runs the same values;
* ``dtype``: an upcast re-run (improve_precision, to_cpu) of an API whose draws depend on the
  dtype (``bernoulli``, ``normal``, fractional pooling; ``names.DTYPE_FREE`` lists those that do
  not, on the CPU);
* ``cuda_upcast``: an upcast re-run on CUDA (its kernels for another dtype draw their own way:
  not verified, so not replayed); the modes that keep the dtype replay CUDA calls;
* ``cuda_attention``: attention with dropout on CUDA (the backend, and with it the dropout
  stream, is chosen by dtype, layout and grad mode);
* ``device``: to_cpu re-runs a call of another device on the CPU, whose generator is another;
* ``generator``: a device without a generator probekit can save and restore (only CPU and CUDA),
  or a CUDA graph being captured.

A replayed call is never re-run in blocks (``blocks.py``): a block's re-run would draw the first
elements of the stream, not its own part of the mask.
"""
from __future__ import annotations

import torch

from . import names
from .modes import MODES

#: why a call's draws cannot be replayed (the log line and ``fb.coverage``'s ``reason``)
WHY = {
    "values": "its number of draws depends on the input values, so a re-run on perturbed "
              "inputs falls out of step with the real call's random stream",
    "dtype": "its draws depend on the dtype, so an upcast re-run would draw other numbers than "
             "the real call",
    "cuda_upcast": "an upcast re-run on cuda draws through another kernel (not known to draw "
                   "the same numbers; the modes that keep the dtype replay it)",
    "cuda_attention": "attention with dropout on cuda: the backend, and with it the dropout "
                      "stream, depends on dtype, layout and grad mode",
    "device": "the re-run runs on another device, whose generator draws other numbers",
    "generator": "its generator cannot be saved and restored (only CPU and CUDA generators, "
                 "outside CUDA graph capture)",
}


def why_text(why: str) -> str:
    return f"a random call whose draws cannot be replayed: {WHY.get(why, why)}"


class Replay:
    """The generators one random call draws from, their states saved before the real call."""

    __slots__ = ("gens", "before")

    def __init__(self, gens: list) -> None:
        self.gens = gens
        self.before: list | None = None

    def save(self) -> None:
        """Just before the real call: the states the re-runs start from."""
        self.before = [g.get_state() for g in self.gens]

    def rewind(self) -> None:
        """Set the saved states (a fix that failed after its upcast call drew: the original
        call then draws what it would have drawn)."""
        for g, s in zip(self.gens, self.before):
            g.set_state(s)

    def bind(self, func):
        """``func`` run on the saved stream, leaving the generators as it found them."""
        gens, before = self.gens, self.before
        if before is None:
            raise RuntimeError("Replay.bind before save()")
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
            now = [g.get_state() for g in gens]
            for g, s in zip(gens, before):
                g.set_state(s)
            try:
                return func(*args, **kwargs)
            finally:
                for g, s in zip(gens, now):
                    g.set_state(s)

        return replayed


def _cuda_generator(device: torch.device):
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def plan(draw, leaves: list, mode_name: str):
    """A ``Replay`` for a call that draws (``draw``: ``names.Draw``), or the key of ``WHY`` saying
    why its draws cannot be replayed in ``mode_name``."""
    mode = MODES[mode_name]
    name = draw.name
    if name in names.VALUE_DRAWS and not mode.exact:
        return "values"
    others = []   # devices other than the CPU (the common case has none)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu" and x.device not in others:
            others.append(x.device)
    if draw.generator is not None and draw.generator.device.type != "cpu" and \
            draw.generator.device not in others:
        others.append(draw.generator.device)
    if any(d.type != "cuda" for d in others):
        return "generator"
    if mode.upcast:
        if others:
            return "device" if mode.fuzz_device == "cpu" else "cuda_upcast"
        if name not in names.DTYPE_FREE:
            return "dtype"
    elif others and name in names.ATTENTION:
        return "cuda_attention"
    gens = [torch.default_generator]
    for d in others:
        g = _cuda_generator(d)
        if g is None:
            return "generator"
        if all(g is not have for have in gens):
            gens.append(g)
    if draw.generator is not None and all(draw.generator is not g for g in gens):
        gens.append(draw.generator)
    return Replay(gens)
