"""The grad store's write path: the training thread hands its steps to one background writer
per process (a bounded queue: a step waits rather than memory growing; the writer's errors are
raised on the training thread), fsync only with ``durable=True``, and a short run's last shard
of sign bits holds only its steps."""
import os
import threading

import numpy as np
import pytest
import torch

from probekit.grads import open_grads
from probekit.grads.store.live import LIVE
from probekit.grads.numerics.stats import Layout, compute
from probekit.grads.store.store import GradStoreError, GradWriter

LAYOUT = Layout(("w", "b"), (4000, 30), ((40, 100), (30,)))


def stats(step, layout=LAYOUT):
    gen = torch.Generator().manual_seed(step)
    return compute([torch.randn(s, generator=gen) for s in layout.shapes], layout, "L1",
                   (-1, 0, 1), "md5", None, True)


def test_steps_are_written_off_the_training_thread_with_a_bounded_queue(tmp_path, monkeypatch):
    """While the writer is held up (a slow disk), the training thread goes on until the queue
    holds its limit, then waits; once the writer moves, every step is committed exactly."""
    row = sum(v.nbytes for v in vars(stats(0)).values() if v is not None)
    monkeypatch.setattr(LIVE, "max_queued", 3 * row)
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L1", (-1, 0, 1), "md5", 2, significance=True)
    written_by = set()
    original = w._write_row

    def spy(step, st):
        written_by.add(threading.current_thread().name)
        return original(step, st)

    monkeypatch.setattr(w, "_write_row", spy)
    done = []
    with w._io:  # the writing is held up
        def train():
            for s in range(8):
                w.append(s, stats(s))
                done.append(s)

        t = threading.Thread(target=train)
        t.start()
        t.join(2.0)
        # step s hands s-1 over: steps 0..2 queued (3 rows), step 4 waits to hand 3 over
        assert done == [0, 1, 2, 3], done
        assert LIVE.queued == 3 * row
    t.join(30)
    assert done == list(range(8))
    w.close()
    assert written_by == {"probekit-grad-writer"}
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == list(range(8))
    assert np.array_equal(ds["direction"].values, np.stack([stats(s).direction for s in range(8)]))
    assert LIVE.queued == 0


def test_a_writing_error_is_raised_on_the_training_thread(tmp_path):
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L1", (-1, 0, 1), "md5", 1, significance=True)
    w.append(0, stats(0))
    w.append(1, stats(1))
    w.flush()
    folder = tmp_path / "grads.zarr" / "rank0" / "direction" / "c"
    for f in sorted(folder.rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    folder.rmdir()
    folder.write_text("not a folder")  # the next chunk cannot be written
    w.append(2, stats(2))
    w.append(3, stats(3))  # hands 2 over: written, and it fails, on the writing thread
    with pytest.raises(GradStoreError, match=r"writing .*rank0 failed: NotADirectoryError"):
        for s in range(4, 40):  # raised at a following step, not lost
            w.append(s, stats(s))
            LIVE.wait(w, None)
    with pytest.raises(GradStoreError, match="failed"):
        w.close()
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1]  # what was committed


@pytest.mark.parametrize("durable", [False, True])
def test_fsync_only_when_durable(tmp_path, monkeypatch, durable):
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L1", (-1, 0, 1), "md5", 2, significance=True,
                   durable=durable)
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    for s in range(5):
        w.append(s, stats(s))
    w.close()
    monkeypatch.undo()
    assert open_grads(tmp_path)["step"].values.tolist() == list(range(5))
    if durable:  # files and the folders they were renamed into, before each commit
        assert synced.count(False) >= 10 and synced.count(True) >= 3, synced
    else:
        assert synced == []


def test_a_short_runs_last_shard_holds_only_its_steps(tmp_path):
    """Sign bits of a small model: a shard of many steps, an inner chunk per step; a 10-step
    run's shard file is its 10 steps and the index, not the whole shard padded."""
    import zarr

    w = GradWriter(str(tmp_path), 0, LAYOUT, "L1", (-1, 0, 1), "md5", 50, significance=True)
    steps_per_shard = w.dir_chunks[0]
    assert steps_per_shard > 10
    for s in range(10):
        w.append(s, stats(s))
    w.close()
    shard = tmp_path / "grads.zarr" / "rank0" / "direction" / "c" / "0" / "0"
    assert shard.stat().st_size == 10 * LAYOUT.nbytes + 16 * steps_per_shard
    arr = zarr.open_array(str(tmp_path / "grads.zarr" / "rank0" / "direction"), mode="r")
    want = np.stack([stats(s).direction for s in range(10)])
    assert np.array_equal(arr[:], want)  # Zarr itself reads the shard
    assert np.array_equal(open_grads(tmp_path)["direction"].values, want)


def test_chunks_of_uncommitted_rows_are_written_in_place(tmp_path, monkeypatch):
    """Issue 38: a chunk file holding no committed row is read by no reader, so it is written in
    place; one holding committed rows is replaced whole (a temporary file, then a rename)."""
    from probekit.grads.store import store as store_mod

    monkeypatch.setattr(store_mod, "_TARGET_CHUNK_BYTES", 256)   # one step per bits chunk
    w = GradWriter(str(tmp_path), 0, LAYOUT, "L1", (-1, 0, 1), "md5", 50, significance=True)
    assert w.dir_chunks[0] == 1
    renamed = []
    real = os.replace

    def spy(src, dst):
        renamed.append(os.path.relpath(dst, tmp_path / "grads.zarr" / "rank0"))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    for s in range(3):
        w.append(s, stats(s))
    LIVE.wait(w)
    # steps 0 and 1 written: the run's start was committed (no row yet), no chunk replaced
    assert renamed == ["commit.json"] and (tmp_path / "grads.zarr" / "rank0" / "direction" /
                                           "c" / "1" / "1").is_file()
    w.flush()                                 # the first commit: every chunk still fresh
    assert not [r for r in renamed if os.sep + "c" + os.sep in r], renamed
    assert renamed.count("commit.json") == 2
    renamed.clear()
    w.append(3, stats(3))
    w.flush()                                 # the statistics' chunk 0 holds committed rows
    assert {f"{a}/c/0" for a in ("step",)} | {f"{a}/c/0/0" for a in ("present", "max")} <= \
        set(renamed), renamed
    # the bits' chunks are a step each: only their shape (zarr.json) changes
    assert [r for r in renamed if r.startswith(("direction", "significant"))] == \
        ["direction/zarr.json", "significant/zarr.json"], renamed
    w.close()
    monkeypatch.undo()
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 1, 2, 3]
    assert np.array_equal(ds["direction"].values, np.stack([stats(s).direction for s in range(4)]))
    assert np.array_equal(ds["significant"].values,
                          np.stack([stats(s).significant for s in range(4)]))
