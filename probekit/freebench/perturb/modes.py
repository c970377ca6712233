"""What each perturbation mode means: one registry entry per ``pert_mode`` with its traits.

Torch-free on purpose: ``probekit.config`` takes its accepted ``pert_mode`` values from here
(``import probekit`` loads no torch). The perturbation functions themselves are registered under
the same names in ``perturb.py`` (which refuses a name that has no entry here); the metric's
threshold rule, the fix handler, the backward stage and the config validation read the traits
below instead of naming modes.

==================  =====  ======  =====  =========  ============  ==============================
mode                noise  upcast  exact  swap_back  fuzz_device   schedule
==================  =====  ======  =====  =========  ============  ==============================
improve_precision          yes                       npu
bit_noise           yes                              npu
add_noise           yes                              npu
change_value                              yes        npu
no_change                          yes               npu
to_cpu                     yes                       cpu
combined                                             npu           improve_precision, bit_noise
==================  =====  ======  =====  =========  ============  ==============================

* ``noise``: moves an input by one ulp: a sensitivity mode, judged against ``sqrt(u)`` of the
  output's scale (``scales.py``), as are the other modes that are neither upcast nor exact.
* ``upcast``: re-runs at a higher precision (or on the CPU in fp32/fp64): an accuracy mode (judged
  against a correct kernel's bound, ``2 (u_out |y| + gamma_k(u_acc) S)``: ``scales.py``); autocast is turned off for the re-run, and
  ``handler_type="fix"`` may swap its result in.
* ``exact``: re-runs on an exact copy, so any difference is non-determinism: threshold 0.
* ``swap_back``: reorders elements; outputs (and, in the backward stage, gradients) are swapped
  back before comparing.
* ``fuzz_device``: the ``fuzz_device`` the mode needs ("cpu" for to_cpu; the others run where the
  call ran, msprobe's "npu").
* ``schedule``: the modes a combined mode runs, one per step in turn (step ``s`` uses
  ``schedule[s % len(schedule)]``; under a budget the probed steps take them in turn, the
  quiet steps skipped): ``combined`` finds an inaccurate kernel (improve_precision)
  and an ill-conditioned computation (bit_noise) within two steps, each step costing what one
  mode costs. Its own traits are none of the above (it is never applied itself).
"""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Mode:
    name: str
    noise: bool = False
    upcast: bool = False
    exact: bool = False
    swap_back: bool = False
    fuzz_device: str = "npu"
    schedule: tuple = ()


MODES: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    if mode.name in MODES:
        raise ValueError(f"pert_mode {mode.name!r} registered twice")
    MODES[mode.name] = mode
    return mode


for _mode in (Mode("improve_precision", upcast=True), Mode("bit_noise", noise=True),
              Mode("add_noise", noise=True), Mode("change_value", swap_back=True),
              Mode("no_change", exact=True), Mode("to_cpu", upcast=True, fuzz_device="cpu"),
              Mode("combined", schedule=("improve_precision", "bit_noise"))):
    register(_mode)

#: every pert_mode, in the registry's order (config's accepted values)
PERT_MODES = tuple(MODES)
#: the modes ``handler_type="fix"`` accepts (their result can replace the original)
FIX_PERT_MODES = tuple(name for name, m in MODES.items() if m.upcast)
