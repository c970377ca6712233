"""The source-coordinate term of resampling calls (``interpolate``, ``grid_sample``): issue 34,
class I.

A resampling kernel computes, for every output pixel, where it reads the input: the source
coordinate ``x_src = scale (dst + 1/2) - 1/2`` (``interpolate``, ``align_corners=False``;
``scale dst`` with ``align_corners=True``), ``((g + 1) n - 1) / 2`` (``grid_sample``'s grid
``g`` unnormalised). A correct kernel computes it in its opmath type (float32 for float32,
bfloat16 and float16): the scale, the product and the shift are each rounded, so ``x_src``
carries up to ``gamma_3(u_acc) (|x_src| + 1)`` of a pixel, and the interpolant moves by its
slope along that axis times that: ``gamma_3(u_acc) (|x_src| + 1) |dy/dx_src|`` per axis. For
noise-like images the slope is about ``max|x|`` per pixel and ``|x_src|`` reaches the input's
size, so at a 64-pixel input this is some ``200 u`` of ``max|y|`` where the tensor scale's bound
allowed ``30 u``: CrossViT's fp32 bicubic upsampling from 64 to 240 pixels, 135 ``u`` of
``max|exact|`` off, 134.4 of them from the fp32 coordinates alone (exact arithmetic on them),
was ``inaccurate`` at 4.5x. The term is the bound's, not the result's magnitude.

``term(name, a, leaves, r, u_acc)``: that term in float64, shaped like the output ``r``, or None
(a mode without a slope -- nearest, area --, antialiasing, a layout the float64 emulation does
not reproduce). The slope comes from ``grid_sample`` in float64 on the same source coordinates
(the coordinates shifted by ``H`` pixel either way; the larger one-sided slope, which a linear
interpolant's kink at a pixel does not hide), checked to reproduce the call's float64 result.
The backward (the input gradient, a scatter of ``g`` times the coordinates' weights) is not
covered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .scales import Args, gamma

#: the resampling calls (their float64 result reproduced by ``grid_sample``)
APIS = frozenset({"interpolate", "grid_sample"})
#: the coordinate's roundings (the scale, the product, the shift)
ROUNDINGS = 3
#: the shift, in pixels, the slope is measured over
H = 2.0 ** -16
#: how close the float64 emulation must come to the call's own float64 result (relative)
AGREE = 1e-9

_INTERP = {"linear": "bilinear", "bilinear": "bilinear", "trilinear": "bilinear",
           "bicubic": "bicubic"}


def term(name: str, a: Args, leaves: list, r: torch.Tensor, u_acc: float):
    """``gamma_3(u_acc) sum_axes (|x_src| + 1) |dy/dx_src|`` (module doc), or None."""
    try:
        with torch.no_grad():
            if name == "interpolate":
                got = _interpolate(a, r)
            elif name == "grid_sample":
                got = _grid_sample(a, r)
            else:
                return None
    except (RuntimeError, ValueError, TypeError, ZeroDivisionError):
        return None
    if got is None:
        return None
    x, grid, mode, padding, sizes, src, reshape = got
    y = F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=True)
    if reshape is not None:
        y = reshape(y)
    if y.shape != r.shape or not _agrees(y, r):
        return None
    out = torch.zeros_like(r)
    for axis, n in enumerate(sizes):          # grid_sample's last dim: (x, y[, z]) = W, H[, D]
        if n < 2:
            continue
        step = 2.0 * H / (n - 1)
        slope = None
        for sign in (1.0, -1.0):
            g = grid.clone()
            g[..., axis] += sign * step
            ys = F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=True)
            if reshape is not None:
                ys = reshape(ys)
            d = (ys - y).abs_().div_(H)
            slope = d if slope is None else torch.maximum(slope, d)
        out.add_(slope.mul_(src[axis].abs().add(1.0)))
    return out.mul_(gamma(ROUNDINGS, u_acc))


def _agrees(y: torch.Tensor, r: torch.Tensor) -> bool:
    scale = r.abs().amax().item() if r.numel() else 0.0
    return bool(((y - r).abs() <= AGREE * scale + 1e-300).all())


def _interpolate(a: Args, r: torch.Tensor):
    x = a.get("input", 0)
    mode = a.get("mode", 3) or "nearest"
    if not isinstance(x, torch.Tensor) or mode not in _INTERP or a.get("antialias", 6):
        return None
    spatial = x.dim() - 2
    if spatial < 1 or spatial > 3 or r.dim() != x.dim():
        return None
    align = bool(a.get("align_corners", 4))
    factor = a.get("scale_factor", 2)
    recompute = a.get("recompute_scale_factor", 5)
    if factor is not None and not isinstance(factor, (list, tuple)):
        factor = [factor] * spatial
    ins, outs = list(x.shape[2:]), list(r.shape[2:])
    coords = []                                   # per spatial dim (D, H, W order)
    for d, (n_in, n_out) in enumerate(zip(ins, outs)):
        dst = torch.arange(n_out, dtype=torch.float64, device=r.device)
        if align:
            src = dst * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
        else:
            if factor is not None and not recompute:
                scale = 1.0 / float(factor[d])
            else:
                scale = n_in / n_out
            src = dst.add(0.5).mul_(scale).sub_(0.5)
            if mode != "bicubic":
                src = src.clamp_min(0.0)
        coords.append(src)
    xs, reshape = x, None
    if spatial == 1:                              # (N, C, L) as (N, C, 1, L)
        xs = x.unsqueeze(2)
        ins, coords = [1] + ins, [torch.zeros(1, dtype=torch.float64, device=r.device)] + coords
        reshape = (lambda t: t.squeeze(2))
    sizes = list(reversed(ins))                   # grid order: W, H[, D]
    mesh = torch.meshgrid(*coords, indexing="ij")  # (D, H, W) grids of the source coordinates
    src = list(reversed(mesh))
    grid = torch.stack([_normalise(s, n) for s, n in zip(src, sizes)], dim=-1)
    grid = grid.unsqueeze(0).expand(x.shape[0], *grid.shape).contiguous()
    return xs, grid, _INTERP[mode], "border", sizes, src, reshape


def _normalise(src: torch.Tensor, n: int) -> torch.Tensor:
    """``align_corners=True``'s normalised coordinate of pixel coordinate ``src``."""
    return src * (2.0 / (n - 1)) - 1.0 if n > 1 else torch.zeros_like(src)


def _grid_sample(a: Args, r: torch.Tensor):
    x, grid = a.get("input", 0), a.get("grid", 1)
    mode = a.get("mode", 2) or "bilinear"
    if not isinstance(x, torch.Tensor) or not isinstance(grid, torch.Tensor) or \
            mode not in ("bilinear", "bicubic"):
        return None
    padding = a.get("padding_mode", 3) or "zeros"
    align = bool(a.get("align_corners", 4))
    if padding == "reflection" and not align:   # reflects about -1/2: not re-expressible
        return None
    sizes = list(reversed(x.shape[2:]))           # W, H[, D]
    src, norm = [], []
    for axis, n in enumerate(sizes):
        g = grid[..., axis]
        s = (g + 1) * 0.5 * (n - 1) if align else ((g + 1) * n - 1) * 0.5
        src.append(s.unsqueeze(1))                # broadcast over the channels
        norm.append(_normalise(s, n))
    # re-expressed with align_corners=True (what ``term`` samples with): the same pixels
    return x, torch.stack(norm, dim=-1), mode, padding, sizes, src, None

