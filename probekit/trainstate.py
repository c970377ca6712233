"""The training's state, saved and restored around a re-run of its step (``triage``, ``impact``).

``TrainingState(model, optimizer=None)`` takes the model's parameters and buffers (values, in
place), its ``.grad`` tensors (the same objects, their values), the train/eval flags, the
optimizer's state (``optimizer=``) and the random generators (torch's CPU and CUDA ones, Python's
``random``, numpy's); ``restore()`` puts all of it back, so a step function can run again and
again from the same point and the training then continues exactly as if it never ran.
"""
from __future__ import annotations

import copy
import random

import torch


class TrainingState:
    """Parameters, buffers, grads (objects and values), train flags, optimizer state, RNG."""

    def __init__(self, model, optimizer=None) -> None:
        self.model = model
        self.tensors = [(t, t.detach().clone()) for t in tensors(model)]
        self.grads = []
        for p in model.parameters():
            g = p.grad
            self.grads.append((p, g, None if g is None else g.detach().clone()))
        self.training = [(m, m.training) for m in model.modules()]
        self.optimizer = optimizer
        self.opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.rng = rng_state()

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
            for p, g, saved in self.grads:
                if g is not None:
                    g.copy_(saved)
                p.grad = g
        for m, flag in self.training:
            m.training = flag
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self.opt_state))
        set_rng_state(self.rng)


def check_step(model, step_fn) -> None:
    """``model`` a ``torch.nn.Module`` and ``step_fn`` a callable (``TypeError`` naming the bad
    one): what a re-run of a training step needs."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: {type(model).__name__} is not valid; accepted: a "
                        "torch.nn.Module")
    if not callable(step_fn):
        raise TypeError(f"step_fn: {step_fn!r} is not valid; accepted: a callable running one "
                        "training step (forward and backward) of model")


def tensors(model):
    """The model's parameters and buffers, each once."""
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
