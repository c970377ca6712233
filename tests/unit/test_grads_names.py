"""Wrapper prefixes removed from parameter names."""
from probekit.grads.store.names import canonical_name, canonical_names


def test_canonical_name():
    assert canonical_name("module._orig_mod.h.0._checkpoint_wrapped_module.attn.weight") == \
        "h.0.attn.weight"
    assert canonical_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert canonical_name("module.module.x") == "x"
    assert canonical_name("a.module.b") == "a.module.b"  # a user's submodule called "module"
    assert canonical_name("module") == "module"
    assert canonical_name("transformer.wte.weight") == "transformer.wte.weight"


def test_canonical_names_keep_originals_when_they_would_collide():
    assert canonical_names(["module.w", "_orig_mod.v"]) == ("w", "v")
    assert canonical_names(["module.w", "w"]) == ("module.w", "w")
