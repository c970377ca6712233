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

from ._harness import ROOT, ReplicaWitness, ShardView

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


def shard_view(model, extra: dict | None = None):
    """A ``ShardView`` of ``model`` over the TP group with Megatron's placements (and
    ``extra``), and a ``ReplicaWitness`` of its replicated parameters over the TP group."""
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import init_device_mesh

    places = {**placements(model), **(extra or {})}
    mesh = init_device_mesh("cpu", (ps.get_tensor_model_parallel_world_size(),))
    return ShardView(model, mesh, places), ReplicaWitness(
        {n: p for n, p in model.named_parameters() if n not in places},
        group=ps.get_tensor_model_parallel_group())


def placements(model) -> dict:
    """``{name: Shard(dim)}`` for the parameters Megatron marks ``tensor_model_parallel`` (their
    ``partition_dim``): what ``ShardView`` needs; the others are replicated."""
    from torch.distributed.tensor import Shard

    return {n: Shard(p.partition_dim) for n, p in model.named_parameters()
            if getattr(p, "tensor_model_parallel", False)}
