"""Where the statistics live: the Zarr store, msprobe's dump folders, and the readers of both.

``store`` (a rank group's layout, ``GradWriter``, reader), ``live`` (the one writing thread),
``chunks`` (raw chunk-file I/O), ``storage`` (local folder or fsspec URL), ``restarts`` (the
store over restarts: ``segments``), ``assemble`` (full parameters from shards), ``sources``
(``open_grads``, ``load_runs``: any path or Dataset -> {rank: Dataset}), ``msprobe`` (msprobe's
grad dumps read and written), ``export`` (any run in msprobe's layout), ``names`` (parameter
names without wrapper prefixes).

May import: ``numerics`` and probekit's shared modules. Not ``record`` or ``compare``.
"""
