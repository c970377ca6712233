"""``GradProbe`` for MindSpore: record gradient statistics at every call of an optimizer.

msprobe's MindSpore grad probe is given the optimizer (``monitor(optimizer)``), not the model: a
MindSpore optimizer is a ``Cell`` called with the tuple of gradients, in the order of its
``parameters``. A forward pre-hook on that cell sees the gradients the update is about to use.

Step = the number of calls of the optimizer, from 0 (msprobe's numbering). The statistics go to
the same Zarr store as PyTorch runs (``{dump_path}/grads.zarr/rank{r}/``), written by the same
``GradWriter``, so every reader of probekit works on a MindSpore run unchanged.

PyNative mode only: in graph mode (``GRAPH_MODE``, or an optimizer called inside ``ms.jit``)
MindSpore compiles the optimizer's hooks into the graph, where Python code cannot run. Graph mode
is refused when monitoring starts (``GraphModeError``), naming what is not supported.
"""
from __future__ import annotations

import os
import time

import mindspore as ms

from ..config import ConfigError, config_for, grad_probe_options
from ..grads.stats import Layout
from ..grads.store import GradWriter
from ..log import Once, ensure_handler, get_logger
from . import stats as _stats

log = get_logger(__name__)


class GraphModeError(RuntimeError):
    """The MindSpore grad probe was started in graph mode, which it does not support."""


GRAPH_MODE_MESSAGE = (
    "grad_probe: MindSpore GRAPH_MODE (static graph) is not supported by probekit; accepted: "
    "PYNATIVE_MODE. In graph mode the optimizer runs inside a compiled graph, so no Python hook "
    "sees its gradients (and msprobe's static-graph path lacks MD5, rank and step filters as "
    "well). Call mindspore.set_context(mode=mindspore.PYNATIVE_MODE) before monitor(), and keep "
    "the optimizer call outside ms.jit (the forward/backward may stay compiled).")


def get_rank() -> int:
    """This process's rank: MindSpore's communication group when initialised, else RANK, else 0."""
    try:
        from mindspore.communication.management import GlobalComm, get_rank as ms_rank

        if GlobalComm.INITED:  # get_rank() answers 0 before init()
            return int(ms_rank())
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover - other versions
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _is_optimizer(obj) -> bool:
    return isinstance(obj, ms.nn.Cell) and hasattr(obj, "parameters") and isinstance(
        getattr(obj, "parameters", None), (tuple, list, ms.ParameterTuple))


class GradProbe:
    """Record per-parameter gradient statistics (and sign bits) at every optimizer call.

    >>> probe = GradProbe(optimizer, grad_level="L2", dump_path="./run_ms").start()
    >>> train(net, optimizer); probe.stop()
    >>> ds = probekit.open_grads("./run_ms")

    ``config`` and ``options`` as for PyTorch's ``probekit.GradProbe`` (msprobe's key names:
    ``grad_level``, ``bounds``, ``step``, ``rank``, ``param_list`` (names as in
    ``optimizer.parameters``, i.e. ``Parameter.name``), ``dump_path``, ``hash``,
    ``flush_every``); ``level``/``steps``/``ranks`` still work, deprecated.
    """

    def __init__(self, optimizer, *, config=None, **options):
        if not _is_optimizer(optimizer):
            raise TypeError(f"optimizer: {type(optimizer).__name__} is not valid; accepted: a "
                            "mindspore.nn.Optimizer (a Cell called with the gradients)")
        self.config = config_for("grad_probe", config, **grad_probe_options(options))
        self.optimizer = optimizer
        self.steps_seen = 0
        self.hook_seconds: list[float] = []
        self._handle = None
        self._writer = None
        self._plan = None  # statistics plan and workspace, made by start()
        self._once = Once()
        self._select_params()

    def _select_params(self) -> None:
        names = [p.name for p in self.optimizer.parameters]
        wanted = set(self.config.grad_probe.param_list)
        if wanted:
            missing = sorted(wanted - set(names))
            if missing:
                sample = ", ".join(names[:8])
                raise ConfigError(f"grad_probe.param_list: {missing!r} not found in the "
                                  f"optimizer; accepted: names of optimizer.parameters (e.g. "
                                  f"{sample})")
        index = [i for i, n in enumerate(names) if not wanted or n in wanted]
        if not index:
            raise ValueError("grad_probe: the optimizer has no parameter to monitor")
        if len(set(names[i] for i in index)) != len(index):
            raise ValueError("grad_probe: the optimizer holds two parameters with the same name; "
                             "give them distinct names (Parameter.name)")
        params = [self.optimizer.parameters[i] for i in index]
        self._index = index
        self.param_names = tuple(names[i] for i in index)
        self.layout = Layout(self.param_names, tuple(int(p.size) for p in params),
                             tuple(tuple(int(d) for d in p.shape) for p in params))

    @property
    def dump_path(self) -> str:
        return self.config.dump_path

    @property
    def active(self) -> bool:
        return self._handle is not None

    @property
    def has_store(self) -> bool:
        """True once ``start()`` created this rank's store (False on a rank the filter skips)."""
        return self._writer is not None

    def start(self) -> "GradProbe":
        ensure_handler()
        if self._handle is not None:
            return self
        if ms.get_context("mode") == ms.GRAPH_MODE:
            raise GraphModeError(GRAPH_MODE_MESSAGE)
        rank = get_rank()
        if self.config.rank and rank not in self.config.rank:
            log.info("grad_probe: rank %d is not in rank filter %s; nothing is recorded", rank,
                     list(self.config.rank))
            return self
        if self._writer is None:
            section = self.config.grad_probe
            self._writer = GradWriter(self.dump_path, rank, self.layout, section.grad_level,
                                      section.bounds, section.hash, section.flush_every)
            self._plan = _stats.Plan(self.layout)
        self._handle = self.optimizer.register_forward_pre_hook(self._pre_step)
        log.info("grad_probe: monitoring %d parameters (MindSpore) at level %s into %s",
                 len(self.param_names), self.config.grad_probe.grad_level, self.dump_path)
        return self

    def stop(self) -> None:
        """Remove the hook and write every buffered step."""
        handle, self._handle = self._handle, None
        try:
            if handle is not None:
                handle.remove()
        finally:
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                if self._plan is not None and self._plan.scratch is not None:
                    self._plan.scratch.close()  # the pool's threads end with the probe

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def __enter__(self) -> "GradProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _pre_step(self, cell, inputs) -> None:
        step = self.steps_seen
        self.steps_seen += 1
        if self.config.step and step not in self.config.step:
            return
        t0 = time.perf_counter()
        grads = inputs[0] if inputs else None
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self.optimizer.parameters):
            if self._once("bad-input"):
                log.warning("grad_probe: the optimizer was not called with one gradient per "
                            "parameter (got %s); step %d is not recorded",
                            type(grads).__name__, step)
            return
        picked = [grads[i] for i in self._index]
        section = self.config.grad_probe
        result = _stats.compute(picked, self._plan, section.grad_level, section.bounds,
                                section.hash)
        self._writer.append(step, result)
        self.hook_seconds.append(time.perf_counter() - t0)

    def dataset(self, chunks=None):
        """The recorded (committed) steps of this rank as an xarray Dataset; flushes first."""
        from ..grads.sources import open_grads

        self.flush()
        return open_grads(self.dump_path, rank=get_rank(), chunks=chunks)

    def __repr__(self) -> str:
        state = "recording" if self._handle is not None else "stopped"
        return (f"GradProbe[MindSpore]({len(self.param_names)} params, level="
                f"{self.config.grad_probe.grad_level}, steps seen={self.steps_seen}, "
                f"dump_path={self.dump_path!r}, {state})")
