"""Turn what a user hands over (a path or a Dataset) into {rank: Dataset} for the grad probe.

A path may be a probekit dump folder (holding ``grads.zarr``), the ``grads.zarr`` store itself,
an fsspec URL of either (``storage.py``), or an msprobe grad dump folder
(``rank{r}/grad_summary_{step}.csv`` + ``step{s}/*.npy``).
"""
from __future__ import annotations

import os

import numpy as np

from ..log import get_logger
from . import msprobe
from .assemble import assemble_runs, is_sharded
from .storage import location
from .store import GradStoreError, find_store, open_rank, store_ranks

log = get_logger(__name__)


def _is_dataset(obj) -> bool:
    return type(obj).__name__ == "Dataset" and hasattr(obj, "data_vars")


def load_runs(source, *, chunks=None, storage_options=None, shards: bool = False) -> dict:
    """{rank: Dataset} for a path or URL, a Dataset or a dict of Datasets.

    A run recorded shard by shard (FSDP2, tensor parallel: rank groups with a ``placement``)
    comes back assembled: one Dataset of full parameters, under the lowest rank that recorded a
    shard (``assemble.py``); ``shards=True`` gives each rank's shards as recorded instead."""
    if _is_dataset(source):
        return {int(source.attrs.get("rank", 0)): source}
    if isinstance(source, dict):
        return {int(r): ds for r, ds in source.items()}
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"grad run: {type(source).__name__} is not valid; accepted: a path or "
                        "URL of a probekit or msprobe dump, or an xarray Dataset from open_grads")
    fs, path = location(source, storage_options)
    if not fs.remote and not os.path.isdir(path):
        raise GradStoreError(f"grad run: {path!r} is not a folder")
    ranks, reader = _rank_reader(fs, path, chunks)
    runs = {r: reader(r) for r in ranks}
    runs = runs if shards else assemble_runs(runs)
    for ds in runs.values():
        _count_no_grad(ds)
    return runs


def without_grad(ds) -> list[str]:
    """The parameters of ``ds`` that have no gradient at any of its steps (none when it has no
    step): frozen ones, ones the backward pass never reached."""
    if "present" not in ds.data_vars or not ds.sizes.get("step", 0):
        return []
    had = np.asarray(ds["present"].any("step").values, bool)
    return [str(name) for name, h in zip(ds["param"].values, had) if not h]


def _count_no_grad(ds):
    """Note in ``ds.attrs["no_grad"]`` how many parameters never had a gradient."""
    ds.attrs["no_grad"] = len(without_grad(ds))
    return ds


def _rank_reader(fs, path: str, chunks):
    """(ranks recorded at ``path``, a function reading one of them): msprobe dump or our store."""
    if not fs.remote and os.path.isdir(path) and msprobe.is_grad_dump(path):
        return msprobe.grad_dump_ranks(path), lambda r: msprobe.read_grad_dump(path, r)
    store = find_store(path, fs)
    return store_ranks(store, fs), lambda r: open_rank(store, r, chunks=chunks, fs=fs)


def open_grads(path, rank=None, chunks=None, *, storage_options=None, shards: bool = False):
    """One rank of a recorded run as an xarray Dataset (committed steps only).

    ``path``: a dump folder with ``grads.zarr``, the store itself, an msprobe grad dump, or an
    fsspec URL of a store (``s3://bucket/run``, ``gs://...``, ``memory://...``; credentials from
    the usual ``AWS_*`` variables or ``storage_options``). ``rank``: needed when several ranks
    were recorded. ``chunks="auto"``: dask arrays over the Zarr chunks (lazy; for stores larger
    than memory) instead of loading into memory.

    A sharded run (FSDP2, tensor parallel) is assembled: full-parameter statistics and sign
    bits, as a single process would have recorded them, over the steps every rank holding a
    shard committed; ``shards=True`` opens one rank's shards as recorded.

    Variables: ``max``, ``min``, ``norm`` (step, param), ``present`` (step, param), ``hash``
    (L0), ``zeros`` and ``dist`` (step, param, interval) (L2), ``direction`` (step, byte) packed
    sign bits (L1/L2); coordinates ``step``, ``param``, ``numel``, ``shape``, ``offset``,
    ``interval``. The attribute ``no_grad`` counts the parameters that have no gradient at any
    step (a WARNING says so when that is all of them: an empty recording).
    """
    ds = _open(path, rank, chunks, storage_options, shards)
    _count_no_grad(ds)
    n, steps = ds.sizes.get("param", 0), ds.sizes.get("step", 0)
    if steps and n and ds.attrs["no_grad"] == n:
        log.warning("grad run %s: none of its %d parameters has a gradient at any of its %d "
                    "steps: the recording is empty (frozen parameters, or a backward pass that "
                    "did not reach them)", path if isinstance(path, str) else os.fspath(path),
                    n, steps)
    return ds


def _open(path, rank, chunks, storage_options, shards):
    label = path if isinstance(path, str) else os.fspath(path)
    fs, where = location(path, storage_options)
    ranks, reader = _rank_reader(fs, where, chunks)
    if rank in ranks:  # one rank asked for: read it alone unless it is a shard of a whole
        ds = reader(rank)
        if shards or not is_sharded(ds):
            return ds
    runs = {r: reader(r) for r in ranks}
    runs = runs if shards else assemble_runs(runs)
    ranks = sorted(runs)
    if rank is None:
        if len(ranks) != 1:
            raise GradStoreError(f"{label!r} holds ranks {ranks}; pass rank= one of them")
        rank = ranks[0]
    if rank not in runs:
        raise GradStoreError(f"rank: {rank!r} is not valid for {label!r}; accepted: {ranks}"
                             + ("" if shards else " (shards=True opens each rank's shards)"))
    return runs[rank]
