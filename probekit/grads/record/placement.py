"""Which part of each gradient this rank records, and where that part lies.

* DTensor parameters (FSDP2, tensor parallel, HSDP): the rank records its own shard (no gather),
  with its placement: the global shape, the shard's offset in every dimension, its local shape
  (the real elements, no padding), the device mesh's shape and this rank's coordinates on it.
  Over a mesh dimension the tensor is replicated on (HSDP's replicas, the data-parallel dimension
  of 2-D parallelism), only coordinate 0 records it: the other replicas hold the same bytes.
* DDP: the gradients are all-reduced, equal on every rank of its process group, so only the
  group's first rank records.

A ``rank`` filter, when given, keeps msprobe's meaning: the listed ranks record everything they
hold, replicas included (the reader takes a replicated shard once).
"""
from __future__ import annotations

from ...log import get_logger

log = get_logger(__name__)


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def dtensor_placement(t) -> dict | None:
    """Where this rank's shard of DTensor ``t`` lies; None for a placement that is not a plain
    block (``Partial``, ``_StridedShard``...): such a tensor is gathered whole instead."""
    return block_placement(t.shape, t.device_mesh, t.placements)


def block_placement(shape, mesh, placements) -> dict | None:
    """Where this rank's block of a tensor of global ``shape`` placed by ``placements`` over
    ``mesh`` lies (``dtensor_placement``'s dict); None when a placement is not ``Shard`` or
    ``Replicate``, or this rank is not on the mesh."""
    from torch.distributed.tensor import Replicate, Shard

    places = tuple(placements)
    if any(type(p) not in (Shard, Replicate) for p in places):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coord = mesh.get_coordinate()
    if coord is None:  # this rank is outside the tensor's mesh: it holds nothing of it
        return None
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, places)
    return {"global_shape": [int(x) for x in shape], "offset": [int(x) for x in offset],
            "local_shape": [int(x) for x in local_shape],
            "mesh_shape": [int(x) for x in mesh.shape], "mesh_coord": [int(x) for x in coord],
            "mesh_dims": list(mesh.mesh_dim_names or ()),
            "placements": [_name(p) for p in places]}


def local_placement(t, mesh, placements, name: str = "") -> dict:
    """Where plain tensor ``t``, this rank's piece of a parameter declared ``placements`` over
    ``mesh`` (``shards.LocalShards``), lies: ``dtensor_placement``'s dict, the whole shape being
    the local one times the mesh size along each sharded dimension (pieces of equal size). A
    piece that is not such a block is a ``ValueError`` naming ``name``."""
    shape = list(t.shape)
    for d, p in enumerate(placements):
        if hasattr(p, "dim"):
            if not 0 <= p.dim < len(shape):
                raise ValueError(f"GradProbe(shards=): Shard({p.dim}) is not valid for "
                                 f"{name!r}, of shape {list(t.shape)}; accepted: Shard(0) to "
                                 f"Shard({len(shape) - 1}) or Replicate()")
            shape[p.dim] *= int(mesh.shape[d])
    place = block_placement(shape, mesh, placements)
    if place is None or place["local_shape"] != [int(x) for x in t.shape]:
        raise ValueError(f"GradProbe(shards=): {name!r} holds {list(t.shape)} here, not a block "
                         f"of {shape} placed {[_name(p) for p in placements]} on a mesh of "
                         f"shape {list(mesh.shape)}; accepted: pieces of equal size")
    return place


def _name(p) -> str:
    return f"S({p.dim})" if hasattr(p, "dim") else "R"


def first_replica(place: dict) -> bool:
    """True when this rank is coordinate 0 on every mesh dimension the tensor is replicated
    over (it records the shard for all its replicas)."""
    return all(c == 0 for c, p in zip(place["mesh_coord"], place["placements"]) if p == "R")


def local_grad(g, param, place):
    """The gradient this rank records for ``param``: its local shard (a view, no copy) when
    ``place`` describes one, the whole gradient (an all-gather) for a DTensor with no
    placement, else ``g`` itself."""
    if g is None or not is_dtensor(g):
        return g
    if place is None:
        return g.full_tensor()
    if tuple(g.placements) != tuple(param.placements):  # not seen under FSDP2/TP; be exact
        g = g.redistribute(g.device_mesh, param.placements)
    return g.to_local()


def ddp_first_rank(model) -> bool | None:
    """For a model wrapped in ``DistributedDataParallel``: is this rank the first of DDP's
    process group? None for a model DDP does not wrap."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or not dist.is_initialized():
        return None
    return dist.get_rank(model.process_group) == 0


def amax_reducer(params, places, meshes=None):
    """A function from this rank's largest finite ``|x|`` of each recorded gradient (a float64
    tensor, one per parameter of ``params``) to the whole gradients' (for the significance
    threshold ``eps(dtype) * max|x|`` of a shard, ``stats.compute(reduce_amax=)``, so
    shard-local bits equal a single process's); None when no parameter is sharded. ``meshes``:
    each parameter's mesh (default: its DTensor's; a declared plain shard's, ``shards.py``).

    One MAX all-reduce per mesh group the shards are spread over (the ranks of the mesh
    dimensions they are sharded on: FSDP2's shard group, a TP group; one group for a 1-D
    mesh), on the mesh's device type (NCCL takes device tensors). Only ranks that record take
    part: the replicas that record nothing are outside these groups (their own replica's
    groups are separate)."""
    import torch
    import torch.distributed as dist

    groups: dict = {}
    for i, (p, pl) in enumerate(zip(params, places)):
        if pl is None or not any(x != "R" for x in pl["placements"]):
            continue
        dims = tuple(d for d, x in enumerate(pl["placements"]) if x != "R")
        # each fully_shard call may build its own mesh of the same ranks
        mesh = meshes[i] if meshes is not None else p.device_mesh
        key = (mesh.device_type, str(mesh.mesh.tolist()), dims)
        groups.setdefault(key, (mesh, dims, []))[2].append(i)
    if not groups:
        return None
    plan = []
    for mesh, dims, members in groups.values():
        if len(dims) == 1:
            group = mesh.get_group(dims[0])
        elif mesh.size() == dist.get_world_size():  # sharded over the whole world
            group = None
        else:  # several sharded dimensions of a sub-mesh: their flattened group
            group = mesh._flatten("_".join(mesh.mesh_dim_names[d] for d in dims)).get_group()
        plan.append((mesh.device_type, group, torch.tensor(members, dtype=torch.long)))

    def reduce(local):
        out = local.clone()
        for device, group, idx in plan:
            part = local.index_select(0, idx.to(local.device)).to(device)
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
            out.index_copy_(0, idx.to(local.device), part.to(local.device))
        return out

    return reduce
