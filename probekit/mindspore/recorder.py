"""``GradProbe`` for MindSpore: record gradient statistics at every call of an optimizer.

msprobe's MindSpore grad probe is given the optimizer (``monitor(optimizer)``), not the model: a
MindSpore optimizer is a ``Cell`` called with the tuple of gradients, in the order of its
``parameters``. probekit wraps its ``construct`` with a tap (``graph.py``) that sees the
gradients the update is about to use, in PyNative mode, in ``GRAPH_MODE`` and inside ``@ms.jit``
train steps alike (compiled into the graph there).

Step = the number of calls of the optimizer, from 0 (msprobe's numbering), counted where the
statistics arrive; the ``step`` filter is applied there (the statistics of other steps are not
computed on the host path, and not written on either). The statistics go to the same Zarr store
as PyTorch runs (``{dump_path}/grads.zarr/rank{r}/``), written by the same ``GradWriter``, so
every reader of probekit works on a MindSpore run unchanged.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref

import numpy as np
import torch

from .compat import check_numpy

check_numpy()  # before MindSpore is imported: numpy 2 beside its numpy-1 wheel

import mindspore as ms  # noqa: E402

from ..config import ConfigError, config_for, grad_probe_options
from ..dist import restart_count
from ..grads.numerics import stats as host_stats
from ..grads.numerics.sampling import whole_sample
from ..grads.numerics.stats import Layout, StepStats, padded_nbytes
from ..grads.store.restarts import plan_run
from ..grads.store.store import GradWriter
from ..grads.record.summary import ProbeSummary, probe_summary
from ..log import Once, ensure_handler, get_logger
from . import capture as _capture
from . import graph as _graph
from . import stats as _stats

log = get_logger(__name__)


class GraphModeError(RuntimeError):
    """Something the MindSpore grad probe cannot record in a compiled (graph-mode) step; the
    message names it and what to do instead."""


_RECORDING: "weakref.WeakSet[GradProbe]" = weakref.WeakSet()
_EXIT_HOOKED = False


def _sync_at_exit() -> None:
    """At exit, before the store's exit flush (``grads.live``, registered earlier, runs later):
    let queued steps' callbacks reach the probes still recording."""
    if any(True for _ in _RECORDING):
        try:
            _graph.synchronize()
        except Exception as exc:  # at interpreter exit: report, never raise
            log.warning("grad_probe: waiting for MindSpore at exit failed: %s", exc)


def _hook_exit() -> None:
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_sync_at_exit)
        _EXIT_HOOKED = True


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
    ``flush_every``, ``flush_seconds``, ``significance``); ``level``/``steps``/``ranks`` still
    work, deprecated. ``where``: ``"auto"`` (host statistics when MindSpore runs on the CPU,
    in-graph/device statistics otherwise), ``"host"`` or ``"device"``.

    Start it before the first call of a compiled train step: a graph compiled earlier does not
    hold the tap (``stop()`` then raises ``GraphModeError`` naming the steps it missed).
    """

    def __init__(self, optimizer, *, config=None, where: str = "auto", **options):
        if not _is_optimizer(optimizer):
            raise TypeError(f"optimizer: {type(optimizer).__name__} is not valid; accepted: a "
                            "mindspore.nn.Optimizer (a Cell called with the gradients)")
        _stats.resolve_where(where)  # validated now, resolved at start()
        self.config = config_for("grad_probe", config, **grad_probe_options(options))
        if self.config.grad_probe.grad_point != "step":
            raise ConfigError(
                f"grad_probe.grad_point: {self.config.grad_probe.grad_point!r} is not valid for "
                "MindSpore; accepted: 'step' (the tap sits in the optimizer's call: the "
                "gradients it is handed, after any clipping in the train step)",
                key="grad_probe.grad_point", value=self.config.grad_probe.grad_point,
                accepted="step")
        self.optimizer = optimizer
        self.where = where
        self.steps_seen = 0
        self.hook_seconds: list[float] = []
        self._tap = None
        self._writer = None
        self._plan = None  # statistics plan and workspace, made by start()
        self._lock = threading.Lock()
        self._once = Once()
        self._gs0 = None  # the optimizer's global_step when recording started
        self._seen0 = 0
        self._arrived: set = set()  # host tap: parameters of the current step seen so far
        self._current = None  # host tap: the statistics of the step being assembled
        self.bytecode_refused = 0  # callbacks refused under PIJit's rewrite (capture.py)
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
        self._slot = {i: k for k, i in enumerate(index)}  # optimizer index -> layout position
        self._dtypes = [p.dtype for p in params]
        self.param_names = tuple(names[i] for i in index)
        shapes = tuple(tuple(int(d) for d in p.shape) for p in params)
        section = self.config.grad_probe
        # sampled sign bits: the elements PyTorch's probe samples (grads/sampling.py)
        self._sample, nbits = whole_sample(shapes, section.sample
                                           if section.grad_level != "L0" else 0)
        self.layout = Layout(self.param_names, tuple(int(p.size) for p in params), shapes,
                             nbits)
        self._single = [Layout((n,), (c,), (s,), None if nbits is None else (b,))
                        for n, c, s, b in zip(self.layout.names, self.layout.numels,
                                              self.layout.shapes, self.layout.bits)]

    @property
    def dump_path(self) -> str:
        return self.config.dump_path

    @property
    def active(self) -> bool:
        return self._tap is not None

    @property
    def has_store(self) -> bool:
        """True once ``start()`` created this rank's store (False on a rank the filter skips)."""
        return self._writer is not None

    @property
    def mode(self) -> str | None:
        """Where the statistics are computed while recording: ``"host"`` or ``"device"``."""
        return self._tap.kind if self._tap is not None else None

    def start(self) -> "GradProbe":
        ensure_handler()
        if self._tap is not None:
            return self
        rank = get_rank()
        if self.config.rank and rank not in self.config.rank:
            log.info("grad_probe: rank %d is not in rank filter %s; nothing is recorded", rank,
                     list(self.config.rank))
            return self
        why = _graph.check_construct(_graph.original_construct(self.optimizer))
        if why:
            raise GraphModeError(
                f"grad_probe: {type(self.optimizer).__name__} cannot be monitored: {why}. "
                "probekit taps the gradients where the optimizer receives them; monitor a "
                "mindspore.nn.Optimizer called as optimizer(gradients)")
        sliced = _graph.sharding()
        if sliced:
            raise GraphModeError(
                f"grad_probe: MindSpore's {sliced} is not supported: the optimizer would receive "
                "slices of the gradients, which probekit does not record as parameters. Record "
                "with parallel_mode 'stand_alone', 'data_parallel' or 'hybrid_parallel' "
                "(parameters whole on each rank), or record the PyTorch twin of the model")
        tap = self._make_tap(_stats.resolve_where(self.where))
        if self._writer is None:
            section = self.config.grad_probe
            self._writer = GradWriter(self.dump_path, rank, self.layout, section.grad_level,
                                      section.bounds, section.hash, section.flush_every,
                                      section.flush_seconds, significance=section.significance,
                                      attrs=self._store_attrs(),
                                      durable=section.durable, overwrite=section.overwrite)
            # a restart continues the store: from start_step, else the optimizer's global_step
            # (restored with a checkpoint), else after the store's newest step; any other run
            # replaces a store whose last run ended cleanly (restarts.plan_run)
            gs = _graph.global_step(self.optimizer) if section.start_step is None else None
            alone = int(os.environ.get("WORLD_SIZE", os.environ.get("RANK_SIZE", "1")) or 1) <= 1
            why = ("resume=True" if section.resume else "start_step"
                   if section.start_step is not None else
                   f"an elastic restart (restart count {restart_count()})" if restart_count()
                   else f"the optimizer's global_step is {gs} (resumed)" if gs else "")
            try:
                run = plan_run(self.dump_path, start=section.start_step, inferred=gs,
                               why="the optimizer's global_step", overwrite=section.overwrite,
                               scope="job" if alone else "rank", rank=rank,
                               sample=int(self._store_attrs().get("sample", 0)),
                               restart=bool(why), why_restart=why)
            except Exception:
                self._writer.close()
                self._writer = None
                raise
            self._writer.begin(run)
            self.steps_seen = int(run["start"])
            self._plan = _stats.Plan(self.layout)
        self._gs0 = _graph.global_step(self.optimizer)
        self._seen0 = self.steps_seen
        tap.attach(self)
        _graph.install(self.optimizer, tap)
        self._tap = tap
        _RECORDING.add(self)
        _hook_exit()
        log.info("grad_probe: monitoring %d parameters (MindSpore, %s statistics) at level %s "
                 "into %s", len(self.param_names), tap.kind, self.config.grad_probe.grad_level,
                 self.dump_path)
        return self

    def _store_attrs(self) -> dict:
        attrs = {"framework": "mindspore"}
        if self._sample is not None:  # sampled sign bits (grads/sampling.py)
            attrs.update(sample=int(self.config.grad_probe.sample),
                         sample_bits=list(self.layout.bits))
        return attrs

    def _make_tap(self, where: str):
        """The optimizer's tap for ``where``: its existing one when that fits (graphs compiled
        with it keep working), else a new one."""
        tap = _graph.current_tap(self.optimizer)
        if tap is not None and tap.probe is not None and tap.probe is not self:
            raise RuntimeError("grad_probe: this optimizer is already monitored by another "
                               "probe; stop() that one first")
        original = _graph.original_construct(self.optimizer)
        section = self.config.grad_probe
        if where == "host":
            if isinstance(tap, _graph.HostTap):
                return tap
            return _graph.HostTap(self.optimizer, original)
        signature = (tuple(self._index), section.grad_level, tuple(section.bounds),
                     bool(section.significance), section.sample)
        if isinstance(tap, _graph.DeviceTap) and tap.signature == signature:
            return tap
        return _graph.DeviceTap(self.optimizer, original, self._index, section.grad_level,
                                section.bounds, section.significance,
                                modules=self.layout.modules, sample=self._sample,
                                sample_size=section.sample)

    def stop(self, *, clean: bool = True) -> None:
        """Detach from the optimizer and write every buffered step (``clean``: the run ended as
        planned, which its commit says: the next run, unless a restart, replaces it).

        Raises ``GraphModeError`` (after writing) when the optimizer ran steps the probe did
        not see: a train step compiled before ``monitor()`` holds no tap. Logs the one-line
        ``summary`` once the steps are written."""
        tap, self._tap = self._tap, None
        _RECORDING.discard(self)
        missed = 0
        try:
            if tap is not None:
                _graph.synchronize()  # queued graphs: their callbacks reach the probe first
                with self._lock:
                    tap.attach(None)
                    if self._arrived and self._once("partial-step"):
                        log.warning("grad_probe: step %d got the gradients of %d of %d "
                                    "parameters before stop(); it is not recorded",
                                    self.steps_seen, len(self._arrived),
                                    len(self.optimizer.parameters))
                    self._arrived.clear()
                    self._current = None
                _graph.uninstall(self.optimizer)
                gs = _graph.global_step(self.optimizer)
                if gs is not None and self._gs0 is not None and not self.bytecode_refused:
                    missed = (gs - self._gs0) - (self.steps_seen - self._seen0)
        finally:
            try:
                if self._writer is not None:
                    self._writer.close(clean=clean)
            finally:
                if self._plan is not None:
                    self._plan.close()
        if tap is not None and self._writer is not None:
            log.info("%s", self.summary)
        if missed > 0:
            raise GraphModeError(
                f"grad_probe: the optimizer ran {missed} step(s) that probekit did not see "
                f"(it saw {self.steps_seen - self._seen0}): they ran in a graph compiled before "
                "monitor()/start() (an @ms.jit train step, a TrainOneStepCell or a GRAPH_MODE "
                "call already made), which holds no probe. Call monitor() before the first "
                "call of the compiled train step, or compile a new one after it (a new ms.jit "
                "function or TrainOneStepCell).")

    @property
    def summary(self) -> ProbeSummary:
        """Steps written (all of them after ``stop()``), parameters, bytes of this rank's store
        and where it is; ``str()`` of it is the line ``stop()`` logs (``grads/summary.py``, as
        for PyTorch)."""
        return probe_summary(self._writer, len(self.param_names))

    def flush(self) -> None:
        if self._writer is not None:
            if self._tap is not None:
                _graph.synchronize()
            self._writer.flush()

    def __enter__(self) -> "GradProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(clean=exc[0] is None)

    # -- the tap's entry points (graph.py) -----------------------------------------------------
    def _selected(self, step: int) -> bool:
        return not self.config.step or step in self.config.step

    def _refuse_bytecode(self) -> None:
        """The callback runs under PIJit's rewriter (capture.py): raise ``GraphModeError``, which
        MindSpore hands to the caller of the train step. Nothing else may run then."""
        self.bytecode_refused += 1
        raise GraphModeError(_capture.bytecode_message(self.steps_seen))

    def _on_eager(self, grads) -> None:
        """PyNative, optimizer not compiled: the whole tuple of gradient tensors."""
        if sys._getframe().f_code is not _CODE["_on_eager"] or not _capture.plain():
            self._refuse_bytecode()  # bytecode capture (capture.py)
        with self._lock:
            step = self.steps_seen
            self.steps_seen += 1
            if not self._selected(step):
                return
            t0 = time.perf_counter()
            if not isinstance(grads, (tuple, list)) or \
                    len(grads) != len(self.optimizer.parameters):
                if self._once("bad-input"):
                    log.warning("grad_probe: the optimizer was not called with one gradient "
                                "per parameter (got %s); step %d is not recorded",
                                type(grads).__name__, step)
                return
            section = self.config.grad_probe
            result = _stats.compute([grads[i] for i in self._index], self._plan,
                                    section.grad_level, section.bounds, section.hash,
                                    self.mode or "auto", section.significance,
                                    sample=self._sample)
            self._writer.append(step, result)
            self.hook_seconds.append(time.perf_counter() - t0)

    def _on_host_amax(self, j: int, array) -> float:
        """Host tap, first callback: the largest finite |x| of gradient ``j`` (0 where it is
        not recorded), read in place."""
        if sys._getframe().f_code is not _CODE["_on_host_amax"] or not _capture.plain():
            self._refuse_bytecode()  # bytecode capture (capture.py)
        if self._slot.get(j) is None or array.size == 0:
            return 0.0
        return host_stats.finite_amax(_stats.host_view(array, self._dtypes[self._slot[j]]))

    def _on_host_grad(self, j: int, array, peaks) -> None:
        """Host tap: the host memory of gradient ``j`` of the optimizer, in place, and every
        gradient's largest finite |x| (``peaks``, by optimizer index)."""
        if sys._getframe().f_code is not _CODE["_on_host_grad"] or not _capture.plain():
            self._refuse_bytecode()  # bytecode capture (capture.py)
        with self._lock:
            if j in self._arrived:  # the previous step did not complete: start afresh
                if self._once("incomplete"):
                    log.warning("grad_probe: a step ended with %d of %d gradients seen; it is "
                                "not recorded", len(self._arrived),
                                len(self.optimizer.parameters))
                self._arrived.clear()
                self._current = None
            if not self._arrived:
                self._start_step()
            self._arrived.add(j)
            k = self._slot.get(j)
            if k is not None and self._current is not None:
                t0 = time.perf_counter()
                self._fill(k, array, peaks)
                self._elapsed += time.perf_counter() - t0
            if len(self._arrived) == len(self.optimizer.parameters):
                self._finish_step()

    def _start_step(self) -> None:
        self._elapsed = 0.0
        self._current = (_empty_stats(self.layout, self.config.grad_probe)
                         if self._selected(self.steps_seen) else None)

    def _fill(self, k: int, array, peaks) -> None:
        if array.size != self.layout.numels[k]:
            raise GraphModeError(
                f"grad_probe: the compiled step handed {self.layout.names[k]!r} a gradient of "
                f"{array.size} elements; the parameter has {self.layout.numels[k]} (a sliced or "
                "resized parameter is not supported). Record without sharding the parameters")
        section = self.config.grad_probe
        mods = self.layout.modules
        scale = max(float(peaks[self._index[m]]) for m in np.flatnonzero(mods == mods[k]))
        part = host_stats.compute([_stats.host_view(array, self._dtypes[k])], self._single[k],
                                  section.grad_level, section.bounds, section.hash,
                                  self._scratch(), section.significance,
                                  reduce_amax=lambda local: torch.full_like(local, scale),
                                  sample=None if self._sample is None else [self._sample[k]])
        _place(self._current, k, part, self.layout)

    def _finish_step(self) -> None:
        step, out = self.steps_seen, self._current
        self.steps_seen += 1
        self._arrived.clear()
        self._current = None
        if out is not None:
            t0 = time.perf_counter()
            self._writer.append(step, out)
            self.hook_seconds.append(self._elapsed + time.perf_counter() - t0)

    def _scratch(self):
        if self._plan.scratch is None:
            self._plan.scratch = host_stats.Workspace()
        return self._plan.scratch

    def _on_device_stats(self, tap, arrays) -> None:
        """Device tap: one step's statistics, computed in the graph."""
        if sys._getframe().f_code is not _CODE["_on_device_stats"] or not _capture.plain():
            self._refuse_bytecode()  # bytecode capture (capture.py)
        with self._lock:
            step = self.steps_seen
            self.steps_seen += 1
            if not self._selected(step):
                return
            t0 = time.perf_counter()
            section = self.config.grad_probe
            present = [True] * len(self.param_names)
            result = _stats.unpack(arrays, self.layout, present, section.grad_level,
                                   section.bounds, section.hash, section.significance)
            self._writer.append(step, result)
            self.hook_seconds.append(time.perf_counter() - t0)

    def dataset(self, chunks=None):
        """The recorded (committed) steps of this rank as an xarray Dataset; flushes first."""
        from ..grads.store.sources import open_grads

        self.flush()
        return open_grads(self.dump_path, rank=get_rank(), chunks=chunks)

    def __repr__(self) -> str:
        state = f"recording ({self.mode})" if self._tap is not None else "stopped"
        return (f"GradProbe[MindSpore]({len(self.param_names)} params, level="
                f"{self.config.grad_probe.grad_level}, steps seen={self.steps_seen}, "
                f"dump_path={self.dump_path!r}, {state})")


#: the callbacks' own code: under PIJit's rewriter their frames run another code object
_CODE = {name: getattr(GradProbe, name).__code__
         for name in ("_on_eager", "_on_host_amax", "_on_host_grad", "_on_device_stats")}


def _empty_stats(layout: Layout, section) -> StepStats:
    """A step's statistics before any parameter arrived (as
    ``probekit.grads.numerics.stats.compute`` starts them: no gradient yet, no sign bit, every
    significance bit set)."""
    p = len(layout.names)
    out = StepStats(present=np.zeros(p, bool), max=np.full(p, np.nan), min=np.full(p, np.nan),
                    norm=np.full(p, np.nan))
    level = section.grad_level
    if level == "L0":
        out.hash = np.zeros((p, host_stats.HASH_NBYTES[section.hash]), np.uint8)
    else:
        out.direction = np.zeros(layout.nbytes, np.uint8)
        if section.significance:
            out.significant = np.full(layout.nbytes, 255, np.uint8)
    if level == "L2":
        out.zeros = np.full(p, np.nan)
        out.dist = np.full((p, len(section.bounds) + 1), np.nan)
    return out


def _place(out: StepStats, k: int, part: StepStats, layout: Layout) -> None:
    """Copy the one-parameter statistics ``part`` into position ``k`` of ``out``."""
    for name in ("present", "max", "min", "norm", "hash", "zeros", "dist"):
        arr = getattr(out, name)
        if arr is not None:
            arr[k] = getattr(part, name)[0]
    nb = padded_nbytes(layout.bits[k])
    off = int(layout.offsets[k])
    if out.direction is not None:
        out.direction[off:off + nb] = part.direction[:nb]
    if out.significant is not None and part.significant is not None:
        out.significant[off:off + nb] = part.significant[:nb]
