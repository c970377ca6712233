"""Write a grad run in another tool's layout (``probekit grads export --to msprobe``).

Above both the readers (``sources.load_runs``: any path, URL or Dataset -> {rank: Dataset}) and
the format itself (``msprobe.write_rank``), so the format module never imports the readers that
import it.
"""
from __future__ import annotations

import os

from .msprobe import write_rank
from .sources import load_runs


def write_grad_dump(source, out_path: str, ranks=None, storage_options=None) -> list[str]:
    """Write a grad run (path, URL or Dataset) in msprobe's layout under ``out_path``; returns
    the files written. ``ranks``: the ranks to write (default: all)."""
    runs = load_runs(source, chunks=None, storage_options=storage_options)
    written = []
    for rank, ds in sorted(runs.items()):
        if ranks is not None and rank not in ranks:
            continue
        written += write_rank(ds, os.path.join(out_path, f"rank{rank}"))
    return written
