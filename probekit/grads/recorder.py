"""``GradProbe``: record gradient statistics of a model at every step of its optimizer.

Step = the number of ``step()`` calls of the optimizer that owns the model's parameters, counted
from 0 (msprobe's numbering). The statistics are taken in the optimizer's pre-step hook, so they
describe the gradients the update is about to use. When no optimizer is given, a global pre-step
hook is registered and every optimizer that does not own one of the model's parameters is ignored;
the hook is removed by ``stop()``.
"""
from __future__ import annotations

import sys
import time
import weakref

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..config import Config, ConfigError, GradProbeConfig, make_config
from ..dist import get_rank, rank_selected
from ..log import Once, ensure_handler, get_logger
from . import stats as _stats
from .names import canonical_names
from .store import GradWriter

log = get_logger(__name__)


def _as_config(config, options) -> Config:
    if config is None:
        return make_config("grad_probe", **options)
    if options:
        raise ValueError(f"pass either config=... or options, not both (got {sorted(options)})")
    if isinstance(config, GradProbeConfig):
        return Config(task="grad_probe", grad_probe=config)
    if isinstance(config, Config):
        if config.task != "grad_probe":
            raise ConfigError(f"task: {config.task!r} is not valid for GradProbe; accepted: "
                              "grad_probe")
        return config
    from ..config import load_config

    return _as_config(load_config(config), {})


class GradProbe:
    """Record per-parameter gradient statistics (and sign bits) at every optimizer step.

    >>> with GradProbe(model, level="L2", dump_path="./run_a"):
    ...     train(model, optimizer)
    >>> ds = probekit.open_grads("./run_a")

    ``steps``/``ranks`` restrict the recorded steps and ranks (empty or None = all);
    ``param_list`` restricts the parameters (names from ``model.named_parameters()``, with or
    without wrapper prefixes). Parameters are stored under their names without the prefixes of
    ``torch.compile``, DDP, FSDP1 and checkpoint wrappers (``names.canonical_name``); the names as
    recorded are kept in the store's ``recorded_params`` attribute.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, level: str = "L1",
                 bounds=(-1, 0, 1), param_list=None, steps=None, ranks=None,
                 dump_path: str = "./dump_path", hash: str = "md5", flush_every: int = 50, *,
                 config=None, flush_seconds: float = 60.0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: {type(model).__name__} is not valid; accepted: a "
                            "torch.nn.Module")
        if config is None:
            options = dict(dump_path=dump_path, rank=list(ranks or []), step=list(steps or []),
                           grad_level=level, bounds=list(bounds), param_list=list(param_list or []),
                           hash=hash, flush_every=flush_every, flush_seconds=flush_seconds)
        else:
            options = {}
        self.config = _as_config(config, options)
        self.model = model
        self.optimizer = optimizer
        self.steps_seen = 0
        self.hook_seconds: list[float] = []
        self._handles = []
        self._writer = None
        self._owner = None
        self._step_frame = None
        self._others = weakref.WeakSet()
        self._once = Once()
        self._select_params()

    # -- parameters ------------------------------------------------------------------------
    def _select_params(self) -> None:
        section = self.config.grad_probe
        named = list(self.model.named_parameters())
        clean = canonical_names(n for n, _ in named)
        named = [(c, n, p) for c, (n, p) in zip(clean, named)]
        wanted = set(section.param_list)
        if wanted:
            known = {c for c, _, _ in named} | {n for _, n, _ in named}
            missing = sorted(wanted - known)
            if missing:
                sample = ", ".join(sorted(c for c, _, _ in named)[:8])
                raise ConfigError(f"grad_probe.param_list: {missing!r} not found in the model; "
                                  f"accepted: names from model.named_parameters() (e.g. {sample})")
            named = [(c, n, p) for c, n, p in named if c in wanted or n in wanted]
        frozen = [c for c, _, p in named if not p.requires_grad]
        if frozen:
            log.info("grad_probe: %d parameters do not require grad now; they are recorded from "
                     "the step they first have a gradient (first: %s; param_list leaves them out)",
                     len(frozen), frozen[0])
        if not named:
            raise ValueError("grad_probe: the model has no parameter to monitor")
        self.param_names = tuple(c for c, _, _ in named)
        self.recorded_names = tuple(n for _, n, _ in named)
        self._params = [p for _, _, p in named]
        self._param_ids = {id(p) for p in self._params}
        self.layout = _stats.Layout(self.param_names, tuple(p.numel() for p in self._params),
                                    tuple(tuple(p.shape) for p in self._params))

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def dump_path(self) -> str:
        return self.config.dump_path

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def start(self) -> "GradProbe":
        ensure_handler()
        if self._handles:
            return self
        if not rank_selected(self.config.rank):
            log.info("grad_probe: rank %d is not in rank filter %s; nothing is recorded",
                     get_rank(), list(self.config.rank))
            return self
        if self._writer is None:  # the store exists (0 committed steps) once recording starts
            section = self.config.grad_probe
            self._writer = GradWriter(self.dump_path, get_rank(), self.layout,
                                      section.grad_level, section.bounds, section.hash,
                                      section.flush_every, section.flush_seconds,
                                      attrs={"recorded_params": list(self.recorded_names)})
            self._scratch = _stats._Scratch()
        if self.optimizer is not None:
            self._owner = self.optimizer
            self._handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._post_step))
        else:
            self._handles.append(register_optimizer_step_pre_hook(self._pre_step))
            self._handles.append(register_optimizer_step_post_hook(self._post_step))
        log.info("grad_probe: monitoring %d parameters at level %s into %s",
                 len(self.param_names), self.config.grad_probe.grad_level, self.dump_path)
        return self

    def stop(self) -> None:
        """Remove the hooks and write every buffered step."""
        handles, self._handles = self._handles, []
        try:
            for h in handles:
                h.remove()
        finally:
            if self._writer is not None:
                self._writer.close()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def __enter__(self) -> "GradProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the hook --------------------------------------------------------------------------
    def _owns(self, optimizer) -> bool:
        if self._owner is not None:
            return optimizer is self._owner
        if optimizer in self._others:
            return False
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            self._owner = optimizer
            return True
        self._others.add(optimizer)
        return False

    def _nested(self) -> bool:
        """True inside an outer ``step()`` of the same optimizer: a subclass whose ``step``
        calls ``super().step()`` runs the hooks twice, and that is one optimizer step."""
        outer = self._step_frame
        frame = sys._getframe(2)
        while outer is not None and frame is not None:
            if frame is outer:
                return True
            frame = frame.f_back
        return False

    def _post_step(self, optimizer, args, kwargs) -> None:
        if optimizer is self._owner:
            self._step_frame = None

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._owns(optimizer):
            if self._once(("other-optimizer", id(optimizer))):
                log.debug("grad_probe: ignoring an optimizer that does not own the model's "
                          "parameters")
            return
        if self._nested():
            return
        self._step_frame = sys._getframe(1)
        step = self.steps_seen
        self.steps_seen += 1
        if self.config.step and step not in self.config.step:
            return
        t0 = time.perf_counter()
        grads = []
        for name, p in zip(self.param_names, self._params):
            g = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else None
            g = g if g is not None else p.grad
            if g is None and self._once(("no-grad", name)):
                log.info("grad_probe: %s has no gradient at step %d (skipped; logged once)",
                         name, step)
            grads.append(g)
        section = self.config.grad_probe
        result = _stats.compute(grads, self.layout, section.grad_level, section.bounds,
                                section.hash, self._scratch)
        self._writer.append(step, result)
        self.hook_seconds.append(time.perf_counter() - t0)

    # -- results ---------------------------------------------------------------------------
    def dataset(self, chunks=None):
        """The recorded (committed) steps of this rank as an xarray Dataset; flushes first."""
        from . import open_grads

        self.flush()
        return open_grads(self.dump_path, rank=get_rank(), chunks=chunks)

    def __repr__(self) -> str:
        state = "recording" if self._handles else "stopped"
        return (f"GradProbe({len(self.param_names)} params, level="
                f"{self.config.grad_probe.grad_level}, steps seen={self.steps_seen}, "
                f"dump_path={self.dump_path!r}, {state})")
