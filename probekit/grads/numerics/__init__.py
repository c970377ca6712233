"""The numbers: what is computed from a gradient, and the index arithmetic over its elements.

``stats`` (one step's per-parameter statistics and packed sign bits: ``compute`` -> ``StepStats``;
the ``Layout`` the store writes), ``kernel`` (the fused chunk kernel, ``_kernel.c`` built as
``probekit.grads.numerics._kernel``, and its numpy twin), ``sampling`` (sampled sign bits and
their confidence intervals), ``geometry`` (boxes of a parameter's index space and the runs of
bits two runs share).

The bottom stage: the recorder computes with it, the store writes its layout, the comparison
counts with its kernel. May import probekit's shared modules only.
"""
