"""Issue 28, point 3: msprobe's documented loop -- ``monitor(model)`` once, ``start()`` /
``stop()`` / ``step()`` around every iteration -- records every step with a grad_probe
config.json, as msprobe 1.0.4 does (its start/stop/step return at once for task grad_probe)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from probekit import PrecisionDebugger, open_grads
from probekit.grads.store.msprobe import read_grad_dump

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from msprobe_util import ROOT, run_msprobe  # noqa: E402

STEPS = 5

# the loop of msprobe's grad-probe and free-benchmark documents; only the import differs
LOOP = textwrap.dedent("""
    import sys
    import torch
    if sys.argv[1] == "msprobe":
        from msprobe.pytorch import PrecisionDebugger
    else:
        from probekit import PrecisionDebugger
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    debugger = PrecisionDebugger(config_path=sys.argv[2])
    debugger.monitor(model)
    for step in range(int(sys.argv[3])):
        debugger.start()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        debugger.stop()
        debugger.step()
""")


def grad_config(tmp_path, name):
    cfg = {"task": "grad_probe", "dump_path": str(tmp_path / name), "rank": [], "step": [],
           "grad_probe": {"grad_level": "L2", "param_list": [], "bounds": [-0.1, 0, 0.1]}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_every_step_of_msprobes_loop_is_recorded(tmp_path):
    """In process: after the loop the debugger's results hold all steps, the probe still
    records (stop() ended nothing), and close() ends it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    debugger = PrecisionDebugger(config_path=grad_config(tmp_path, "pk"))
    debugger.monitor(model)
    for _ in range(STEPS):
        debugger.start()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        debugger.stop()
        debugger.step()
    probe = debugger._session.probe
    assert probe.active and probe.steps_seen == STEPS
    assert debugger.results["step"].values.tolist() == list(range(STEPS))
    assert debugger.summary["steps"] == STEPS
    debugger.close()
    assert not probe.active
    assert open_grads(tmp_path / "pk")["step"].values.tolist() == list(range(STEPS))


@pytest.mark.msprobe
def test_msprobe_and_probekit_record_the_same_steps(tmp_path):
    """The same script under msprobe 1.0.4 and probekit (only the import differs): the same
    steps, and the same statistics, in both dumps."""
    run_msprobe(LOOP, "msprobe", grad_config(tmp_path, "ms"), str(STEPS))
    out = subprocess.run([sys.executable, "-c", LOOP, "probekit", grad_config(tmp_path, "pk"),
                          str(STEPS)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs, ours = read_grad_dump(str(tmp_path / "ms"), 0), open_grads(tmp_path / "pk")
    assert theirs["step"].values.tolist() == ours["step"].values.tolist() == list(range(STEPS))
    assert theirs["param"].values.tolist() == ours["param"].values.tolist()
    for name in ("max", "min", "dist", "direction"):
        assert np.array_equal(theirs[name].values, ours[name].values), name
