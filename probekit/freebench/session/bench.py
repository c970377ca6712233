"""``FreeBench``: the public free-benchmark session (context manager, start/stop/step, results).

    fb = probekit.FreeBench(dump_path="./out", pert_mode="bit_noise")
    with fb:                          # start() on enter, stop() on exit; usable again
        loss = model(x).sum(); loss.backward()
    fb.step()                         # per-API counters reset, step number + 1
    fb.results                        # DataFrame, one row per inconsistent output

Steps follow the optimizer, as in ``GradProbe``: an ``optimizer.step()`` inside the probe ends
the training step (``fb.step()`` right after it is the same boundary, not another one).
    fb.summary                        # calls, checked, skipped {reason: n}, flagged, steps

``PrecisionDebugger(task="free_benchmark")`` drives the same object through ``open_session``.
"""
from __future__ import annotations

import atexit
import functools
import os
import time
import weakref

import torch

from ...config import Config, ConfigError, config_for
from ...dist import RankCache, rank_selected
from ...log import Once, ensure_handler, get_logger
from . import coverage
from ..report import results as _results
from .compiled import MESSAGE as COMPILED_MESSAGE
from .compiled import CompileGuard, CompiledModelError, is_compiled_module
from ..engine.intercept import Engine, make_mode
from .modules import ModuleScope
from .optsteps import Followed, OptimizerSteps
from ..repro.record import Recorder
from ..report.runs import DumpRun
from ..report.view import Findings, Summary, summary_line

log = get_logger("probekit.freebench")


class FreeBench:
    """Re-run torch API calls on perturbed inputs and report the inconsistent outputs.

    ``config``: a probekit ``Config`` (task free_benchmark), a ``FreeBenchmarkConfig``, a path to a
    msprobe/probekit config.json, or None; ``**options`` as ``probekit.make_config`` takes them
    (``dump_path``, ``pert_mode``, ``handler_type``, ``fuzz_stage``, ``scope``, ``list``, ...).
    ``module="h.2.attn"`` (or ``modules=[...]``) checks only the calls made while those modules
    of ``model`` run (``model=`` here or ``start(model)``), nested submodules included; the
    ``module`` column of the results names the innermost one.
    """

    def __init__(self, config=None, *, model=None, **options) -> None:
        ensure_handler()
        if "modules" in options:  # plural spelling of the ``module`` key
            modules = options.pop("modules")
            if "module" in options:
                raise ConfigError("free_benchmark.module: given both as module= and modules=; "
                                  "accepted: one of them", key="free_benchmark.module",
                                  value=modules, accepted="one of module=, modules=")
            options["module"] = list(modules) if isinstance(modules, (list, tuple)) else modules
        self.config: Config = config_for("free_benchmark", config, **options)
        self._model = None
        self._scope = None
        if model is not None:
            self._set_model(model)
        self._rows: list[dict] = []
        self._sink = _results.CsvSink(self.config.dump_path)
        self._rank = RankCache()
        self._engine = Engine(self.config, self._emit, self._rank.get())
        #: this rank is in the rank filter (read again at each start(): ``RankCache``)
        self._rank_active = rank_selected(self.config.rank, self._engine.rank)
        # a confirmed finding's call is saved for fb.repro (repro/record.py)
        self._engine.repro_capture = Recorder(self._engine, self.config.dump_path)
        self._mode = None
        #: an idle step runs between start() and stop(): nothing intercepted (``_idle_step``)
        self._idle = False
        #: torch.optim's step hooks (steps follow the optimizer; a step whose calls matter to
        #: nothing runs unintercepted: optsteps.py)
        self._steps = OptimizerSteps(self._engine, self)
        self._followed = Followed(self._engine)
        self._compile_guard = CompileGuard()
        self._closed = False
        self._mode_made = None
        self._coverage_once = Once()
        self._step_kinds = coverage.step_kinds(self.config)
        self._step_start = self._step_snapshot()
        self._block_start = None
        self._started = False  # start() was called (step() before it is warned about)
        self._run = None  # this session's run in its dump folder (report/runs.py), from start()
        #: ``impact`` results by api_name (the findings view's ``impact`` column)
        self.impacts: dict = {}
        # steps follow the optimizer (``_optimizer_step``) until fb.step() is called: the
        # optimizers seen and those that stepped since the last boundary; whether the last
        # boundary was the optimizer's
        self._explicit = False
        self._optimizers: set = set()
        self._stepped: set = set()
        self._auto_last = False
        # verdicts still pending when the process exits (a run that never called stop()) are
        # read back and written then; a weak reference: the hook does not keep this alive
        self._exit_hook = functools.partial(_gather_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True between start() and stop()."""
        return self._mode is not None or self._idle

    def _set_model(self, model) -> None:
        """Resolve the module scope against ``model`` (unknown names: ``ConfigError``)."""
        names = self.config.free_benchmark.module
        if model is self._model:
            return
        if names:
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"model: {type(model).__name__} is not valid; accepted: a "
                                  "torch.nn.Module (free_benchmark.module names its submodules)")
            self._scope = ModuleScope(model, names)
        self._model = model

    def start(self, model=None) -> None:
        """Begin intercepting torch calls on this thread. With ``module`` set, only calls made
        inside those modules of ``model`` (here or ``FreeBench(model=...)``) are checked; without
        it ``model`` is unused: every API call is seen, inside or outside a model. A
        ``torch.compile``'d model is refused (``CompiledModelError``): probe the uncompiled
        module."""
        t = time.perf_counter()
        try:
            self._start(model, t)
        finally:
            budget = self._engine.budget
            if budget is not None and budget.t0 is not None:   # the probe's own time
                budget.own(time.perf_counter() - t)

    def _start(self, model, t: float) -> None:
        """``start()``'s work; ``t``: when it was called (a budget's clock starts there)."""
        if self._closed:
            raise RuntimeError("this FreeBench was closed")
        if model is not None and is_compiled_module(model):
            raise CompiledModelError(COMPILED_MESSAGE)
        if self._mode is not None or self._idle:
            return
        if model is not None:
            self._set_model(model)
        names = self.config.free_benchmark.module
        if names and self._scope is None:
            raise ConfigError(f"free_benchmark.module: {list(names)!r} needs the model; "
                              "accepted: FreeBench(..., model=model) or start(model)")
        self._started = True
        rank = self._rank.get()
        self._rank_active = rank_selected(self.config.rank, rank)
        if not self._rank_active:
            log.debug("free benchmark inactive: rank %d is not in %s", rank,
                      list(self.config.rank))
            return
        self._engine.rank = rank
        if self._run is None:  # the dump folder: append (a restart), replace, or refuse
            self._run = DumpRun.begin(self.config, rank)
        else:
            self._run.mark(False)  # running again
        budget = self._engine.budget
        if budget is not None:
            budget.started(t)   # from start()'s first line: its own work is the probe's cost
        self._sink.open()
        # the optimizer's steps are watched in a reference step too: they end the step
        self._steps.install()
        if self._idle_step():
            self._idle = True   # nothing intercepted (``_idle_step``)
            return
        try:
            self._intercept()
        except BaseException:
            self._steps.remove()
            raise
        if self.config.free_benchmark.handler_type == "fix" and \
                self.config.free_benchmark.fuzz_stage == "backward":
            log.info("Free benchmark: fix applies to the forward call; the gradients of a fixed "
                     "call come from its upcast computation too")

    def _step_snapshot(self):
        """The counters at a step's start, or None once every kind of step finding this
        session can report was reported (each is logged once): nothing left to count."""
        return self._engine.totals() if self._step_kinds else None

    def _idle_step(self) -> bool:
        """This step intercepts nothing: a budget's reference or quiet step (the plain step is
        measured, ``budget.py``), or one the step filter excludes (its calls cost nothing)."""
        budget = self._engine.budget
        return not self._engine.enabled or (budget is not None and budget.reference)

    def _intercept(self) -> None:
        """Enter the interception: the TorchFunctionMode, the compile guard, the module scope."""
        mode = self._mode_made
        if mode is None:   # one per session, pushed at each block (its decisions are the engine's)
            mode = self._mode_made = make_mode(self._engine)
        try:
            self._compile_guard.install()
            if self._scope is not None:
                self._scope.attach()
                self._engine.modules = self._scope
            mode.__enter__()
        except BaseException:
            self._compile_guard.remove()
            self._detach_scope()
            raise
        self._mode = mode
        if self.config.free_benchmark.fuzz_stage == "backward" and \
                not self._coverage_once.seen("backward"):   # (block_findings' one kind)
            self._block_start = self._engine.totals()

    def _release(self) -> None:
        """Leave the interception (``_intercept``'s undoing): the mode exited, the compile
        guard and the engine's hooks removed (pending backward checks dropped, counted), the
        block's coverage findings reported."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        try:
            if self._steps.release():  # an optimizer step that raised left it off the stack
                pass
            elif (torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
                    if torch._C._len_torch_function_stack() else None) is not mode:
                log.warning("Free benchmark: another TorchFunctionMode was entered after start() "
                            "and is still active; stop() removes the top mode")
                mode.__exit__(None, None, None)
            else:
                mode.__exit__(None, None, None)
        finally:
            self._compile_guard.remove()
            watched = len(self._engine.handles)
            self._engine.stopped()
            self._detach_scope()
        if self._block_start is not None:
            self._report(coverage.block_findings(self.config, self._block_start,
                                                 self._engine.totals(), watched))
            self._block_start = None

    def stop(self) -> None:
        """Stop intercepting; pending backward checks are dropped (counted ``no_gradient``),
        global hooks removed, the verdicts read back and every flag settled: a finding, a hot
        spot, or (an accelerator's verdict whose inputs are gone) ``unexplained``. The run
        ended cleanly: its dump folder says so (the next run, unless a restart, replaces its
        findings; ``report/runs.py``)."""
        self._stop(clean=True)

    def _stop(self, clean: bool) -> None:
        if self._mode is None and not self._idle:
            return
        t = time.perf_counter()
        self._idle = False
        try:
            try:
                self._release()
            finally:
                self._steps.remove()
                self._gather()
                self._engine.settle()   # no flag left waiting for a next run (judging.py)
            self._end_run(clean)
        finally:
            budget = self._engine.budget
            if budget is not None:   # to stop()'s last line: its own work is the probe's cost
                now = time.perf_counter()
                budget.own(now - t)
                budget.stopped(now)

    def _end_run(self, clean: bool) -> None:
        if self._run is not None:
            try:
                self._run.stopped(self._sink, self._engine.repro_capture.written.values(), clean)
            except OSError as exc:
                log.warning("Free benchmark: could not update %s: %s", self.config.dump_path,
                            exc)

    def _report(self, findings) -> None:
        """Log each coverage finding once per session (kind: rank, step, scope, backward...)."""
        for kind, level, message in findings:
            if self._coverage_once(kind):
                log.log(level, message)
                if kind in self._step_kinds:   # no snapshot is taken once all were logged
                    self._step_kinds = tuple(k for k in self._step_kinds if k != kind)

    def _detach_scope(self) -> None:
        self._engine.modules = None
        if self._scope is not None:
            self._scope.detach()

    def _gather(self) -> None:
        """Read back the pending verdicts (one device-to-host transfer) and write the findings."""
        budget = self._engine.budget
        t0 = time.perf_counter()
        try:
            self._engine.gather()
        except Exception as exc:  # never reaches the training code
            self._engine.verdicts.drop()
            log.warning("Free benchmark: reading back the pending checks failed (%s: %s); they "
                        "were dropped", type(exc).__name__, exc)
        finally:
            if budget is not None:
                budget.spent(time.perf_counter() - t0, checks=0)

    def step(self) -> None:
        """End of a training step: pending verdicts gathered, per-API counters reset, the step
        number grows by one. A filter or stage that left the step with nothing checked is
        reported once (WARNING), and so is a step() before any start().

        Steps follow the optimizer (as in ``GradProbe``) in a session that does not call
        ``fb.step()``: an ``optimizer.step()`` made while the probe is active ends the step by
        itself (``_optimizer_step``), so a plain ``with fb:`` loop that calls
        ``optimizer.step()`` counts its steps (and ``combined`` alternates its modes). Once
        ``fb.step()`` is called the steps are the caller's, as before; its first call right
        after a step the optimizer ended is that same boundary (``opt.step(); fb.step()``
        inside or after the block is one step)."""
        budget = self._engine.budget
        t = time.perf_counter()
        # step()'s own work is the probe's cost, counted in the step it closes
        opened = budget is not None and budget.t0 is None
        if budget is not None:
            budget.started(t)
            budget.stepping(t)
        try:
            self._step()
        finally:
            if budget is not None:
                budget.stepped(time.perf_counter())
                if opened:
                    budget.stopped()

    def _step(self) -> None:
        self._steps.repair()   # an optimizer step that raised: the mode back on the stack
        if not self._started and self._coverage_once("step-before-start"):
            log.warning("%s", _step_before_start(self.config, self._engine.step))
        first, self._explicit = not self._explicit, True
        if first and self._auto_last:
            self._gather()    # the optimizer ended this step already
            return
        self._advance(auto=False)

    # -- the optimizer's steps (optsteps.py) ------------------------------------------------------
    def mode(self):
        """The engine's mode while it intercepts (None in a budget's reference step)."""
        return self._mode

    def may_suspend(self, optimizer) -> bool:
        """Can this outermost optimizer step run unintercepted without moving the name of any
        call after it (the API counters count its calls)? Yes when it ends the step (steps
        follow the optimizer, every optimizer seen has stepped), or, in the steps ``fb.step()``
        ends, once a step showed no call counted after its optimizer steps."""
        if self._explicit:
            return self._followed.ok is True and not self._followed.followed
        key = id(optimizer)
        return self._stepped | {key} >= self._optimizers | {key}

    def optimizer_starts(self) -> None:
        self._followed.starts()

    def optimizer_step(self, optimizer, suspended: bool = False) -> None:
        """An outermost optimizer step ended while the probe is active (``suspended``: its calls
        were not intercepted). Until ``fb.step()`` is called it ends the step; with several
        optimizers (a GAN's generator and discriminator) once every optimizer seen so far has
        stepped since the last boundary. Never raises into the training."""
        self._followed.ended(suspended)
        if self._explicit:
            return
        try:
            key = id(optimizer)
            self._optimizers.add(key)
            self._stepped.add(key)
            if self._stepped >= self._optimizers:
                self._stepped.clear()
                self._advance(auto=True)
        except Exception as exc:   # never reaches the training code
            log.warning("Free benchmark: ending the step at the optimizer's step failed (%s: "
                        "%s)", type(exc).__name__, exc)

    def _advance(self, auto: bool) -> None:
        """One step boundary (``auto``: the optimizer's): the verdicts gathered, the step's
        coverage findings reported, the engine's per-step state moved to the next step."""
        self._gather()
        e = self._engine
        try:
            moved = self._followed.boundary(learn=not auto)
            if moved is not None and self._coverage_once("optimizer-followed"):
                log.warning("Free benchmark: calls followed optimizer.step() in step %d before "
                            "fb.step(); that optimizer step was not intercepted, so the "
                            "counters (api_name) of those calls may differ from msprobe's. "
                            "Optimizer steps are intercepted from now on", moved)
            if self._step_start is not None:
                now = e.totals()
                self._report(coverage.step_findings(self.config, self._step_start, now, e.step,
                                                    self._rank_active,
                                                    filtered=self._started and not e.enabled))
        finally:
            e.next_step()
            self._step_start = self._step_snapshot()
            self._auto_last = auto
        idle = self._idle_step()
        if self.active and idle != self._idle:
            # a session left running across a step boundary (fb.step() or the optimizer's): an
            # idle step runs with nothing intercepted, the step after it intercepts again; the
            # optimizer's hooks stay, so its steps keep ending steps
            if idle:
                self._release()
                self._idle = True
            else:
                self._idle = False
                self._intercept()

    def monitor(self, model, optimizer=None) -> None:
        log.warning("monitor() belongs to the grad probe; the free benchmark sees every API call "
                    "between start() and stop()")

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self._closed = True
            atexit.unregister(self._exit_hook)
            self._steps.close()
            if self._run is not None:
                self._run.close()   # the marker file it kept open

    def __enter__(self) -> "FreeBench":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop(clean=exc[0] is None)  # left by an exception: the run did not end cleanly

    # -- results ---------------------------------------------------------------------------------
    def _emit(self, rows: list[dict]) -> None:
        self._rows.extend(rows)
        try:
            if self._run is not None:  # a replaced run's rows go before this run's first
                self._run.settle(self._sink, self._engine.repro_capture.written.values())
            self._sink.write(rows)
        except OSError as exc:
            log.warning("Free benchmark: could not append to %s: %s", self._sink.path, exc)

    @property
    def results(self):
        """pandas DataFrame, one row per inconsistent output (``probekit.freebench.COLUMNS``)."""
        self._gather()
        return _results.frame(self._rows)

    @property
    def summary(self) -> Summary:
        """Calls seen, checked, skipped ``{reason: n}``, flagged, steps (and hot spots, coverage
        when they apply): a dict whose ``str()`` is the findings view's one-line summary."""
        self._gather()
        s = self._engine.summary()
        if self._compile_guard.refused:
            s["compiled_refused"] = self._compile_guard.refused
        if self._steps.unseen:   # their calls are in no count above (optsteps.py)
            s["optimizer_steps_unseen"] = self._steps.unseen
        return Summary(s)

    def repro(self, row, out=None, *, shrink: bool = False, check: bool = False):
        """Write a standalone repro folder of a finding and return it (``repro.Repro``: its
        path, the command to run, what the script measures): ``repro.py`` (needs only torch;
        exits 1 while the defect is present), ``inputs.pt``, ``REPORT.md``. ``row``: a row of
        ``results``, its position there, or its ``api_name``; ``out``: the folder (default
        ``{dump_path}/repro/{api_name}.rank{r}``); ``shrink``: make the inputs smaller while
        the finding still reproduces; ``check``: also run the script in a fresh Python.
        Uses the record the session saved when it confirmed the finding (``repro/record.py``),
        so ``probekit freebench repro DUMP ROW`` does the same from the dump folder alone."""
        from ..repro import folder as repro

        self._gather()
        return repro.for_row(self.config.dump_path, row, out, results=self.results,
                             shrink=shrink, check=check)

    def impact(self, row, model, step_fn, **options):
        """Does this finding matter for the training? Re-run the steps of ``step_fn`` (forward
        and backward of ``model``; ``optimizer=`` when it steps one) with the finding's call
        fixed (computed wider and cast back, as ``handler_type="fix"`` does) and judge the
        change in the gradients against a control's rounding noise, in the grad comparison's
        words: "fixing `layer_norm` backward moves the gradients within what bf16 rounding
        explains". ``row``: a row of ``results``, its position, or its ``api_name``; options:
        ``steps``, ``optimizer``, ``control``, ``seeds``, ``every_call``, ``dump_path``,
        ``verbose`` (``probekit.impact``). Returns the ``Impact`` (``kind``, ``verdict``,
        ``text``), also kept in ``impacts`` for the findings view's ``impact`` column. The
        model, grads, optimizer and random generators are left as they were."""
        from ...impacting import impact as _impact
        from ..repro.folder import select

        self._gather()
        finding = select(self.results, row)
        done = _impact(model, step_fn, finding, **options)
        self.impacts[finding["api_name"]] = done
        return done

    @property
    def hotspots(self):
        """What the dtype predicts, kept apart from the findings (never in ``results`` or the
        CSV): one row per call site and output whose check moved by more than a correct kernel's
        rounding explains without being a finding -- a sensitivity mode's output that moved by
        more than twice a correct kernel's rounding bound but kept most of its bits, or an accuracy mode's error that
        the inputs' own conditioning explains (``cause``), or, on an accelerator, one waiting
        for its call site's analysis (cause ``pending`` inside a block, ``unexplained`` after
        ``stop()``: ``judging.py``). The worst check is shown, ``count`` says how many there
        were; most severe first."""
        self._gather()
        e = self._engine
        return _results.hotspot_frame(list(e._hot.values()) + [
            dict(r, count=1) for held in (e._held, e._unexplained) for rows in held.values()
            for r in rows])

    @property
    def coverage(self):
        """DataFrame, one row per call site eligible for a check (``api_name`` with its counter,
        e.g. ``Torch.matmul.3``): ``calls`` (times it ran) and ``checked`` (times it was checked).
        With ``budget``, ``summary["coverage"]`` is the share of these sites checked at least once."""
        self._gather()
        return self._engine.coverage.frame()

    @property
    def api_counts(self) -> dict:
        """Calls per API in the current step (``{"Torch.matmul": 3, ...}``): call ``i`` of API
        ``K`` is named ``K.i.forward`` (or ``.backward``), the names ``scope`` takes."""
        return dict(self._engine.counts)

    @property
    def csv_path(self) -> str:
        return os.path.join(self.config.dump_path, _results.CSV_NAME) if self._sink.path is None \
            else self._sink.path

    def _repr_html_(self) -> str:
        return Findings.of(self)._repr_html_()

    def __repr__(self) -> str:
        fb = self.config.free_benchmark
        state = "active" if self.active else ("closed" if self._closed else "stopped")
        where = f"module={list(fb.module)!r}, " if fb.module else ""
        return (f"FreeBench(pert_mode={fb.pert_mode!r}, handler_type={fb.handler_type!r}, "
                f"fuzz_stage={fb.fuzz_stage!r}, {where}{state}; "
                f"{summary_line(self.summary)})")


def _step_before_start(config: Config, step: int) -> str:
    """The warning for a ``step()`` before any ``start()``: the step number still grows (it
    counts training steps, as msprobe's does), so a ``step`` filter may now exclude the rest."""
    msg = (f"Free benchmark: step() was called before any start(): step {step} ends with nothing "
           f"checked and the next block is step {step + 1}. step() ends a training step whose "
           "calls ran between start() and stop() (or inside `with fb:`)")
    left = [s for s in config.step if s > step]
    if config.step and not left:
        msg += (f"; with the step filter {list(config.step)} no step is left to check: "
                "nothing will be checked")
    elif config.step:
        msg += f"; the step filter {list(config.step)} leaves steps {left} to check"
    return msg


def _gather_at_exit(ref) -> None:
    """At process exit: the pending verdicts of a FreeBench that is still around are read back
    and their findings written (never raises)."""
    fb = ref()
    if fb is None or fb._closed:
        return
    try:
        fb._gather()
        fb._engine.settle()
        if fb.active:  # never stopped: it ended with the process, cleanly unless on an error
            import sys

            fb._end_run(clean=getattr(sys, "last_value", None) is None)
    except Exception:
        pass


def open_session(config: Config) -> FreeBench:
    """The factory ``PrecisionDebugger`` calls for task ``free_benchmark``."""
    return FreeBench(config)
