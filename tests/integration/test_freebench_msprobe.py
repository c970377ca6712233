"""Side by side with msprobe 1.0.4 on the same calls: same API names, and probekit also flags
the negative mirror of a cancellation that msprobe's clamped metric misses.

Needs msprobe's venv (tests/msprobe_util.py finds it; `make test` builds it).
"""
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from probekit.freebench import FreeBench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from msprobe_util import msprobe_python  # noqa: E402

pytestmark = pytest.mark.msprobe

CALLS = textwrap.dedent("""
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    na, nb = -a, -b
    # lowest mantissa bits 0 and 1: bit_noise moves the two terms in opposite directions
    m1, m2 = torch.tensor([[1e4 + 0.01, 1e4 - 0.001]]), torch.tensor([[1.0], [-1.0]])
    m2t = m2.t().contiguous()
    def calls():
        a + b
        torch.add(a, b)
        a.add(b)
        a - (-b)
        na + nb
        torch.matmul(m1, m2)
        m1 @ m2
        F.linear(m1, m2t)
""")

MSPROBE_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    import torch, torch.nn.functional as F
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1,
                                         init_method=f"tcp://127.0.0.1:{port}")
    fb = {"scope": [], "list": [], "fuzz_device": "npu", "pert_mode": "bit_noise",
          "handler_type": "check", "fuzz_level": "L1", "fuzz_stage": "forward",
          "if_preheat": False, "preheat_step": 15, "max_sample": 20}
    cfg = {"task": "free_benchmark", "dump_path": out, "rank": [], "step": [], "level": "L1",
           "seed": 1234, "is_deterministic": False, "enable_dataloader": False,
           "free_benchmark": fb}
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    from msprobe.pytorch import PrecisionDebugger
    d = PrecisionDebugger(config_path=os.path.join(out, "config.json"))
""") + CALLS + "d.start(); calls(); d.stop(); d.step()\n"


def test_same_names_and_the_negative_mirror(tmp_path):
    ms_out = tmp_path / "msprobe"
    ms_out.mkdir()
    proc = subprocess.run([msprobe_python(), "-c", MSPROBE_SCRIPT, str(ms_out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ms = pd.read_csv(ms_out / "free_benchmark.csv", encoding="utf-8-sig")

    scope = {"torch": torch, "F": F}
    exec(CALLS, scope)
    fb = FreeBench(dump_path=str(tmp_path / "probekit"), pert_mode="bit_noise")
    with fb:
        scope["calls"]()
    ours = fb.results

    # every row msprobe reports, probekit reports under the same name, with the same error
    ms_names = ms["api_name"].tolist()
    assert ms_names[:4] == ["Tensor.__add__.0.forward", "Torch.add.0.forward",
                            "Tensor.add.0.forward", "Tensor.__sub__.0.forward"]
    # (as a finding, or as a hot spot: see below)
    seen = pd.concat([ours, fb.hotspots], ignore_index=True)
    merged = ms.merge(seen, on="api_name", suffixes=("_ms", "_pk"))
    assert merged["api_name"].tolist() == ms_names
    assert merged["max_rel_pk"].tolist() == pytest.approx(merged["max_rel_ms"].tolist(), rel=1e-5)
    # the negative mirror (-1e4-0.01) + 1e4 is missed by msprobe and found by probekit
    assert "Tensor.__add__.1.forward" not in ms_names
    assert ours["api_name"].tolist() == [
        "Tensor.__add__.0.forward", "Torch.add.0.forward", "Tensor.add.0.forward",
        "Tensor.__sub__.0.forward", "Tensor.__add__.1.forward"]
    # the same cancellation inside a dot product: one-ulp nudges move it by about u * S, S =
    # sum |a||b|, its own rounding, so it is not ill-conditioned relative to S (docs/
    # free_benchmark.md, the noise modes): msprobe's rows are probekit's hot spots -- with the
    # bits the result lost relative to itself (issue 34 point 5: more than half of fp32's 24)
    assert fb.hotspots["api_name"].tolist() == [
        "Torch.matmul.0.forward", "Tensor.__matmul__.0.forward", "Functional.linear.0.forward"]
    assert set(fb.hotspots["cause"]) == {"ill-conditioned"}
    assert (fb.hotspots["bits_lost"] > 12).all(), fb.hotspots
    mirror = ours.set_index("api_name").loc["Tensor.__add__.1.forward", "max_rel"]
    assert mirror == ours.set_index("api_name").loc["Tensor.__add__.0.forward", "max_rel"]
