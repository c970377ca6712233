"""A finding as a standalone repro folder: a script needing only torch, its inputs, REPORT.md.

``folder`` (``of_call`` and the folder ``FreeBench.repro`` writes), ``record`` (what a finding's
call needs to run again, saved by the session), ``script`` (the text of ``repro.py`` and
``REPORT.md``), ``shrink`` (smaller inputs that still reproduce), ``helpers`` (the measuring
functions, standalone: a script carries a copy of their source, it imports no probekit).

``probekit.freebench.repro.of_call`` is the documented way to write a folder for any call; it
loads on first access (this package imports nothing itself).

May import: ``engine``, ``judge``, ``perturb``, ``names`` and probekit's shared modules. Not
``session`` or ``report``.
"""
from __future__ import annotations

from ...lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"of_call": ".folder", "Repro": ".folder"})
