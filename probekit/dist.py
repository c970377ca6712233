"""Rank of this process: torch.distributed when initialised, else the launcher's RANK, else 0.

Imports no framework: a process that never imported torch cannot have initialised its process
group (so ``import probekit`` stays light, and works where torch is not installed).
"""
from __future__ import annotations

import os
import sys


def get_rank() -> int:
    if initialized():
        return sys.modules["torch"].distributed.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def initialized() -> bool:
    """torch.distributed's process group is initialised in this process."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    return dist is not None and dist.is_available() and dist.is_initialized()


class RankCache:
    """``get_rank()`` read again only where it can have changed: a rank read before the process
    group was initialised (the launcher's ``RANK``, or 0) is read again once it is; one read
    from the group stays (a group's rank does not change). Cheaper than ``get_rank()`` at
    every step start: reading ``os.environ`` right after a training step costs ~10 us."""

    __slots__ = ("rank", "_from_group")

    def __init__(self) -> None:
        self.rank = None
        self._from_group = False

    def get(self) -> int:
        if self.rank is None or (not self._from_group and initialized()):
            self._from_group = initialized()
            self.rank = get_rank()
        return self.rank


def rank_selected(ranks, rank: int | None = None) -> bool:
    """True when this process's rank (``rank``, else ``get_rank()``) is in ``ranks`` (an empty
    filter selects every rank)."""
    return not ranks or (get_rank() if rank is None else rank) in ranks


def restart_count() -> int:
    """torchelastic's restart count of this job (``TORCHELASTIC_RESTART_COUNT``; 0 otherwise):
    above 0, this process is a restart of a job that failed."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


_DECISIONS: dict = {}  # (kind, target) -> decisions this process took part in (the key's part)


def agree(kind: str, target: str, decide, error=None) -> dict:
    """``decide(scope)`` once for the job, its JSON-able result for every rank: under
    torch.distributed the first rank to claim the key decides and publishes its decision in the
    process group's store, the others wait for it (a key-value exchange, no collective);
    otherwise this process decides alone (scope "job" when it is the whole job, "rank" when
    other processes run beside it, ``WORLD_SIZE`` > 1). A ``ProbekitError`` of the decision is
    raised on every rank (as ``error``, default its own type's base ``ProbekitError``). The key
    holds ``kind``, the restart count, a hash of ``target`` (what is decided about: a store)
    and how many decisions this process took about it."""
    import datetime
    import hashlib
    import json

    from .errors import ProbekitError

    error = error or ProbekitError
    n = _DECISIONS[(kind, target)] = _DECISIONS.get((kind, target), 0) + 1
    kv = None
    dist = sys.modules["torch"].distributed if initialized() else None
    if dist is not None and dist.get_world_size() > 1:
        try:
            kv = dist.distributed_c10d._get_default_store()
        except Exception:  # pragma: no cover - another torch: each rank decides alone
            kv = None
    if kv is None:
        alone = int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1
        return decide("job" if alone else "rank")
    key = "probekit/{}/{}/{}/{}".format(kind, restart_count(),
                                        hashlib.sha1(target.encode()).hexdigest()[:16], n)
    me = f"{os.getpid()}-{get_rank()}"
    claimed = kv.compare_set(key + "/claim", "", me)
    if (claimed.decode() if isinstance(claimed, bytes) else claimed) == me:
        try:
            out = decide("job")
        except ProbekitError as exc:
            out = {"error": str(exc)}
        except Exception as exc:  # the others must not wait for a decision that never comes
            out = {"error": f"{kind}: the decision failed: {type(exc).__name__}: {exc}"}
        kv.set(key + "/run", json.dumps(out))
    else:
        kv.wait([key + "/run"], datetime.timedelta(seconds=600))
        raw = kv.get(key + "/run")
        out = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    if "error" in out:
        raise error(out["error"])
    return out
