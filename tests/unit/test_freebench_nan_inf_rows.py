"""A NaN/Inf finding's row: beyond any threshold (ratio inf, drawn as the plot's NaN/Inf bar)
and its maxima over the finite pairs +0 where there are none, never -0 (a float16 sum of 100000
ones overflows to Inf; its float32 re-run is finite)."""
import math

import torch

from probekit.freebench import FreeBench


def test_a_nan_inf_row_reads_beyond_the_threshold(tmp_path):
    v = torch.ones(100000, dtype=torch.float16)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision")
    with fb:
        s = v.sum()
    assert math.isinf(float(s))
    rows = fb.results
    assert list(rows["kind"]) == ["nan_inf"]
    row = rows.iloc[0]
    assert math.isinf(row["ratio"]) and row["ratio"] > 0
    assert row["max_rel"] == 0.0 and math.copysign(1.0, row["max_rel"]) == 1.0
    assert math.copysign(1.0, row["max_abs"]) == 1.0
    assert "NaN/Inf" in fb._repr_html_() or "∞" in fb._repr_html_()
