"""The preheat rule: sampling window, calibration, what stays checked afterwards."""
import logging
import math

import torch

from probekit.freebench import FreeBench
from probekit.freebench.engine.preheat import RISK_RATIO, Preheat


def test_sampling_window_moves_by_max_sample():
    p = Preheat(preheat_step=3, max_sample=2)
    assert [i for i in range(6) if p.sample("K", i, 0)] == [0, 1]       # nothing known yet
    p.end_step({"K": 5})
    assert [i for i in range(5) if p.sample("K", i, 1)] == [2, 3]       # (i - 2) mod 5 < 2
    assert [i for i in range(5) if p.sample("K", i, 2)] == [0, 4]       # (i - 4) mod 5 < 2
    p.end_step({"K": 2})
    assert [i for i in range(2) if p.sample("K", i, 2)] == [0, 1]       # N <= M: all of them
    assert p.total("K") == 2 and p.total("other") == "?"


def test_calibration_and_decision():
    p = Preheat(preheat_step=1, max_sample=1)
    assert p.in_preheat(0) and not p.in_preheat(1)
    p.record("low", 0.1)
    p.record("low", RISK_RATIO / 2)
    p.record("edge", RISK_RATIO)
    p.record("bad", math.nan)              # NaN risk counts as infinite
    assert p.wanted("edge") and p.wanted("bad") and not p.wanted("low")
    assert p.wanted("never-seen")
    assert p.at_risk() == ["bad", "edge"] and p.low_risk() == ["low"]


def test_preheat_in_a_loop(tmp_path, caplog):
    x = torch.rand(8) + 1
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", if_preheat=True,
                   preheat_step=2, max_sample=1)
    checked = []
    with caplog.at_level(logging.INFO, logger="probekit"):
        for _ in range(4):
            before = fb.summary["checked"]
            with fb:
                for _ in range(3):
                    torch.exp(x)          # well-conditioned: calibrated low risk
                for _ in range(2):
                    a + b                 # cancellation: flagged, stays checked
            checked.append(fb.summary["checked"] - before)
            fb.step()
    assert checked == [2, 2, 2, 2]
    s = fb.summary
    assert s["skipped"] == {"preheat": 12} and s["flagged"] == 6
    assert fb.results["api_name"].tolist() == [
        "Tensor.__add__.0.forward", "Tensor.__add__.1.forward", "Tensor.__add__.0.forward",
        "Tensor.__add__.1.forward", "Tensor.__add__.0.forward", "Tensor.__add__.1.forward"]
    assert fb.results["step"].tolist() == [0, 1, 2, 2, 3, 3]
    msgs = [r.getMessage() for r in caplog.records]
    assert ("[probekit] Free benchmark: preheat sample in step 1 api_name Torch.exp.1.forward "
            "curr_called_seq: 1/3") in msgs
    done = [m for m in msgs if "preheat finished" in m]
    assert len(done) == 1
    assert "APIs still checked: ['Tensor.__add__']" in done[0]
    assert "['Torch.exp']" in done[0]
