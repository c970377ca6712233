"""Ranks creating their groups of one store at the same moment (as under torchrun)."""
import multiprocessing as mp

from probekit.grads import open_grads
from probekit.grads.numerics.stats import Layout
from probekit.grads.store.store import GradWriter

LAYOUT = Layout(("w",), (4,), ((4,),))


def _create(path, rank, barrier, results):
    barrier.wait()
    try:
        GradWriter(path, rank, LAYOUT, "L1", (-1, 0, 1), "md5", 4).close()
        results.put((rank, "ok"))
    except Exception as exc:  # reported to the test
        results.put((rank, repr(exc)))


def test_ranks_create_one_store_concurrently(tmp_path):
    ctx = mp.get_context("fork")
    for trial in range(12):
        path = str(tmp_path / f"t{trial}")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_create, args=(path, r, barrier, results)) for r in range(4)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(60)
        assert got == [(r, "ok") for r in range(4)], (trial, got)
        for r in range(4):
            assert open_grads(path, rank=r).attrs["committed_steps"] == 0
