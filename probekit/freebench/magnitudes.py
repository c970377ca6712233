"""The magnitude ``S`` of the families whose own arithmetic subtracts (``scales.py``'s model).

For a multilinear call ``S`` is the call on absolute values; where the formula itself subtracts
(a softmax's ``y (g - <g, y>)``, a normalisation's ``x - mean``) that re-run keeps the
subtraction, so these families state their formula's magnitude: what each element would be if
none of the terms the formula adds up cancelled (docs/free_benchmark.md, the family table).

* ``backward(name, a, leaves, g)``: ``{input position: S}`` of the input gradients, computed in
  the leaves' dtype (the re-run's: float32 for a 16-bit call, float64 in the cause analysis);
* ``forward(name, a, leaves)``: ``S`` of a normalisation's output (used by the analysis; the
  fast forward check screens normalisations with the tensor scale).

Each returns None when the call's arguments are outside what the formula covers (the check then
falls back to the tensor scale).
"""
from __future__ import annotations

import math

import torch

from .scales import Args


def _position(leaves: list, t) -> int | None:
    for i, x in enumerate(leaves):
        if x is t:
            return i
    return None


def _softmax(name: str, a: Args, leaves: list, g: torch.Tensor, log: bool):
    x = a.get("input", 0) if "input" in a.params else a.get("self", 0)
    dim = a.get("dim", 1)
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int):
        return None
    pos = _position(leaves, x)
    if pos is None:
        return None
    y = torch.softmax(-x if name == "softmin" else x, dim)
    s = g.abs()
    if log:     # |g| + exp(log_softmax) sum |g|: two tensors of x's size alive
        return {pos: y.mul_(s.sum(dim, keepdim=True)).add_(s)}
    # y (|g| + sum |g| y), in place (vecdot: no third tensor of x's size)
    t = torch.linalg.vecdot(s, y, dim=dim).unsqueeze(dim)
    return {pos: s.add_(t).mul_(y)}


def _stats(x: torch.Tensor, dims: tuple, eps: float, rms: bool = False):
    """(mean or None, rstd) of ``x`` over ``dims`` (biased variance, as the kernels use)."""
    if rms:
        return None, torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    mu = x.mean(dims, keepdim=True)
    var = (x - mu).pow(2).mean(dims, keepdim=True)
    return mu, torch.rsqrt(var + eps)


class _Norm:
    """One normalisation call: its input, statistics and affine parameters, broadcastable."""

    def __init__(self, name: str, a: Args, leaves: list) -> None:
        self.ok = False
        x = a.get("input", 0)
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return
        self.pos = _position(leaves, x)
        if self.pos is None:
            return
        self.x, self.groups, self.rms = x, None, name == "rms_norm"
        w, b = a.get("weight", None), (None if self.rms else a.get("bias", None))
        extra = (1,) * max(0, x.dim() - 2)
        if name in ("layer_norm", "rms_norm"):
            shape = a.get("normalized_shape", 1)
            n = 1 if isinstance(shape, int) else len(shape)
            self.dims = tuple(range(x.dim() - n, x.dim()))
            eps = a.get("eps", None)
            if eps is None:
                eps = torch.finfo(x.dtype).eps if self.rms else 1e-5
            self.mu, self.rstd = _stats(x, self.dims, eps, self.rms)
            self.wdims = tuple(range(x.dim() - n))
            view = None
        elif name == "group_norm":
            groups, eps = a.get("num_groups", 1), a.get("eps", 1e-5)
            if x.dim() < 2 or not isinstance(groups, int) or x.shape[1] % groups:
                return
            self.groups = groups
            self.mu, self.rstd = (self._spread(t) for t in
                                  _stats(x.reshape(x.shape[0], groups, -1), (2,), eps))
            self.wdims = (0,) + tuple(range(2, x.dim()))
            view = (1, -1, *extra)
        elif name in ("batch_norm", "instance_norm"):
            eps = a.get("eps", 1e-5)
            stats = a.get("training", False) if name == "batch_norm" else \
                a.get("use_input_stats", True)
            if x.dim() < 2 or not stats:
                return     # eval: multilinear in x; the abs re-run is not taken for it here
            self.dims = ((0,) if name == "batch_norm" else ()) + tuple(range(2, x.dim()))
            self.mu, self.rstd = _stats(x, self.dims, eps)
            self.wdims = (0,) + tuple(range(2, x.dim()))
            view = (1, -1, *extra)
        else:
            return
        self.w = w.reshape(view) if isinstance(w, torch.Tensor) and view else w
        self.b = b.reshape(view) if isinstance(b, torch.Tensor) and view else b
        self.ok = True

    def _spread(self, t: torch.Tensor) -> torch.Tensor:
        """A per-group (B, G, 1) statistic as a per-channel (B, C, 1...) one."""
        x = self.x
        t = t.repeat_interleave(x.shape[1] // self.groups, 1)
        return t.reshape(*t.shape[:2], *(1,) * (x.dim() - 2))

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean of ``t`` over each element's normalisation group (broadcastable to ``t``)."""
        if self.groups is None:
            return t.mean(self.dims, keepdim=True)
        return self._spread(t.reshape(t.shape[0], self.groups, -1).mean(2, keepdim=True))

    def xhat(self) -> torch.Tensor:
        return self.x * self.rstd if self.rms else (self.x - self.mu) * self.rstd


def norm_forward(name: str, a: Args, leaves: list):
    """``S`` of a normalisation's output: ``rstd |w| (|x - mu| + mean|x - mu|) + |b|``."""
    n = _Norm(name, a, leaves)
    if not n.ok:
        return None
    dev = n.x.abs() if n.rms else (n.x - n.mu).abs()
    s = (dev + n.mean(dev)) * n.rstd
    if isinstance(n.w, torch.Tensor):
        s = s * n.w.abs()
    if isinstance(n.b, torch.Tensor):
        s = s + n.b.abs()
    return s


def _norm_backward(name: str, a: Args, leaves: list, g: torch.Tensor):
    """In place where it can: at most three tensors of the input's size besides it and ``g``."""
    n = _Norm(name, a, leaves)
    if not n.ok:
        return None
    out = {}
    xa = n.xhat().abs_()
    ga = g.abs()
    wt, bt = a.get("weight", None), (None if n.rms else a.get("bias", None))
    pb = _position(leaves, bt) if isinstance(bt, torch.Tensor) else None
    pw = _position(leaves, wt) if isinstance(wt, torch.Tensor) else None
    if pb is not None:            # sum |g| over the rows
        out[pb] = (ga.sum(n.wdims) if n.wdims else ga.clone()).reshape(bt.shape)
    if pw is not None:            # sum |g| |x^| over the rows
        t = ga * xa
        out[pw] = (t.sum(n.wdims) if n.wdims else t).reshape(wt.shape)
        del t
    gw = ga.mul_(n.w.abs()) if isinstance(n.w, torch.Tensor) else ga      # |g w|
    sx = xa.mul_(n.mean(gw * xa))                                         # |x^| mean|g w x^|
    if not n.rms:
        sx.add_(n.mean(gw))
    out[n.pos] = sx.add_(gw).mul_(n.rstd)      # rstd (|g w| + mean|g w| + |x^| mean|g w x^|)
    return out


#: elements of the (batch, heads, query rows, keys) probabilities one block of the attention
#: formula holds (8 MiB of float64), so a long sequence never materialises its whole L x L
ATTENTION_BLOCK = 1 << 20


def _sdpa(a: Args, leaves: list, g: torch.Tensor):
    q, k, v = a.get("query", 0), a.get("key", 1), a.get("value", 2)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return None
    if a.get("dropout_p", 4) or 0.0:
        return None
    pq, pk, pv = (_position(leaves, t) for t in (q, k, v))
    mask, causal = a.get("attn_mask", 3), a.get("is_causal", 5)
    scale = a.get("scale", 6)
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kk, vv, rep = k, v, 1
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            return None
        rep = q.shape[-3] // k.shape[-3]
        kk, vv = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    L, Lk = q.shape[-2], k.shape[-2]
    ka, va = kk.abs(), vv.abs()
    sq = torch.empty_like(q) if pq is not None else None
    sk = torch.zeros(kk.shape, dtype=q.dtype, device=q.device) if pk is not None else None
    sv = torch.zeros(vv.shape, dtype=q.dtype, device=q.device) if pv is not None else None
    per_row = max(1, (q.numel() // max(1, q.shape[-1])) // L * Lk)
    rows = max(1, ATTENTION_BLOCK // per_row)
    for r0 in range(0, L, rows):        # query rows in blocks: P is per row
        r1 = min(L, r0 + rows)
        qb, gb = q[..., r0:r1, :], g[..., r0:r1, :]
        scores = (qb @ kk.transpose(-2, -1)) * s
        if causal:
            keep = torch.ones(L, Lk, dtype=torch.bool, device=q.device).tril()[r0:r1]
            scores.masked_fill_(~keep, -math.inf)
        if isinstance(mask, torch.Tensor):
            mb = mask[..., r0:r1, :] if mask.dim() >= 2 and mask.shape[-2] == L else mask
            if mb.dtype == torch.bool:
                scores.masked_fill_(~mb, -math.inf)
            else:
                scores.add_(mb)
        pm = torch.softmax(scores, -1).nan_to_num_(0.0)
        del scores
        # the probabilities with the rounding the scores carry: P (1 + 2 s |q||k|^T)
        pm.mul_((qb.abs() @ ka.transpose(-2, -1)).mul_(2 * s).add_(1))
        ga = gb.abs()
        sds = ga @ va.transpose(-2, -1)                              # |dO||v|^T
        sds.add_(torch.linalg.vecdot(pm, sds, dim=-1).unsqueeze(-1)).mul_(pm)
        if sq is not None:
            sq[..., r0:r1, :] = (sds @ ka).mul_(s)
        if sk is not None:
            sk.add_(sds.transpose(-2, -1) @ qb.abs(), alpha=s)
        if sv is not None:
            sv.add_(pm.transpose(-2, -1) @ ga)
        del pm, sds, ga
    out = {}
    if sq is not None:
        out[pq] = sq
    for pos, t, orig in ((pk, sk, k), (pv, sv, v)):
        if t is not None:
            out[pos] = t.unflatten(-3, (orig.shape[-3], rep)).sum(-3) if rep > 1 else t
    return out


def backward(name: str, a: Args, leaves: list, g: torch.Tensor):
    """``{input position: S}`` of the input gradients of a formula family (module doc), or None."""
    with torch.no_grad():
        if name in ("softmax", "softmin", "_softmax"):
            return _softmax(name, a, leaves, g, log=False)
        if name in ("log_softmax", "_log_softmax"):
            return _softmax(name, a, leaves, g, log=True)
        if name == "scaled_dot_product_attention":
            return _sdpa(a, leaves, g)
        return _norm_backward(name, a, leaves, g)


def forward(name: str, a: Args, leaves: list):
    """``S`` of a normalisation's output (module doc), or None."""
    with torch.no_grad():
        return norm_forward(name, a, leaves)
