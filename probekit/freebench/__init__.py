"""Free benchmark: re-run PyTorch API calls on perturbed inputs and report inconsistent outputs.

``FreeBench`` is the public entry point; ``PrecisionDebugger(task="free_benchmark")`` uses it too.
Modules: ``names`` (API naming/classification), ``intercept`` (the TorchFunctionMode),
``perturb`` (perturbations), ``metric`` (error metric), ``handlers`` (thresholds, check/fix),
``preheat`` (sampling rule), ``backward`` (gradient checks), ``results`` (CSV, DataFrame, HTML),
``bench`` (``FreeBench``).
"""
from .results import COLUMNS
from .bench import FreeBench, open_session

__all__ = ["FreeBench", "open_session", "COLUMNS"]
