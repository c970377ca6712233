"""Rank of this process: torch.distributed when initialised, else the launcher's RANK, else 0.

Imports no framework: a process that never imported torch cannot have initialised its process
group (so ``import probekit`` stays light, and works where torch is not installed).
"""
from __future__ import annotations

import os
import sys


def get_rank() -> int:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def rank_selected(ranks) -> bool:
    """True when this process's rank is in ``ranks`` (an empty filter selects every rank)."""
    return not ranks or get_rank() in ranks
