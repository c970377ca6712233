"""Free benchmark: re-run PyTorch API calls on perturbed inputs and report inconsistent outputs.

``FreeBench`` is the public entry point; ``PrecisionDebugger(task="free_benchmark")`` uses it too.
Modules: ``names`` (API naming/classification), ``intercept`` (the TorchFunctionMode),
``perturb`` (perturbations), ``metric`` (error metric), ``handlers`` (thresholds, check/fix),
``preheat`` (sampling rule), ``backward`` (gradient checks), ``results`` (CSV, DataFrame, HTML),
``session`` (``FreeBench``), ``state`` (calls that write state), ``compiled`` (torch.compile
refused).
"""
from .compiled import CompiledModelError
from .results import COLUMNS
from .session import FreeBench, open_session

__all__ = ["FreeBench", "open_session", "COLUMNS", "CompiledModelError"]
