"""Module scope for the free benchmark: which named module is running right now.

``ModuleScope(model, names)`` resolves ``names`` against ``model.named_modules()`` (an unknown
name is a ``ConfigError`` listing the close names) and, on ``attach()``, puts a forward pre-hook
and an always-called forward hook on every module of those subtrees. The hooks keep a stack of
the running named modules and ``depth``, the number of scoped modules on it: the engine checks
only calls made while ``depth > 0`` (nested submodules included, a module called twice per step
counted at each call), and ``current`` names the innermost running module (the ``module``
column). Modules outside the scoped subtrees get no hook, so they cost nothing. The backward
checks of ``fuzz_stage="backward"`` are decided when the API is called in the forward, so a
module's backward is covered through the calls of its forward; they are attributed to the module
that was running then. ``detach()`` (always called by ``FreeBench.stop()``) removes every hook.
"""
from __future__ import annotations

import difflib

from ...config import ConfigError


def close_names(name: str, names, n: int = 5) -> list[str]:
    """The module names closest to ``name`` (difflib), then those sharing its last component."""
    names = list(names)
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    tail = name.rsplit(".", 1)[-1]
    close += [m for m in names if m.rsplit(".", 1)[-1] == tail and m not in close]
    return close[:n]


def resolve(model, names, key: str = "free_benchmark.module") -> dict:
    """``{name: module}`` for ``names``; an unknown name raises a ``ConfigError`` naming it, the
    model and the close names."""
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        if name not in modules:
            close = close_names(name, [m for m in modules if m])
            hint = (f"close names: {', '.join(repr(c) for c in close)}" if close else
                    f"names from model.named_modules(), e.g. "
                    f"{', '.join(repr(m) for m in list(modules)[1:6])}")
            raise ConfigError(f"{key}: {name!r} is not a module of this "
                              f"{type(model).__name__}; accepted: {hint}")
        out[name] = modules[name]
    return out


class ModuleScope:
    """Tracks the running named modules of the scoped subtrees of ``model``."""

    def __init__(self, model, names) -> None:
        self.names = tuple(names)
        self.targets = resolve(model, self.names)
        self._model = model
        self.stack: list[str] = []
        self.depth = 0
        self.handles: list = []

    @property
    def current(self) -> str:
        """The innermost running named module ("" outside every scoped module)."""
        return self.stack[-1] if self.stack else ""

    def attach(self) -> None:
        """Hook every module of the scoped subtrees (idempotent; state reset)."""
        self.detach()
        target_ids = {id(m) for m in self.targets.values()}
        seen = set()
        try:
            for name, root in self.targets.items():
                for sub, mod in root.named_modules(prefix=name):
                    if id(mod) in seen:
                        continue
                    seen.add(id(mod))
                    scoped = id(mod) in target_ids
                    self.handles.append(mod.register_forward_pre_hook(self._pre(sub, scoped)))
                    self.handles.append(mod.register_forward_hook(self._post(scoped),
                                                                  always_call=True))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()
        self.stack.clear()
        self.depth = 0

    def _pre(self, name: str, scoped: bool):
        def hook(module, args):
            self.stack.append(name)
            if scoped:
                self.depth += 1
        return hook

    def _post(self, scoped: bool):
        def hook(module, args, output):
            if self.stack:
                self.stack.pop()
            if scoped and self.depth:
                self.depth -= 1
        return hook
