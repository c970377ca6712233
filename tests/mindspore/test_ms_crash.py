"""The store's guarantees hold for MindSpore runs: a run that exits without stop() keeps every
step (the debugger flushes at exit), and a run killed with SIGKILL at a random moment reopens
with exactly its committed steps, each holding the values that were recorded."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

import probekit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

RECORDER = textwrap.dedent("""
    import sys, numpy as np, mindspore as ms
    from probekit.mindspore import PrecisionDebugger
    ms.set_context(mode=ms.PYNATIVE_MODE)
    path, steps = sys.argv[1], int(sys.argv[2])
    params = [ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
              for i, s in enumerate([(300, 40), (1000,)])]
    opt = ms.nn.SGD(params, learning_rate=0.0)
    dbg = PrecisionDebugger(task="grad_probe", dump_path=path, grad_level="L2", flush_every=3)
    dbg.monitor(opt)
    print("started", flush=True)
    step = 0
    while steps < 0 or step < steps:
        rng = np.random.default_rng(1000 + step)
        opt(tuple(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)) for p in params))
        step += 1
    # no stop(): the debugger's exit handler flushes
""")


def expected_max(step):
    rng = np.random.default_rng(1000 + step)
    return [rng.standard_normal(s).astype(np.float32).max() for s in [(300, 40), (1000,)]]


def run(path, steps):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", RECORDER, str(path), str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def test_exit_without_stop_keeps_every_step(tmp_path):
    proc = run(tmp_path / "d", 7)
    assert proc.wait(timeout=120) == 0
    ds = probekit.open_grads(tmp_path / "d")
    assert ds["step"].values.tolist() == list(range(7))  # 7 is not a multiple of flush_every
    assert ds["max"].values[6].tolist() == expected_max(6)


@pytest.mark.slow
def test_sigkill_five_times(tmp_path):
    rng = random.Random(3)
    seen = []
    for trial in range(5):
        path = tmp_path / f"run{trial}"
        proc = run(path, -1)
        assert proc.stdout.readline().split() == ["started"]
        time.sleep(rng.uniform(0.05, 1.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        ds = probekit.open_grads(path)
        n = ds.attrs["committed_steps"]
        seen.append(n)
        assert n % 3 == 0  # whole flush blocks only
        assert ds["step"].values.tolist() == list(range(n))
        for s in range(n):
            assert ds["max"].values[s].tolist() == expected_max(s)
    assert max(seen) > 0
