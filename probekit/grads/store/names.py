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
