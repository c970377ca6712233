"""megatron-core on CPU with gloo, for the reproductions that run Megatron's own code.

``make bench`` installs megatron-core 0.16.1 (the newest release for Python 3.11; 0.17 and later
need Python 3.12) with ``pip install --no-deps --target .venv-megatron-core``: the shared venv is
untouched, and the package needs nothing beyond torch, numpy and packaging.
``PROBEKIT_MEGATRON_CORE`` names another folder. Megatron's tensor-parallel mappings allocate
their buffers on ``torch.cuda.current_device()``; on a CPU-only torch that raises, so it is
pointed at the CPU (the only change: the layers, mappings, cross entropy and gradient
finalisation run unchanged). Megatron's gradient-norm and clipping kernels
(``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``) allocate on ``'cuda'`` by name: the
reproductions that clip keep Megatron's choice of gradients and do the sums on the CPU.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

from ._harness import ROOT

VERSION = "0.16.1"


class MegatronMissing(RuntimeError):
    """megatron-core is not installed where the bench looks for it."""


def load():
    """``megatron.core``, from ``PROBEKIT_MEGATRON_CORE`` or ``.venv-megatron-core``."""
    path = os.environ.get("PROBEKIT_MEGATRON_CORE") or os.path.join(ROOT, ".venv-megatron-core")
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)
    try:
        import megatron.core
        from megatron.core import package_info
    except ImportError as exc:
        raise MegatronMissing(
            f"megatron-core is not installed in {path}: run `make bench`, or `python -m pip "
            f"install --no-deps --target {path} megatron-core=={VERSION}`") from exc
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    if package_info.__version__ != VERSION:
        raise MegatronMissing(f"megatron-core {package_info.__version__} in {path}; the "
                              f"reproductions were written against {VERSION}")
    return megatron.core


def available() -> bool:
    try:
        load()
    except MegatronMissing:
        return False
    return True


@contextlib.contextmanager
def tensor_parallel(world: int, sequence_parallel: bool = False):
    """Megatron's parallel state with ``world`` tensor-parallel ranks; yields the layers'
    ``ModelParallelConfig`` (fp32, CPU initialisation, which also marks the sharded weights
    ``tensor_model_parallel``; the caller then sets the weights)."""
    load()
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        yield ModelParallelConfig(tensor_model_parallel_size=world,
                                  sequence_parallel=sequence_parallel,
                                  use_cpu_initialization=True, perform_initialization=True,
                                  params_dtype=torch.float32)
    finally:
        ps.destroy_model_parallel()


def column(ref: torch.nn.Linear, config, **options):
    """Megatron's ``ColumnParallelLinear`` holding this rank's rows of ``ref``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = ColumnParallelLinear(ref.in_features, ref.out_features, config=config,
                                 init_method=torch.nn.init.zeros_, bias=ref.bias is not None,
                                 **options)
    _load(layer, ref, weight_dim=0, bias_dim=0)
    return layer


def row(ref: torch.nn.Linear, config, **options):
    """Megatron's ``RowParallelLinear`` (input already split over the ranks) holding this
    rank's columns of ``ref``; its bias replicated."""
    from megatron.core.tensor_parallel import RowParallelLinear

    layer = RowParallelLinear(ref.in_features, ref.out_features, config=config,
                              init_method=torch.nn.init.zeros_, bias=ref.bias is not None,
                              input_is_parallel=True, skip_bias_add=False, **options)
    _load(layer, ref, weight_dim=1, bias_dim=None)
    return layer


def _load(layer, ref, *, weight_dim: int, bias_dim: int | None) -> None:
    from megatron.core import parallel_state as ps

    rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        layer.weight.copy_(ref.weight.chunk(world, dim=weight_dim)[rank])
        if ref.bias is not None:
            layer.bias.copy_(ref.bias if bias_dim is None else
                             ref.bias.chunk(world, dim=bias_dim)[rank])


def shards(model, extra: dict | None = None):
    """How the grad probe sees ``model``'s plain local shards: probekit's ``megatron_shards``
    over Megatron's TP group (its marks: ``tensor_model_parallel`` parameters sharded along
    ``partition_dim``, the others replicated and checked across the group), ``extra``
    (placements of parameters Megatron's marks miss) winning."""
    from megatron.core import parallel_state as ps

    from probekit.grads import megatron_shards

    return megatron_shards(model, ps.get_tensor_model_parallel_group(), placements=extra)
