"""Findings as the user reads them: rows, the findings view and the command line.

``results`` (the row layout, msprobe's CSV columns first, the DataFrame), ``view`` (one table of
findings merged per call, headless; the notebook layer subclasses it), ``cli`` (``probekit
freebench report|repro``).

May import: ``repro``, ``engine``, ``judge``, ``perturb``, ``names`` and probekit's shared
modules. Not ``session``.
"""
