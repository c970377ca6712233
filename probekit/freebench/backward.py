"""fuzz_stage "backward": check the input gradients an API produces, without touching the real ones.

At the forward call we keep the API's inputs (references, with their version counters) and hook
the gradient of its first differentiable output. When that gradient ``g`` arrives during the real
backward pass, the hook

1. scales ``g`` by a power of two so that ``max|g|`` lies in [0.5, 1) (exact: only the exponent
   changes), so the per-dtype floors of the metric apply at unit scale (computed on the device:
   the check makes one host sync, for the comparison);
2. recomputes the API on detached copies of the inputs and takes their gradients with
   ``torch.autograd.grad`` (the reference);
3. does the same on the perturbed inputs (change_value: the output gradient is swapped like the
   output and the input gradient swapped back);
4. compares the gradients input by input (``output_index`` = the input's position in the call's
   flattened arguments) on the device, the verdict read back at the step's gather point
   (``deferred.py``), and returns ``None``, so the gradient flowing on is the real one.

An input modified in place between the call and its backward cancels the check. For APIs with
several differentiable outputs, the check covers the gradient flowing through the first one.
Hooks still pending are removed when the probe stops.
"""
from __future__ import annotations

import contextlib
import time

import torch

from . import autocast, cause, handlers, perturb, state
from .guards import modes_off, no_autocast
from .names import call_site


#: floor of the backward metric, in units of the input gradient's scale (see ``unit_scaled``)
BACKWARD_FLOOR = 0.5


def unit_scaled(gr: torch.Tensor, gq: torch.Tensor) -> tuple:
    """Both gradients (in at least fp32) times the power of two that brings ``max|gr|`` into
    [0.5, 1): exact, on the device. With ``BACKWARD_FLOOR`` = 0.5 an element is then judged
    relative to itself when it is at least the largest power of two <= max|gr| (the tensor's
    scale S), and relative to S when it is smaller: ``|p_i - o_i| / max(|o_i|, S)``."""
    cdt = torch.promote_types(torch.promote_types(gr.dtype, gq.dtype), torch.float32)
    a, b = gr.detach().to(cdt), gq.detach().to(cdt)
    if a.numel() == 0:
        return a, b
    m = a.abs().amax()
    ok = torch.isfinite(m) & (m > 0)
    _, exp = torch.frexp(torch.where(ok, m, torch.ones_like(m)))
    f = torch.ldexp(torch.ones_like(m), -exp)
    return a * f, b * f


def watch(engine, call, key, n, name, func, leaves, spec, frame):
    """Run the call; hook its first differentiable output for a backward check."""
    out = func(*call.args, **call.kwargs)
    try:
        with modes_off():
            outs = handlers.float_outputs(out)
            if not outs:
                engine.note_skip("no_float_output", key, name)
                return out
            diff = [i for i, x in enumerate(leaves) if perturb.is_float(x) and x.requires_grad]
            sel = next(((i, t) for i, t in outs if t.requires_grad), None)
            if not diff or sel is None or not torch.is_grad_enabled():
                engine.note_skip("no_grad", key, name)
                return out
            check = _BackwardCheck(engine, call, key, n, name, func, leaves, spec, diff, sel[0],
                                   call_site(frame), engine.step)
            x = autocast.first_tensor(leaves)
            check.autocast = (x.device.type, autocast.enabled_dtype(x.device))
            check.module = engine.current_module()  # the module running at the forward call
            engine.handles.append(sel[1].register_hook(check))
    except Exception as exc:  # never reaches the training code
        engine.failed(key, name, exc)
    return out


class _BackwardCheck:
    def __init__(self, engine, call, key, n, name, func, leaves, spec, diff, out_index, site,
                 step):
        self.engine = engine
        self.call = call
        self.key = key
        self.n = n
        self.name = name
        self.func = func
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

    def __call__(self, grad):
        e = self.engine
        if self.leaves is None or e.busy:
            return None
        e.busy = True
        t0 = time.perf_counter() if e.budget is not None else 0.0
        try:
            with modes_off():
                self._check(grad)
        except perturb.Cancel as exc:
            e.cancelled(self.key, self.name, str(exc))
        except Exception as exc:  # never reaches the training code
            e.failed(self.key, self.name, exc)
        finally:
            e.busy = False
            self.leaves = self.call = None  # release the inputs
            if e.budget is not None:
                e.budget.spent(time.perf_counter() - t0)
        return None

    def _output(self, out):
        for i, t in handlers.float_outputs(out):
            if i == self.out_index:
                return t
        raise RuntimeError("the re-run did not produce the hooked output")

    def _check(self, grad):
        e = self.engine
        leaves = self.leaves
        if any(leaves[i]._version != v for i, v in zip(self.diff, self.versions)):
            raise perturb.Cancel("an input was modified in place before the backward pass")
        snap = self.call.snap  # state the call writes (running statistics...): fresh clones
        g = grad.detach()
        if g.numel():
            # power-of-two scale to max|g| in [0.5, 1), computed on the device (no sync)
            m = g.abs().amax().float()
            _, exp = torch.frexp(torch.where(torch.isfinite(m) & (m > 0), m, torch.ones_like(m)))
            g = g * torch.ldexp(torch.ones_like(m), -exp)
        mode = e.mode_name
        dev, ac_dtype = self.autocast or (None, None)
        same_autocast = torch.autocast(dev, dtype=ac_dtype) if ac_dtype is not None \
            else contextlib.nullcontext()
        with torch.enable_grad(), same_autocast:
            # reference: the API on detached copies of its inputs
            ref = list(state.restore(leaves, snap))
            ref_in = []
            for i in self.diff:
                ref[i] = ref[i].detach().requires_grad_(True)
                ref_in.append(ref[i])
            a, kw = perturb.unflatten(ref, self.spec)
            y = self._output(self.func(*a, **kw))
            g_ref = torch.autograd.grad(y, ref_in, g, allow_unused=True)
            # perturbed
            plain = [x.detach() if isinstance(x, torch.Tensor) else x
                     for x in state.restore(leaves, snap)]
            if e.noise_mode:  # one ulp of the precision the op computed in (autocast)
                with torch.no_grad():
                    plain = autocast.noise_leaves(plain, [(self.out_index, y)])
            with torch.no_grad():
                pert = perturb.apply(mode, perturb.Call(self.call.info, *perturb.unflatten(
                    plain, self.spec), self.call.fuzz_device), plain, self.spec)
            e.applied(self.key, self.name)
            p_leaves, _ = perturb.flatten(pert.args, pert.kwargs)
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
            gp_out = g.to(dtype=yp.dtype, device=yp.device)
            if pert.post is not None:
                gp_out = pert.post(gp_out)
            g_pert = torch.autograd.grad(yp, p_in, gp_out, allow_unused=True)
        triples, originals = [], []
        for i, gr, gq in zip(self.diff, g_ref, g_pert):
            if gr is None or gq is None:
                continue
            if e.mode.swap_back and i in replaced and gq.dim() >= 1:
                gq = perturb.swap_last(gq)
            triples.append((i, *unit_scaled(gr, gq)))
            originals.append(gr)
        if not triples:
            raise perturb.Cancel("no input gradient to compare")

        cast_to = ac_dtype if e.noise_mode else None   # inputs as the op computed with them
        y_dtype = y.dtype

        def fresh():
            return autocast.cast_like(state.restore(leaves, snap), cast_to, y_dtype)

        def explain(flagged):  # only for flagged gradients: float64 recomputations
            return cause.analyse_backward(self.func, fresh, self.spec, self.diff,
                                          self.out_index, g, flagged)

        with torch.no_grad():
            e.defer(self.key, self.n, self.name, "backward", self.step, self.site, pert.in_dtype,
                    triples, module=self.module, explain=explain,
                    floors=[BACKWARD_FLOOR] * len(triples), originals=originals)
