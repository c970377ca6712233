"""Parameter names as people read them: the prefixes wrappers add are removed.

``torch.compile`` records ``_orig_mod.transformer.wte.weight``, DDP/DataParallel ``module.*``, FSDP1
and activation checkpointing insert ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.``
anywhere in the path. The grad probe stores the cleaned name (so a compiled run compares with an
eager one, a DDP run with a single-process one) and keeps the recorded name in the store.
"""
from __future__ import annotations

#: path components inserted by wrappers wherever they wrap a submodule
WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
#: prefixes of whole-model wrappers (DDP, DataParallel): removed at the start only, since a user
#: submodule may well be called ``module``
LEADING_PARTS = ("module",)


def canonical_name(name: str) -> str:
    """``module._orig_mod.h.0._checkpoint_wrapped_module.attn.weight`` -> ``h.0.attn.weight``."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] in LEADING_PARTS:
        parts = parts[1:]
    return ".".join(parts)


def canonical_names(names) -> tuple[str, ...]:
    """The cleaned names, or the names as given if cleaning would make two of them equal."""
    names = tuple(names)
    clean = tuple(canonical_name(n) for n in names)
    return clean if len(set(clean)) == len(clean) else names


class LayerOffset:
    """A ``rename`` for a pipeline stage that numbers its layers from 0 (Megatron-LM,
    hand-split stages): ``layers.{i}`` -> ``layers.{i + offset}`` wherever ``{container}.{i}``
    is a whole part of the name (``decoder.layers.0.mlp.weight`` -> ``decoder.layers.4.mlp.
    weight`` with ``offset=4``), every other name unchanged. ``layer_offset(4)`` makes one;
    it pickles (a comparison on a dask cluster takes it)."""

    def __init__(self, offset: int, container: str = "layers") -> None:
        import re

        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"layer_offset: offset {offset!r} is not valid; accepted: an "
                             "integer >= 0 (the global index of the stage's first layer)")
        if not isinstance(container, str) or not container or "." in container:
            raise ValueError(f"layer_offset: container {container!r} is not valid; accepted: "
                             "the name of the module list holding the layers (e.g. 'layers', "
                             "'h', 'blocks')")
        self.offset, self.container = offset, container
        self._pattern = re.compile(rf"(^|\.)({re.escape(container)})\.(\d+)(?=\.|$)")

    def __call__(self, name: str) -> str:
        return self._pattern.sub(
            lambda m: f"{m.group(1)}{m.group(2)}.{int(m.group(3)) + self.offset}", name)

    def __getstate__(self):
        return {"offset": self.offset, "container": self.container}

    def __setstate__(self, state):
        self.__init__(state["offset"], state["container"])

    def __repr__(self) -> str:
        return f"layer_offset({self.offset}, container={self.container!r})"


def layer_offset(offset: int, container: str = "layers") -> LayerOffset:
    """``rename=layer_offset(4)``: a pipeline stage's local layer ``layers.0`` is the model's
    ``layers.4`` (``LayerOffset``)."""
    return LayerOffset(offset, container)


def check_rename(rename, what: str = "rename"):
    """``rename`` as a function from a name to its new name (None: the identity): a dict (names
    it lacks stay as they are) or a callable; anything else raises ``TypeError``."""
    from collections.abc import Mapping

    if rename is None:
        return None
    if isinstance(rename, Mapping):
        table = dict(rename)
        bad = [k for k, v in table.items() if not isinstance(k, str) or not isinstance(v, str)
               or not v]
        if bad:
            raise TypeError(f"{what}: {bad[0]!r} -> {table[bad[0]]!r} is not valid; accepted: "
                            "a dict of parameter names to non-empty names")
        return _Table(table)
    if callable(rename):
        return rename
    raise TypeError(f"{what}: {type(rename).__name__} is not valid; accepted: a dict of "
                    "parameter names to new names, a function of a name (e.g. "
                    "probekit.grads.layer_offset(4)), or None")


class _Table:
    """A dict rename as a function (picklable; names it lacks unchanged)."""

    def __init__(self, table: dict) -> None:
        self.table = table

    def __call__(self, name: str) -> str:
        return self.table.get(name, name)


def renamed(names, rename, what: str = "rename") -> tuple[str, ...]:
    """``names`` through ``rename`` (``check_rename``'s function or None); ``ValueError``
    naming both when two names become one, or when the function gives no name."""
    if rename is None:
        return tuple(names)
    out, seen = [], {}
    for n in names:
        new = rename(n)
        if not isinstance(new, str) or not new:
            raise ValueError(f"{what}: {n!r} -> {new!r} is not valid; accepted: a non-empty "
                             "name")
        if new in seen:
            raise ValueError(f"{what}: {seen[new]!r} and {n!r} both become {new!r}; accepted: "
                             "a rename that keeps the names apart")
        seen[new] = n
        out.append(new)
    return tuple(out)
