"""Recording: the hooks on a training that turn its gradients into statistics, step by step.

``recorder`` (``GradProbe``: the optimizer's pre-step hook, step counting, filters), ``task``
(the grad probe behind ``PrecisionDebugger(task="grad_probe")``), ``control`` (a control run:
the reference's code with its rounding drawn at random), ``placement`` (which part of each
gradient a rank records), ``rawgrads`` (``grad_point="backward"``), ``summary`` (the one line a
recording ends with).

May import: ``store``, ``numerics`` and probekit's shared modules. Not ``compare`` (a peer: a
recording never needs the comparison, nor the comparison a recorder).
"""
