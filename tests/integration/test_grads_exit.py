"""Nothing recorded is lost when the process ends without ``stop()``: normal end (msprobe's
documented usage), uncaught exception, ``sys.exit``, Ctrl-C, SIGTERM; SIGKILL loses at most one
flush window, bounded in time; a reader in the same process sees the buffered steps."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from probekit.grads import GradProbe, open_grads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    from probekit import PrecisionDebugger
    from probekit.grads import GradProbe
    from tests._train import make_model
    how, path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "probe-no-stop":
        GradProbe(model, dump_path=path).start()
    else:
        debugger = PrecisionDebugger(config_path=os.path.join(path, "config.json"))
        debugger.monitor(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print("trained", flush=True)
    if how == "exception":
        raise RuntimeError("boom")
    if how == "exit1":
        sys.exit(1)
    if how == "ctrl-c":
        raise KeyboardInterrupt
    if how in ("sigterm", "sigkill"):
        time.sleep(60)
""")


def run(tmp_path, how, steps, extra=None, wait_signal=None):
    path = tmp_path / how
    path.mkdir()
    cfg = {"task": "grad_probe", "dump_path": str(path),
           "grad_probe": {"grad_level": "L1", **(extra or {})}}
    (path / "config.json").write_text(json.dumps(cfg))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=ROOT))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), how, str(path), str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if wait_signal is not None:
        assert proc.stdout.readline().strip() == "trained"
        time.sleep(wait_signal[1])
        proc.send_signal(wait_signal[0])
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err, path


@pytest.mark.parametrize("how, code", [("normal", 0), ("exception", 1), ("exit1", 1),
                                       ("ctrl-c", 130), ("probe-no-stop", 0)])
def test_every_step_on_disk_without_stop(tmp_path, how, code):
    rc, err, path = run(tmp_path, how, 7)
    if how == "ctrl-c":  # python exits 1 or -SIGINT/130 depending on version: it died of Ctrl-C
        assert rc != 0 and "KeyboardInterrupt" in err
    else:
        assert rc == code, err
    assert "failed" not in err, err
    ds = open_grads(path)
    assert ds["step"].values.tolist() == list(range(7))
    assert bool(ds["present"].all())


def test_sigterm_flushes_then_dies_of_sigterm(tmp_path):
    rc, err, path = run(tmp_path, "sigterm", 7, wait_signal=(signal.SIGTERM, 0.2))
    assert rc == -signal.SIGTERM, err
    assert open_grads(path)["step"].values.tolist() == list(range(7))


def test_sigkill_loses_at_most_a_time_bounded_window(tmp_path):
    # 50 steps buffered by default, but the window is also bounded to 0.5 s: the steps recorded
    # before the script sleeps are written by the next step after 0.5 s, or by the idle timer
    rc, err, path = run(tmp_path, "sigkill", 5, extra={"flush_seconds": 0.5},
                        wait_signal=(signal.SIGKILL, 2.0))
    assert rc == -signal.SIGKILL
    assert open_grads(path)["step"].values.tolist() == list(range(5))


def test_same_process_reader_sees_buffered_steps(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = GradProbe(model, optimizer=opt, dump_path=str(tmp_path), flush_every=50).start()
    try:
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        ds = open_grads(str(tmp_path))
        assert ds["step"].values.tolist() == [0, 1, 2]
        assert ds["max"].values[:, 0].tolist() == [2.0, 2.0, 2.0]  # d(sum)/dW = batch of ones
    finally:
        probe.stop()


def test_handler_and_timer_removed_when_the_last_writer_closes(tmp_path):
    import threading

    before = signal.getsignal(signal.SIGTERM)
    model = torch.nn.Linear(2, 2)
    probe = GradProbe(model, dump_path=str(tmp_path)).start()
    assert signal.getsignal(signal.SIGTERM) is not before  # installed while recording
    probe.stop()
    assert signal.getsignal(signal.SIGTERM) is before
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
            t.name == "probekit-grad-writer" for t in threading.enumerate()):
        time.sleep(0.01)
    assert not any(t.name == "probekit-grad-writer" for t in threading.enumerate())
