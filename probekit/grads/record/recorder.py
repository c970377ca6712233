"""``GradProbe``: record gradient statistics of a model at every step of its optimizer.

Step = the number of ``step()`` calls of the optimizer that owns the model's parameters, counted
from 0 (msprobe's numbering). The statistics are taken in the optimizer's pre-step hook, so they
describe the gradients the update is about to use: after gradient clipping, when the loop clips
(HF Trainer, Lightning and accelerate clip before ``step()``). With ``grad_point="backward"``
they are the raw gradients instead, as the last backward pass before the step left them
(``rawgrads.py``), still recorded once per step. When no optimizer is given, a global pre-step
hook is registered and every optimizer that does not own one of the model's parameters is ignored;
the hooks are removed by ``stop()``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref

import numpy as np
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ...config import ConfigError, config_for, grad_probe_options
from ...dist import agree, get_rank, rank_selected, restart_count
from ...errors import GradStoreError
from ...log import Once, ensure_handler, get_logger
from ..numerics import stats as _stats
from ..store.names import canonical_names, check_rename, renamed
from .placement import (
    amax_reducer, ddp_first_rank, dtensor_placement, first_replica, is_dtensor, local_grad,
    local_placement)
from .rawgrads import BackwardTap
from .replicas import local_tensor
from ..store.restarts import plan_run
from ..store.store import GradWriter, layout_key
from .summary import ProbeSummary, probe_summary

log = get_logger(__name__)

#: steps of optimizers owning none of the monitored parameters, with none of this probe's own,
#: after which a WARNING says nothing is recorded (a GAN's discriminator may step a few times
#: before the generator's first step: 10 leaves room for that)
IGNORED_STEPS_WARNING = 10


class GradProbe:
    """Record per-parameter gradient statistics (and sign bits) at every optimizer step.

    >>> with GradProbe(model, grad_level="L2", dump_path="./run_a"):
    ...     train(model, optimizer)
    >>> ds = probekit.open_grads("./run_a")

    ``config``: a ``Config``, a ``GradProbeConfig``, a dict or a config.json path (as
    ``probekit.config_for`` takes them); ``options`` use msprobe's key names and override it:
    ``dump_path``, ``grad_level`` ("L0"/"L1"/"L2", default "L1"), ``bounds``, ``param_list``
    (names from ``model.named_parameters()``, with or without wrapper prefixes), ``step`` /
    ``rank`` (recorded steps and ranks; empty = all), ``hash``, ``flush_every``,
    ``flush_seconds``, ``significance``, ``grad_point`` (``"step"``, the default: the gradients
    ``optimizer.step()`` is handed, after clipping; ``"backward"``: the raw gradients at the end
    of the last backward pass before the step, before clipping), ``start_step``, ``overwrite``,
    ``durable`` (below). The spellings ``level=``,
    ``steps=``, ``ranks=`` of earlier versions still work, with a ``DeprecationWarning``.
    ``scaler``: the run's ``GradScaler``, so that its skipped steps keep their place (a row with
    no gradient present);
    with ``grad_point="backward"`` also to unscale the raw (scaled) gradients' statistics.
    ``storage_options``: for a ``dump_path`` that is an fsspec URL (``s3://bucket/run``): passed
    to the filesystem (endpoint, credentials; the ``AWS_*`` variables work without it).
    ``control``: record this run as a control for a test at that precision (``"bf16"``,
    ``"fp16"``, ``"fp32"``, optionally ``":autocast"``/``":cast"``; ``control.py``): between
    ``start()`` and ``stop()`` the model runs under the test's precision recipe with every
    low-precision operation computed in the wider dtype and rounded at random (its own
    generator, seeded by ``control_seed``); run it on the reference's code and pass it to
    ``compare_grads(ref, test, control=...)``.

    Distributed runs write one copy of every gradient: under DTensor sharding (FSDP2, tensor
    parallel, HSDP) each rank records its own shard with its placement, no gather, and
    ``open_grads`` assembles full parameters; under DDP the first rank of the group records.
    A ``rank`` filter, when given, selects the recording ranks as in msprobe. ``shards``: where
    the plain local pieces of a layout that keeps them as plain tensors lie
    (``LocalShards(mesh, {name: Shard(0)})``; Megatron's tensor parallelism:
    ``megatron_shards(model)``; ``shards.py``): recorded and checked as DTensor shards are.

    Restarts: a run into a store that holds steps continues it. Its first step is
    ``start_step`` when given, else the optimizer's own step count (Adam, AdamW, RMSprop...
    keep one in their state, which HF Trainer, Lightning and a checkpointing script restore),
    else the step after the store's newest (a new store: 0, msprobe's numbering); from that
    step on it supersedes what earlier runs recorded (steps a killed run wrote beyond the
    checkpoint it resumed from). A run that would replace every recorded step needs
    ``overwrite=True``. A changed world size or
    sharding records into a new layout folder of the same store; the readers join them
    (``restarts.py``). ``durable=True``: every commit flushed to the disk (survives a power
    loss; without it, the death of the process).

    Parameters are stored under their names without the prefixes of ``torch.compile``, DDP,
    FSDP1 and checkpoint wrappers (``names.canonical_name``); the names as recorded are kept in
    the store's ``recorded_params`` attribute.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, *, config=None, scaler=None,
                 storage_options: dict | None = None, control=None, control_seed=None,
                 rename=None, shards=None, **options):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: {type(model).__name__} is not valid; accepted: a "
                            "torch.nn.Module")
        if isinstance(control, torch.dtype):  # the config holds its name
            from .control import parse_control

            control = parse_control(control).name
        options.update(control=control, control_seed=control_seed)
        self.config = config_for("grad_probe", config, **grad_probe_options(options))
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.storage_options = dict(storage_options or {})
        self._rename_arg = rename
        self._rename = check_rename(rename, "GradProbe(rename=)")
        from .shards import LocalShards

        if shards is not None and not isinstance(shards, LocalShards):
            raise TypeError(f"GradProbe(shards=): {type(shards).__name__} is not valid; "
                            "accepted: probekit.grads.LocalShards (or megatron_shards(model)), "
                            "or None")
        self._shards = shards
        self._control = None
        section = self.config.grad_probe
        if section.control is not None:
            from .control import Perturbation

            self._control = Perturbation(model, section.control, section.control_seed)
        self.steps_seen = 0  # training iterations begun (the step axis)
        self.hook_seconds: list[float] = []
        self._handles = []
        self._writer = None
        self._owners = weakref.WeakKeyDictionary()  # optimizer -> indices of its monitored params
        self._owned = set()  # indices owned by some optimizer seen so far
        self._step_frame = None
        self._others = weakref.WeakSet()
        self._epoch = 0  # backward passes told apart: grads changed since the last step()
        self._grad_sig = None
        self._iter = None  # the current iteration: step, captures, optimizers stepped
        self._scratch = None
        self._compute_dtype = None  # the autocast dtype of the latest forward, if any
        self._updates = 0  # GradScaler.update() calls (the iteration count when a scaler is given)
        self._once = Once()
        self._tap = None  # grad_point "backward": the statistics at the end of each backward
        self._tap_seconds = 0.0
        self._run = None  # this recording's run in the store (``_begin_run``, at its first step)
        self._replicas = False  # the replica check (``replicas.py``): built at start(); None: off
        self._check_only = False
        self._check_frame = None
        self._opt_ids = weakref.WeakKeyDictionary()  # optimizer -> ids of its parameters
        self._checks = 0  # replica checks run (the step of a rank that records nothing)
        self._select_params()
        # empty recordings are warned about (_warn_*): which parameters ever had a gradient at
        # a recorded step, and the steps of optimizers owning none of them
        self._had_grad = np.zeros(len(self._params), bool)
        self._ignored_steps = 0
        if (self.config.grad_probe.grad_point == "backward" and scaler is not None
                and self.config.grad_probe.grad_level == "L0"):
            raise ConfigError(
                "grad_probe.grad_level: 'L0' is not valid with grad_point 'backward' and a "
                "GradScaler (the digest would be of the scaled gradient's bytes); accepted: "
                "L1, L2, or grad_point 'step'", key="grad_probe.grad_level", value="L0",
                accepted="L1, L2 (or grad_point 'step')")

    # -- parameters ------------------------------------------------------------------------
    def _select_params(self) -> None:
        section = self.config.grad_probe
        named = list(self.model.named_parameters())
        # plain local pieces declared as blocks (``shards.py``): {id: (mesh, placements)}
        self._declared = {} if self._shards is None else self._shards.resolve(named)
        clean = canonical_names(n for n, _ in named)
        if self._rename is not None:  # the logical names: a pipeline stage's global ones
            self._check_rename_keys(named, clean)
            try:
                clean = renamed(clean, self._rename, "GradProbe(rename=)")
            except ValueError as exc:
                raise ConfigError(str(exc), key="rename", value=self._rename_arg,
                                  accepted="a rename keeping the names apart") from None
        named = [(c, n, p) for c, (n, p) in zip(clean, named)]
        wanted = set(section.param_list)
        if wanted:
            known = {c for c, _, _ in named} | {n for _, n, _ in named}
            missing = sorted(wanted - known)
            if missing:
                sample = ", ".join(sorted(c for c, _, _ in named)[:8])
                raise ConfigError(f"grad_probe.param_list: {missing!r} not found in the model; "
                                  f"accepted: names from model.named_parameters() (e.g. {sample})",
                                  key="grad_probe.param_list", value=missing,
                                  accepted=f"names from model.named_parameters() (e.g. {sample})")
            named = [(c, n, p) for c, n, p in named if c in wanted or n in wanted]
        frozen = [c for c, _, p in named if not p.requires_grad]
        if frozen:
            log.info("grad_probe: %d parameters do not require grad now; they are recorded from "
                     "the step they first have a gradient (first: %s; param_list leaves them out)",
                     len(frozen), frozen[0])
        if not named:
            raise ValueError("grad_probe: the model has no parameter to monitor")
        self._layout_desc = self._describe(named)
        # every monitored parameter of this rank, replicas it does not record included: the
        # replica check digests them all (``replicas.py``)
        self._monitored = named
        named, self._placement = self._shard_plan(named)
        self.param_names = tuple(c for c, _, _ in named)
        self.recorded_names = tuple(n for _, n, _ in named)
        self._params = [p for _, _, p in named]
        self._param_ids = {id(p) for p in self._params}
        self._sharded = self._placement is not None
        # a DTensor with no block placement is gathered whole: every rank joins those gathers
        self._gathers = self._sharded and any(
            pl is None and is_dtensor(p) for pl, p in zip(self._placement, self._params))
        # a shard's significance threshold is the whole gradient's: one MAX all-reduce per
        # step and mesh group, among the ranks recording the shards (all of them, unless a
        # rank filter leaves some out: then each shard's threshold is its own)
        self._reduce_amax = (amax_reducer(self._params, self._placement,
                                          [self._mesh_of(p) for p in self._params])
                             if self._sharded and self._all_ranks_record() else None)
        local = (self._placement or [None] * len(named))
        numels = tuple(int(torch.Size(pl["local_shape"]).numel()) if pl else p.numel()
                       for pl, p in zip(local, self._params))
        self._sample, nbits = _sample_plan(section, local, self._params, numels)
        self.layout = _stats.Layout(
            self.param_names, numels,
            tuple(tuple(pl["local_shape"]) if pl else tuple(p.shape)
                  for pl, p in zip(local, self._params)), nbits)

    def _check_rename_keys(self, named, clean) -> None:
        """A dict ``rename`` names parameters of the model: a key that is none is an error
        naming it and the model's names (the name it would rename may be misspelt)."""
        from collections.abc import Mapping

        if not isinstance(self._rename_arg, Mapping):
            return
        known = set(clean) | {n for n, _ in named}
        missing = sorted(set(self._rename_arg) - known)
        if missing:
            sample = ", ".join(sorted(clean)[:8])
            raise ConfigError(f"GradProbe(rename=): {missing!r} not found in the model; "
                              f"accepted: names from model.named_parameters() (e.g. {sample})",
                              key="rename", value=missing,
                              accepted=f"names from model.named_parameters() (e.g. {sample})")
        # the keys may be the recorded names: look them up by the cleaned name too
        raw = dict(zip((n for n, _ in named), clean))
        table = {raw.get(k, k): v for k, v in self._rename_arg.items()}
        self._rename = check_rename(table)

    def _place_of(self, p, name: str = "") -> dict | None:
        """Where this rank's piece of ``p`` lies (``placement.dtensor_placement``'s dict): a
        DTensor's shard, a plain piece declared by ``shards=``; None otherwise."""
        if is_dtensor(p):
            return dtensor_placement(p)
        got = self._declared.get(id(p))
        if got is None:
            return None
        try:
            return local_placement(p, *got, name=name)
        except ValueError as exc:
            raise ConfigError(str(exc), key="shards", value=name,
                              accepted="pieces of equal size") from None

    def _mesh_of(self, p):
        """The mesh of ``p``'s placement: its DTensor's, or the one ``shards=`` declared."""
        got = self._declared.get(id(p))
        return got[0] if got is not None else getattr(p, "device_mesh", None)

    def _describe(self, named) -> dict:
        """What every rank of the run records, computed alike on each (the layout key of
        ``restarts.py``): the options that shape the store and every monitored parameter's
        global shape and placement, not this rank's shards."""
        section = self.config.grad_probe
        params = []
        for c, n, p in named:
            place = self._place_of(p, n)
            params.append([c, [int(x) for x in p.shape], None if place is None else
                           {"mesh": place["mesh_shape"], "placements": place["placements"]}])
        return {"level": section.grad_level, "bounds": list(section.bounds),
                "hash": section.hash if section.grad_level == "L0" else None,
                "significance": bool(section.significance) and section.grad_level != "L0",
                "grad_point": section.grad_point, "rank": sorted(self.config.rank),
                "params": params}

    def _all_ranks_record(self) -> bool:
        import torch.distributed as dist

        if not self.config.rank:
            return True
        world = dist.get_world_size() if dist.is_initialized() else 1
        return set(range(world)) <= set(self.config.rank)

    def _shard_plan(self, named):
        """(the parameters this rank records, their placements or None when no parameter is a
        DTensor): under DTensor sharding each rank records its own shard, and of a replicated
        shard only the first replica (``placement.py``), unless a ``rank`` filter is given."""
        if not any(is_dtensor(p) or id(p) in self._declared for _, _, p in named):
            return named, None
        places = [self._place_of(p, n) for _, n, p in named]
        keep = [i for i, pl in enumerate(places)
                if pl is None or self.config.rank or first_replica(pl)]
        if len(keep) < len(named):
            log.info("grad_probe: rank %d records %d of %d parameters (the others' shards are "
                     "replicas recorded by another rank)", get_rank(), len(keep), len(named))
        return [named[i] for i in keep], [places[i] for i in keep]

    def _agree_start(self) -> None:
        """What every rank records, agreed at the first ``start()`` (``replicas.exchange``:
        through torch.distributed's key-value store, no collective): the replica check
        (``replicas.py``; None when off or nothing is replicated anywhere) and the job's layout
        key (``self._job_key``: the ranks' own keys, one for all when they differ, as pipeline
        stages' do, so the stages record into one layout folder). With ``check_replicas=False``
        nothing is exchanged (a job may then run a probe on some ranks only): each rank keeps
        its own layout key."""
        import torch.distributed as dist

        from . import replicas as rep

        section = self.config.grad_probe
        own = layout_key(self._layout_desc)
        places = [self._place_of(p, n) for _, n, p in self._monitored]
        mine = (rep.pieces(self.model, self._monitored, places, section.tied,
                           [self._mesh_of(p) for _, _, p in self._monitored])
                if section.check_replicas else [])
        table = rep.table(mine, self._monitored, section.tied, section.check_replicas,
                          layout=own)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1 and not section.check_replicas:  # no exchange: a rank may run no probe
            self._job_key, self._replicas = own, None
            return
        tables = rep.exchange(table) if world > 1 else [table]
        if tables is None:  # some rank came not: each its own (the warning said so)
            self._job_key, self._replicas = own, None
            return
        keys = [t["layout"] for t in tables]
        self._job_key = own if len(set(keys)) == 1 else layout_key({"ranks": keys})
        self._replicas = rep.ReplicaCheck.build(mine, tables, self._monitored, section.tied)
        if self._replicas is not None:  # each piece's position in the recorded parameters
            rec = {id(p): i for i, p in enumerate(self._params)}
            self._piece_rec = np.array([rec.get(id(p), -1) for p in self._replicas.params],
                                       np.int64)
            held = self._piece_rec >= 0  # the pieces recorded here, and where
            self._piece_at = (held, np.where(held, self._piece_rec, 0))

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def dump_path(self) -> str:
        return self.config.dump_path

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @property
    def has_store(self) -> bool:
        """True once ``start()`` created this rank's store (False on a rank the filter skips)."""
        return self._writer is not None

    def start(self) -> "GradProbe":
        ensure_handler()
        if self._handles:
            return self
        if self._replicas is False:  # once per probe: every rank's table (no collective)
            self._agree_start()
        checking = self._replicas is not None
        selected = rank_selected(self.config.rank)
        self._check_only = False  # hooks only for the replica check: nothing recorded here
        if not selected:
            log.info("grad_probe: rank %d is not in rank filter %s; nothing is recorded",
                     get_rank(), list(self.config.rank))
            if not self._gathers and not checking:
                return self
            self._check_only = not self._gathers
            # gradients gathered whole are gathered by every rank together, and the replica
            # check's digests are gathered from every rank: this rank takes part, writes nothing
        elif not self.config.rank and ddp_first_rank(self.model) is False:
            log.info("grad_probe: rank %d holds the same gradients as the first rank of its DDP "
                     "group, which records them; nothing is recorded here (rank=[...] records "
                     "chosen ranks)%s", get_rank(),
                     "; its replicas are checked against the others'" if checking else "")
            if not checking:
                return self
            selected, self._check_only = False, True
        elif not self._params:
            log.info("grad_probe: rank %d holds only replicas of shards other ranks record; "
                     "nothing is recorded here", get_rank())
            if not checking:
                return self
            selected, self._check_only = False, True
        if self._writer is None and selected:  # the store exists (0 committed steps) once recording starts
            _end_earlier(self)
            section = self.config.grad_probe
            attrs = {"recorded_params": list(self.recorded_names),
                     "grad_point": section.grad_point}
            if self._control is not None:
                attrs.update(control=self._control.spec.name,
                             control_seed=self._control.spec.seed)
            if self._sharded:
                attrs["placement"] = list(self._placement)
            if self._sample is not None:  # sampled sign bits (sampling.py)
                attrs.update(sample=int(section.sample), sample_bits=list(self.layout.bits))
            if self._replicas is not None:  # the replica check's arrays (replicas.py)
                attrs["replica_check"] = self._replicas.attrs(self._params)
            self._writer = GradWriter(self.dump_path, get_rank(), self.layout,
                                      section.grad_level, section.bounds, section.hash,
                                      section.flush_every, section.flush_seconds,
                                      attrs=attrs, significance=section.significance,
                                      storage_options=self.storage_options,
                                      layout_key=self._job_key,
                                      durable=section.durable, overwrite=section.overwrite,
                                      world=_world_size(),
                                      replicas=self._replicas is not None)
            self._run = None
            self._scratch = _stats.Workspace()
        elif self._writer is not None:
            self._writer.reopen()  # started again after stop(): the same run goes on
        if self._writer is not None:
            _RECORDING[id(self)] = self
        optimizers = (self.optimizer if isinstance(self.optimizer, (list, tuple))
                      else [self.optimizer] if self.optimizer is not None else [])
        for opt in optimizers:
            self._owns(opt)
            self._handles.append(opt.register_step_pre_hook(self._pre_step))
            self._handles.append(opt.register_step_post_hook(self._post_step))
        if optimizers and self._writer is not None and not self._owned:
            log.warning("grad_probe: the optimizer given owns none of the %d monitored "
                        "parameters (was it built over another model or a copy of this one?); "
                        "the gradients are taken at its steps all the same",
                        len(self.param_names))
        if not optimizers:
            self._handles.append(register_optimizer_step_pre_hook(self._pre_step))
            self._handles.append(register_optimizer_step_post_hook(self._post_step))
        if self.scaler is not None:
            self._handles.append(_count_calls(self.scaler, "update", self._on_update))
        if self._check_only:
            log.info("grad_probe: rank %d checks its replicas of %d parameters at every step",
                     get_rank(), len(self._replicas.entries))
            return self
        if self._control is not None:  # its forward pre-hook enters autocast before ours reads it
            self._handles.append(self._control.start())
        self._handles.append(self.model.register_forward_pre_hook(_autocast_hook(self)))
        if self.config.grad_probe.grad_point == "backward":
            synced = None
            if ddp_first_rank(self.model) is not None:
                # DDP decides at each forward whether the next backward all-reduces (not inside
                # no_sync): a backward that does not is followed by one that does before the
                # step, so its statistics are not computed
                sync = {"next": True}
                synced = lambda: sync["next"]  # noqa: E731

                def before_forward(module, args):
                    sync["next"] = bool(module.require_backward_grad_sync)

                self._handles.append(self.model.register_forward_pre_hook(before_forward))
            self._tap = BackwardTap(self._params, self._backward_stats, synced)
            self._tap_seconds = 0.0
            self._tap.attach()
            self._handles.append(self._tap)
        log.info("grad_probe: monitoring %d parameters at level %s (gradients %s) into %s",
                 len(self.param_names), self.config.grad_probe.grad_level,
                 "at the end of backward, before clipping" if self._tap is not None
                 else "at the optimizer step", self.dump_path)
        return self

    def stop(self) -> None:
        """Remove the hooks and write every buffered step; log the one-line ``summary`` (when
        this rank records). The run ended cleanly: the next run into the store, unless a
        restart, replaces it (``restarts.plan_run``)."""
        self._stop(clean=True)

    def _stop(self, clean: bool) -> None:
        _RECORDING.pop(id(self), None)
        handles, self._handles = self._handles, []
        try:
            for h in handles:
                h.remove()
        finally:
            try:
                if self._writer is not None:
                    self._writer.close(clean=clean)
            finally:
                if self._scratch is not None:
                    self._scratch.close()  # the pool's threads end with the probe
        if handles and self._writer is not None:
            log.info("%s", self.summary)
            failed = sys.exc_info()[1]     # stop() on the way out of an error
            if self.steps_seen == 0 and failed is not None:
                log.info("grad_probe: the run stopped with an error (%s) before its first "
                         "optimizer step; no step is recorded", type(failed).__name__)
            elif self.steps_seen == 0:
                log.warning("%s", self._no_step_message())

    def _no_step_message(self) -> str:
        msg = ("grad_probe: no optimizer step over the monitored parameters was seen, so no "
               "step is recorded. ")
        if self._ignored_steps:
            return msg + (f"{self._ignored_steps} step(s) of optimizers owning none of the "
                          f"{len(self.param_names)} monitored parameters were ignored: the "
                          "optimizer was built over other parameters (another model, or a copy "
                          "of this one made after it); build it over this model's parameters "
                          "or pass it to the probe")
        return msg + ("Likely cause: optimizer.step() ran outside the probe (before start() or "
                      "after stop(), or outside the `with` block)")

    @property
    def summary(self) -> ProbeSummary:
        """Steps written (all of them after ``stop()``), parameters, bytes of this rank's store,
        where it is and how many parameters never had a gradient at a recorded step
        (``no_grad``); ``str()`` of it is the line ``stop()`` logs."""
        check = self._replicas or None
        replicas = None if check is None else {
            "checked": check.checked, "disagree": check.events()}
        return probe_summary(self._writer, len(self.param_names),
                             no_grad=int((~self._had_grad).sum()), replicas=replicas)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def recipe(self):
        """``with probe.recipe():`` around the lines of the step that the test runs under
        ``torch.autocast`` (the forward and a loss computed outside the model, say): in a
        control run (``control="bf16"``) autocast applies there, as in the test; in any other
        run the block does nothing, so the reference's code and its control's are the same
        code. Without it the control applies its recipe around ``model.forward`` only."""
        if self._control is None:
            return contextlib.nullcontext()
        return self._control.recipe()

    def __enter__(self) -> "GradProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self._stop(clean=exc[0] is None)  # a `with` block left by an exception: a crashed run

    # -- the hooks -------------------------------------------------------------------------
    def _owns(self, optimizer) -> bool:
        if optimizer in self._owners:
            return True
        if optimizer in self._others:
            return False
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        idx = [i for i, p in enumerate(self._params) if id(p) in ids]
        if not idx and self.optimizer is None:
            self._others.add(optimizer)
            return False
        self._owners[optimizer] = idx
        self._owned.update(idx)
        return True

    def _nested(self, outer=False) -> bool:
        """True inside an outer ``step()`` of an optimizer: a subclass whose ``step`` calls
        ``super().step()`` runs the hooks twice, and that is one optimizer step. ``outer``: the
        frame that called the outer call's hook (default: the recording's)."""
        outer = self._step_frame if outer is False else outer
        frame = sys._getframe(2)
        while outer is not None and frame is not None:
            if frame is outer:
                return True
            frame = frame.f_back
        return False

    def _grads(self):
        out = []
        for p in self._params:
            g = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else None
            out.append(g if g is not None else p.grad)
        return out

    def _signature(self, grads):
        return [(weakref.ref(g), g._version) if g is not None else None for g in grads]

    def _fresh(self, grads) -> bool:
        """Did a backward pass run since the last ``step()``? (a gradient is another tensor or
        was modified in place since then)"""
        old = self._grad_sig
        if old is None:
            return True
        for g, o in zip(grads, old):
            if (g is None) != (o is None):
                return True
            if g is not None and (o[0]() is not g or o[1] != g._version):
                return True
        return False

    def _on_update(self) -> None:
        self._updates += 1

    def _post_step(self, optimizer, args, kwargs) -> None:
        # the outer step() call's hooks run in one frame (torch's wrapper): only its post-hook
        # ends the step; the gradients as the update left them are the reference for _fresh
        if optimizer in self._owners and sys._getframe(1) is self._step_frame:
            self._step_frame = None
            self._grad_sig = self._signature(self._grads())

    def _pre_step(self, optimizer, args, kwargs):
        if self._check_only or (self._replicas is not None and not self._owns(optimizer)):
            # an optimizer stepping replicas this rank does not record: the check alone
            if not self._nested(self._check_frame):  # one check per outer step() call
                self._check_frame = sys._getframe(1)
                if self._check_only and self._sharded:
                    self._reduce_pending(optimizer)  # the recording ranks' reductions
                if self._replicas is not None and self._replicas.owned(optimizer).any():
                    self._checks += 1
                    self._replica_step(optimizer, None, ())
                    self._replicas.note(self._checks - 1)
            if self._check_only:
                return None
        if not self._owns(optimizer):
            if self._once(("other-optimizer", id(optimizer))):
                log.debug("grad_probe: ignoring an optimizer that does not own the model's "
                          "parameters")
            self._ignored_steps += 1
            if (self.steps_seen == 0 and self._ignored_steps == IGNORED_STEPS_WARNING
                    and self._writer is not None):
                log.warning("grad_probe: %d optimizer steps so far, none over the %d monitored "
                            "parameters: nothing is recorded. Was the optimizer built over "
                            "other parameters (another model, or a copy of this one)?",
                            self._ignored_steps, len(self.param_names))
            return None
        if self._nested():
            return None
        self._step_frame = sys._getframe(1)
        lead = 1 if args and args[0] is optimizer else 0  # torch passes (self, *args)
        closure = kwargs.get("closure", args[lead] if len(args) > lead else None)
        if callable(closure):
            # the step computes its gradients in the closure (LBFGS): take them from its first
            # evaluation, which the update uses, instead of the stale ones before it
            state = {"done": False}

            def recording_closure(*a, **k):
                loss = closure(*a, **k)
                if not state["done"]:
                    state["done"] = True
                    self._capture(optimizer)
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": recording_closure}
            return (*args[:lead], recording_closure, *args[lead + 1:]), kwargs
        self._capture(optimizer)
        return None

    def _capture(self, optimizer) -> None:
        """Take the gradients of ``optimizer``'s parameters into the current iteration.

        Iterations: one ``step()`` of an optimizer that already stepped in the current
        iteration begins the next one; steps taken on the gradients of the same backward pass
        (no gradient changed in between) belong to the same iteration, whichever optimizer
        stepped first. With a ``GradScaler`` the iteration is the number of its ``update()``
        calls, so steps it skipped stay in place (as steps where no gradient is present)."""
        if self._run is None and self._writer is not None:
            self._begin_run(optimizer)  # once: reads the store (not in the hook's time)
        t0 = time.perf_counter()
        grads = self._grads()
        if self._fresh(grads):
            self._epoch += 1
        self._grad_sig = self._signature(grads)
        mine = set(self._owners.get(optimizer, ()))
        mine.update(i for i in range(len(grads)) if i not in self._owned)  # owned by none
        raw = []
        if self._tap is not None:  # grad_point "backward": the newest backward's statistics
            pending = self._tap.pending()
            raw = [i for i in sorted(mine) if grads[i] is not None and pending[i]]
            self._tap.attach()  # parameters unfrozen since the last step
        live = mine.difference(raw)  # the others are taken here, as at grad_point "step"
        part = [g if i in live else None for i, g in enumerate(grads)]
        if self._sharded:  # DTensor: this rank's shards (gathered whole where no placement)
            part = self._local_grads(part, optimizer)
            if self._writer is None:  # a rank outside the rank filter: gathered, not recorded
                if self._replicas is not None and self._replicas.owned(optimizer).any():
                    self._replica_step(optimizer, None, ())
                    self._replicas.note(self.steps_seen)
                return
        if mine and all(grads[i] is None for i in mine) and self._once("no-grad-at-all"):
            log.warning("%s", self._no_grad_message(mine))
        for i in sorted(mine):
            if grads[i] is None and self._params[i].requires_grad and self._once(
                    ("no-grad", i)):
                log.info("grad_probe: %s has no gradient at step %d (skipped; logged once)",
                         self.param_names[i], self.steps_seen if self._iter is None
                         or id(optimizer) in self._iter["stepped"] else self._iter["step"])
        stats = self._statistics(part)
        extra = 0.0
        if self._tap is not None:
            # kept for a parameter no optimizer seen so far owns: its own may step next
            views = self._tap.take(raw, self._owners.get(optimizer, ()))
            if views:
                stats = _stats.merge([stats, *views], self.layout)
            extra, self._tap_seconds = self._tap.seconds - self._tap_seconds, self._tap.seconds
        if self._replicas is not None and self._replicas.owned(optimizer).any():
            self._replica_step(optimizer, stats, live)  # one all-gather: every replica's digest
        key = id(optimizer)
        cur = self._iter
        if cur is None or key in cur["stepped"] or (
                self.scaler is not None and self._updates > cur["step"]):
            moved = []
            if cur is not None and self.scaler is None:
                moved = [c for c in cur["captures"] if c[1] == self._epoch]
                if moved:  # steps of the same backward pass belong to the new iteration
                    cur["captures"] = [c for c in cur["captures"] if c[1] != self._epoch]
                    self._emit(cur, amend=True)
            step = self._updates if self.scaler is not None else self.steps_seen
            if self.scaler is not None:
                for skipped in range(self.steps_seen, step):  # steps GradScaler skipped
                    self._emit({"step": skipped, "captures": [], "stepped": set()})
            self.steps_seen = step + 1
            cur = self._iter = {"step": step, "captures": moved,
                                "stepped": {c[0] for c in moved}}
            cur["captures"].append((key, self._epoch, stats))
            cur["stepped"].add(key)
            self._emit(cur)
        else:
            cur["captures"].append((key, self._epoch, stats))
            cur["stepped"].add(key)
            self._emit(cur, amend=True)
        if self._replicas is not None:
            self._replicas.note(cur["step"])
        # the step's hook time includes the statistics taken at the backward passes before it
        self.hook_seconds.append(time.perf_counter() - t0 + extra)

    def _local_grads(self, part, optimizer):
        """This rank's shards of the gradients ``part`` (``placement.local_grad``), the pending
        reductions of ``_reduce_pending`` taken from it."""
        reduced = self._reduce_pending(optimizer)
        return [None if g is None else reduced[id(p)] if id(p) in reduced
                else local_grad(g, p, pl)
                for g, p, pl in zip(part, self._params, self._placement)]

    def _reduce_pending(self, optimizer) -> dict:
        """{id(parameter): its reduced local gradient} for the DTensor parameters stepped by
        ``optimizer`` whose gradient's placement is not theirs (a sequence-parallel norm's
        ``Partial``: the reduction the optimizer's own ops do later). Every rank holding such
        a parameter reduces it here, recording it or not, in the order of the monitored
        parameters, so each collective has all its members (a rank recording nothing but
        holding replicas calls this at every step too)."""
        ids = self._opt_ids.get(optimizer)
        if ids is None:
            ids = self._opt_ids[optimizer] = {id(p) for g in optimizer.param_groups
                                              for p in g["params"]}
        reduced = {}
        for _, _, p in self._monitored:
            if id(p) not in ids or not is_dtensor(p):
                continue
            g = self._grad_of(p)
            if (g is None or not is_dtensor(g) or tuple(g.placements) == tuple(p.placements)
                    or dtensor_placement(p) is None):
                continue
            with torch.no_grad():
                reduced[id(p)] = g.redistribute(g.device_mesh, p.placements).to_local()
        return reduced

    @staticmethod
    def _grad_of(p):
        g = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else None
        return g if g is not None else p.grad

    def _replica_step(self, optimizer, stats, live) -> None:
        """The replica check of one optimizer step (``replicas.ReplicaCheck.run``): its codes go
        into ``stats`` (the recorded parameters' ``replicas``, ``replica_rank``,
        ``replica_gap``). The gradients' max and min come from ``stats`` where it holds them
        (``grad_point="step"``, taken at this step: ``live``)."""
        check = self._replicas
        grads = [self._grad_of(p) for p in check.params]
        if check.has_dtensors:  # a DTensor's gradient: its local tensor, or still pending
            grads = [(local_tensor(g) if tuple(g.placements) == tuple(p.placements)
                      else "partial") if g is not None and is_dtensor(g) else g
                     for g, p in zip(grads, check.params)]
        rec = self._piece_rec
        known = None
        if stats is not None and self.config.grad_probe.grad_point == "step" and rec.size:
            held, at = self._piece_at
            took = np.zeros(len(self._params), bool)
            took[list(live)] = True
            have = held & took[at] & np.asarray(stats.present, bool)[at]
            if check.has_dtensors:
                have &= np.array([not isinstance(g, str) for g in grads], bool)
            known = (have, np.asarray(stats.max)[at], np.asarray(stats.min)[at])
        got = check.run(optimizer, grads, known)
        if stats is None:
            return
        n = len(self._params)
        stats.replicas = np.zeros(n, np.uint8)
        stats.replica_rank = np.full(n, -1, np.int64)
        stats.replica_gap = np.full(n, np.nan)
        on = (rec >= 0) & (got["code"] > 0)
        stats.replicas[rec[on]] = got["code"][on]
        stats.replica_rank[rec[on]] = got["other"][on]
        stats.replica_gap[rec[on]] = got["gap"][on]

    def _no_grad_message(self, idx) -> str:
        """The warning for an optimizer step at which none of the parameters ``idx`` it takes has
        a gradient (logged once): the likely cause, from the parameters' state."""
        n = len(idx)
        step = self.steps_seen if self._iter is None else self._iter["step"]
        frozen = sum(not self._params[i].requires_grad for i in idx)
        msg = (f"grad_probe: none of the {n} monitored parameters stepped by the optimizer has a "
               f"gradient at step {step}; their statistics are empty (NaN). ")
        if frozen == n:
            return msg + ("They are all frozen (requires_grad=False): unfreeze them, or monitor "
                          "the trainable ones (param_list)")
        return msg + ("Likely cause: the backward pass did not reach them (the loss came from "
                      "another model or a copy, ran under torch.no_grad, or backward() ran "
                      "outside the probe's model), or the gradients were cleared "
                      "(zero_grad) before optimizer.step()")

    def _begin_run(self, optimizer) -> None:
        """This recording's first step and what it supersedes in the store (``restarts.
        plan_run``), decided once for the job: by the first rank to get here, the others take
        its decision from torch.distributed's store (one key, no collective)."""
        section = self.config.grad_probe
        inferred = _optimizer_step(optimizer) if section.start_step is None else None
        why_restart = _restart_reason(section, optimizer, inferred)

        def decide(scope):
            return plan_run(self.dump_path, start=section.start_step, inferred=inferred,
                            why=f"the step count of {type(optimizer).__name__}'s state",
                            overwrite=section.overwrite, scope=scope, rank=get_rank(),
                            storage_options=self.storage_options or None,
                            sample=int(section.sample) if self._sample is not None else 0,
                            restart=bool(why_restart), why_restart=why_restart)

        run = agree("grads", self._writer.store_url, decide, GradStoreError)
        self._run = run
        start = int(run["start"])
        self.steps_seen = start
        if self.scaler is not None:
            self._updates = start
        self._writer.begin(run)
        held = run.get("held")
        if run.get("replaced"):
            log.info("grad_probe: %s held steps %d..%d of a run that ended cleanly; this run "
                     "is not a restart, so it replaces them (resume=True continues a store)",
                     self.dump_path, *run["replaced"])
        elif held and run.get("from") is None:
            log.info("grad_probe: %s held steps %d..%d; overwrite=True: this run replaces them",
                     self.dump_path, *held)
        elif held:
            gone = "" if start > held[1] else (
                f"; steps {max(start, held[0])}..{held[1]} recorded before are superseded "
                "by this run's")
            log.info("grad_probe: %s holds steps %d..%d; this run (a restart: %s) records from "
                     "step %d (%s)%s", self.dump_path, held[0], held[1], run.get("restart"),
                     start, run.get("how"), gone)

    def _statistics(self, part, bounds=None):
        """``stats.compute`` of this rank's gradients ``part``: the shards' significance scale
        reduced over their mesh groups, the autocast dtype of the latest forward."""
        section = self.config.grad_probe
        reduce = (self._reduce_amax if section.significance and section.grad_level != "L0"
                  else None)
        with torch.no_grad(), _paused():
            return _stats.compute(part, self.layout, section.grad_level,
                                  section.bounds if bounds is None else bounds, section.hash,
                                  self._scratch, section.significance, reduce,
                                  self._compute_dtype, sample=self._sample)

    def _backward_stats(self, idx):
        """``grad_point="backward"``: the statistics of parameters ``idx`` as the backward pass
        that just ended left them (``BackwardTap``), unscaled by the ``GradScaler``'s scale when
        ``scaler=`` was given; None on a rank that records nothing."""
        grads = self._grads()
        want = set(idx)
        part = [g if i in want else None for i, g in enumerate(grads)]
        if self._sharded:
            part = [local_grad(g, p, pl)
                    for g, p, pl in zip(part, self._params, self._placement)]
        if self._writer is None:
            return None
        section = self.config.grad_probe
        scale = 1.0
        if self.scaler is not None and self.scaler.is_enabled():
            scale = float(self.scaler.get_scale())
        bounds = section.bounds if scale == 1.0 else tuple(b * scale for b in section.bounds)
        stats = self._statistics(part, bounds)
        if scale != 1.0:
            _unscale(stats, scale, [g is not None and g.dtype == torch.float32 for g in part])
        return stats

    def _emit(self, it, amend: bool = False) -> None:
        step = it["step"]
        if self._writer is None or (self.config.step and step not in self.config.step):
            return
        parts = [c[2] for c in it["captures"]]
        if not parts:
            section = self.config.grad_probe
            parts = [_stats.compute([None] * len(self._params), self.layout, section.grad_level,
                                    section.bounds, section.hash, self._scratch,
                                    section.significance)]
        stats = parts[0] if len(parts) == 1 else _stats.merge(parts, self.layout)
        self._had_grad |= np.asarray(stats.present, bool)
        if not amend:
            self._writer.append(step, stats)
        elif not self._writer.amend(step, stats) and self._once(("late", step)):
            log.warning("grad_probe: step %d was already written when another optimizer stepped "
                        "in the same iteration; those gradients are not in it", step)

    # -- results ---------------------------------------------------------------------------
    def dataset(self, chunks=None):
        """The recorded (committed) steps of this rank as an xarray Dataset; flushes first."""
        from ..store.sources import open_grads

        self.flush()
        if self._sharded:  # the whole model from every rank's committed shards
            return open_grads(self.dump_path, chunks=chunks,
                              storage_options=self.storage_options or None)
        return open_grads(self.dump_path, rank=get_rank(), chunks=chunks,
                          storage_options=self.storage_options or None)

    def __repr__(self) -> str:
        state = "recording" if self._handles else "stopped"
        return (f"GradProbe({len(self.param_names)} params, level="
                f"{self.config.grad_probe.grad_level}, steps seen={self.steps_seen}, "
                f"dump_path={self.dump_path!r}, {state})")


#: the probes of this process whose run is open (started, not stopped), by id
_RECORDING: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _store_key(dump_path: str) -> str:
    path = str(dump_path)
    return path.rstrip("/") if "://" in path else os.path.realpath(path)


def _end_earlier(probe) -> None:
    """Stop the probes of this process still recording into the store ``probe`` is about to
    record into (a notebook cell run again, whose probe was never stopped: msprobe's loop ends a
    recording only at ``close()``). That is a re-run, not a crash: the earlier probe's hooks are
    removed and its steps written, its run ends cleanly, and the new run replaces it as any
    re-run does (or continues it, if it is a restart)."""
    mine = _store_key(probe.dump_path)
    for other in list(_RECORDING.values()):
        if other is probe or other._writer is None or _store_key(other.dump_path) != mine:
            continue
        log.warning("grad_probe: a probe of this process was still recording into %s (started "
                    "and never stopped, as when a notebook cell runs again); it is stopped now, "
                    "and this probe's run follows it", probe.dump_path)
        other._stop(clean=True)


def _sample_plan(section, places, params, numels):
    """(per parameter the positions of its sampled elements in the recorded tensor or None for
    all of them, bits recorded per parameter) for ``grad_probe.sample`` (``sampling.py``:
    chosen by global index, so a shard records its part of the whole parameter's sample);
    (None, None) when every element is recorded."""
    k = section.sample if section.grad_level != "L0" else 0
    if not k:
        return None, None
    from ..numerics.sampling import samples_in_box

    sample, nbits = [], []
    for place, p, n in zip(places, params, numels):
        if place:
            gshape, off, ext = place["global_shape"], place["offset"], place["local_shape"]
        else:
            gshape = tuple(p.shape)
            off, ext = (0,) * len(gshape), gshape
        _, pos = samples_in_box(gshape, k, off, ext)
        whole = pos.size == n
        sample.append(None if whole else pos)
        nbits.append(n if whole else int(pos.size))
    if all(x is None for x in sample):
        return None, None
    return sample, tuple(nbits)


def _paused():
    """The control's rounding stays out of the probe's own statistics."""
    from .control import paused

    return paused()


def _autocast_hook(probe):
    """A forward pre-hook noting whether the model runs under autocast, and in which dtype:
    the gradients of an autocast forward were computed in it, so their significance threshold
    is that dtype's (``stats.significance_unit``). Kept out of compiled graphs."""
    ref = weakref.ref(probe)

    def note(module, args):
        p = ref()
        if p is None:
            return
        device = _device_type(module)
        p._compute_dtype = (torch.get_autocast_dtype(device)
                            if torch.is_autocast_enabled(device) else None)

    return torch.compiler.disable(note)


def _device_type(module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _unscale(stats, scale: float, fp32) -> None:
    """Statistics of gradients scaled by ``scale`` -> those of the gradients ``GradScaler``'s
    ``unscale_`` gives: each element times ``inv = float32(1 / scale)``, so the max and min are
    ``max * inv`` (rounded to float32 for a float32 gradient, ``fp32[i]``: rounding is
    monotonic) and the norm is ``norm * inv``; the signs, zeros and significance bits do not
    change, and the intervals were counted against ``bounds * scale``. Exact for a power-of-two
    scale (GradScaler's default 2**16, growth 2, backoff 0.5), the last bits of the norm aside."""
    inv = np.float64(np.float32(1.0 / np.float64(scale)))
    fp32 = np.asarray(fp32, bool)
    for name in ("max", "min"):
        v = getattr(stats, name) * inv  # a float32 times a float32: exact in float64
        with np.errstate(over="ignore"):
            v[fp32] = v[fp32].astype(np.float32)
        setattr(stats, name, v)
    stats.norm = stats.norm * inv


class _CallCounter:
    """A removable wrapper counting calls of ``obj.name`` (an instance attribute over the class
    method; ``remove()`` deletes it)."""

    def __init__(self, obj, name, callback) -> None:
        self.obj, self.name = obj, name
        method = getattr(obj, name)

        def counted(*args, **kwargs):
            out = method(*args, **kwargs)
            callback()
            return out

        setattr(obj, name, counted)

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def _count_calls(obj, name, callback) -> _CallCounter:
    return _CallCounter(obj, name, callback)


def _restart_reason(section, optimizer, inferred) -> str:
    """Why this run is a restart of a recording ("" when it is not): ``resume=True``,
    ``start_step``, torchelastic's restart count, or an optimizer whose state was restored from
    a checkpoint (a step count above 0, or state of an optimizer that keeps no count)."""
    if section.resume:
        return "resume=True"
    if section.start_step is not None:
        return "start_step"
    if restart_count() > 0:
        return f"an elastic restart (TORCHELASTIC_RESTART_COUNT={restart_count()})"
    if inferred:
        return f"{type(optimizer).__name__}'s state is at step {inferred} (resumed)"
    if inferred is None and any(getattr(optimizer, "state", {}).values()):
        return f"{type(optimizer).__name__} has state before its first step (resumed)"
    return ""


def _optimizer_step(optimizer):
    """The number of steps ``optimizer`` took, from the ``step`` its state keeps per parameter
    (Adam, AdamW, RMSprop, Adagrad...; restored with a checkpoint's optimizer state): the index
    of the step about to be taken, in the pre-step hook. None for an optimizer keeping none."""
    steps = []
    for state in getattr(optimizer, "state", {}).values():
        value = state.get("step") if isinstance(state, dict) else None
        if value is None:
            continue
        try:
            steps.append(int(float(value)))
        except (TypeError, ValueError):
            continue
    if steps:
        return max(steps)
    return 0 if getattr(optimizer, "state", None) is not None and _keeps_steps(optimizer) \
        else None


def _keeps_steps(optimizer) -> bool:
    """An optimizer of a kind that counts steps in its state, before its first step (empty
    state): its step is 0."""
    from torch import optim

    kinds = tuple(getattr(optim, n) for n in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam",
                                              "RMSprop", "Adagrad", "Adadelta", "ASGD",
                                              "Rprop", "SparseAdam") if hasattr(optim, n))
    return isinstance(optimizer, kinds) and not any(optimizer.state.values())


def _world_size():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None
