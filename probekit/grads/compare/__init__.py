"""Comparing two runs: sign-bit similarity, flags, verdicts against a control, and reports.

``compare`` (``compare_grads``), ``opening`` (a run's segments and rank groups as the comparison
reads them), ``planner`` (the element ranges two runs share), ``counting`` (the count tasks),
``engine`` (where the graph runs: local cores or a dask cluster), ``unmatched`` (parameters of
one run only), ``verdict`` (verdicts with a null), ``suspects`` (the modules owning the first
diverging parameters), ``report`` and ``pictures`` (msprobe's ``GradComparator`` output),
``cli`` (``probekit grads compare|summary|export``).

May import: ``store``, ``numerics`` and probekit's shared modules. Not ``record`` (a peer).
"""
