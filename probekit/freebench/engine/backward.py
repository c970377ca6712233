"""fuzz_stage "backward": check the input gradients an API produces, without touching the real ones.

At the forward call we keep the API's inputs (references, with their version counters) and, where
``realgrad.plan`` can tell them apart, hook the autograd nodes that hand each input its gradient
from this call. In the real backward pass:

1. the upstream gradient ``g`` is read as the call's last node receives it (a node pre-hook: after
   any hook on the output tensor), and the input gradients as those nodes compute them: the
   reference is the gradient the training really used (elsewhere, ``g`` is read by a hook on the
   first differentiable output and the reference recomputed on detached copies of the inputs);
2. the API is re-run on the perturbed inputs and their gradients taken with
   ``torch.autograd.grad`` and the same ``g`` (change_value: the output gradient is swapped like
   the output and the input gradient swapped back); a call with a large output is re-run block
   by block (``blocks.plan``, ``_blocked``), so one block's upcast inputs and gradients exist at
   a time;
3. the gradients are compared input by input (``output_index`` = the input's position in the
   call's flattened arguments) relative to the reference gradient's scale (``grad_stats``), with
   the error model of ``scales.py`` with the dtype the forward call computed in (under autocast the
   gradients of a bf16 op arrive as fp32 tensors but were computed in bf16) and each gradient's
   own ``S`` (the backward on absolute values with ``|g|``, or a family's formula), on the device;
   the verdict is read back at the step's gather point (``deferred.py``). Every hook returns
   ``None``, so the gradient flowing on is the real one.

A call that draws from a generator (a dropout, attention with dropout) is re-run on the random
stream of its forward call (``rng.py``): the states saved just before it are set for each re-run
in the backward pass and the training's current ones set back afterwards, so the perturbed
re-run draws the forward call's mask and the training's stream does not move.

An input modified in place between the call and its backward cancels the check. For APIs with
several differentiable outputs, the check covers the gradient flowing through the first one.
Hooks still pending are removed when the probe stops.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.overrides import has_torch_function

from . import autocast, blocks, realgrad, state
from ..judge import cause, handlers, saved, scales
from ..perturb import perturb
from ..judge.deferred import combine
from ..judge.guards import detached, grad_mode, modes_off, no_autocast
from ..judge.judging import count_scale
from ..judge.metric import device_stats
from ..names import call_site


#: autograd's engine entry point behind ``torch.autograd.grad`` (None where this torch has none)
_run_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


def _grad(y: torch.Tensor, inputs: list, g: torch.Tensor) -> tuple:
    """``torch.autograd.grad(y, inputs, g, allow_unused=True)``: the same engine call, without
    the wrapper's argument normalisation and checks (the checks run with every function mode
    popped), ~7 µs a call on this CPU (issue 38). The wrapper (its checks and errors) unless
    ``y`` and ``g`` are plain dense tensors of one dtype and shape and no input overrides torch
    functions (the wrapper dispatches to a tensor subclass), or where this torch has no such
    entry point."""
    if _run_backward is None or type(y) is not torch.Tensor or type(g) is not torch.Tensor or \
            y.is_nested or g.dtype != y.dtype or g.shape != y.shape or \
            has_torch_function(tuple(inputs)):
        return torch.autograd.grad(y, inputs, g, allow_unused=True)
    return _run_backward((y,), (g,), False, False, tuple(inputs), True, accumulate_grad=False)


def grad_stats(gr: torch.Tensor, gq: torch.Tensor, exact: bool, scale=None, verdicts=None,
               whole: bool = True) -> tuple:
    """``metric.device_stats`` of a reference gradient (or a block of it) and the perturbed one:
    the deviation relative to the gradient tensor's own scale (``max|gr|``; blocks combine to the
    whole tensor's), or to ``scale`` element by element (the error model's, ``scales.py``: the
    gradient's magnitude ``S``, or ``(S, lam)`` for the two terms ``|gq| + lam S``). With
    ``verdicts``, through ``Verdicts.stats`` (never left inconclusive, ``deferred.py``)."""
    lam = 0.0
    if isinstance(scale, tuple):
        scale, lam = scale
    if verdicts is not None:
        return verdicts.stats(detached(gr), detached(gq), scale, exact, whole, lam)
    return device_stats(detached(gr), detached(gq), scale, exact, lam)


#: APIs whose gradient goes to the elements they select (a maximum, a pooling window's largest
#: value): under a one-ulp input change a tie (frequent in bf16) can break the other way and the
#: gradient moves to another element whole. That is the sensitivity of a choice, not a loss of
#: precision, so the sensitivity modes (bit_noise, add_noise, change_value) do not check their
#: gradients (the upcast modes and no_change do)
SELECTION = frozenset("""
max min amax amin maximum minimum fmax fmin max_pool1d max_pool2d max_pool3d
max_pool1d_with_indices max_pool2d_with_indices max_pool3d_with_indices adaptive_max_pool1d
adaptive_max_pool2d adaptive_max_pool3d fractional_max_pool2d fractional_max_pool3d
fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices _fractional_max_pool2d
_fractional_max_pool3d median
nanmedian mode cummax cummin kthvalue topk sort msort
""".split())


def watch(engine, call, key, n, name, func, leaves, spec, frame):
    """Run the call; hook its first differentiable output for a backward check (and, where
    ``realgrad.plan`` allows, the nodes that hand its inputs their real gradients)."""
    if call.info.name in SELECTION and not (engine.mode.upcast or engine.mode.exact):
        engine.note_skip("selection", key, name)
        return func(*call.args, **call.kwargs)
    mark = realgrad.marker()
    if call.replay is not None:  # a random call (or one watched: rng.py): the re-runs in the
        call.replay.save()       # backward pass replay this stream, the forward call's mask
    out, call.compute = autocast.run(engine.inner_dtypes, call.info.name, func, call.args,
                                     call.kwargs, leaves)
    try:
        with modes_off():
            base = call.rerun or func   # an in-place call: re-run out of place (state.py)
            rerun = base if call.replay is None else call.replay.bind(base)
            if rerun is None:    # it drew, and its draws cannot be replayed: skipped
                return out
            if rerun is base:    # it draws nothing
                call.replay = None
            outs = handlers.float_outputs(out, complex_=True)   # (an FFT's: issue 34)
            if not outs:
                engine.note_skip("no_float_output", key, name)
                return out
            diff = [i for i, x in enumerate(leaves) if perturb.is_float(x) and x.requires_grad]
            with_grad = [(i, t) for i, t in outs if t.requires_grad]
            if not diff or not with_grad or not torch.is_grad_enabled():
                engine.note_skip("no_grad", key, name)
                return out
            sel = with_grad[0]
            check = _BackwardCheck(engine, call, key, n, name, rerun, leaves, spec, diff, sel[0],
                                   call_site(frame), engine.step)
            check.call_func = func
            x = autocast.first_tensor(leaves)
            check.autocast = (x.device.type, autocast.enabled_dtype(x.device))
            check.module = engine.current_module()  # the module running at the forward call
            check.out_dtype = sel[1].dtype
            # the output its backward reads, when it keeps it (saved.py): the accuracy modes'
            # re-run reads this one too, as the kernel was handed it
            check.handed = sel[1].detach() if saved.saves_output(sel[1]) else None
            #: the dtype its gradients are judged in (autocast's for a call with fp32 outputs
            #: that computed in it: ``autocast.run``)
            check.compute_dtype = call.compute or check.out_dtype
            check.n_outs = len(outs)
            engine.watching.append(check)   # counted as no_gradient if it never runs
            # the real input gradients only when no other output carries gradients into them
            edges = realgrad.plan(sel[1], leaves, diff, mark) if len(with_grad) == 1 else None
            if edges is None:
                engine.handles.append(sel[1].register_hook(check))
            else:
                # the upstream gradient as the call's last node receives it (after every hook
                # on the output tensor, which may change it), then the inputs' real gradients;
                # one entry per watched call in ``handles``
                handles = realgrad.Handles([sel[1].grad_fn.register_prehook(
                    realgrad.upstream(sel[1].output_nr, check.upstream))])
                for node, hook in realgrad.Collector(edges, check.with_real).hooks():
                    handles.append(node.register_hook(hook))
                engine.handles.append(handles)
    except Exception as exc:  # never reaches the training code
        engine.failed(key, name, exc)
    return out


def _parts(mag) -> tuple:
    """A gradient's scale material as a tuple (``(Q, K)`` of a counted call, else ``(S,)``)."""
    return mag if isinstance(mag, tuple) else (mag,)


class _BackwardCheck:
    def __init__(self, engine, call, key, n, name, func, leaves, spec, diff, out_index, site,
                 step):
        self.engine = engine
        self.call = call
        self.key = key
        self.n = n
        self.name = name
        self.func = func
        #: the API itself (``func`` may be its replay-bound wrapper): its argument names
        self.call_func = func
        self.call_name = ""
        self.leaves = leaves
        self.spec = spec
        self.diff = diff
        self.versions = [leaves[i]._version for i in diff]
        self.out_index = out_index
        self.site = site
        self.step = step
        #: (device type, autocast dtype or None) at the forward call: the re-runs use the same
        self.autocast = None
        self.module = ""
        self.out_dtype = None
        self.compute_dtype = None
        self.n_outs = 0
        #: with ``realgrad``: the upstream gradient, kept until the real input gradients arrive
        self.g = None
        #: each compared input's error-model family, reduction length and whether its family's
        #: formula applies (``scales.py``), and its ``Judge`` for the scales (set per check)
        self.plan = None
        self.judges = None
        #: the forward output the call's backward reads (``saved.saves_output``), else None
        self.handed = None

    def __call__(self, grad):
        """The hook on the output (reference recomputed): the upstream gradient arrives."""
        self._run(grad, None)
        return None

    def upstream(self, grad) -> None:
        """The upstream gradient, kept until the real input gradients arrive (``with_real``)."""
        if self.leaves is not None and grad is not None:
            self.g = detached(grad)

    def with_real(self, grads: dict) -> None:
        """``realgrad.Collector``'s callback: the real input gradients arrived."""
        g, self.g = self.g, None
        if g is not None:
            self._run(g, grads)

    def _run(self, grad, real):
        e = self.engine
        if self.leaves is None or e.busy:
            return
        e.busy = True
        t0 = time.perf_counter() if e.budget is not None else 0.0
        try:
            with modes_off():
                self._check(grad, real)
        except perturb.Cancel as exc:
            e.cancelled(self.key, self.name, str(exc))
        except Exception as exc:  # never reaches the training code
            e.failed(self.key, self.name, exc)
        finally:
            e.busy = False
            self.leaves = self.call = self.handed = None  # release the inputs
            if e.budget is not None:
                e.budget.spent(time.perf_counter() - t0)

    def _output(self, out):
        for i, t in handlers.float_outputs(out, complex_=True):
            if i == self.out_index:
                return t
        raise RuntimeError("the re-run did not produce the hooked output")

    def _plan(self, plain, g):
        """A ``blocks.Plan`` for re-running this call block by block, or None: the call has one
        floating output, and every compared input gradient either comes block by block (the
        input is sliced with the output) or, in upcast modes only, is the sum of the blocks'
        (weights, biases: accumulated in float64, well within the threshold of the original
        dtype)."""
        if self.n_outs != 1 or g.numel() <= blocks.BLOCK or self.call.replay is not None:
            return None   # (a random call's mask is drawn whole)
        a, kw = perturb.unflatten(plain, self.spec)
        plan = blocks.plan(self.engine.mode_name, self.call.info, a, kw, plain,
                           [(self.out_index, g)])
        if plan is None:
            return None
        sliced = {i for i, _ in plan.split}
        if not self.engine.upcast_mode and any(i not in sliced for i in self.diff):
            return None
        return plan

    def _rerun(self, leaves, g, handed=None):
        """Perturb ``leaves``, re-run the API with autograd and return (input gradients for
        ``diff``, Perturbed) with upstream gradient ``g``. ``handed``: the forward output the
        real backward read (``saved.py``); an upcast re-run whose backward reads its own output
        reads this one instead, so that the kernel is measured on the inputs it was given."""
        e = self.engine
        with grad_mode(False):
            pert = perturb.apply(e.mode_name, perturb.Call(self.call.info, *perturb.unflatten(
                leaves, self.spec), self.call.fuzz_device), leaves, self.spec)
        p_leaves = list(pert.new)   # (= flatten(pert.args, pert.kwargs): the same leaves)
        replaced = pert.replaced
        p_in = []
        for i in self.diff:
            x = p_leaves[i]
            x = (x if i in replaced else x.detach()).requires_grad_(True)
            p_leaves[i] = x
            p_in.append(x)
        pa, pkw = perturb.unflatten(p_leaves, self.spec)
        with no_autocast(e.upcast_mode):
            yp = self._output(self.func(*pa, **pkw))
        if handed is not None and e.upcast_mode and saved.saves_output(yp):
            saved.hand(yp, handed)
        gp_out = g if g.dtype == yp.dtype and g.device == yp.device else \
            g.to(dtype=yp.dtype, device=yp.device)
        if pert.post is not None:
            gp_out = pert.post(gp_out)
        # the backward without autocast, as the real one runs (autocast applies to the ops of a
        # backward run while it is on: an upcast re-run's gradients would be bf16 again)
        with no_autocast(True):
            grads = list(_grad(yp, p_in, gp_out))
            mags = self._magnitudes(p_leaves, gp_out)
        return grads, mags, pert

    def _magnitudes(self, p_leaves, gp_out):
        """What each compared gradient's scale is made of (None: the tensor's scale) where its
        ``Judge`` needs one (accuracy modes): the backward on squared inputs with ``g^2`` for
        the data-aware bound of the multilinear and arithmetic families (``(Q, K)``, ``K`` the
        terms per element of a counted one), ``S`` from a formula for softmax, normalisations
        and attention (``magnitudes.py``)."""
        if not any(j.kind != scales.TENSOR for j in self.judges.values()):
            return None
        got = cause.backward_magnitudes(self.func, self.call.info.name, p_leaves, self.spec,
                                        self.diff, self.out_index, detached(gp_out), self.judges,
                                        fast=True)
        return [got.get(i) for i in self.diff]

    def _scale(self, i, gq, mag):
        """The per-element scale of input ``i``'s gradient: ``S``, ``(S, lam)`` for a 16-bit
        call's ``|gq| + lam S``, or the data-aware bound's ``sqrt(Q + dlam gq^2)`` (``count``:
        its per-element form) (``scales.Judge``); None when it is judged against the tensor's
        scale."""
        j = self.judges.get(i)
        if j is None or j.kind == scales.TENSOR or mag is None:
            return None
        if j.source == "data":
            return mag.addcmul_(gq, gq, value=j.dlam).sqrt_()
        if j.source == "count":
            return count_scale(j, gq, *mag)
        # the two terms |gq| + lam S are made chunk by chunk by the comparison (grad_stats)
        return mag if not j.lam else (mag, j.lam)

    def _no_scale(self, i) -> None:
        """Input ``i``'s gradient is compared with the tensor's scale. When its ``Judge`` wanted
        ``S`` and none was made, it is judged as family ``other`` (the tensor's scale) from now
        on; a sensitivity mode's ``Judge`` compares with the tensor's scale anyway and keeps the
        family, so that the float64 analysis measures the move against the call's own ``S``
        (``cause.py``, issue 26), as in the accuracy modes."""
        j = self.judges.get(i)
        if j is None or j.kind != scales.TENSOR or j.upcast:
            self.plan[i] = ("other",) + self.plan[i][1:]

    def _whole(self, plain, g, g_ref, exact):
        """(values, [(input position, reference gradient)], dtype computed in) of one re-run."""
        e = self.engine
        g_pert, mags, pert = self._rerun(plain, g, self.handed)
        e.applied(self.key, self.name)
        replaced, in_dtype = pert.replaced, pert.in_dtype
        del pert  # the re-run's inputs go before the comparisons
        values, originals = [], []
        with grad_mode(False):
            for k, (i, gr) in enumerate(zip(self.diff, g_ref)):
                gq, g_pert[k] = g_pert[k], None
                if gr is None or gq is None:
                    continue
                if e.mode.swap_back and i in replaced and gq.dim() >= 1:
                    gq = perturb.swap_last(gq)
                sc = self._scale(i, gq, None if mags is None else mags[k])
                if sc is None:
                    self._no_scale(i)
                values.append(grad_stats(gr, gq, exact, sc, e.verdicts))
                originals.append((i, gr))
                del gq, sc
        return values, originals, in_dtype

    def _blocked(self, plan, plain, g, g_ref, exact):
        """``_whole`` block by block (``plan``): one block's perturbed inputs, output and
        gradients exist at a time. A sliced input's gradient is compared per block against the
        same slice of the reference, with the floor of the whole reference; a whole input's
        gradient is summed over the blocks in float64 and compared once."""
        sliced = dict(plan.split)
        parts = {i: [] for i in self.diff}
        acc: dict = {}
        acc_mag: dict = {}
        in_dtype = None
        for start, length in plan.parts:
            g_pert, mags, pert = self._rerun(
                plan.leaves(plain, start, length), plan.output(g, start, length),
                None if self.handed is None else plan.output(self.handed, start, length))
            in_dtype = pert.in_dtype
            del pert
            with grad_mode(False):
                for k, (i, gr) in enumerate(zip(self.diff, g_ref)):
                    gq, g_pert[k] = g_pert[k], None
                    mag = None if mags is None else mags[k]
                    if gr is None or gq is None:
                        continue
                    if i in sliced:
                        sc = self._scale(i, gq, mag)
                        if sc is None:
                            self._no_scale(i)
                        parts[i].append(grad_stats(gr.narrow(sliced[i], start, length), gq,
                                                   exact, sc, self.engine.verdicts, False))
                    elif i in acc:
                        acc[i].add_(gq)
                        if mag is not None:   # S, Q and K all add up over the blocks
                            for have, m in zip(_parts(acc_mag[i]), _parts(mag)):
                                have.add_(m)
                    else:
                        acc[i] = gq.to(torch.float64, copy=True)
                        if mag is not None:
                            acc_mag[i] = tuple(m.to(torch.float64, copy=True)
                                               for m in _parts(mag))
                            if not isinstance(mag, tuple):
                                acc_mag[i] = acc_mag[i][0]
                    del gq, mag
        self.engine.applied(self.key, self.name)
        values, originals = [], []
        with grad_mode(False):
            for i, gr in zip(self.diff, g_ref):
                if gr is None:
                    continue
                if i in sliced and parts[i]:
                    values.append(combine(parts[i]))
                elif i in acc:
                    gq = acc.pop(i)
                    sc = self._scale(i, gq, acc_mag.pop(i, None))
                    if sc is None:
                        self._no_scale(i)
                    values.append(grad_stats(gr, gq, exact, sc, self.engine.verdicts))
                else:
                    continue
                originals.append((i, gr))
        return values, originals, in_dtype

    def _check(self, grad, real):
        e = self.engine
        leaves = self.leaves
        snap = self.call.snap  # what the call overwrites (in place, running statistics): clones
        if any(leaves[i]._version != v for i, v in zip(self.diff, self.versions)
               if not (snap and i in snap)):   # (an overwritten input comes from its clone)
            raise perturb.Cancel("an input was modified in place before the backward pass")
        g = detached(grad)
        dev, ac_dtype = self.autocast or (None, None)
        same_autocast = torch.autocast(dev, dtype=ac_dtype) if ac_dtype is not None \
            else contextlib.nullcontext()
        with grad_mode(True), same_autocast:
            if real is not None:   # the gradients the real backward gave the inputs
                g_ref = [real.get(i) for i in self.diff]
            else:                  # recomputed: the API on detached copies of its inputs
                ref = list(state.restore(leaves, snap))
                ref_in = []
                for i in self.diff:
                    ref[i] = ref[i].detach().requires_grad_(True)
                    ref_in.append(ref[i])
                a, kw = perturb.unflatten(ref, self.spec)
                y = self._output(self.func(*a, **kw))
                with no_autocast(True):
                    g_ref = torch.autograd.grad(y, ref_in, g, allow_unused=True)
                del ref, ref_in, a, kw, y
            # perturbed
            plain = [x.detach() if isinstance(x, torch.Tensor) else x
                     for x in state.restore(leaves, snap)]
            # the inputs as the op computed with them (autocast): the noise is one ulp of that
            # precision, the upcast starts from what the kernel really received
            x = autocast.first_tensor(plain)
            if x is not None:
                plain = autocast.cast_like(plain, autocast.enabled_dtype(x.device),
                                           self.out_dtype)
            exact = e.verdicts.want_exact(e.site_of("backward", self.key, self.n))
            self._judge(plain, g, g_ref)
            plan = self._plan(plain, g) if not snap else None
            if plan is not None:
                values, originals, in_dtype = self._blocked(plan, plain, g, g_ref, exact)
            else:
                values, originals, in_dtype = self._whole(plain, g, g_ref, exact)
            del plain
        if not values:
            raise perturb.Cancel("no input gradient to compare")

        def fresh():   # the inputs as the op computed with them
            return autocast.cast_like(state.restore(leaves, snap), ac_dtype, self.out_dtype)

        def explain(items):  # only for flagged gradients: float64 recomputations
            return cause.analyse_backward(self.func, fresh, self.spec, self.diff,
                                          self.out_index, g, items, api=self.call_name)
        explain.repro = {"stage": "backward", "func": self.func, "call": self.call,   # issue 30
                         "spec": self.spec, "fresh": fresh, "plan": dict(self.plan), "g": g,
                         "diff": self.diff, "out_index": self.out_index, "autocast": ac_dtype,
                         "api": self.call_func}

        self.call_name = self.call.info.name
        with grad_mode(False):
            e.defer(self.key, self.n, self.name, "backward", self.step, self.site, in_dtype,
                    [(i, gr, None) for i, gr in originals], values=values, exact=exact,
                    module=self.module, explain=explain, originals=[gr for _, gr in originals],
                    compute=[self.compute_dtype] * len(values),
                    plan=[self.plan[i] for i, _ in originals])

    def _judge(self, plain, g, g_ref) -> None:
        """Each compared input's family, reduction length (``scales.backward_length``) and
        ``Judge`` for the scales of this check."""
        e = self.engine
        name = self.call.info.name
        fam = scales.family(name)
        a = scales.Args(self.call_func, name, *perturb.unflatten(plain, self.spec))
        k_fwd = scales.forward_length(name, a, plain, g)
        formula_ok = not (fam == "attention" and (a.get("dropout_p", 4) or 0.0))
        if fam in ("multilinear", "arithmetic"):
            formula_ok = scales.data_variant(name, a, "backward")
        self.plan, self.judges = {}, {}
        for i, gr in zip(self.diff, g_ref):
            if gr is None:
                continue
            k = scales.backward_length(name, a, plain, i, g, k_fwd)
            self.plan[i] = (fam, k, formula_ok)
            self.judges[i] = e.judge_of(fam, k, self.compute_dtype, gr.dtype, None, "backward",
                                        formula_ok)
