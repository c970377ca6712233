"""Free benchmark: re-run PyTorch API calls on perturbed inputs and report inconsistent outputs.

``FreeBench`` is the public entry point; ``PrecisionDebugger(task="free_benchmark")`` uses it too.
Modules: ``modes`` (what each pert_mode means; torch-free), ``names`` (API naming/classification),
``intercept`` (the TorchFunctionMode), ``perturb`` (perturbations), ``metric`` (error metric),
``handlers`` (thresholds, check/fix), ``preheat`` (sampling rule), ``backward`` (gradient
checks), ``guards`` (modes off, autocast off), ``results`` (CSV, DataFrame), ``view`` (the
findings view), ``bench`` (``FreeBench``), ``state`` (calls that write state), ``compiled``
(torch.compile refused), ``coverage`` (zero coverage reported), ``autocast`` (autocast-aware
noise and fix), ``cause`` (why a finding: inaccurate / ill-conditioned), ``repro`` (a finding as
a standalone script needing only torch; ``repro_record``, ``repro_script``, ``repro_helpers``,
``repro_shrink``).

The public names load on first access, so ``probekit.freebench.modes`` can be read without
importing torch (``probekit.config`` does).
"""
from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {"FreeBench": ".bench", "open_session": ".bench", "COLUMNS": ".results",
         "CompiledModelError": ".compiled"}
__all__ = ["FreeBench", "open_session", "COLUMNS", "CompiledModelError"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
