"""Issue 28, point 6: ``step()`` before any ``start()`` is a clear WARNING, not a silent change
of the step counter (which still counts training steps, as msprobe's does)."""
import logging

import torch

import probekit
from probekit import PrecisionDebugger


def cancel():
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    return a + b  # a cancellation: bit_noise flags it


def test_free_bench_step_before_start_warns_and_names_the_step_filter(tmp_path, caplog):
    fb = probekit.FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", step=[0])
    with caplog.at_level(logging.INFO, logger="probekit"):
        fb.step()
        fb.step()  # warned once
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "[probekit] Free benchmark: step() was called before any start(): step 0 ends with "
        "nothing checked and the next block is step 1. step() ends a training step whose calls "
        "ran between start() and stop() (or inside `with fb:`); with the step filter [0] no step "
        "is left to check: nothing will be checked"]


def test_step_after_start_is_not_warned_about(tmp_path, caplog):
    fb = probekit.FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", step=[0, 1])
    with caplog.at_level(logging.INFO, logger="probekit"):
        for _ in range(2):
            with fb:
                cancel()
            fb.step()
    assert not [r for r in caplog.records if "before any start" in r.getMessage()]
    assert fb.summary["flagged"] == 2


def test_the_debugger_counts_and_warns_like_msprobe(tmp_path, caplog):
    """msprobe's step() counts the step also before start(): the debugger does the same (it
    used to drop the call), with the warning, and names the steps the filter leaves."""
    d = PrecisionDebugger(task="free_benchmark", dump_path=str(tmp_path), pert_mode="bit_noise",
                          step=[0, 1])
    with caplog.at_level(logging.INFO, logger="probekit"):
        d.step()
        d.start()
        cancel()
        d.stop()
        d.step()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "[probekit] Free benchmark: step() was called before any start(): step 0 ends with "
        "nothing checked and the next block is step 1. step() ends a training step whose calls "
        "ran between start() and stop() (or inside `with fb:`); the step filter [0, 1] leaves "
        "steps [1] to check"]
    assert d.results["step"].tolist() == [1]
    d.close()
