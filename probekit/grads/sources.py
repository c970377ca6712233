"""Turn what a user hands over (a path or a Dataset) into {rank: Dataset} for the grad probe.

A path may be a probekit dump folder (holding ``grads.zarr``), the ``grads.zarr`` store itself,
or an msprobe grad dump folder (``rank{r}/grad_summary_{step}.csv`` + ``step{s}/*.npy``).
"""
from __future__ import annotations

import os

from .store import GradStoreError, find_store, open_rank, store_ranks


def _is_dataset(obj) -> bool:
    return type(obj).__name__ == "Dataset" and hasattr(obj, "data_vars")


def load_runs(source, *, chunks=None) -> dict:
    """{rank: Dataset} for a path, a Dataset or a dict of Datasets."""
    if _is_dataset(source):
        return {int(source.attrs.get("rank", 0)): source}
    if isinstance(source, dict):
        return {int(r): ds for r, ds in source.items()}
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"grad run: {type(source).__name__} is not valid; accepted: a path to a "
                        "probekit or msprobe dump, or an xarray Dataset from open_grads")
    path = os.fspath(source)
    if not os.path.isdir(path):
        raise GradStoreError(f"grad run: {path!r} is not a folder")
    ranks, reader = _rank_reader(path, chunks)
    return {r: reader(r) for r in ranks}


def _rank_reader(path: str, chunks):
    """(ranks recorded at ``path``, a function reading one of them): msprobe dump or our store."""
    from . import msprobe

    if os.path.isdir(path) and msprobe.is_grad_dump(path):
        return msprobe.grad_dump_ranks(path), lambda r: msprobe.read_grad_dump(path, r)
    store = find_store(path)
    return store_ranks(store), lambda r: open_rank(store, r, chunks=chunks)


def open_grads(path, rank=None, chunks=None):
    """One rank of a recorded run as an xarray Dataset (committed steps only).

    ``path``: a dump folder with ``grads.zarr``, the store itself, or an msprobe grad dump.
    ``rank``: needed when several ranks were recorded. ``chunks="auto"``: dask arrays over the
    Zarr chunks (lazy; for stores larger than memory) instead of loading into memory.

    Variables: ``max``, ``min``, ``norm`` (step, param), ``present`` (step, param), ``hash``
    (L0), ``zeros`` and ``dist`` (step, param, interval) (L2), ``direction`` (step, byte) packed
    sign bits (L1/L2); coordinates ``step``, ``param``, ``numel``, ``shape``, ``offset``,
    ``interval``.
    """
    path = os.fspath(path)
    ranks, reader = _rank_reader(path, chunks)
    if rank is None:
        if len(ranks) != 1:
            raise GradStoreError(f"{path!r} holds ranks {ranks}; pass rank= one of them")
        rank = ranks[0]
    if rank not in ranks:
        raise GradStoreError(f"rank: {rank!r} is not valid for {path!r}; accepted: {ranks}")
    return reader(rank)
