"""Perturbations: what each ``pert_mode`` means and the functions that apply it.

``modes`` (one registry entry per ``pert_mode`` with its traits; torch-free: ``probekit.config``
reads it, so this ``__init__`` imports nothing), ``perturb`` (pure functions on tensors and the
registry applying them to a call).

May import: ``names`` and probekit's shared modules. Not ``judge`` or above.
"""
