"""The free benchmark's public session: what a user starts, steps and stops.

``bench`` (``FreeBench``, ``open_session`` for ``PrecisionDebugger``), ``modules`` (module scope:
which named module runs now), ``coverage`` (no silent zero coverage), ``compiled``
(torch.compile refused, with the way out).

May import: ``report``, ``repro``, ``engine``, ``judge``, ``perturb``, ``names`` and probekit's
shared modules (config, dist, log). Nothing below imports it.
"""
