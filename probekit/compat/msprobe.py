"""Moved: the msprobe grad-dump format lives with the grad probe, ``probekit.grads.store.msprobe``
(``write_grad_dump``: ``probekit.grads.store.export``).

This module keeps the old import path working, with a ``DeprecationWarning``.
"""
import warnings

from ..grads.store.export import write_grad_dump
from ..grads.store.msprobe import (
    MsprobeDumpError, grad_dump_ranks, is_grad_dump, parse_number, read_grad_dump)

warnings.warn("probekit.compat.msprobe moved to probekit.grads.store.msprobe (write_grad_dump: "
              "probekit.grads.store.export)", DeprecationWarning, stacklevel=2)

__all__ = ["MsprobeDumpError", "grad_dump_ranks", "is_grad_dump", "parse_number",
           "read_grad_dump", "write_grad_dump"]
