"""Parameters found in one run only: a comparison names them instead of dropping them silently.

``compare_grads`` pairs parameters by name; the others are kept in its result
(``unmatched_vars``: names, counts, each run's parameter count), logged (``unmatched_text``)
and judged by the CLIs (``mostly_unmatched``: more than half of a run without a counterpart
makes ``probekit grads compare`` and ``probekit mindspore compare`` exit 1 unless
``--allow-unmatched``).
"""
from __future__ import annotations

import numpy as np


def unmatched_vars(only_first, only_second, n_first: int, n_second: int) -> dict:
    """The parameters of one run only as a comparison's variables: ``only_in_first`` /
    ``only_in_second``, names along their own position coordinate ``first_only`` /
    ``second_only`` (so ranks concatenate: a rank with fewer is padded with ""), their counts
    ``n_only_in_first`` / ``n_only_in_second``, and each run's parameter count
    ``n_params_first`` / ``n_params_second``."""
    return {"only_in_first": (("first_only",), np.array(only_first, dtype=str)),
            "only_in_second": (("second_only",), np.array(only_second, dtype=str)),
            "first_only": (("first_only",), np.arange(len(only_first))),
            "second_only": (("second_only",), np.arange(len(only_second))),
            "n_only_in_first": ((), len(only_first)), "n_only_in_second": ((), len(only_second)),
            "n_params_first": ((), int(n_first)), "n_params_second": ((), int(n_second))}


def unmatched(result) -> dict:
    """The parameters of one run only in a one-rank comparison (``result.sel(rank=r)`` or
    ``compare_rank``'s): ``{"first": [names], "second": [names], "n_first": params of the
    first run, "n_second": ...}``."""
    def names(var):
        return [str(n) for n in np.asarray(result[var].values).ravel() if str(n)]

    return {"first": names("only_in_first"), "second": names("only_in_second"),
            "n_first": int(result["n_params_first"].item()),
            "n_second": int(result["n_params_second"].item())}


def unmatched_text(only_first, only_second, n_first: int, n_second: int,
                   limit: int = 10) -> str:
    """``"2 parameters in one run only, not compared: second run only (2 of 6): h.2.weight,
    h.2.bias"`` ("" when every parameter has its counterpart); at most ``limit`` names a run."""
    if not only_first and not only_second:
        return ""
    parts = []
    for which, names, total in (("first", only_first, n_first), ("second", only_second,
                                                                 n_second)):
        if names:
            shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more"
                                                 if len(names) > limit else "")
            parts.append(f"{which} run only ({len(names)} of {total}): {shown}")
    k = len(only_first) + len(only_second)
    return (f"{k} parameter{'' if k == 1 else 's'} in one run only, not compared: "
            + "; ".join(parts))


def mostly_unmatched(result) -> list:
    """``"4 of the second run's 6 parameters"`` for each run of a one-rank comparison more than
    half of whose parameters have no counterpart in the other."""
    u = unmatched(result)
    return [f"{len(u[which])} of the {which} run's {u['n_' + which]} parameters"
            for which in ("first", "second") if 2 * len(u[which]) > u["n_" + which]]
