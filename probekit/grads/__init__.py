"""The grad probe: per-step gradient statistics and sign bits in Zarr, and two-run comparison."""
from .compare import GradCompareError, compare_grads, first_divergence
from .control import perturb
from .recorder import GradProbe
from .report import GradComparator
from .restarts import segments
from .sources import open_grads
from .store import GradStoreError
from .suspects import suspects  # also registers the ``cmp.probekit`` accessor

__all__ = ["GradProbe", "open_grads", "compare_grads", "first_divergence", "perturb",
           "GradComparator", "GradCompareError", "GradStoreError", "suspects", "segments"]
