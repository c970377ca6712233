"""Replica agreement: every replicated parameter checked across its replicas at every step.

A parameter is replicated when several ranks hold the same piece of it and must hold the same
values: DDP's ranks (the whole model), the coordinates of a DTensor mesh dimension it is
``Replicate`` on (HSDP's replicas, a norm or an MoE router under tensor parallelism), and the
parameters the user names in ``tied`` (an embedding tied to the last pipeline stage's output
layer). Collectives make those replicas bit-identical (an all-reduce leaves the same bytes on
every rank); a bug that skips a reduction, reduces over the wrong group or adds to one copy
only leaves them apart, with or without a reference run.

Each replicated piece is a *key*: its name (a tied group's first name), its offset and local
shape, and the ranks of its group (DDP's process group, the mesh coordinates along its
``Replicate`` dimensions, or every rank for a tied group); the ranks holding the same key are
its replicas. At ``start()`` each rank publishes its keys through torch.distributed's key-value
store (no collective) and every rank builds the same table: key -> (rank, slot).

At every optimizer step, before the update, each rank computes a *digest* of each replicated
piece it holds (recording it or not: DDP's other ranks and HSDP's other replicas record
nothing but still take part):

* the gradient the optimizer uses: its max and min (exact, whatever the order of the
  computation: the recording ranks take them from the statistics they compute anyway, the
  others with ``torch.aminmax``) and an exact hash of a fixed sample of ``SAMPLE`` elements
  (their bit patterns as integers, summed with odd weights in int64: order-independent);
* the parameter itself (as the previous update left it), by the same sample hash.

The digests of all ranks travel in one ``all_gather_into_tensor`` of a fixed-size int64 tensor
per step (``DIGEST`` words per slot, as many slots as the rank holding the most pieces), and
each rank compares every key's replicas: equal bits, or *disagree*. A gradient DTensor still
``Partial`` (a sequence-parallel norm's, reduced by the optimizer's own ops) is not a replica
yet: its parameter is checked at the next step. Exact equality is the test: replicas produced by
a collective, or by the same deterministic kernels on the same inputs, are bit-identical
(docs/DESIGN.md, "Replica agreement", for layouts where redundant computation on
non-deterministic kernels can part them by rounding, and what ``replica_gap`` then shows).
"""
from __future__ import annotations

import json
import os
import weakref

import numpy as np
import torch

from ...config import ConfigError
from ...dist import get_rank
from ...log import get_logger
from ..store.names import canonical_names

log = get_logger(__name__)

#: elements of each tensor in the sample hash (fixed, evenly strided positions)
SAMPLE = 256
#: int64 words per slot of the gathered digest: flags, gradient max, min, sample hash,
#: parameter sample hash
DIGEST = 5
#: seconds a rank waits at start() for every rank's table before the check is switched off
HANDSHAKE_SECONDS = 60.0
#: the store format of the check's arrays (``replicas``, ``replica_rank``, ``replica_gap``)
VERSION = 1
#: the ``replicas`` code bits: checked at this step, the gradients differ, the parameters differ
CHECKED, GRAD_DIFFERS, PARAM_DIFFERS = 1, 2, 4

_CHECKED, _GRAD = 1, 2  # flags of a slot's digest: checked at this step, gradient present


def describe_code(code: int) -> str:
    """What a ``replicas`` code says: "gradients", "parameters", "gradients and parameters"."""
    what = [w for bit, w in ((GRAD_DIFFERS, "gradients"), (PARAM_DIFFERS, "parameters"))
            if code & bit]
    return " and ".join(what)


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT_OF: dict = {}  # dtype -> the integer dtype of its width


def local_tensor(t):
    """A DTensor's local tensor (its ``_local_tensor``, the tensor ``to_local()`` returns a view
    of, without the autograd function's cost per call)."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


def _int_view(t: torch.Tensor) -> torch.Tensor:
    dtype = _INT_OF.get(t.dtype)
    if dtype is None:
        dtype = _INT_OF[t.dtype] = _INTS[t.element_size()]
    return t.view(dtype)


class SampleHash:
    """An exact, order-independent hash of a fixed sample of each of a list of tensors: the
    elements at ``SAMPLE`` evenly strided positions (all of a smaller tensor), their bit
    patterns as integers times odd weights ``2j + 1``, summed in int64 (wrapping): any change
    of a sampled element changes it. Contiguous CPU tensors: every one in a single call of the
    compiled kernel (``kernel.sample_hash``: their addresses, the strides and counts planned
    here once), no other Python work per tensor. Where the kernel is not built, and for other
    CPU tensors: numpy views of the samples (cached for a tensor whose memory stays put, as a
    parameter's), one concatenation and one segmented sum per element width; accelerator
    tensors: the same in torch on their device. All give the same values."""

    def __init__(self, numels, keep=()) -> None:
        self.numels = [int(n) for n in numels]
        self.keep = set(keep)  # tensors whose memory stays from call to call (parameters)
        self.counts = [min(n, SAMPLE) for n in self.numels]
        self.strides = [max(1, n // SAMPLE) for n in self.numels]
        self._weights = np.arange(SAMPLE, dtype=np.int64) * 2 + 1
        self._views: dict = {}  # i -> (data_ptr, numpy view of the sample)
        self._plans: dict = {}
        self._c_stride = np.array(self.strides, np.int64)
        self._c_count = np.array(self.counts, np.int64)

    def _sample(self, i: int, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        if flat.numel() != self.numels[i]:
            raise ValueError(f"replica check: tensor {i} has {flat.numel()} elements, the check "
                             f"started with {self.numels[i]}")
        return _int_view(flat[::self.strides[i]][:self.counts[i]])

    def _host(self, i: int, t: torch.Tensor, keep: bool) -> np.ndarray:
        got = self._views.get(i) if keep else None
        if got is not None and got[0] == t.data_ptr():
            return got[1]
        flat = _int_view(t if not t.requires_grad else t.detach()).numpy().reshape(-1)
        if flat.size != self.numels[i]:
            raise ValueError(f"replica check: tensor {i} has {flat.size} elements, the check "
                             f"started with {self.numels[i]}")
        view = flat[::self.strides[i]][:self.counts[i]]
        if keep:  # a parameter: its memory stays (a gradient's view would keep it alive)
            self._views[i] = (t.data_ptr(), view)
        return view

    def __call__(self, tensors) -> np.ndarray:
        """int64 hashes, one per tensor; 0 where a tensor is None. The tensors of ``keep``
        (positions given at construction) keep their memory from call to call (parameters):
        their sample views are reused on the numpy path."""
        from ..numerics import kernel

        n = len(tensors)
        out = np.zeros(n, np.int64)
        addr, width, rest = [], [], []
        for i, t in enumerate(tensors):
            if t is None or self.counts[i] == 0:
                addr.append(0)
                width.append(0)
            elif (t.is_cpu and t.is_contiguous() and t.numel() == self.numels[i]
                  and t.element_size() in _INTS):
                addr.append(t.data_ptr())
                width.append(t.element_size())
            else:
                addr.append(0)
                width.append(0)
                rest.append(i)
        if not kernel.sample_hash(np.array(addr, np.int64), self._c_stride, self._c_count,
                                  np.array(width, np.int32), out):
            rest = [i for i, t in enumerate(tensors) if t is not None and self.counts[i]]
        if rest:
            self._numpy(tensors, rest, out)
        return out

    def _numpy(self, tensors, which, out) -> None:
        """The hashes of the tensors at positions ``which`` into ``out``, without the kernel."""
        host: dict = {}
        device: dict = {}
        for i in which:
            t = tensors[i]
            if t.device.type == "cpu":
                v = self._host(i, t, i in self.keep)
                host.setdefault(v.dtype, []).append((i, v))
            else:
                s = self._sample(i, t)
                device.setdefault((s.device, s.dtype), []).append((i, s))
        with np.errstate(over="ignore"):
            for dtype, items in host.items():
                idx = tuple(i for i, _ in items)
                plan = self._plans.get((dtype, idx))
                if plan is None:  # the weights and the segments' starts, once per layout
                    plan = self._plans[(dtype, idx)] = (
                        np.concatenate([self._weights[:self.counts[i]] for i in idx]),
                        np.cumsum([0] + [self.counts[i] for i in idx[:-1]]))
                x = np.concatenate([v for _, v in items]) * plan[0]  # int64 (the weights')
                out[list(idx)] = np.add.reduceat(x, plan[1])
        for (dev, _), items in device.items():
            idx = tuple(i for i, _ in items)
            plan = self._plans.get((dev, idx))
            if plan is None:
                w = torch.from_numpy(np.concatenate([self._weights[:self.counts[i]]
                                                     for i in idx]))
                seg = torch.cat([torch.full((self.counts[i],), k, dtype=torch.int64)
                                 for k, i in enumerate(idx)])
                plan = self._plans[(dev, idx)] = (w.to(dev), seg.to(dev))
            w, seg = plan
            x = torch.cat([s for _, s in items]).to(torch.int64) * w
            sums = torch.zeros(len(idx), dtype=torch.int64, device=dev).index_add_(0, seg, x)
            out[list(idx)] = sums.cpu().numpy()


# -- which pieces are replicated --------------------------------------------------------------
def _tied_names(tied, canonical: dict) -> dict:
    """{canonical name held here: (group index, the group's first name)} for ``tied`` (names
    with or without wrapper prefixes)."""
    out = {}
    for gi, group in enumerate(tied):
        first = canonical.get(group[0], group[0])
        for name in group:
            c = canonical.get(name, name)
            out[c] = (gi, first)
    return out


def _mesh_group(place: dict, mesh) -> list | None:
    """The global ranks of this rank's replicas of a DTensor shard: the mesh coordinates that
    vary along its ``Replicate`` dimensions, the others fixed; None when it has none (or they
    are of size 1)."""
    dims = [d for d, p in enumerate(place["placements"]) if p == "R" and place["mesh_shape"][d] > 1]
    if not dims:
        return None
    index = tuple(slice(None) if d in dims else c for d, c in enumerate(place["mesh_coord"]))
    return sorted(int(x) for x in mesh.mesh[index].reshape(-1).tolist())


def _ddp_ranks(model) -> list | None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or not dist.is_initialized():
        return None
    ranks = sorted(dist.get_process_group_ranks(model.process_group))
    return ranks if len(ranks) > 1 else None


def pieces(model, named, places, tied=(), meshes=None) -> list:
    """The replicated pieces this rank holds, in the order of ``named`` ([(canonical name,
    recorded name, parameter)]; ``places``: each one's ``placement.dtensor_placement`` or
    None; ``meshes``: each one's mesh, default its DTensor's): [{"index", "key", "label",
    "name", "gshape"}]. A piece is replicated when the model is wrapped in DDP (over its process
    group), when it is ``Replicate`` over a mesh dimension of size > 1 (a DTensor, or a plain
    shard declared so: ``shards.py``; over those coordinates), or when ``tied`` names it
    (wherever held)."""
    canonical = {}
    for c, n, _ in named:
        canonical[c] = c
        canonical[n] = c
    ties = _tied_names(tied, canonical)
    ddp = _ddp_ranks(model)
    out = []
    for i, ((c, _, p), place) in enumerate(zip(named, places)):
        is_dt = type(p).__name__ == "DTensor"
        if is_dt and place is None:  # Partial, _StridedShard...: not a block, not checked
            continue
        off = place["offset"] if place else [0] * p.dim()
        local = place["local_shape"] if place else list(p.shape)
        gshape = place["global_shape"] if place else list(p.shape)
        where = f"{list(off)}|{list(local)}"
        if c in ties:
            gi, first = ties[c]
            out.append({"index": i, "key": f"tied{gi}:{first}|{where}", "name": c,
                        "label": "tied " + "/".join(f"`{t}`" for t in tied[gi]),
                        "gshape": list(gshape)})
            continue
        if place is not None:
            ranks = _mesh_group(place, meshes[i] if meshes is not None else p.device_mesh)
            if ranks is None:
                continue
            dims = [d for d, x in enumerate(place["placements"]) if x == "R"
                    and place["mesh_shape"][d] > 1]
            names = place.get("mesh_dims") or []
            label = "/".join(names[d] if d < len(names) else f"mesh dim {d}" for d in dims)
            out.append({"index": i, "key": f"{c}|{where}|mesh{ranks}", "name": c,
                        "label": label, "gshape": list(gshape)})
        elif ddp is not None:
            out.append({"index": i, "key": f"{c}|{where}|ddp{ddp}", "name": c, "label": "DDP",
                        "gshape": list(gshape)})
    return out


# -- the agreement at start(): every rank's table ----------------------------------------------
_HANDSHAKES = [0]  # probes this process started under torch.distributed (the key's counter)


def table(mine: list, named, tied, check: bool, **extra) -> dict:
    """What this rank tells the others at ``start()``: its replicated pieces' keys, labels and
    names, the shapes of the ``tied`` names it holds, whether its check is on, and ``extra``."""
    held = {}
    for c, n, p in named:
        held[c] = list(p.shape)
        held[n] = list(p.shape)
    wanted = {n for group in tied for n in group}
    return {"pieces": [[e["key"], e["label"], e["name"]] for e in mine],
            "tied": {n: held[n] for n in wanted if n in held}, "check": bool(check), **extra}


def exchange(mine: dict) -> list | None:
    """Every rank's ``mine`` (a JSON-able dict), through the default process group's key-value
    store: each rank sets its own key and waits for the others' (``HANDSHAKE_SECONDS``); the
    first rank to finish decides for all whether everyone came (``compare_set`` on one key), so
    every rank gets the same answer: the list by rank, or None (someone never came: the check
    is off everywhere). The key counts the probes this process started: the ranks of a job
    start theirs in the same order (their dump paths may differ)."""
    import datetime

    import torch.distributed as dist

    kv = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    _HANDSHAKES[0] += 1
    base = "probekit/replicas/{}/{}".format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                                            _HANDSHAKES[0])
    kv.set(f"{base}/rank{get_rank()}", json.dumps(mine))
    keys = [f"{base}/rank{r}" for r in range(world)]
    try:
        kv.wait(keys, datetime.timedelta(seconds=HANDSHAKE_SECONDS))
        came = "all"
    except Exception:  # a timeout: some rank runs no probe (or another one)
        came = "missing"
    decided = kv.compare_set(f"{base}/decision", "", came)
    decided = decided.decode() if isinstance(decided, bytes) else decided
    if decided != "all":
        missing = [r for r, k in enumerate(keys) if not kv.check([k])]
        log.warning("grad_probe: the replica check is off: rank(s) %s did not start a GradProbe "
                    "within %.0f s of this one (start one on every rank, or pass "
                    "check_replicas=False); each rank records its own layout", missing or "?",
                    HANDSHAKE_SECONDS)
        return None
    out = []
    for k in keys:
        raw = kv.get(k)
        out.append(json.loads(raw.decode() if isinstance(raw, bytes) else raw))
    return out


class ReplicaCheck:
    """The replica check of one probe: built at ``start()`` by ``ReplicaCheck.build`` (None
    when there is nothing to check anywhere), then ``run`` at every optimizer step."""

    def __init__(self, mine: list, tables: list, params: list, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.entries = mine  # this rank's replicated pieces (``pieces``), slot = position
        self.params = params  # their parameters
        members: dict = {}
        labels: dict = {}
        for r, table in enumerate(tables):
            for slot, (key, label, name) in enumerate(table["pieces"]):
                members.setdefault(key, []).append((r, slot))
                labels.setdefault(key, (label, name))
        self.keys = sorted(k for k, m in members.items() if len(m) > 1)
        # the parameters checked anywhere (a tied group's every name)
        self.checked = len({name for t in tables for key, _, name in t["pieces"]
                            if len(members[key]) > 1})
        self.labels = [labels[k] for k in self.keys]
        self.slots = max((len(t["pieces"]) for t in tables), default=0)
        key_index = {k: j for j, k in enumerate(self.keys)}
        rows = [(key_index[k], r, s) for k, m in members.items() if k in key_index
                for r, s in m]
        rows.sort()
        self.m_key = np.array([x[0] for x in rows], np.int64)
        self.m_rank = np.array([x[1] for x in rows], np.int64)
        self.m_slot = np.array([x[2] for x in rows], np.int64)
        # per key: its members' rank lists (for the words), and this rank's slot in it
        self.ranks = [sorted({int(r) for r in self.m_rank[self.m_key == j]})
                      for j in range(len(self.keys))]
        self.my_key = np.array([key_index.get(e["key"], -1) for e in mine], np.int64)
        # per key its members' rows; per replicated piece of this rank, those rows one after
        # the other (``idx``, ``piece``: which piece, ``piece_starts``): one vectorised compare
        self.start = np.searchsorted(self.m_key, np.arange(len(self.keys) + 1))
        self._firsts = self.start[self.m_key]  # each member's key's first member
        self.mine = np.flatnonzero(self.my_key >= 0)
        lo, hi = self.start[self.my_key[self.mine]], self.start[self.my_key[self.mine] + 1]
        lens = hi - lo
        self.piece = np.repeat(np.arange(self.mine.size), lens)
        self.piece_starts = (np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
                             if lens.size else np.zeros(0, np.int64))
        self.idx = (np.repeat(lo, lens) + np.arange(int(lens.sum()))
                    - np.repeat(self.piece_starts, lens)).astype(np.int64)
        self._dtensor = [type(p).__name__ == "DTensor" for p in params]
        numels = [local_tensor(p).numel() if dt else p.numel()
                  for p, dt in zip(params, self._dtensor)]
        # the gradients' samples, then the parameters' (kept: their memory stays), one call
        self.hash = SampleHash(numels + numels, keep=range(len(numels), 2 * len(numels)))
        self._owned = weakref.WeakKeyDictionary()
        # the ranks holding some replicated piece: the all-gather's group (all: the default)
        self.members = sorted({int(r) for r in self.m_rank})
        self.group = None
        self.first: dict = {}  # key index -> its first disagreement (``events``)
        self.pending: dict = {}  # the last run's disagreements, until ``note(step)``
        # per step: the digest row, the all-gather's buffers (made at the first run)
        self._row = np.zeros((max(1, self.slots), DIGEST), np.int64)
        self._comm = None
        self.has_dtensors = any(self._dtensor)

    @property
    def active(self) -> bool:
        """True when some piece is replicated somewhere (every rank then joins each step)."""
        return bool(self.keys)

    @classmethod
    def build(cls, mine: list, tables: list, named, tied):
        """The check of a probe at ``start()`` from this rank's replicated pieces ``mine``
        (``pieces``) and every rank's table (``table``; ``exchange``d, or this rank's alone in
        a single process): ``tied`` validated against every rank's names and shapes
        (``ConfigError`` on every rank alike). None when no piece is replicated anywhere, when
        some rank has the check off, or when this rank holds no replicated piece (it takes no
        part). Under torch.distributed every rank must call it (the all-gather's group is made
        here)."""
        import torch.distributed as dist

        if not all(t.get("check") for t in tables):
            return None
        _check_tied(tied, [t["tied"] for t in tables], named)
        world = len(tables)
        check = cls(mine, tables, [named[e["index"]][2] for e in mine], get_rank(), world)
        if not check.active:
            return None
        if world > 1 and len(check.members) < world:
            # every rank is here (the tables came from all): the group of those holding pieces
            check.group = dist.new_group(check.members)
        if check.rank not in check.members:
            return None  # holds nothing replicated: takes no part
        return check

    def attrs(self, params) -> dict:
        """The group attribute ``replica_check`` of a rank recording ``params``: the format
        ``version``, the ``sample`` of the hash, and per recorded parameter the group its
        replicas form (``labels``: "DDP", a mesh dimension's name, "tied"; None: not
        replicated)."""
        mine = {id(p): self.labels[j][0] for p, j in zip(self.params, self.my_key) if j >= 0}
        return {"version": VERSION, "sample": SAMPLE,
                "labels": [mine.get(id(p)) for p in params]}

    # -- every step ---------------------------------------------------------------------------
    def owned(self, optimizer) -> np.ndarray:
        """Which of this rank's pieces ``optimizer`` steps (all of them for None)."""
        if optimizer is None:
            return np.ones(len(self.entries), bool)
        got = self._owned.get(optimizer)
        if got is None:
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            got = self._owned[optimizer] = np.array([id(p) in ids for p in self.params], bool)
        return got

    def run(self, optimizer, grads, known=None) -> dict:
        """One step: digest this rank's pieces stepped by ``optimizer``, gather every rank's
        (one collective), compare. ``grads``: per piece the local gradient the optimizer uses
        (None: none; ``"partial"``: still a pending reduction, not compared); ``known``: (which
        pieces' max and min are already computed, their max, their min) as arrays (the
        recorded statistics), or None. Returns, per piece
        of this rank, ``code`` (``CHECKED`` | ``GRAD_DIFFERS`` | ``PARAM_DIFFERS``; 0 not
        checked), ``other`` (the lowest rank whose digest differs from this one's; -1) and
        ``gap`` (the largest relative difference of the gradient's max or min from another
        replica's; NaN where no gradient was compared). ``note(step)`` then files the step's
        first disagreements under the training step."""
        import torch.distributed as dist

        n = len(self.entries)
        mask = self.owned(optimizer)
        every = bool(mask.all())  # this optimizer steps every piece: no per-piece masking
        if every:
            local = [None if isinstance(g, str) else g for g in grads]
        else:
            on = mask.tolist()
            local = [g if on[k] and not isinstance(g, str) else None
                     for k, g in enumerate(grads)]
        present = np.fromiter((g is not None for g in local), bool, n)
        ext = np.full((n, 2), np.nan)
        have = np.zeros(n, bool)
        if known is not None:
            have, mx, mn = known
            ext[have, 0], ext[have, 1] = mx[have], mn[have]
        todo = np.flatnonzero(present & ~have).tolist()
        todo = [k for k in todo if local[k].numel()]
        if todo:  # the pieces this rank does not record: one pass each, on their device
            mm = torch.stack([torch.stack(torch.aminmax(local[k].detach())).double()
                              for k in todo]).cpu().numpy()
            ext[todo] = mm[:, ::-1]  # aminmax gives (min, max)
        if every and not self.has_dtensors:
            vals = self.params  # plain parameters: their own memory
        else:
            vals = [(local_tensor(p) if dt else p) if on else None
                    for p, dt, on in zip(self.params, self._dtensor, mask.tolist())]
        flags = np.where(mask, _CHECKED, 0) | np.where(present, _GRAD, 0)
        ext = ext + 0.0  # -0.0 -> 0.0
        ext[np.isnan(ext)] = np.nan  # one NaN
        row = self._row
        row[:n, 0] = flags
        row[:n, 1:3] = ext.view(np.int64)
        hashes = self.hash(local + list(vals))
        row[:n, 3] = hashes[:n]
        row[:n, 4] = hashes[n:]
        if self.world > 1:
            if self._comm is None:  # the buffers of the all-gather, once
                device = _comm_device()
                size = len(self.members)
                self._comm = (device, torch.empty((size * row.shape[0], DIGEST),
                                                  dtype=torch.int64, device=device),
                              torch.from_numpy(row) if device.type == "cpu" else None,
                              np.zeros((self.world, row.shape[0], DIGEST), np.int64))
            device, recv, send, table = self._comm
            send = send if send is not None else torch.from_numpy(row).to(device)
            _all_gather(recv, send, group=self.group)
            table[self.members] = recv.cpu().numpy().reshape(len(self.members),
                                                             row.shape[0], DIGEST)
        else:
            table = row[None]
        return self._compare(table, n)

    def _compare(self, table: np.ndarray, n: int) -> dict:
        vals = table[self.m_rank, self.m_slot]  # (members, DIGEST)
        code = np.zeros(n, np.uint8)
        other = np.full(n, -1, np.int64)
        gap = np.full(n, np.nan)
        self.pending = {}
        if np.array_equal(vals, vals[self._firsts]):
            # the usual step: every replica's digest equals its key's first's, bit for bit;
            # what the full comparison below gives then: checked pieces agree, gap 0 where a
            # gradient was compared
            flags = table[self.rank, self.mine, 0]
            checked = (flags & _CHECKED) > 0
            code[self.mine] = np.where(checked, CHECKED, 0)
            gap[self.mine] = np.where(checked & ((flags & _GRAD) > 0), 0.0, np.nan)
            return {"code": code, "other": other, "gap": gap}
        # every key against its first member: what the probe's summary keeps
        g_diff, p_diff = _differ(vals, vals[self._firsts])
        bad = g_diff | p_diff
        if bad.any():  # rare: said once per key (``note``)
            for j in np.unique(self.m_key[bad]):
                lo, hi = self.start[j], self.start[j + 1]
                odd = self.m_rank[lo:hi][bad[lo:hi]]
                self.pending[int(j)] = {
                    "what": describe_code((GRAD_DIFFERS if g_diff[lo:hi].any() else 0)
                                          | (PARAM_DIFFERS if p_diff[lo:hi].any() else 0)),
                    "ranks": [int(self.m_rank[lo]), int(odd[0])]}
        # this rank's pieces against every replica of theirs: what its store keeps
        if not self.mine.size:
            return {"code": code, "other": other, "gap": gap}
        ref = table[self.rank, self.mine[self.piece]]
        sub = vals[self.idx]
        gd, pd = _differ(sub, ref)
        starts = self.piece_starts
        any_g = np.logical_or.reduceat(gd, starts)
        any_p = np.logical_or.reduceat(pd, starts)
        ranks = np.where(gd | pd, self.m_rank[self.idx], np.iinfo(np.int64).max)
        low = np.minimum.reduceat(ranks, starts)
        checked = (table[self.rank, self.mine, 0] & _CHECKED) > 0
        code[self.mine] = np.where(checked, CHECKED | np.where(any_g, GRAD_DIFFERS, 0)
                                   | np.where(any_p, PARAM_DIFFERS, 0), 0)
        other[self.mine] = np.where(checked & (low < np.iinfo(np.int64).max), low, -1)
        gap[self.mine] = np.where(checked, _gaps(sub, ref, starts), np.nan)
        return {"code": code, "other": other, "gap": gap}

    def note(self, step: int) -> None:
        """File the last ``run``'s disagreements under training step ``step`` (the first one of
        each key is kept: ``events``)."""
        for j, ev in getattr(self, "pending", {}).items():
            if j not in self.first:
                self.first[j] = dict(ev, step=int(step))
        self.pending = {}

    def events(self) -> list:
        """The first disagreement of each replicated piece: [{"param", "first_step", "what",
        "group", "ranks"}] by step (``what``: "gradients", "parameters" or both; ``group``:
        "DDP", a mesh dimension's name, "tied"; ``ranks``: the piece's first rank and the first
        rank differing from it), one per parameter (its earliest piece)."""
        out = {}
        for j, ev in sorted(self.first.items(), key=lambda x: x[1]["step"]):
            label, name = self.labels[j]
            if name not in out:
                out[name] = {"param": name, "first_step": ev["step"], "what": ev["what"],
                             "group": label, "ranks": tuple(ev["ranks"])}
        return sorted(out.values(), key=lambda e: (e["first_step"], e["param"]))


def _differ(vals, ref):
    """(gradient differs, parameter differs) of digests ``vals`` against ``ref`` (rows of
    ``DIGEST`` words), where both were checked at this step: a gradient present on one side
    only differs."""
    fa, fb = vals[:, 0], ref[:, 0]
    both = ((fa & _CHECKED) > 0) & ((fb & _CHECKED) > 0)
    p_diff = both & (vals[:, 4] != ref[:, 4])
    ga, gb = (fa & _GRAD) > 0, (fb & _GRAD) > 0
    g_diff = both & ((ga != gb) | (ga & gb & np.any(vals[:, 1:4] != ref[:, 1:4], axis=1)))
    return g_diff, p_diff


def _gaps(vals, ref, starts) -> np.ndarray:
    """Per run of rows (``starts``): the largest relative difference of the gradient's max or
    min between ``ref`` and ``vals`` row by row (NaN where no gradient was compared in the run;
    inf: NaN on one side only)."""
    ok = ((vals[:, 0] & _GRAD) > 0) & ((ref[:, 0] & _GRAD) > 0)
    a = np.ascontiguousarray(vals[:, 1:3]).view(np.float64)
    b = np.ascontiguousarray(ref[:, 1:3]).view(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.maximum(np.abs(a), np.abs(b))
        rel = np.where(scale > 0, np.abs(a - b) / np.where(scale > 0, scale, 1.0), 0.0)
    rel = np.where((np.isnan(a) & np.isnan(b)) | (a == b), 0.0, rel)  # inf == inf: no gap
    rel = np.where(np.isnan(rel), np.inf, rel).max(axis=1)
    rel = np.where(ok, rel, -1.0)
    out = np.maximum.reduceat(rel, starts)
    return np.where(out < 0, np.nan, out)


def _all_gather(out, inp, group=None) -> None:
    """One tensor from every rank of ``group`` into ``out`` (``all_gather_single`` where torch
    has it: its deprecated alias warns at every call)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _comm_device():
    """Where the default process group's collectives take tensors: the current CUDA device
    for NCCL, else the CPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_tied(tied, held: list, named) -> None:
    """Every name of ``tied`` held by some rank, and every group's names of one shape."""
    if not tied:
        return
    shapes: dict = {}
    for table in held:
        for n, s in table.items():
            shapes.setdefault(n, s)
    missing = [n for group in tied for n in group if n not in shapes]
    if missing:
        close = sorted(canonical_names(n for _, n, _ in named))[:8]
        raise ConfigError(
            f"grad_probe.tied: {missing!r} is held by no rank; accepted: parameter names as "
            f"model.named_parameters() gives them on some rank (here e.g. {', '.join(close)})",
            key="grad_probe.tied", value=missing, accepted="parameter names of the model")
    for group in tied:
        got = {n: tuple(shapes[n]) for n in group}
        if len(set(got.values())) > 1:
            parts = ", ".join(f"{n} {list(s)}" for n, s in got.items())
            raise ConfigError(
                f"grad_probe.tied: the parameters of {list(group)!r} differ in shape ({parts}); "
                "accepted: tied parameters of one shape", key="grad_probe.tied",
                value=list(group), accepted="tied parameters of one shape")
