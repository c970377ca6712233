"""SIGKILL a recording process mid-run, 20 times: every store reopens with exactly its
committed steps, and every committed value is the one that was recorded."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from probekit.grads import open_grads
from probekit.grads.numerics.stats import Layout, compute

SHAPES = [(300, 400), (1000,), (64, 64, 5)]

# A server imports torch/probekit once, then forks one recorder per request (the forked child
# records deterministic gradients into the given folder until it is killed).
SERVER = textwrap.dedent("""
    import os, signal, sys, torch
    torch.set_num_threads(1)
    import zarr  # imported once here, not in every forked recorder
    from probekit.grads import GradProbe
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)  # its first use imports dynamo
    SHAPES = %r
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    def grads(step):
        gen = torch.Generator().manual_seed(1000 + step)
        return [torch.randn(s, generator=gen) for s in SHAPES]
    for line in sys.stdin:
        path = line.strip()
        pid = os.fork()
        if pid == 0:
            params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
            model = torch.nn.ParameterList(params)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            probe = GradProbe(model, optimizer=opt, grad_level="L2", dump_path=path, flush_every=3)
            probe.start()
            print("started", os.getpid(), flush=True)
            step = 0
            while True:
                for p, g in zip(params, grads(step)):
                    p.grad = g
                opt.step()
                step += 1
        print("forked", pid, flush=True)
""") % (SHAPES,)


def expected_stats(step):
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    lay = Layout(("0", "1", "2"), tuple(int(np.prod(s)) for s in SHAPES), tuple(SHAPES))
    return compute(grads, lay, "L2", (-1, 0, 1))


@pytest.mark.slow
def test_sigkill_twenty_times(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    rng = random.Random(7)
    committed = []
    try:
        for trial in range(20):
            path = tmp_path / f"run{trial}"
            server.stdin.write(f"{path}\n")
            server.stdin.flush()
            lines = [server.stdout.readline().split() for _ in range(2)]
            child = int(next(x for x in lines if x[0] == "started")[1])
            time.sleep(rng.uniform(0.05, 0.8))
            os.kill(child, signal.SIGKILL)
            time.sleep(0.05)
            ds = open_grads(path)  # the store exists from start(): 0 or more committed steps
            n = ds.attrs["committed_steps"]
            committed.append(n)
            assert ds["step"].values.tolist() == list(range(n))
            for s in range(n):
                exp = expected_stats(s)
                for name in ("max", "min", "zeros", "dist", "direction", "present"):
                    assert np.array_equal(ds[name].values[s], getattr(exp, name)), (trial, s, name)
                # the norm's float64 sum of squares: the recording's may differ from a standalone
                # compute in its last bit (seen once in ~30 full-suite runs, at step 460 of a
                # late kill; cause not pinned down): a step written wrongly would be far off
                np.testing.assert_allclose(ds["norm"].values[s], exp.norm, rtol=1e-15, atol=0,
                                           err_msg=str((trial, s)))
    finally:
        server.kill()
        server.wait()
    # the kills must have landed mid-run: most stores hold committed steps, not all the same
    assert sum(n > 0 for n in committed) >= 12, committed
    assert len(set(committed)) >= 5, committed
