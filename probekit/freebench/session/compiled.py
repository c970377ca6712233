"""torch.compile under the free benchmark: refused, with the way out.

A ``TorchFunctionMode`` on the stack makes dynamo trace a compiled model again, break its graph
at the mode and run it eagerly: the loss becomes the eager one (not the compiled one) and the
eager calls are checked instead of the compiled kernels. Check mode must never change what the
training computes, so the probe refuses: while it is active on a thread, a dynamo compilation
started on that thread raises ``CompiledModelError`` before anything runs (dynamo reports it as
``InternalTorchDynamoError`` carrying this message), and ``start(model)`` refuses a compiled module
up front. The guard is installed when dynamo is loaded (``torch.compile`` loads it), so a model
first compiled inside the probe's block is not caught in that block. The way out is to probe the uncompiled module (``compiled._orig_mod`` or the module
given to ``torch.compile``) in the steps that are checked.
"""
from __future__ import annotations

import sys
import threading

MESSAGE = ("the free benchmark cannot check a torch.compile'd model: under the probe dynamo would "
           "run it eagerly (the loss would be the eager one, not the compiled one) and its "
           "compiled kernels would not be checked. Probe the uncompiled module instead: call "
           "`model._orig_mod` (the module given to torch.compile) inside `with fb:` for the "
           "checked steps, and the compiled model outside it.")


class CompiledModelError(RuntimeError):
    """A compiled model (or any dynamo compilation) met an active free benchmark."""


def is_compiled_module(model) -> bool:
    """True for what ``torch.compile(module)`` returns (dynamo's ``OptimizedModule``)."""
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


class CompileGuard:
    """While installed, a dynamo compilation on the installing thread raises
    ``CompiledModelError``; ``refused`` counts them. ``remove()`` is idempotent."""

    def __init__(self) -> None:
        self.refused = 0
        self._callback = None
        self._handler = None   # dynamo's callback handler, kept from install()
        self._thread = None

    def install(self) -> None:
        if "torch._dynamo" not in sys.modules:
            # nothing was compiled in this process yet (torch.compile imports dynamo): no
            # compiled model can run; importing dynamo here would cost ~1 s per process
            return
        from torch._dynamo.callback import callback_handler

        self._thread = threading.get_ident()

        def on_compile_start(*_args):
            if threading.get_ident() != self._thread:
                return
            self.refused += 1
            raise CompiledModelError(MESSAGE)

        self._callback = callback_handler.register_start_callback(on_compile_start) \
            or on_compile_start
        self._handler = callback_handler

    def remove(self) -> None:
        cb, self._callback = self._callback, None
        if cb is None:
            return
        try:
            self._handler.remove_start_callback(cb)
        except ValueError:
            pass
