"""The grad probe: per-step gradient statistics and sign bits in Zarr, and two-run comparison.

Sub-packages by stage, each importing only the stages after it: ``record`` (``GradProbe``) and
``compare`` (``compare_grads``), peers, over ``store`` (the Zarr store, msprobe dumps, readers)
over ``numerics`` (the statistics, the kernel, sampling, index geometry). This ``__init__`` is the
public face: it imports the public names from their homes.
"""
from .compare.compare import GradCompareError, compare_grads, first_divergence
from .compare.report import GradComparator
from .compare.suspects import suspects  # also registers the ``cmp.probekit`` accessor
from .compare.verdict import Verdict, verdict_of
from .record.control import perturb
from .record.recorder import GradProbe
from .record.shards import LocalShards, megatron_shards
from .store.names import layer_offset
from .store.replicas import replica_disagreements
from .store.restarts import segments
from .store.sources import open_grads
from .store.store import GradStoreError

__all__ = ["GradProbe", "open_grads", "compare_grads", "first_divergence", "perturb",
           "GradComparator", "GradCompareError", "GradStoreError", "suspects", "segments",
           "layer_offset", "replica_disagreements", "Verdict", "verdict_of", "LocalShards",
           "megatron_shards"]
