"""From a re-run to a verdict: how far the output moved, and whether that is a finding.

``metric`` (the error of a re-run relative to the call's scale), ``scales`` (the error model every
threshold comes from), ``magnitudes`` (the magnitude of families that subtract), ``handlers``
(thresholds, check and fix), ``cause`` (the float64 analysis: inaccurate, ill-conditioned or
unconfirmed), ``deferred`` (comparisons kept on the device until the step's gather), ``judging``
(the engine's judging part), ``guards`` (no TorchFunctionMode or autocast sees probekit's own
work).

May import: ``perturb``, ``names`` and probekit's shared modules. Not ``engine`` or above.
"""
