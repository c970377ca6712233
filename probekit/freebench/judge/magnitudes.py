"""The magnitude ``S`` of the families whose own arithmetic subtracts (``scales.py``'s model).

For a multilinear call ``S`` is the call on absolute values; where the formula itself subtracts
(a softmax's ``y (g - <g, y>)``, a normalisation's ``x - mean``) that re-run keeps the
subtraction, so these families state their formula's magnitude (and add/sub, whose gradients
are ``|g|`` summed over the broadcast dims, need no re-run at all): what each element would be if
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
    s = g.abs()
    if log:     # |g| + exp(y) sum|g|, y = log_softmax(x)
        return {pos: s.add_(torch.softmax(x, dim).mul_(s.sum(dim, keepdim=True)))}
    y = torch.softmax(-x if name == "softmin" else x, dim)
    # y (|g| + sum |g| y), in place (vecdot: no third tensor of x's size)
    t = torch.linalg.vecdot(s, y, dim=dim).unsqueeze(dim)
    return {pos: s.add_(t).mul_(y)}


def _saturating(name: str, a: Args, leaves: list, g: torch.Tensor):
    """sigmoid ``|g| y`` (>= |g| y (1 - y) and >= |g| y |1 - 2y|), tanh ``|g| (1 + y^2)``
    (>= |g| (1 - y^2) and >= 2 |g| y^2): the gradient's magnitude and the factor of the saved
    output's rounding in one (issue 26; the reference reads the saved output since issue 34)."""
    x = a.get("input", 0) if "input" in a.params else a.get("self", 0)
    if not isinstance(x, torch.Tensor):
        return None
    pos = _position(leaves, x)
    if pos is None or x.shape != g.shape:
        return None
    ga = g.abs()
    if name == "sigmoid":
        return {pos: torch.sigmoid(x).mul_(ga)}
    t = torch.tanh(x)
    return {pos: ga.addcmul_(ga * t, t)}


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

    def fold(self) -> torch.Tensor:
        """``rstd (|x| + |mu|)`` where ``x`` differs from its mean, 0 where it equals it: what
        one rounding of each of the folded products ``x a`` and ``mu a`` leaves (``norm_fold``);
        only for a normalisation with a mean."""
        return self.x.abs().add_(self.mu.abs()).mul_(self.rstd).masked_fill_(self.x == self.mu,
                                                                             0.0)


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


def norm_fold(name: str, a: Args, leaves: list):
    """The fold term of a normalisation's output (issue 34, class M): ``rstd |w| (|x| + |mu|)``
    where ``x`` differs from its mean ``mu``, 0 where it equals it; None for ``rms_norm`` (no
    mean: its ``S`` already holds ``rstd |w| |x|``) and outside the formula's cover.

    A CPU kernel applies the statistics folded into one scale and shift, ``y = x a + c`` with
    ``a = rstd w`` and ``c = b - mu a``, in its opmath type (the scalar and the vectorised
    kernels alike): the products ``x a`` and ``mu a`` are each rounded, so the result carries up
    to ``u_acc rstd |w| (|x| + |mu|)`` -- the size of ``x`` and ``mu``, not of ``x - mu``, which is
    all ``S`` holds. Where the mean is far above the spread (batch norm over two values, mean
    344 times the spread) that is hundreds of ``u`` of ``S``, and the scalar kernel, which
    accumulates the statistics in float64, errs 106 ``u`` of ``S`` there. Where ``x`` equals its
    mean the two products are the same rounded product and cancel exactly, and the result is the
    bias: the scalar kernel returns it (a constant batch-norm channel, a ``LayerNorm(1)``), so
    the term is 0 there, and the vectorised kernels' ``u |x| rstd`` (pytorch#5410's constant
    channels, up to 0.93 at 1e5) stays the kernel's error."""
    n = _Norm(name, a, leaves)
    if not n.ok or n.rms:
        return None
    t = n.fold()
    if isinstance(n.w, torch.Tensor):
        t = t.mul_(n.w.abs())
    return t


#: elements of a normalisation's input the backward formula works on at a time (2 MiB of
#: float64 per temporary): the cause analysis runs it on a whole float64 tensor
NORM_BLOCK = 1 << 18


def _norm_dim(name: str, x: torch.Tensor, a: Args):
    """A dim of ``x`` whose slices normalise independently (rows of a layer norm, channels of a
    batch norm, samples of a group or instance norm), or None."""
    if name in ("layer_norm", "rms_norm"):
        shape = a.get("normalized_shape", 1)
        n = 1 if isinstance(shape, int) else len(shape)
        return 0 if x.dim() > n else None
    if name == "batch_norm":
        return 1 if x.dim() >= 2 else None
    return 0 if x.dim() >= 2 else None


def _norm_backward(name: str, a: Args, leaves: list, g: torch.Tensor):
    """Block by block along a dim whose slices normalise independently, when the input is large
    (``NORM_BLOCK``): the weight and bias magnitudes summed over the blocks."""
    x = a.get("input", 0)
    if not isinstance(x, torch.Tensor):
        return None
    d = _norm_dim(name, x, a)
    if d is None or x.numel() <= NORM_BLOCK or x.shape[d] < 2:
        return _norm_backward_whole(name, a, leaves, g)
    pos = _position(leaves, x)
    if pos is None:
        return None
    step = max(1, NORM_BLOCK // max(1, x.numel() // x.shape[d]))
    per_channel = name == "batch_norm"      # its weight and bias are sliced with the channels
    params = {p: t for p, t in enumerate(leaves) if p != pos and isinstance(t, torch.Tensor)
              and t.dim() == 1 and per_channel and t.shape[0] == x.shape[1]}
    out = {pos: torch.empty_like(x)}
    for s0 in range(0, x.shape[d], step):
        n = min(step, x.shape[d] - s0)
        sub = list(leaves)
        sub[pos] = x.narrow(d, s0, n)
        for p, t in params.items():
            sub[p] = t.narrow(0, s0, n)
        ab = Args.__new__(Args)
        ab.args, ab.kwargs, ab.params = _rebind(a, sub, leaves)
        ab.params = a.params
        got = _norm_backward_whole(name, ab, sub, g.narrow(d, s0, n))
        if got is None:
            return _norm_backward_whole(name, a, leaves, g)
        for p, v in got.items():
            if p == pos:
                out[pos].narrow(d, s0, n).copy_(v)
            elif p in params:
                out.setdefault(p, torch.empty_like(leaves[p])).narrow(0, s0, n).copy_(v)
            elif p in out:
                out[p].add_(v)
            else:
                out[p] = v
        del got
    return out


def _rebind(a: Args, sub: list, leaves: list) -> tuple:
    """``(args, kwargs, None)`` of ``a`` with each leaf replaced by its slice."""
    swap = {id(t): s for t, s in zip(leaves, sub) if t is not s}
    return (tuple(swap.get(id(v), v) for v in a.args),
            {k: swap.get(id(v), v) for k, v in a.kwargs.items()}, None)


def _norm_backward_whole(name: str, a: Args, leaves: list, g: torch.Tensor):
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


def _additive(name: str, a: Args, leaves: list, g: torch.Tensor):
    """add/sub/neg: each floating tensor input's gradient is +-alpha g summed to its shape."""
    alpha = a.kwargs.get("alpha", 1)
    alpha = abs(alpha) if isinstance(alpha, (int, float)) else 1
    ga = g.abs()
    out = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            s = ga.sum_to_size(x.shape) if x.shape != ga.shape else ga
            out[i] = s * alpha if (alpha != 1 and i > 0) else s
    return out


def backward(name: str, a: Args, leaves: list, g: torch.Tensor):
    """``{input position: S}`` of the input gradients of a formula family (module doc), or None."""
    from .scales import ADDITIVE

    with torch.no_grad():
        if name in ADDITIVE:
            return _additive(name, a, leaves, g)
        if name in ("softmax", "softmin", "_softmax"):
            return _softmax(name, a, leaves, g, log=False)
        if name in ("log_softmax", "_log_softmax"):
            return _softmax(name, a, leaves, g, log=True)
        if name == "scaled_dot_product_attention":
            return _sdpa(a, leaves, g)
        if name in ("sigmoid", "tanh"):
            return _saturating(name, a, leaves, g)
        return _norm_backward(name, a, leaves, g)


def forward(name: str, a: Args, leaves: list):
    """``S`` of a normalisation's output (module doc), or None."""
    with torch.no_grad():
        return norm_forward(name, a, leaves)


def norm_backward_fold(name: str, a: Args, leaves: list, g: torch.Tensor):
    """The fold term of a normalisation's gradients (``norm_fold``): the backward recomputes
    ``x^ = x rstd - mu rstd`` the same way, off by ``d = rstd (|x| + |mu|)`` per rounding where
    ``x`` differs from its mean, which reaches the weight's gradient as ``sum |g| d`` and the
    input's as ``rstd (d mean|g w x^| + |x^| mean|g w| d)``. ``{input position: term}``, or None
    (``rms_norm``, outside the formula, or an input over ``NORM_BLOCK`` elements: the term is
    left out there)."""
    x = a.get("input", 0)
    if not isinstance(x, torch.Tensor) or x.numel() > NORM_BLOCK:
        return None
    n = _Norm(name, a, leaves)
    if not n.ok or n.rms:
        return None
    d = n.fold()
    ga = g.abs()
    out = {}
    wt = a.get("weight", None)
    pw = _position(leaves, wt) if isinstance(wt, torch.Tensor) else None
    if pw is not None:
        t = ga * d
        out[pw] = (t.sum(n.wdims) if n.wdims else t).reshape(wt.shape)
    gw = ga.mul_(n.w.abs()) if isinstance(n.w, torch.Tensor) else ga
    xa = n.xhat().abs_()
    out[n.pos] = d.mul(n.mean(gw * xa)).add_(xa.mul_(n.mean(gw * d))).mul_(n.rstd)
    return out


def backward_fold(name: str, a: Args, leaves: list, g: torch.Tensor):
    """A normalisation's gradients' fold term (``norm_backward_fold``), or None."""
    with torch.no_grad():
        return norm_backward_fold(name, a, leaves, g)


def fold(name: str, a: Args, leaves: list):
    """A normalisation's fold term (``norm_fold``), or None."""
    with torch.no_grad():
        return norm_fold(name, a, leaves)
