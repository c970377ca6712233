"""The comparison over shared element ranges (planner.py, counting.py, geometry.py): the same
result as comparing the assembled parameters, on every layout pair, without assembling them."""
import itertools
import os

import numpy as np
import pytest
import xarray as xr

import sharded_stores as S
from probekit.grads import GradCompareError, GradStoreError, compare_grads, open_grads
from probekit.grads.numerics import geometry, kernel

PARAMS = {"emb": (13, 6), "w": (7, 10), "conv": (6, 3, 2, 2), "b": (5,), "s": (),
          "big": (40, 33), "c5": (4, 3, 2, 2, 2)}
LAYOUTS = {"single": S.single(PARAMS), "fsdp2": S.fsdp(PARAMS, 2), "fsdp3": S.fsdp(PARAMS, 3),
           "fsdp4": S.fsdp(PARAMS, 4), "tp2": S.tensor_parallel(PARAMS, 2),
           "mesh2x2": S.mesh2d(PARAMS, 2, 2)}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    for name, layout in LAYOUTS.items():
        S.write(base / f"{name}_a", PARAMS, layout, 4, seed=0)
        S.write(base / f"{name}_b", PARAMS, layout, 4, seed=1, noise=0.4)
    return base


def assembled(a, b, **kw):
    """The reference: both runs opened (sharded ones assembled) and compared as Datasets."""
    return compare_grads(open_grads(a), open_grads(b), progress=False, **kw)


@pytest.mark.parametrize("first,second", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_every_layout_pair_counts_as_the_assembled_comparison(stores, first, second,
                                                              monkeypatch):
    a, b = stores / f"{first}_a", stores / f"{second}_b"
    want = assembled(a, b)
    assert 0.0 < float(want["similarity"].min()) < 1.0  # the runs differ, not everywhere
    from probekit.grads.store import assemble

    def refuse(*args, **kwargs):
        raise AssertionError("a parameter was assembled")

    monkeypatch.setattr(assemble, "assemble_runs", refuse)
    for block in (1, 8 << 20):  # slabs of a few elements; one slab set
        got = compare_grads(a, b, block_bytes=block, task_bytes=3 * block, progress=False)
        xr.testing.assert_identical(got, want)


def test_the_same_bits_in_every_layout_compare_equal(stores):
    for first, second in itertools.combinations(LAYOUTS, 2):
        cmp = compare_grads(stores / f"{first}_a", stores / f"{second}_a", progress=False)
        assert np.all(cmp["differ"].values == 0), (first, second)
        assert int(cmp["first_step"].item()) == -1


def test_dead_rank_replicas_rank_filter_and_errors(tmp_path):
    params = {"w": (8, 6), "b": (6,)}
    layout = S.fsdp(params, 3)
    S.write(tmp_path / "died", params, layout, {0: 5, 1: 3, 2: 5})  # rank 1 died after 3
    S.write(tmp_path / "single", params, S.single(params), 5, seed=1, noise=0.5)
    got = compare_grads(tmp_path / "died", tmp_path / "single", progress=False)
    assert got["step"].values.tolist() == [0, 1, 2]
    xr.testing.assert_identical(got, assembled(tmp_path / "died", tmp_path / "single"))
    # every rank recorded replicas too (a rank filter listing them): each piece counted once
    twice = {r: entries + [e for q in layout if q != r for e in layout[q]]
             for r, entries in layout.items()}
    S.write(tmp_path / "replicas", params, twice, 5)
    got = compare_grads(tmp_path / "replicas", tmp_path / "single", progress=False)
    xr.testing.assert_identical(got, assembled(tmp_path / "replicas", tmp_path / "single"))
    # shards that do not cover a parameter: each rank group compared as recorded, rank r
    # with rank r
    S.write(tmp_path / "part_a", params, {0: layout[0], 2: layout[2]}, 5)
    S.write(tmp_path / "part_b", params, {0: layout[0], 2: layout[2]}, 5, seed=3, noise=1.0)
    got = compare_grads(tmp_path / "part_a", tmp_path / "part_b", progress=False)
    assert got["rank"].values.tolist() == [0, 2]
    want = compare_grads({r: open_grads(tmp_path / "part_a", rank=r, shards=True)
                          for r in (0, 2)},
                         {r: open_grads(tmp_path / "part_b", rank=r, shards=True)
                          for r in (0, 2)}, progress=False)
    xr.testing.assert_identical(got, want)
    S.write(tmp_path / "late", params, S.single(params), range(7, 9))
    with pytest.raises(GradCompareError, match=r"share no step \(first: 0, 1, 2; second: 7, 8"):
        compare_grads(tmp_path / "died", tmp_path / "late", progress=False)
    S.write(tmp_path / "l0", params, layout, 2, level="L0")
    with pytest.raises(GradCompareError, match="grad_level 'L0', which keeps no direction"):
        compare_grads(tmp_path / "l0", tmp_path / "single", progress=False)
    other = {"w": (8, 7), "b": (6,)}
    S.write(tmp_path / "other", other, S.fsdp(other, 2), 3)
    with pytest.raises(GradCompareError, match=r"shapes differ.*'w': shape \(8, 6\) in the first run, shape \(8, 7\) in the second"):
        compare_grads(tmp_path / "died", tmp_path / "other", progress=False)


def test_progress_covers_opening_planning_and_counting(stores, capsys):
    compare_grads(stores / "fsdp4_a", stores / "fsdp3_b", progress=True, block_bytes=40,
                  task_bytes=80)
    line = capsys.readouterr().err.rstrip().split("\r")[-1]
    # 2 open batches + the plan + the slab sets' count tasks over 2 step chunks + their sums
    done, total = line.split(": ")[1].split(" tasks")[0].split("/")
    assert done == total and int(total) > 3 + 2, line


def test_flat_boxes_cover_a_range_in_contiguous_boxes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        shape = tuple(int(x) for x in rng.integers(1, 6, rng.integers(1, 5)))
        n = int(np.prod(shape))
        x0 = int(rng.integers(0, n))
        x1 = int(rng.integers(x0, n + 1))
        boxes = geometry.flat_boxes(shape, x0, x1)
        pos = x0
        for off, ext in boxes:
            first = int(np.ravel_multi_index(off, shape))
            last = int(np.ravel_multi_index(tuple(np.add(off, ext) - 1), shape))
            size = int(np.prod(ext))
            assert first == pos and last == first + size - 1, (shape, off, ext)
            pos += size
        assert pos == x1 and len(boxes) <= 2 * len(shape) - 1


def test_run_sets_visit_each_shared_element_once_at_its_place_in_both_boxes():
    rng = np.random.default_rng(1)
    for _ in range(200):
        nd = int(rng.integers(1, 5))
        shape = tuple(int(x) for x in rng.integers(1, 6, nd))

        def box():
            off = [int(rng.integers(0, s)) for s in shape]
            return off, [int(rng.integers(1, s - o + 1)) for s, o in zip(shape, off)]

        boxes_a, boxes_b = [box() for _ in range(3)], [box() for _ in range(3)]
        oa, la = (np.array([b[k] for b in boxes_a]) for k in (0, 1))
        ob, lb = (np.array([b[k] for b in boxes_b]) for k in (0, 1))
        i, j = geometry.candidate_pairs(oa, la, ob, lb)
        meet = {(x, y) for x in range(3) for y in range(3) if np.all(
            np.maximum(oa[x], ob[y]) < np.minimum(oa[x] + la[x], ob[y] + lb[y]))}
        assert set(zip(i.tolist(), j.tolist())) == meet
        rs = geometry.runsets(oa[i], la[i], ob[j], lb[j], np.arange(i.size))
        k, sa, sb, lengths = geometry.expand(rs)
        for q, (x, y) in enumerate(zip(i, j)):
            lo, hi = np.maximum(oa[x], ob[y]), np.minimum(oa[x] + la[x], ob[y] + lb[y])
            want = sorted((int(np.ravel_multi_index(tuple(g - oa[x]), la[x])),
                           int(np.ravel_multi_index(tuple(g - ob[y]), lb[y])))
                          for g in itertools.product(*map(range, lo, hi)))
            got = sorted((int(a + t), int(b + t)) for a, b, n in
                         zip(sa[k == q], sb[k == q], lengths[k == q]) for t in range(n))
            assert got == want


def test_count_runs_every_path_equals_the_bits_unpacked():
    rng = np.random.default_rng(2)
    paths = [p for p in ("avx512", "avx2", "c") if kernel.set_path(p) == p] + ["numpy"]
    kernel.set_path("auto")
    for trial in range(40):
        nrows = int(rng.integers(1, 4))

        def side():
            out = []
            for _ in range(3):
                n = int(rng.integers(1, 200))
                d = rng.integers(0, 256, (nrows, n + 5), np.uint8)[:, 2:2 + n]  # row stride
                s = (rng.integers(0, 256, (nrows, n), np.uint8) if trial % 2 else
                     np.broadcast_to(np.full(n, 255, np.uint8), (nrows, n)))  # stride 0
                out.append((d, s))
            return out

        a, b = side(), side()
        runs = []
        for _ in range(6):
            ra, rb = int(rng.integers(0, 3)), int(rng.integers(0, 3))
            cnt = [int(x) for x in rng.integers(1, 3, 3)]
            da, db = [int(x) for x in rng.integers(0, 40, 3)], [int(x) for x in
                                                                 rng.integers(0, 40, 3)]
            length = int(rng.integers(1, 150))
            span_a = sum((c - 1) * s for c, s in zip(cnt, da)) + length
            span_b = sum((c - 1) * s for c, s in zip(cnt, db)) + length
            if span_a > a[ra][0].shape[1] * 8 or span_b > b[rb][0].shape[1] * 8:
                continue
            a0 = int(rng.integers(0, a[ra][0].shape[1] * 8 - span_a + 1))
            b0 = int(rng.integers(0, b[rb][0].shape[1] * 8 - span_b + 1))
            runs.append([int(rng.integers(0, 4)), ra, rb, a0, b0, length,
                         *[v for k in range(3) for v in (cnt[k], da[k], db[k])]])
        if not runs:
            continue
        runs = np.array(runs, np.int64)
        want = np.zeros((3, nrows, 4), np.int64)
        for row in runs:
            _, sa, sb, ln = geometry.expand(row[[0, 3, 4, 5, *range(6, 15)]][None])
            for r in range(nrows):
                ua, ub = np.unpackbits(a[row[1]][0][r]), np.unpackbits(b[row[2]][0][r])
                ga, gb = np.unpackbits(a[row[1]][1][r]), np.unpackbits(b[row[2]][1][r])
                for x, y, n in zip(sa, sb, ln):
                    diff = ua[x:x + n] ^ ub[y:y + n]
                    both = ga[x:x + n] & gb[y:y + n]
                    want[:, r, row[0]] += [int(diff.sum()), int((diff & both).sum()),
                                           int(both.sum())]
        for path in paths:
            kernel.set_path(path)
            try:
                got = np.zeros((3, nrows, 4), np.int64)
                kernel.count_runs(a, b, runs, nrows, got)
                np.testing.assert_array_equal(got, want, err_msg=path)
                got = np.zeros((3, nrows, 4), np.int64)
                kernel.count_runs([(d, None) for d, _ in a], [(d, None) for d, _ in b], runs,
                                  nrows, got)
                np.testing.assert_array_equal(got[0], want[0], err_msg=path)
                assert not got[1:].any()
            finally:
                kernel.set_path("auto")


def test_count_runs_many_equals_count_runs_against_each_side():
    """One side's bits against several sides laid out alike (a reference against its test and
    its controls: ``kernel.count_runs_many``) count as ``count_runs`` against each alone, on
    every path: runs longer than the piece the C kernel reads once for all sides (2^18 bits),
    at the same bit phase in both (whole words of every side in one fused pass, four sides at
    a time; the bits before the next byte and after the last word alone) and not, with
    significance bits and without, and more sides than it takes at once (16)."""
    rng = np.random.default_rng(5)
    paths = [p for p in ("avx512", "avx2", "c") if kernel.set_path(p) == p] + ["numpy"]
    kernel.set_path("auto")
    nrows, width = 2, 80_000                 # 640,000 bits a row
    for nsides, use_sig in ((3, True), (3, False), (18, True)):
        def side():
            return [(rng.integers(0, 256, (nrows, width), np.uint8),
                     rng.integers(0, 256, (nrows, width), np.uint8) if use_sig else None)
                    for _ in range(2)]

        a = side()
        others = [side() for _ in range(nsides)]
        runs = np.zeros((5, 15), np.int64)
        runs[:, 6::3] = 1                     # one run per set (no leading loop)
        runs[0, :6] = (0, 0, 1, 8, 8, 600_000)                 # same phase, three pieces
        runs[1, :6] = (1, 1, 0, 3, 70, 500_000)                # shifted
        runs[2, :6] = (2, 1, 1, 0, 5, 100)                     # short
        runs[3, :6] = (1, 0, 0, 640_000 - 300_000, 1, 300_000)  # to a row's last bit
        runs[4, :6] = (0, 1, 1, 3, 11, 400_037)                # same phase: head 5, tail 32
        for path in paths:
            kernel.set_path(path)
            try:
                got = np.zeros((nsides, 3, nrows, 3), np.int64)
                kernel.count_runs_many(a, others, runs, nrows, got)
                for i, b in enumerate(others):
                    want = np.zeros((3, nrows, 3), np.int64)
                    kernel.count_runs(a, b, runs, nrows, want)
                    assert want[0].all() and (want[1:].any() == use_sig)
                    np.testing.assert_array_equal(got[i], want, err_msg=f"{path} side {i}")
            finally:
                kernel.set_path("auto")


def _no_assembly(monkeypatch):
    """Make any assembly of a sharded run fail (the comparison of stores assembles nothing)."""
    from probekit.grads.store import assemble

    def refuse(*args, **kwargs):
        raise AssertionError("a parameter was assembled")

    monkeypatch.setattr(assemble, "assemble_runs", refuse)


def _restarted(path, params, garbage):
    """A store over three runs: 4 ranks record steps 0..4 (2..4 of them ``garbage``'s
    gradients), killed; resumed at 2 ranks from step 2, dies after step 3; resumed at 4 ranks
    from step 4 to 6. Segments: 0..1 (the root's groups), 2..3 (a layout folder), 4..6 (the
    root's groups again, continued: rows 4..6 of groups that also hold superseded rows 2..3).
    Shards of 3 steps, so a segment's rows start inside a shard."""
    good = lambda step: S.grads(params, step, 0)  # noqa: E731
    bad = lambda step: (S.grads(params, step, 0) if step < 2  # noqa: E731
                        else S.grads(params, step, 9, noise=3.0))
    run = lambda n, t, start: {"run": n, "time": t, "start": start,  # noqa: E731
                               "from": start, "scope": "job"}
    S.write(path, params, S.fsdp(params, 4), range(0, 5), data=bad if garbage else good,
            flush_every=3, run=run("r1", 1, 0), layout_key="four")
    S.write(path, params, S.fsdp(params, 2), range(2, 4), data=good, flush_every=3,
            run=run("r2", 2, 2), layout_key="two")
    S.write(path, params, S.fsdp(params, 4), range(4, 7), data=good, flush_every=3,
            run=run("r3", 3, 4), layout_key="four")


def test_a_restarted_store_compares_shard_by_shard_as_assembled(tmp_path, monkeypatch):
    """An elastic restart (4 -> 2 -> 4 ranks) against uninterrupted runs: the planner takes the
    store's segments (``restarts.segments``), reads only each segment's rows of its groups (the
    superseded steps the first run wrote are never read) and gives the assembled path's
    counts, without assembling anything."""
    from probekit.grads.compare import compare
    from probekit.grads import segments
    from probekit.grads.store.chunks import bits_meta
    from probekit.grads.compare.engine import Session
    from probekit.grads.compare.opening import store_of

    params = {"w": (9, 6), "b": (7,), "e": (5, 3, 2)}
    _restarted(tmp_path / "restarted", params, garbage=True)
    S.write(tmp_path / "same", params, S.fsdp(params, 4), 7, seed=0, flush_every=3)
    S.write(tmp_path / "other", params, S.single(params), 7, seed=1, noise=0.5)
    segs = segments(tmp_path / "restarted")
    assert [(s.first_step, s.last_step, s.ranks) for s in segs] == [
        (0, 1, [0, 1, 2, 3]), (2, 3, [0, 1]), (4, 6, [0, 1, 2, 3])]
    root = tmp_path / "restarted" / "grads.zarr" / "rank0"
    assert bits_meta(str(root / "direction"))["kind"] == "sharded"
    assert open_grads(tmp_path / "restarted", shards=True, rank=0, segment=2)[
        "step"].values.tolist() == [4, 5, 6]
    want_same = assembled(tmp_path / "restarted", tmp_path / "same")
    want_other = assembled(tmp_path / "restarted", tmp_path / "other")
    back = assembled(tmp_path / "other", tmp_path / "restarted")
    assert np.all(want_same["differ"].values == 0)  # the superseded steps are not read
    assert 0.0 < float(want_other["similarity"].min()) < 1.0
    with Session(progress=False) as session:
        plan = compare.plan_stage(store_of(tmp_path / "restarted"),
                                  store_of(tmp_path / "other"), session=session)
    assert [(q["label"], q["steps"].tolist()) for q in plan["pairs"]] == [
        (0, [0, 1]), (0, [2, 3]), (0, [4, 5, 6])]
    _no_assembly(monkeypatch)
    for block in (1, 8 << 20):
        got = compare_grads(tmp_path / "restarted", tmp_path / "same", block_bytes=block,
                            task_bytes=3 * block, progress=False)
        xr.testing.assert_identical(got, want_same)
        got = compare_grads(tmp_path / "restarted", tmp_path / "other", block_bytes=block,
                            task_bytes=3 * block, progress=False)
        xr.testing.assert_identical(got, want_other)
        got = compare_grads(tmp_path / "other", tmp_path / "restarted", block_bytes=block,
                            task_bytes=3 * block, progress=False)
        xr.testing.assert_identical(got, back)
    # both runs restarted, each with its own segments (pairs of segments over shared steps)
    _restarted(tmp_path / "again", params, garbage=False)
    monkeypatch.undo()
    want = assembled(tmp_path / "again", tmp_path / "restarted")
    _no_assembly(monkeypatch)
    got = compare_grads(tmp_path / "again", tmp_path / "restarted", progress=False)
    xr.testing.assert_identical(got, want)
    assert np.all(got["differ"].values == 0)


def test_plain_and_sharded_bits_count_the_same(tmp_path, monkeypatch):
    """Bits in plain chunk files of one step (``flush_every=1``) and in shards of steps (a
    shard of 2 or 5 steps, its last one short), compared with one another shard by shard:
    the assembled path's counts, mapped or copied. Steps 1, 5 and 6 of the first runs are
    significant everywhere: their significance rows are all fill value, not stored (a shard
    with a gap between its steps, a shard of none: no file)."""
    from probekit.grads.compare import counting
    from probekit.grads.store.chunks import RawChunks, bits_meta

    params = {"w": (9, 6), "b": (7,)}

    def data(seed):
        def grads(step):
            if seed == 0 and step in (1, 5, 6):
                return {n: np.full(shape, 1.0, np.float32) for n, shape in params.items()}
            return S.grads(params, step, seed, 0.5 * seed)
        return grads

    kinds = {}
    for name, every in (("plain", 1), ("shard2", 2), ("shard5", 5)):
        for seed in (0, 1):
            S.write(tmp_path / f"{name}{seed}", params, S.fsdp(params, 3), 7, data=data(seed),
                    flush_every=every)
        meta = bits_meta(str(tmp_path / f"{name}0" / "grads.zarr" / "rank1" / "significant"))
        kinds[name] = (meta["kind"], meta["chunk"][0])
    assert kinds == {"plain": ("plain", 1), "shard2": ("sharded", 2),
                     "shard5": ("sharded", 5)}
    sig = str(tmp_path / "shard50" / "grads.zarr" / "rank0" / "significant")
    assert not os.path.exists(os.path.join(sig, "c", "1", "0"))  # steps 5, 6: no shard
    assert np.all(RawChunks.open(sig, 7).read(0, 7)[[1, 5, 6]] == 255)
    want = {}
    for a, b in itertools.permutations(kinds, 2):
        want[a, b] = assembled(tmp_path / f"{a}0", tmp_path / f"{b}1")
    assert float(want["plain", "shard2"]["similarity"].min()) < 1.0
    _no_assembly(monkeypatch)
    for mapped in (True, False):
        if not mapped:
            monkeypatch.setattr(counting, "map_rows", lambda *args: None)
        for (a, b), w in want.items():
            for block in (1, 8 << 20):  # a step per block; all steps in one
                got = compare_grads(tmp_path / f"{a}0", tmp_path / f"{b}1", progress=False,
                                    block_bytes=block, task_bytes=8 << 20)
                xr.testing.assert_identical(got, w)


def test_only_committed_rows_are_read_or_mapped(tmp_path, monkeypatch):
    """Rows a writer wrote but did not commit (a killed process) are neither read nor mapped:
    asking for them is refused; a shard shorter than its index says is an error, not a crash
    of the process (a mapping past a file's end)."""
    import json

    from probekit.grads.store import chunks

    params = {"w": (9, 6), "b": (7,)}
    S.write(tmp_path / "a", params, S.fsdp(params, 2), 6, flush_every=3)
    S.write(tmp_path / "b", params, S.single(params), 6, seed=1, noise=0.5)
    for r in (0, 1):  # commit.json says 4 steps: rows 4 and 5 are in the shard, not committed
        commit = tmp_path / "a" / "grads.zarr" / f"rank{r}" / "commit.json"
        info = json.loads(commit.read_text())
        info["steps"] = 4
        info["runs"][0].update(rows=[0, 4], steps=[0, 3])
        commit.write_text(json.dumps(info))
    want = assembled(tmp_path / "a", tmp_path / "b")
    assert want["step"].values.tolist() == [0, 1, 2, 3]
    raw = chunks.RawChunks.open(str(tmp_path / "a" / "grads.zarr" / "rank0" / "direction"), 4)
    assert raw.kind == "sharded" and raw.shape[0] == 4
    assert chunks.map_rows(raw, np.arange(3, 4), 0, 4).shape == (1, 4)
    with pytest.raises(GradStoreError, match="rows 3..4 asked of 4 committed"):
        chunks.map_rows(raw, np.arange(3, 5), 0, 4)
    with pytest.raises(GradStoreError, match="rows 4..4 asked of 4 committed"):
        chunks.read_rows(raw, np.array([4]), 0, 4, np.empty((1, 4), np.uint8))
    _no_assembly(monkeypatch)
    xr.testing.assert_identical(compare_grads(tmp_path / "a", tmp_path / "b", progress=False),
                                want)
    # a shard cut short (its index kept): an error naming it, whether mapped or copied
    shard = tmp_path / "a" / "grads.zarr" / "rank0" / "direction" / "c" / "0" / "0"
    data = shard.read_bytes()
    shard.write_bytes(data[:raw.shape[1]] + data[-16 * 3:])  # one step's bytes, 3 indexed
    for mapped in (True, False):
        if not mapped:
            monkeypatch.setattr("probekit.grads.compare.counting.map_rows", lambda *args: None)
        with pytest.raises(GradStoreError, match="shorter than its index says"):
            compare_grads(tmp_path / "a", tmp_path / "b", progress=False)


def test_copied_and_mapped_reads_count_the_same(stores, monkeypatch):
    """Ranges mapped from the page cache, copied with preadv, or copied by seek and read (where
    the OS has no preadv): the same counts."""
    import os

    from probekit.grads.compare import counting

    a, b = stores / "fsdp4_a", stores / "mesh2x2_b"
    want = compare_grads(a, b, progress=False)
    monkeypatch.setattr(counting, "map_rows", lambda *args: None)  # every range copied
    xr.testing.assert_identical(compare_grads(a, b, progress=False), want)
    monkeypatch.delattr(os, "preadv")
    xr.testing.assert_identical(compare_grads(a, b, progress=False), want)
