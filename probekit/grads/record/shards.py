"""Plain local shards declared as DTensor blocks.

Some layouts keep each rank's piece of a parameter as a plain tensor and say where it lies in
their own bookkeeping: Megatron's tensor parallelism (``ColumnParallelLinear`` holds its rows of
the weight, marked ``tensor_model_parallel`` with its ``partition_dim``; a LayerNorm is a plain
copy on every TP rank), or data and context parallelism written by hand (every rank a copy, the
gradients all-reduced by the loop). The grad probe sees plain tensors there: every rank records
its piece under the full parameter's name, a comparison with a one-process run meets shapes that
differ, and the replica check sees nothing replicated.

``GradProbe(model, shards=LocalShards(mesh, placements))`` declares those pieces: for each
parameter, DTensor placements over ``mesh`` (a ``DeviceMesh`` of the ranks that share it), as
if it were ``DTensor.from_local(piece, mesh, placements)``. The probe then treats it as it
treats a DTensor's shard (``placement.py``): each rank records its block with the block's
place, a replicated one only on coordinate 0, the readers assemble full parameters under the
one-process names, and the replica check compares the copies of every ``Replicate``d one. The
model, its optimizer and its gradients are untouched: nothing is wrapped or converted.

``megatron_shards(model, group)``: the declaration Megatron's own marks give, over its TP group.
"""
from __future__ import annotations

from collections.abc import Mapping

from ...config import ConfigError
from ..store.names import canonical_name

#: ``default`` of ``LocalShards``: parameters not named are replicated over every mesh dimension
REPLICATE = "replicate"


def _placements(value, ndim: int, what: str) -> tuple:
    """``value`` (a placement, or one per mesh dimension) as a tuple of ``ndim`` ``Shard`` /
    ``Replicate`` placements; anything else is a ``ConfigError`` naming it."""
    from torch.distributed.tensor import Replicate, Shard

    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if len(items) != ndim or any(type(x) not in (Shard, Replicate) for x in items):
        raise ConfigError(
            f"GradProbe(shards=): {what} -> {value!r} is not valid; accepted: Shard(dim) or "
            f"Replicate(), one per dimension of the mesh ({ndim})", key="shards", value=value,
            accepted="Shard(dim) or Replicate(), one per mesh dimension")
    return items


class LocalShards:
    """Where the plain local pieces of a model's parameters lie: DTensor placements over
    ``mesh`` (a ``torch.distributed.device_mesh.DeviceMesh``; this rank must be on it).

    ``placements``: ``{parameter name: placements}`` (a ``Shard(dim)`` or ``Replicate()``, or a
    list of one per mesh dimension; names as ``model.named_parameters()`` gives them, with or
    without wrapper prefixes; ``None``: that parameter stays a plain tensor, recorded by every
    rank holding it). ``default``: the placements of the parameters not named: ``"replicate"``
    (the default: replicated over every mesh dimension, recorded by coordinate 0 and checked
    across the others), a placement or list of them, or None (left plain).

    A ``Shard(d)`` piece holds 1/n of dimension ``d`` of the whole parameter (n: the mesh
    dimension's size; pieces of equal size, as Megatron makes them): the whole shape is the
    local one times n there."""

    def __init__(self, mesh, placements: Mapping | None = None, *, default=REPLICATE) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"LocalShards(mesh=): {type(mesh).__name__} is not valid; accepted: "
                            "a torch.distributed.device_mesh.DeviceMesh")
        if placements is not None and not isinstance(placements, Mapping):
            raise TypeError(f"LocalShards(placements=): {type(placements).__name__} is not "
                            "valid; accepted: a dict of parameter names to placements")
        if mesh.get_coordinate() is None:
            raise ValueError("LocalShards(mesh=): this rank is not on the mesh; accepted: a "
                             "mesh of the ranks that hold the model's pieces, this one included")
        self.mesh = mesh
        nd = mesh.ndim
        self.placements = {str(k): None if v is None else _placements(v, nd, repr(k))
                           for k, v in dict(placements or {}).items()}
        if default is None:
            self.default = None
        elif isinstance(default, str) and default == REPLICATE:
            from torch.distributed.tensor import Replicate

            self.default = (Replicate(),) * nd
        else:
            self.default = _placements(default, nd, "default")

    def resolve(self, named) -> dict:
        """{id(parameter): (mesh, placements)} for ``named`` (``(name, parameter)`` pairs, as
        ``model.named_parameters()`` gives them): the parameters declared. A name of
        ``placements`` that is no parameter, or a DTensor parameter named, is a
        ``ConfigError`` naming it."""
        from .placement import is_dtensor

        named = list(named)
        keys = {}
        for n, p in named:
            keys[n] = p
            keys.setdefault(canonical_name(n), p)
        missing = sorted(k for k in self.placements if k not in keys)
        if missing:
            sample = ", ".join(sorted(canonical_name(n) for n, _ in named)[:8])
            raise ConfigError(f"GradProbe(shards=): {missing!r} not found in the model; "
                              f"accepted: names from model.named_parameters() (e.g. {sample})",
                              key="shards", value=missing,
                              accepted="names from model.named_parameters()")
        chosen = {id(keys[k]): v for k, v in self.placements.items()}
        out = {}
        for n, p in named:
            place = chosen[id(p)] if id(p) in chosen else self.default
            if place is None:
                continue
            if is_dtensor(p):
                if id(p) in chosen:
                    raise ConfigError(f"GradProbe(shards=): {n!r} is a DTensor (it carries its "
                                      "own placements); accepted: plain tensors", key="shards",
                                      value=n, accepted="names of plain-tensor parameters")
                continue
            out[id(p)] = (self.mesh, place)
        return out

    def __repr__(self) -> str:
        return (f"LocalShards(mesh={self.mesh!r}, {len(self.placements)} named, default="
                f"{self.default!r})")


def megatron_shards(model, group=None, *, placements: Mapping | None = None,
                    device_type: str | None = None) -> LocalShards:
    """The ``LocalShards`` of a Megatron model under tensor parallelism, from Megatron's own
    marks: a parameter marked ``tensor_model_parallel`` is ``Shard(partition_dim)`` over the TP
    group (``ColumnParallelLinear``'s weight and bias: rows; ``RowParallelLinear``'s weight:
    columns; ``VocabParallelEmbedding``: rows), one marked ``allreduce=False`` (an expert under
    expert parallelism: each rank its own) stays plain, every other one is ``Replicate`` over the
    TP group (LayerNorms, a row-parallel bias, a router: copies that must agree, checked by the
    replica check). ``group``: the TP process group (default: megatron-core's
    ``parallel_state.get_tensor_model_parallel_group()``); the mesh dimension is named "tp".
    ``placements``: ``LocalShards``' placements of parameters the marks miss or get wrong (a
    head-sharded parameter left unmarked); they win. ``device_type``: the mesh's ("cuda" under
    NCCL; default: the model's parameters' device type). A strided partition
    (``partition_stride`` > 1) is not a block: ``ValueError``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    if group is None:
        try:
            from megatron.core import parallel_state
        except ImportError:
            raise ValueError("megatron_shards: group=None takes Megatron's TP group, and "
                             "megatron.core is not importable here; accepted: the tensor-"
                             "parallel process group") from None
        group = parallel_state.get_tensor_model_parallel_group()
    named = list(model.named_parameters())
    if device_type is None:
        device_type = named[0][1].device.type if named else "cpu"
    chosen = dict(placements or {})
    placements = {}
    for name, p in named:
        if name in chosen or canonical_name(name) in chosen:
            continue
        if getattr(p, "tensor_model_parallel", False):
            stride = int(getattr(p, "partition_stride", 1))
            if stride != 1:
                raise ValueError(f"megatron_shards: {name!r} is partitioned with stride "
                                 f"{stride}, not a block of the whole parameter; accepted: "
                                 "partition_stride 1")
            placements[name] = Shard(int(p.partition_dim))
        elif getattr(p, "allreduce", True) is False:
            placements[name] = None
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    return LocalShards(mesh, {**placements, **chosen})
