"""Full parameters from the shards a sharded run recorded (FSDP2, tensor parallel, HSDP).

Under DTensor sharding each rank records the statistics and sign bits of its own shard of each
parameter, and its group's attribute ``placement`` says where that shard lies (one entry per
recorded parameter, ``None`` for a whole one)::

    {"global_shape": [...], "offset": [...],    # the shard's first index in every dimension
     "local_shape": [...], "mesh_shape": [...], "mesh_coord": [...], "placements": ["S(0)", "R"]}

``assemble_runs`` turns the rank groups of such a run into one Dataset of full parameters, the
same variables and coordinates as a single process's recording, so every reader (the
comparison, the plots, ``GradExplorer``) works on it unchanged:

* steps: those every rank holding a shard committed (a rank that died mid-step leaves the steps
  all ranks committed readable);
* ``present``: every shard had a gradient; ``max``/``min``: over the shards (NaN propagates;
  an empty shard counts for nothing); ``norm``: the square root of the summed float64 squares of
  the shards' norms; ``zeros``/``dist``: the shards' counts (share x shard size, exact integers)
  summed over the parameter's size;
* ``direction``/``significant``: each shard's bits placed at its offsets in the global tensor's
  C order and packed again, lazily, a block of steps at a time (``AssembledBits``);
* ``hash`` (L0): per-shard digests; a parameter in one piece keeps its digest (equal to a
  single process's), a parameter in several gets the md5 of its shards' digests in offset
  order (attribute ``hash_per_shard`` lists them): equal between runs sharded the same way.

Shards recorded twice (replicas written on purpose with a ``rank`` filter) are taken once. When
a parameter's shards do not cover it (a ``rank`` filter that left ranks out), nothing is
assembled: the rank groups are returned as recorded.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from ...log import get_logger
from .chunks import bit_reader, bits_variable, unit_slices
from ..numerics.sampling import sample_size, samples_in_box
from ..numerics.stats import padded_nbytes

log = get_logger(__name__)

_BITS = ("direction", "significant")


def is_sharded(ds) -> bool:
    return "placement" in ds.attrs


def placements(ds) -> list:
    """The per-parameter placement entries of a shard group (``None`` = a whole parameter)."""
    value = ds.attrs.get("placement")
    return json.loads(value) if isinstance(value, str) else list(value)


def _pieces(runs: dict) -> tuple[list, dict]:
    """(parameter names in order, {name: [(rank, index, placement)]}), duplicates dropped."""
    order, pieces, seen = [], {}, set()
    for r in sorted(runs):
        ds = runs[r]
        for j, (name, place) in enumerate(zip(ds["param"].values.tolist(), placements(ds))):
            name = str(name)
            if name not in pieces:
                order.append(name)
                pieces[name] = []
            if place is None:  # a whole parameter (an unsharded one, or a gathered fallback)
                if not any(p[2] is None for p in pieces[name]):
                    pieces[name] = [(r, j, None)]
                continue
            if any(p[2] is None for p in pieces[name]):
                continue
            key = (name, tuple(place["offset"]), tuple(place["local_shape"]))
            if key in seen:  # a replica's copy
                continue
            seen.add(key)
            pieces[name].append((r, j, place))
    return order, pieces


def _global_numel(name, parts, runs) -> int:
    r, j, place = parts[0]
    if place is None:
        return int(runs[r]["numel"].values[j])
    return int(np.prod(place["global_shape"], dtype=np.int64))


def _global_shape(parts, runs) -> str:
    r, j, place = parts[0]
    if place is None:
        return str(runs[r]["shape"].values[j])
    return str(tuple(int(x) for x in place["global_shape"]))


def assemble_runs(runs: dict) -> dict:
    """{rank: Dataset} with every group of a sharded run replaced by one Dataset of full
    parameters under the lowest of its ranks; other groups as they were."""
    sharded = {r: ds for r, ds in runs.items() if is_sharded(ds)}
    if not sharded:
        return runs
    order, pieces = _pieces(sharded)
    whole, partial = [], []
    for name in order:
        parts = pieces[name]
        covered = sum(int(sharded[r]["numel"].values[j]) for r, j, _ in parts)
        (whole if covered == _global_numel(name, parts, sharded) else partial).append(name)
    if partial:
        log.info("grad store: %d of %d parameters miss shards (a rank filter? first: %s); the "
                 "ranks are read as recorded, shard by shard", len(partial), len(order),
                 partial[0])
        return runs
    out = {r: ds for r, ds in runs.items() if r not in sharded}
    label = min(sharded)
    out[label] = _assemble(sharded, whole, {n: pieces[n] for n in whole}, label)
    return dict(sorted(out.items()))


def _assemble(runs: dict, names: list, pieces: dict, label: int):
    import xarray as xr

    used = sorted({r for parts in pieces.values() for r, _, _ in parts})
    steps = None
    for r in used:
        s = np.asarray(runs[r]["step"].values, np.int64)
        steps = s if steps is None else np.intersect1d(steps, s)
    rows = {r: np.searchsorted(np.asarray(runs[r]["step"].values, np.int64), steps)
            for r in used}
    first = runs[label]
    n_steps, n_params = steps.size, len(names)
    numels = np.array([_global_numel(n, pieces[n], runs) for n in names], np.int64)
    data = {}

    def shard_values(var, r, j):
        return np.asarray(runs[r][var].isel(step=rows[r], param=j).values)

    present = np.ones((n_steps, n_params), bool)
    mx = np.full((n_steps, n_params), np.nan)
    mn = mx.copy()
    sumsq = np.zeros((n_steps, n_params))
    has_l2 = "dist" in first
    if has_l2:
        n_int = first.sizes["interval"]
        counts = np.zeros((n_steps, n_params, n_int))
        zeros = np.zeros((n_steps, n_params))
    hashes = np.empty((n_steps, n_params), dtype=object) if "hash" in first else None
    per_shard_hash = []
    for k, name in enumerate(names):
        parts = sorted(pieces[name], key=lambda p: tuple(p[2]["offset"]) if p[2] else ())
        maxes, mins = [], []
        for r, j, _ in parts:
            present[:, k] &= shard_values("present", r, j).astype(bool)
            n = int(runs[r]["numel"].values[j])
            if n == 0:
                continue
            maxes.append(shard_values("max", r, j))
            mins.append(shard_values("min", r, j))
            sumsq[:, k] += shard_values("norm", r, j) ** 2
            if has_l2:
                counts[:, k] += np.rint(shard_values("dist", r, j) * n)
                zeros[:, k] += np.rint(shard_values("zeros", r, j) * n)
        if maxes:
            mx[:, k] = np.max(maxes, axis=0)
            mn[:, k] = np.min(mins, axis=0)
        if hashes is not None:
            digests = [shard_values("hash", r, j) for r, j, _ in parts]
            if len(digests) == 1:
                hashes[:, k] = digests[0]
            else:
                per_shard_hash.append(name)
                for s in range(n_steps):
                    hashes[s, k] = hashlib.md5("".join(str(d[s]) for d in digests).encode()
                                               ).hexdigest()
    absent = ~present
    for arr in (mx, mn):
        arr[absent] = np.nan
    norm = np.sqrt(sumsq)
    norm[absent] = np.nan
    data.update(present=(("step", "param"), present), max=(("step", "param"), mx),
                min=(("step", "param"), mn), norm=(("step", "param"), norm))
    with np.errstate(invalid="ignore", divide="ignore"):
        if has_l2:
            z = zeros / numels
            z[absent] = np.nan
            d = counts / numels[None, :, None]
            d[absent] = np.nan
            data["zeros"] = (("step", "param"), z)
            data["dist"] = (("step", "param", "interval"), d)
    if hashes is not None:
        data["hash"] = (("step", "param"), hashes.astype(str))
    data.update(_replica_vars(runs, names, pieces, shard_values, n_steps))
    coords = {"step": steps, "param": np.array(names, dtype=str), "numel": ("param", numels),
              "shape": ("param", np.array([_global_shape(pieces[n], runs) for n in names],
                                          dtype=str))}
    if "interval" in first.coords:
        coords["interval"] = first["interval"].values
    if "direction" in first:
        k = int(first.attrs.get("sample", 0) or 0)  # sampled sign bits (sampling.py)
        nbits = np.array([sample_size(int(n), k) for n in numels], np.int64)
        offsets = np.concatenate([[0], np.cumsum([padded_nbytes(int(n)) for n in nbits])[:-1]]
                                 ).astype(np.int64) if n_params else np.zeros(0, np.int64)
        coords["offset"] = ("param", offsets)
        if k:
            coords["nbits"] = ("param", nbits)
        for var in _BITS:
            if var in first and all(var in runs[r] for r in used):
                bits = AssembledBits(
                    {r: bit_reader(runs[r], var) for r in used}, rows,
                    [(int(o), int(n), [_piece(runs, r, j, p, k) for r, j, p in pieces[name]])
                     for name, o, n in zip(names, offsets, nbits)],
                    fill=255 if var == "significant" else 0)
                data[var] = bits_variable(("step", "byte"), bits, steps)
    attrs = {k: v for k, v in first.attrs.items() if k not in ("placement", "replica_check")}
    check = _replica_attrs(runs, names, pieces)
    if check is not None:
        attrs["replica_check"] = check
    attrs.update(rank=int(label), committed_steps=int(n_steps), assembled_from=list(used))
    if per_shard_hash:
        attrs["hash_per_shard"] = per_shard_hash
    return xr.Dataset(data, coords=coords, attrs=attrs)


def _replica_vars(runs, names, pieces, shard_values, n_steps) -> dict:
    """The replica check's variables of full parameters: a parameter's replicas disagree where
    a shard's do (codes OR-ed; the lowest differing rank; the largest gap); none when no shard
    group holds them."""
    holders = [r for r in runs if "replicas" in runs[r]]
    if not holders:
        return {}
    p = len(names)
    code = np.zeros((n_steps, p), np.uint8)
    other = np.full((n_steps, p), -1, np.int64)
    gap = np.full((n_steps, p), np.nan)
    for k, name in enumerate(names):
        for r, j, _ in pieces[name]:
            if "replicas" not in runs[r]:
                continue
            code[:, k] |= shard_values("replicas", r, j).astype(np.uint8)
            o = shard_values("replica_rank", r, j).astype(np.int64)
            other[:, k] = np.where((other[:, k] < 0) | ((o >= 0) & (o < other[:, k])), o,
                                   other[:, k])
            with np.errstate(invalid="ignore"):
                gap[:, k] = np.fmax(gap[:, k], shard_values("replica_gap", r, j))
    return {"replicas": (("step", "param"), code), "replica_rank": (("step", "param"), other),
            "replica_gap": (("step", "param"), gap)}


def _replica_attrs(runs, names, pieces):
    """``replica_check`` of full parameters: each one's label from its first shard's group."""
    checks = {r: _as_dict(runs[r].attrs.get("replica_check")) for r in runs}
    if not any(checks.values()):
        return None
    base = next(c for c in checks.values() if c)
    labels = []
    for name in names:
        label = None
        for r, j, _ in pieces[name]:
            got = (checks.get(r) or {}).get("labels") or []
            if j < len(got) and got[j]:
                label = got[j]
                break
        labels.append(label)
    return json.dumps(dict(base, labels=labels))


def _as_dict(value):
    if isinstance(value, str):
        return json.loads(value)
    return dict(value) if value else None


def union_datasets(dss: list):
    """Runs of disjoint parameters (pipeline stages, one Dataset each) as one Dataset: their
    parameters one after the other over the steps they all hold, each one's sign (and
    significance) bits placed after the previous one's (read here: the Dataset path's
    fallback)."""
    import xarray as xr

    if len(dss) == 1:
        return dss[0]
    steps = dss[0]["step"].values
    for ds in dss[1:]:
        steps = np.intersect1d(steps, ds["step"].values)
    dss = [ds.sel(step=steps) for ds in dss]
    per_param = [v for v in dss[0].data_vars if "param" in dss[0][v].dims
                 and all(v in ds for ds in dss)]
    data = {v: xr.concat([ds[v] for ds in dss], dim="param") for v in per_param}
    coords = {"step": steps, "param": np.concatenate([ds["param"].values for ds in dss])}
    for c in ("numel", "shape", "nbits"):
        if all(c in ds.coords for ds in dss):
            coords[c] = ("param", np.concatenate([ds[c].values for ds in dss]))
    out = xr.Dataset(data, coords=coords)
    if "interval" in dss[0].coords:
        out = out.assign_coords(interval=dss[0]["interval"].values)
    if all("offset" in ds.coords for ds in dss):
        base, offsets = 0, []
        for ds in dss:
            offsets.append(np.asarray(ds["offset"].values, np.int64) + base)
            base += int(ds.sizes["byte"])
        out = out.assign_coords(offset=("param", np.concatenate(offsets)))
        for var in ("direction", "significant"):
            if all(var in ds for ds in dss):
                out[var] = (("step", "byte"), np.concatenate(
                    [np.asarray(ds[var].values) for ds in dss], axis=1))
    out.attrs = {k: v for k, v in dss[0].attrs.items() if k not in ("placement",)}
    out.attrs["union_of"] = [int(ds.attrs.get("rank", i)) for i, ds in enumerate(dss)]
    left = [str(n) for ds in dss for n in (ds.attrs.get("left_out") or [])]
    if left:
        out.attrs["left_out"] = left
    return out


def _piece(runs, r, j, place, sample: int = 0):
    """(rank, byte offset in its rows, bits it recorded, local shape, offset, global shape,
    sample numbers): where a shard's bits go in the whole parameter's (the sample numbers of a
    sampled shard of a parameter larger than the sample, else None: placed by its box)."""
    ds = runs[r]
    offset = int(ds["offset"].values[j])
    nbits = int((ds["nbits"] if "nbits" in ds.coords else ds["numel"]).values[j])
    if place is None:
        return (r, offset, nbits, None, None, None, None)
    gshape = tuple(place["global_shape"])
    idx = None
    if sample and sample < int(np.prod(gshape, dtype=np.int64)):
        idx = samples_in_box(gshape, sample, place["offset"], place["local_shape"])[0]
    return (r, offset, nbits, tuple(place["local_shape"]), tuple(place["offset"]), gshape,
            idx)


class AssembledBits:
    """(step, byte) packed bits of full parameters, read from the shard groups' bits a block of
    steps at a time: each shard's bits unpacked, placed at its offsets, packed again. Reads like
    ``RawChunks`` (``read(r0, r1, c0, c1, out=)`` and unit-step slices), so the comparison's
    buffered path and the lazy Dataset variable both take it."""

    ndim = 2
    dtype = np.dtype(np.uint8)

    def __init__(self, sources: dict, rows: dict, params: list, fill: int = 0) -> None:
        self.sources, self.rows, self.params, self.fill = sources, rows, params, fill
        n = len(next(iter(rows.values()))) if rows else 0
        nbytes = params[-1][0] + padded_nbytes(params[-1][1]) if params else 0
        self.shape = (n, int(nbytes))

    def __getitem__(self, key):
        return self.read(*unit_slices(self, key))

    def _rank_rows(self, r, r0, r1) -> np.ndarray:
        idx = self.rows[r][r0:r1]
        src = self.sources[r]
        if idx.size == 0:
            return np.zeros((0, src.shape[1]), np.uint8)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        block = src.read(lo, hi)
        return block if hi - lo == idx.size and idx[0] == lo and np.all(np.diff(idx) == 1) \
            else block[idx - lo]

    def read(self, r0: int, r1: int, c0: int = 0, c1: int | None = None, out=None):
        c1 = self.shape[1] if c1 is None else c1
        rows = max(0, r1 - r0)
        full = np.full((rows, self.shape[1]), self.fill, np.uint8)
        local = {r: self._rank_rows(r, r0, r1) for r in self.sources}
        for offset, numel, parts in self.params:
            if numel == 0:
                continue
            size = padded_nbytes(numel)
            if len(parts) == 1 and parts[0][2] == numel:  # one piece: the bytes as they are
                r, lo = parts[0][:2]
                full[:, offset:offset + size] = local[r][:, lo:lo + size]
                continue
            if parts[0][6] is not None:  # a sample: each shard's bits at its sample numbers
                dense = np.zeros((rows, numel), bool)
            else:
                dense = np.zeros((rows, *parts[0][5]), bool)
            for r, lo, n, lshape, goff, _, idx in parts:
                if n == 0:
                    continue
                bits = np.unpackbits(local[r][:, lo:lo + -(-n // 8)], axis=1, count=n)
                if idx is not None:
                    dense[:, idx] = bits.astype(bool)
                    continue
                region = (slice(None),) + tuple(slice(o, o + s) for o, s in zip(goff, lshape))
                dense[region] = bits.reshape(rows, *lshape).astype(bool)
            packed = np.packbits(dense.reshape(rows, numel), axis=1)
            full[:, offset:offset + packed.shape[1]] = packed
            if self.fill and numel % 8:  # padding bits of the significance are ones
                full[:, offset + numel // 8] |= 0xFF >> (numel % 8)
        result = full[:, c0:c1]
        if out is not None:
            out[...] = result
            return out
        return result
