"""MindSpore's bytecode capture (``@ms.jit(capture_mode="bytecode")``, PIJit) and the probe.

PIJit compiles a train step by reading its Python bytecode. When it captures the whole step in one
graph, the tap's ``pyfunc`` callbacks run as plain Python (MindSpore's kernel threads call them)
and the step is recorded like an ``ast`` one (tested: the same values as PyNative). When it does
not, it runs the rest of the step as Python, with its frame hook still on. Two things cause that:
a graph break (``print``, ``asnumpy()``, a call it cannot compile) or a compile failure it logs
(``[ERROR] PI ... JitCompileWithTry``). With the tap in the optimizer, MindSpore 2.10.0 logs
``The start_offset is 6, which exceeds the number of new args 5`` for a step whose loss is a
lambda, and a ``code_generator.cc ... Transform`` failure with the in-graph (``where="device"``)
statistics. While that Python runs, the hook rewrites every Python function called meanwhile, on
any thread: the tap's callbacks, and probekit's statistics under them. That code then crashes the
process (segmentation fault, exit code 139, in ``probekit/grads/numerics/stats.py``).

The callbacks can tell: their own frame then runs PIJit's rewrite of their code (a code object
named like ``7I.0R._on_host_grad``), not the code itself, and so does a function they call
(``plain``). Each callback checks both first, and the probe then raises ``GraphModeError``
(``bytecode_message``), which MindSpore hands unchanged to the caller of the train step. The check
has to stay that small: rewritten code that does more, even passing a frame object to a
function, can crash too. Raising stops the step before the optimizer's update (which waits for the
callbacks): failing at the first step, rather than dropping the statistics and training on
unrecorded, at the cost that MindSpore cannot run that compiled step again.
"""
from __future__ import annotations

import sys


def plain() -> bool:
    """True when this call runs this function's own code; False when PIJit rewrote it, as it
    does for every function called while it runs a bytecode-captured step as Python."""
    return sys._getframe().f_code is plain.__code__


def bytecode_message(step: int) -> str:
    return (
        f"grad_probe: step {step} stopped before the optimizer's update and is not recorded: it "
        "runs in a train step compiled with @ms.jit(capture_mode=\"bytecode\") that MindSpore "
        "did not capture into one graph (a graph break, or a compile failure it logged). "
        "MindSpore then rewrites every Python function called during the step, probekit's "
        "statistics included, and the process crashes. Compile the train step anew with @ms.jit "
        "(capture_mode=\"ast\", the default), or use GRAPH_MODE: both are recorded")
