"""Compare a PyTorch run with a MindSpore run of the same architecture, parameter by parameter.

The two frameworks name some parameters differently and lay some weights out differently. Before
the signs are compared, the second run (``other``, usually MindSpore) is *aligned* to the first
(``reference``, usually PyTorch): its parameters are renamed and, where a weight is stored
transposed, its sign bits are transposed. Nothing here imports MindSpore or torch.

Names (``mapping``): a dict ``{other name: reference name}``, a function ``other name ->
reference name`` (return None to drop a parameter), or None for the automatic rule: a name found
in the reference is kept; otherwise MindSpore's suffixes become PyTorch's (``ms_to_torch_name``):
``.gamma`` -> ``.weight``, ``.beta`` -> ``.bias``, ``.moving_mean`` -> ``.running_mean``,
``.moving_variance`` -> ``.running_var``, ``.embedding_table`` -> ``.weight``. Parameters found in
one run only are left out of the comparison and named: the aligned run's attribute ``left_out``
lists, by their MindSpore names, those of the other run that map to no reference parameter (a
mapping returning None drops one on purpose: not listed), and ``compare_grads`` reports them
with the reference's own unmatched parameters (``only_in_second``, ``only_in_first``).

Layouts (``transpose``): ``"auto"`` transposes a 2-D weight whose shape is the reverse of the
reference's (e.g. ``(in, out)`` against ``(out, in)``); a square weight cannot be told apart and
is never transposed automatically — name it in a list to transpose it. ``nn.Dense`` and
``torch.nn.Linear`` both store ``(out, in)``, so an MLP needs no transpose. Any other shape
mismatch (same element count, different shape) is an error naming the parameter.
"""
from __future__ import annotations

import numpy as np

from ..grads.numerics.stats import padded_nbytes

SUFFIXES = {
    ".gamma": ".weight",
    ".beta": ".bias",
    ".moving_mean": ".running_mean",
    ".moving_variance": ".running_var",
    ".embedding_table": ".weight",
}


class AlignError(ValueError):
    """Two runs cannot be put side by side (no shared parameter, incompatible shapes)."""


def ms_to_torch_name(name: str) -> str:
    """MindSpore's parameter name with PyTorch's suffix (``layer.gamma`` -> ``layer.weight``)."""
    for ms_suffix, torch_suffix in SUFFIXES.items():
        if name.endswith(ms_suffix):
            return name[:-len(ms_suffix)] + torch_suffix
    return name


def _shape(text: str) -> tuple:
    inner = str(text).strip().strip("[]()").strip()
    return tuple(int(x) for x in inner.split(",") if x.strip()) if inner else ()


def _rename(names, ref_names, mapping) -> list:
    ref = set(ref_names)
    out = []
    for n in names:
        if mapping is None:
            target = n if n in ref else ms_to_torch_name(n)
        elif callable(mapping):
            target = mapping(n)
        else:
            target = mapping.get(n, n)
        out.append(None if target is None else str(target))
    return out


def align_rank(reference, other, mapping=None, transpose="auto"):
    """``other`` (one rank's Dataset) renamed and re-laid out like ``reference``."""
    ref_names = [str(x) for x in reference["param"].values]
    names = [str(x) for x in other["param"].values]
    targets = _rename(names, ref_names, mapping)
    seen = {}
    for n, t in zip(names, targets):
        if t is not None and t in seen:
            raise AlignError(f"mapping: {seen[t]!r} and {n!r} both map to {t!r}; accepted: a "
                             "mapping giving each parameter its own name")
        if t is not None:
            seen[t] = n
    ref_shape = dict(zip(ref_names, (_shape(s) for s in reference["shape"].values)))
    shapes = [_shape(s) for s in other["shape"].values]
    explicit = set() if transpose in ("auto", None) else set(transpose)
    flip = []
    keep = []
    left_out = []
    for j, (n, t) in enumerate(zip(names, targets)):
        if t is None:
            continue
        if t not in ref_shape:
            left_out.append(n)
            continue
        keep.append(j)
        want, have = ref_shape[t], shapes[j]
        if t in explicit or n in explicit:
            if len(have) != 2 or have[::-1] != want:
                raise AlignError(f"transpose: {t!r} has shape {have}, the reference {want}; "
                                 "accepted: 2-D weights whose shapes are each other's reverse")
            flip.append(j)
        elif have == want:
            continue
        elif transpose == "auto" and len(have) == 2 and have[::-1] == want:
            flip.append(j)
        else:
            raise AlignError(f"{t!r} (other run: {n!r}) has shape {have}, the reference {want}; "
                             "accepted: equal shapes, or 2-D shapes reversed (transposed), or a "
                             "mapping that pairs it with a parameter of the same shape")
    if not keep:
        raise AlignError(f"no parameter of the other run maps to one of the reference "
                         f"(reference: {ref_names[:5]}..., other: {names[:5]}...); pass mapping=")
    ds = other.isel(param=keep)
    new_names = [targets[j] for j in keep]
    new_shapes = [str(shapes[j][::-1] if j in flip else shapes[j]) for j in keep]
    ds = ds.assign_coords(param=("param", np.array(new_names, dtype=str)),
                          shape=("param", np.array(new_shapes, dtype=str)))
    if flip and "direction" in ds and "nbits" in other.coords and any(
            int(other["nbits"].values[j]) != int(other["numel"].values[j]) for j in flip):
        raise AlignError(  # a sample of a transposed weight holds other elements than its own
            f"{[names[j] for j in flip]}: transposed, and the run recorded a sample of their "
            "sign bits (grad_probe.sample), chosen in its own layout; accepted: the same "
            "layout in both runs, or runs recorded without grad_probe.sample")
    if flip and "direction" in ds:
        bits = np.array(other["direction"].values, np.uint8)  # a copy: the source stays intact
        offsets = np.asarray(other["offset"].values, np.int64)
        for j in flip:
            r, c = shapes[j]
            n = r * c
            lo = offsets[j]
            seg = np.unpackbits(bits[:, lo:lo + padded_nbytes(n)], axis=1, count=n)
            seg = seg.reshape(-1, r, c).transpose(0, 2, 1).reshape(-1, n)
            bits[:, lo:lo + padded_nbytes(n)] = _pad_pack(seg, n)
        ds = ds.assign(direction=(("step", "byte"), bits))
    ds.attrs = {**other.attrs, "aligned_to_reference": 1,
                "transposed": [targets[j] for j in flip],
                "left_out": list(other.attrs.get("left_out", ())) + left_out}
    return ds


def _pad_pack(seg: np.ndarray, n: int) -> np.ndarray:
    packed = np.packbits(seg, axis=1)
    out = np.zeros((seg.shape[0], padded_nbytes(n)), np.uint8)
    out[:, :packed.shape[1]] = packed
    return out


def align_runs(reference, other, mapping=None, transpose="auto") -> dict:
    """{rank: Dataset} of ``other`` aligned to ``reference`` (paths or Datasets), rank by rank."""
    from ..grads.store.sources import load_runs

    ref, oth = load_runs(reference), load_runs(other)
    shared = sorted(set(ref) & set(oth))
    if not shared:
        raise AlignError(f"no rank in common: reference {sorted(ref)}, other {sorted(oth)}")
    return {r: align_rank(ref[r], oth[r], mapping, transpose) for r in shared}


def compare_frameworks(reference, other, mapping=None, transpose="auto", **kwargs):
    """``compare_grads`` of a PyTorch run (``reference``) and a MindSpore run (``other``) after
    aligning names and weight layouts; keyword arguments go to ``compare_grads``."""
    from ..grads.compare.compare import compare_grads
    from ..grads.store.sources import load_runs

    ref = load_runs(reference)
    aligned = align_runs(ref, other, mapping, transpose)
    return compare_grads({r: ref[r] for r in aligned}, aligned, **kwargs)
