"""What a grad probe wrote, in one line: steps, parameters, bytes, where the store is.

``GradProbe.summary`` (PyTorch and MindSpore alike) is a ``ProbeSummary``: a dict of the numbers
whose ``str()`` is the line ``stop()`` logs (the store relative to the working folder when it is
inside it)::

    grad_probe: 3 steps x 4 params recorded, 19.6 KiB (20,051 bytes) in run/grads.zarr/rank0
"""
from __future__ import annotations

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int) -> str:
    """``20051`` -> ``"19.6 KiB"`` (binary units, one decimal; bytes as an integer)."""
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{int(n)} bytes" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


class ProbeSummary(dict):
    """``{"steps": committed steps, "params": parameters recorded, "bytes": bytes the rank
    group holds on its storage, "store": its location (None: this rank records nothing)}``, and
    where the recorder knows it ``"no_grad"``: parameters that never had a gradient at a
    recorded step, and ``"replicas"``: the replica check's ``{"checked": replicated parameters
    checked, "disagree": [their first disagreements, by step]}``; ``str()`` is the one-line
    summary."""

    def __str__(self) -> str:
        steps, params = self["steps"], self["params"]
        if self["store"] is None:
            return (f"grad_probe: nothing recorded on this rank ({params} params monitored)"
                    + replicas_text(self.get("replicas")))
        size = human_bytes(self["bytes"])
        return (f"grad_probe: {steps} step{'' if steps == 1 else 's'} x {params} "
                f"param{'' if params == 1 else 's'} recorded, "
                + (size if self["bytes"] < 1024 else f"{size} ({self['bytes']:,} bytes)")
                + f" in {shown_location(self['store'])}"
                + (no_grad_text(self.get("no_grad"), params) if steps else "")
                + replicas_text(self.get("replicas")))


def shown_location(store: str) -> str:
    """``store`` as the line shows it: relative to the working folder when it lies inside it
    (``run_a/grads.zarr/rank0``), else as it is (an absolute path, a URL)."""
    import os

    if "://" in store or not os.path.isabs(store):
        return store
    try:
        rel = os.path.relpath(store)
    except (ValueError, OSError):  # another drive; no working folder any more
        return store
    return store if rel.startswith(os.pardir) else rel


def no_grad_text(no_grad, params: int) -> str:
    """``"; 2 of 6 params never had a gradient"`` (empty when none or unknown)."""
    if not no_grad:
        return ""
    return f"; {no_grad} of {params} param{'' if params == 1 else 's'} never had a gradient"


def replicas_text(replicas) -> str:
    """``"; replicas of `p` disagree from step 0 (tp ranks 0/1: gradients)"`` (the first,
    the others counted), ``"; the replicas of 4 params agree"``, or empty (no check)."""
    if not replicas:
        return ""
    from ..store.replicas import replica_lines

    events = replicas.get("disagree") or []
    if events:
        return "; " + "; ".join(replica_lines(events, limit=1))
    n = int(replicas.get("checked", 0))
    return f"; the replicas of {n} param{'' if n == 1 else 's'} agree" if n else ""


def probe_summary(writer, params: int, no_grad: int | None = None,
                  replicas: dict | None = None) -> ProbeSummary:
    """The summary of a probe writing through ``writer`` (a ``store.GradWriter``, or None for a
    rank that records nothing): its committed steps, the bytes its rank group holds now, and
    ``no_grad`` when given (parameters that never had a gradient at a recorded step)."""
    extra = {} if no_grad is None else {"no_grad": int(no_grad)}
    if replicas is not None:
        extra["replicas"] = replicas
    if writer is None:
        return ProbeSummary(steps=0, params=int(params), bytes=0, store=None)
    return ProbeSummary(steps=int(writer.committed), params=int(params),
                        bytes=int(writer.nbytes()), store=writer.url, **extra)
