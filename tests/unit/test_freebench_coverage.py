"""No silent zero coverage: filters and stages that leave nothing checked are reported once."""
import logging

import pytest
import torch

from probekit.freebench import FreeBench

X = torch.randn(4, 8)
W = torch.randn(8, 8)


def train_steps(fb, steps=3, backward_inside=True):
    w = W.clone().requires_grad_(True)
    for _ in range(steps):
        with fb:
            loss = torch.matmul(X, w).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        fb.step()


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("probekit")]


@pytest.mark.parametrize("options, expect", [
    ({"scope": ["Torch.matmull.0"]}, "scope ['Torch.matmull.0'] matched none of the"),
    ({"list": ["softmaxx"]}, "list ['softmaxx'] matched none of the"),
    ({"scope": ["Torch.matmul.7"]}, "scope ['Torch.matmul.7'] matched none of the"),
    ({"list": ["backward"]}, "matched the filter but none was checked (skipped: {'metadata': 1})"),
    ({"fuzz_stage": "backward", "backward_outside": True},
     "fuzz_stage backward watched 2 call(s) but no gradient reached them"),
])
def test_zero_coverage_warned_once(tmp_path, caplog, options, expect):
    options = dict(options)
    outside = options.pop("backward_outside", False)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", **options)
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=3, backward_inside=not outside)
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and expect in msgs[0], msgs
    assert fb.summary["checked"] == 0


def test_step_filter_excluding_everything(tmp_path, caplog):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", step=[1])
    fb2 = FreeBench(dump_path=str(tmp_path / "b"), pert_mode="no_change", step=[100])
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=1)    # step 0 excluded, step 1 still to come: INFO only
        train_steps(fb2, steps=2)
    assert warnings_of(caplog) == []
    infos = [r.getMessage() for r in caplog.records if "not in the step filter" in r.getMessage()]
    assert infos == [
        "[probekit] Free benchmark: step 0 is not in the step filter; checking starts at step 1 "
        "(0 calls checked so far).",
        "[probekit] Free benchmark: step 0 is not in the step filter; checking starts at step 100 "
        "(0 calls checked so far).",
    ]
    assert fb2.summary["checked"] == 0 and fb2.summary["skipped"]["step_filter"] > 0
    # the selected steps went by without the probe; the first probed step is past the filter
    fb3 = FreeBench(dump_path=str(tmp_path / "c"), pert_mode="no_change", step=[0, 1])
    with caplog.at_level(logging.INFO, logger="probekit"):
        fb3.step()
        fb3.step()
        train_steps(fb3, steps=2)
    assert warnings_of(caplog) == [
        "[probekit] Free benchmark: step() was called before any start(): step 0 ends with "
        "nothing checked and the next block is step 1. step() ends a training step whose calls "
        "ran between start() and stop() (or inside `with fb:`); the step filter [0, 1] leaves "
        "steps [1] to check",  # issue 28: said at the first step() before any start()
        "[probekit] Free benchmark: the step filter [0, 1] selects no step after step 2; "
        "0 calls checked."]


def test_rank_filter_excluding_this_process(tmp_path, caplog):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", rank=[3])
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=2)
    assert warnings_of(caplog) == [
        "[probekit] Free benchmark: rank filter [3] excludes this process; 0 calls checked."]
    assert fb.summary["checked"] == 0


@pytest.mark.parametrize("options", [{}, {"scope": ["Torch.matmul.0"]}, {"list": ["matmul"]},
                                     {"fuzz_stage": "backward"}, {"step": [1, 2]}])
def test_covered_runs_are_not_warned(tmp_path, caplog, options):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", **options)
    with caplog.at_level(logging.INFO, logger="probekit"):
        train_steps(fb, steps=3)
    assert warnings_of(caplog) == []
    assert fb.summary["checked"] > 0
