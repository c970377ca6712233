"""Does a finding matter for this training? ``probekit.impact`` and ``fb.impact(row, ...)``.

A free-benchmark finding is a call less accurate than its dtype allows, or one that loses half
its bits. Whether it changes the training is another question, and the grad comparison answers
it with the words it uses for two runs (``grads/compare/verdict.py``). The training's steps are
run again from the same state (model, grads, optimizer, random generators: ``trainstate``):

* with that call **fixed**: computed in the wider dtype and cast back, as the free benchmark's
  ``handler_type="fix"`` does (its gradients then come from the wide computation too, so a
  backward finding is fixed by fixing its forward call): the reference;
* **as they are**, with the defect: the run under test;
* as they are under a **control**'s random rounding at the finding's precision (two seeds:
  ``grads/record/control.py``): every low-precision call computed wider, so with no kernel's
  defect, and rounded at random; the null: how far rounding alone moves these gradients.

The grad probe records each run's gradients at every step and ``compare_grads(fixed, as_is,
control=[...])`` judges the change: does the run with the defect depart from the run without it
further than rounding at this precision departs from it? "fixing `layer_norm` backward moves the gradients
within what bf16 rounding explains" (the defect is real, and worth reporting, but this training
cannot tell it from rounding), or "beyond" (it changes the training: fix it, or keep that call
in a wider dtype). The same ``Verdict`` as ``cmp.probekit.verdict`` is in ``Impact.verdict``.

Cost: four runs of ``steps`` steps (the reference, the fixed call, two controls), the controls
slower by their emulation (every low-precision call computed again wider: ``control.py``).
"""
from __future__ import annotations

import dataclasses
import html
import logging
import os
import tempfile

import torch

from .errors import ConfigError
from .log import ROOT as LOG_ROOT, get_logger
from .trainstate import TrainingState, check_step

log = get_logger(__name__)

#: the control's precision for a finding's dtype
PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: the controls' seeds: two draws of rounding's noise (their envelope is the band)
SEEDS = (0, 1)


@dataclasses.dataclass
class Impact:
    """What fixing a finding's call does to the gradients: ``kind`` ("beyond" or "within"
    what rounding at ``control``'s precision explains), ``verdict`` (the comparison's
    ``Verdict``: step, parameter, reason), ``text`` (in words; ``str()``), ``comparison`` (the
    ``GradComparison`` of the run as it is against the fixed one, calibrated by the controls),
    ``api_name`` (the finding), ``fixed`` (the call fixed: its forward name, or the API with
    ``every_call``), ``calls_fixed`` (calls fixed over the steps), ``steps``."""

    api_name: str
    api: str
    stage: str
    fixed: str
    control: str
    steps: int
    calls_fixed: int
    verdict: object
    comparison: object
    text: str

    @property
    def kind(self) -> str:
        return self.verdict.kind

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__

    def _repr_html_(self) -> str:
        color = {"beyond": "#b71c1c", "within": "#1b5e20"}.get(self.kind, "#8a6d00")
        return (f"<p class='probekit-impact' style='color:{color}'><b>probekit impact</b>: "
                f"{html.escape(self.text)}</p>")


class _Tap(torch.optim.Optimizer):
    """An optimizer whose step changes nothing: the grad probe records the gradients of a
    ``step_fn`` that steps none at its step."""

    def __init__(self, params) -> None:
        super().__init__([p for p in params], {})

    @torch.no_grad()
    def step(self, closure=None):
        return None


def _takes_step(step_fn) -> bool:
    """Does ``step_fn`` take the step number (a positional parameter without a default)?"""
    import inspect

    try:
        params = inspect.signature(step_fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               and p.default is p.empty for p in params)


def _finding(finding) -> dict:
    if isinstance(finding, str):
        finding = {"api_name": finding}
    if hasattr(finding, "to_dict"):
        finding = finding.to_dict()
    name = finding.get("api_name") if isinstance(finding, dict) else None
    parts = str(name).rsplit(".", 2) if name else []
    if len(parts) != 3 or "." not in parts[0] or not parts[1].isdigit() or \
            parts[2] not in ("forward", "backward"):
        raise ConfigError(f"finding: {finding!r:.80} is not valid; accepted: a row of "
                          "fb.results (or its api_name, e.g. "
                          "'Functional.layer_norm.0.backward')", key="finding", value=finding,
                          accepted="a row of fb.results, or its api_name")
    return dict(finding)


def _dtype(finding: dict, model) -> torch.dtype:
    text = str(finding.get("dtype") or "").removeprefix("torch.")
    dtype = getattr(torch, text, None) if text else None
    if isinstance(dtype, torch.dtype):
        return dtype
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return max(set(floats), key=floats.count) if floats else torch.float32


def control_for(finding, model) -> str:
    """The control a finding is judged against: its dtype's precision (``PRECISION``), with
    the recipe ``none`` when the model's floating parameters are all in that dtype (a model
    cast to it) and the precision's default recipe otherwise (autocast for 16-bit)."""
    dtype = _dtype(_finding(finding), model)
    if dtype not in PRECISION:
        raise ConfigError(f"finding: its dtype {dtype} has no control; accepted: findings in "
                          "bfloat16, float16 or float32", key="finding", value=str(dtype),
                          accepted="bfloat16, float16, float32")
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return PRECISION[dtype] + (":none" if floats == {dtype} and dtype != torch.float32 else "")


def impact(model, step_fn, finding, *, steps: int = 1, optimizer=None, control=None,
           seeds=SEEDS, every_call: bool = False, dump_path=None,
           verbose: bool = False) -> Impact:
    """Re-run ``steps`` steps of ``step_fn`` with ``finding``'s call fixed and judge the change
    in the gradients against the noise of ``control`` runs (module docstring).

    ``model``: the ``nn.Module`` the steps train; ``step_fn()`` or ``step_fn(i)`` (``i``: the
    step of the run, 0 to ``steps - 1``): one training step: forward and backward (and, with
    ``optimizer=`` given, the optimizer's step, whose state is then saved and restored too;
    without it the steps' gradients are recorded at a step that changes nothing, from zeroed
    gradients each time). Every run calls it the same way, so its data must follow from ``i``
    (a list of batches, fixed tensors), not from an iterator that moves on; ``finding``: a row of ``fb.results`` or its
    ``api_name``; ``control``: the precision recipe of the null (default ``control_for``: the
    finding's dtype, ``:none`` for a model cast to it); ``seeds``: one control run per seed
    (their envelope); ``every_call``: fix every call of the API, not only the finding's;
    ``dump_path``: where the runs are recorded (default: a temporary folder, removed);
    ``verbose``: keep the probes' INFO lines. The model, its gradients, the optimizer and the
    random generators are left as they were."""
    from .freebench import FreeBench
    from .grads import GradProbe, compare_grads
    from .grads.compare.verdict import verdict_of
    from .paths import safe_join, safe_name

    check_step(model, step_fn)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"steps: {steps!r} is not valid; accepted: an integer >= 1",
                          key="steps", value=steps, accepted="an integer >= 1")
    seeds = tuple(seeds)
    if not seeds:
        raise ConfigError("seeds: () is not valid; accepted: one or more control seeds",
                          key="seeds", value=seeds, accepted="one or more integers")
    takes_step = _takes_step(step_fn)
    row = _finding(finding)
    name = row["api_name"]
    head, index, stage = name.rsplit(".", 2)
    api = head.split(".", 1)[1]
    target = api if every_call else f"{head}.{index}.forward"
    control = control if control is not None else control_for(row, model)
    tap = optimizer if optimizer is not None else _Tap(model.parameters())
    state = TrainingState(model, optimizer)
    tmp = tempfile.TemporaryDirectory(prefix="probekit-impact-") if dump_path is None else None
    folder = tmp.name if tmp is not None else safe_join(os.fspath(dump_path), "impact",
                                                        safe_name(name))
    logger = logging.getLogger(LOG_ROOT)
    level = logger.level
    if not verbose:
        logger.setLevel(logging.WARNING)
    fixed = 0
    try:
        def record(run, fix=False, spec=None, seed=0):
            state.restore()
            fb = None
            if fix:
                scope = {"list": [api]} if every_call else {"scope": [target]}
                fb = FreeBench(dump_path=os.path.join(folder, "fix"), overwrite=True,
                               pert_mode="improve_precision", handler_type="fix",
                               fuzz_stage="forward", **scope)
            probe = GradProbe(model, optimizer=tap, dump_path=os.path.join(folder, run),
                              grad_level="L1", overwrite=True, control=spec,
                              control_seed=seed if spec is not None else None)
            with probe:
                for i in range(steps):
                    if optimizer is None:
                        for p in model.parameters():
                            p.grad = None
                    args = (i,) if takes_step else ()
                    if fb is not None:
                        with fb:
                            step_fn(*args)
                        fb.step()
                    else:
                        step_fn(*args)
                    if optimizer is None:
                        tap.step()
            return 0 if fb is None else int(fb.summary["checked"])

        fixed = record("fixed", fix=True)
        record("as_is")
        if not fixed:
            raise ConfigError(
                f"finding: {name!r} is not valid here; accepted: a call step_fn makes (no call "
                f"{'of ' + api if every_call else 'named ' + target} ran in {steps} step(s) of "
                "step_fn: a call's number counts from the start of its step)", key="finding",
                value=name, accepted="a call step_fn makes")
        for k, seed in enumerate(seeds):
            record(f"control{k}", spec=control, seed=seed)
        cmp = compare_grads(os.path.join(folder, "fixed"), os.path.join(folder, "as_is"),
                            control=[os.path.join(folder, f"control{k}")
                                     for k in range(len(seeds))], progress=False)
        cmp.load()
    finally:
        logger.setLevel(level)
        state.restore()
        if tmp is not None:
            tmp.cleanup()
    verdict = verdict_of(cmp)
    return Impact(name, api, stage, target, control, steps, fixed, verdict, cmp,
                  words(api, stage, verdict, control, steps, every_call, cmp))


def words(api: str, stage: str, verdict, control: str, steps: int,
          every_call: bool = False, cmp=None) -> str:
    """"fixing `layer_norm` backward moves the gradients beyond / within what bf16 rounding
    explains", where and by how much, in the grad comparison's words."""
    import math

    what = f"fixing {'every ' if every_call else ''}`{api}` {stage}"
    prec = control.partition(":")[0]

    def fmt(x):
        return "n/a" if math.isnan(x) else f"{x:.4f}"

    if verdict.kind == "beyond":
        where = f"at {verdict.parameter}" if verdict.parameter else "in the step's total"
        if verdict.reason in ("sign", "total"):
            why = (f"significant-sign similarity {fmt(verdict.similarity)}; the {prec} controls "
                   f"keep {fmt(verdict.control_similarity)}, noise allows down to "
                   f"{fmt(verdict.band)}")
        elif verdict.reason == "scale" and cmp is not None and verdict.parameter:
            cell = cmp.sel(step=verdict.step, param=verdict.parameter)
            if "rank" in cell.dims:
                cell = cell.sel(rank=verdict.rank)
            dev = {k: float(cell[f"{k}_dev"] / cell[f"{k}_allowed"]) for k in ("norm", "range")}
            key = "range" if dev["range"] > dev["norm"] else "norm"
            stat = "max - min" if key == "range" else "norm"
            why = (f"its gradient {stat} {float(cell[key + '_ratio']):.4g}x the fixed run's, the "
                   f"{prec} control's {float(cell[key + '_ratio_control']):.4g}x")
        else:
            from .grads.compare.verdict import REASONS

            why = REASONS.get(verdict.reason, verdict.reason)
        return (f"{what} moves the gradients beyond what {prec} rounding explains: from step "
                f"{verdict.step} {where} ({why})")
    if verdict.kind == "within":
        return (f"{what} moves the gradients within what {prec} rounding explains over "
                f"{steps} step{'s' * (steps != 1)} (lowest significant-sign similarity "
                f"{fmt(verdict.similarity)}; the {prec} controls' lowest "
                f"{fmt(verdict.control_similarity)}): this training cannot tell the defect "
                "from rounding")
    return f"{what}: {verdict.text}"
