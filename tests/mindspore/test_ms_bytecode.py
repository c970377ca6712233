"""MindSpore's other capture modes with the probe on. ``@ms.jit(capture_mode="bytecode")`` (PIJit)
runs in a subprocess, because it used to end the process with a segmentation fault: a step it
captures whole records the same values as PyNative, and a step it runs partly as Python is refused
with ``GraphModeError`` before any of probekit's statistics run (probekit/mindspore/capture.py).
``capture_mode="trace"`` updates the weights once, and the probe records that one update."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

import probekit  # noqa: E402
from probekit.mindspore import GradProbe  # noqa: E402

from ms_bytecode import BOUNDS, STEPS, new_run, train_step  # noqa: E402
from ms_models import data, run_steps  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KEYS = ("present", "max", "min", "norm", "zeros", "dist", "direction", "significant")

REFUSED = (
    "grad_probe: step 0 stopped before the optimizer's update and is not recorded: it runs in a "
    "train step compiled with @ms.jit(capture_mode=\"bytecode\") that MindSpore did not capture "
    "into one graph (a graph break, or a compile failure it logged). MindSpore then rewrites "
    "every Python function called during the step, probekit's statistics included, and the "
    "process crashes. Compile the train step anew with @ms.jit (capture_mode=\"ast\", the "
    "default), or use GRAPH_MODE: both are recorded")


def run_compiled(variant, where, dump, capture="bytecode"):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "ms_bytecode.py"), variant, where,
                          str(dump), capture], capture_output=True, text=True, env=env,
                         timeout=300, cwd=dump)  # MindSpore writes its rank_0/ dumps there
    # a segmentation fault is returncode -11 (139 from a shell)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout[-2000:]
    return json.loads(last[len("RESULT "):])


def pynative_reference(variant, dump, batches):
    net, opt = new_run()
    probe = GradProbe(opt, grad_level="L2", bounds=BOUNDS, significance=True,
                      dump_path=dump).start()
    losses = run_steps(train_step(variant, net, opt), batches)
    probe.stop()
    return losses, probekit.open_grads(dump)


@pytest.mark.parametrize("variant", ["cell", "function"])
def test_a_bytecode_step_captured_whole_records_the_same_values_as_pynative(tmp_path, variant):
    got = run_compiled(variant, "host", tmp_path)
    losses, ref = pynative_reference(variant, tmp_path / "pynative", data(STEPS, seed=2))
    assert got == {"losses": losses, "updated": [True] * STEPS, "global_step": STEPS}
    ds = probekit.open_grads(tmp_path / "bytecode")
    assert ds["step"].values.tolist() == list(range(STEPS))
    assert ds["param"].values.tolist() == ref["param"].values.tolist()
    for k in KEYS:
        assert np.array_equal(ds[k].values, ref[k].values), k


@pytest.mark.parametrize("variant,where", [("lambda", "host"), ("break", "host"),
                                           ("cell", "device")])
def test_a_bytecode_step_run_partly_as_python_is_refused_by_name(tmp_path, variant, where):
    """A compile failure (the lambda), a graph break, or the in-graph statistics (MindSpore fails
    to compile them with bytecode capture): step 0 raises GraphModeError, the weights are not
    updated, stop() raises nothing (not the "steps probekit did not see" error either), nothing
    is written, and a new @ms.jit step on the same optimizer records."""
    got = run_compiled(variant, where, tmp_path)
    # the optimizer's own count may or may not have run before the step stopped (it does not
    # wait for the gradients); the update does wait for them, and did not run
    assert got.pop("global_step") in (0, 1)
    assert got == {"losses": [], "error": ["GraphModeError", REFUSED], "updated": [False],
                   "after_steps": 2}
    assert probekit.open_grads(tmp_path / "bytecode").sizes["step"] == 0
    assert probekit.open_grads(tmp_path / "after")["step"].values.tolist() == [0, 1]


def test_trace_capture_updates_once_and_that_update_is_recorded(tmp_path):
    """MindSpore 2.10's capture_mode="trace" runs the step's Python once to trace it, and its
    graph leaves the optimizer out: the weights change at the first call only, global_step stays
    1. The probe records that one update, equal to PyNative's first step; stop() raises nothing
    (the optimizer ran once)."""
    got = run_compiled("cell", "host", tmp_path, "trace")
    _, ref = pynative_reference("cell", tmp_path / "pynative", data(STEPS, seed=2))
    assert got["updated"] == [True] + [False] * (STEPS - 1)
    assert got["global_step"] == 1 and set(got) == {"losses", "updated", "global_step"}
    ds = probekit.open_grads(tmp_path / "trace")
    assert ds["step"].values.tolist() == [0]
    for k in KEYS:
        assert np.array_equal(ds[k].values[0], ref[k].values[0]), k
