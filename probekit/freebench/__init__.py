"""Free benchmark: re-run PyTorch API calls on perturbed inputs and report inconsistent outputs.

``FreeBench`` is the public entry point; ``PrecisionDebugger(task="free_benchmark")`` uses it too.
The sub-packages follow the stages a checked call goes through; each imports only the stages
listed after it (``tests/unit/test_import_graph.py`` holds the order; docs/architecture.md draws
it):

* ``session``: the public session (``FreeBench``), module scope, coverage messages, torch.compile
  refused;
* ``report``: findings as rows (CSV, DataFrame), the findings view, ``probekit freebench ...``;
* ``repro``: a finding as a standalone repro folder (record, script, shrinking, helpers);
* ``engine``: the ``TorchFunctionMode`` that intercepts calls and runs the checks (forward,
  backward, autocast, random calls, calls writing state, blocked re-runs, budget, preheat);
* ``judge``: from a re-run to a verdict (error metric, error model, thresholds, the float64
  cause analysis, deferred verdicts, guards probekit's own work runs under);
* ``perturb``: what each ``pert_mode`` means (``modes``, torch-free) and the perturbations;
* ``names``: the API catalogue (naming and classifying torch callables).

The public names load on first access, so ``probekit.freebench.perturb.modes`` can be read
without importing torch (``probekit.config`` does).
"""
from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {"FreeBench": ".session.bench", "open_session": ".session.bench",
         "COLUMNS": ".report.results", "CompiledModelError": ".session.compiled"}
__all__ = ["FreeBench", "open_session", "COLUMNS", "CompiledModelError"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
