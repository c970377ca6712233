"""The interception engine: which calls are checked, and how each check runs.

``intercept`` (the ``TorchFunctionMode``: names, filters, checks a call; ``Engine``), ``backward``
(input-gradient checks), ``realgrad`` (the gradients a call hands its inputs in the real backward),
``autocast`` (perturb at the precision an op computes in), ``rng`` (random calls replayed on the
same stream), ``state`` (calls that write tensors), ``blocks`` (large outputs checked block by
block), ``budget`` (the overhead budget, call-site coverage), ``preheat`` (msprobe's sampling
rule).

May import: ``judge``, ``perturb``, ``names`` and probekit's shared modules. Not ``session``,
``report`` or ``repro``.
"""
