"""free_benchmark.csv writing and the DataFrame/HTML views of findings."""
import csv
import math
import os

import pandas as pd
import pytest
import torch

from probekit.freebench import COLUMNS, FreeBench
from probekit.freebench.report import results
from probekit.freebench.report.view import Findings


def row(**kw):
    base = {"rank": 0, "pert_mode": "bit_noise", "stage": "forward", "step": 0,
            "api_name": "Torch.matmul.0.forward", "max_rel": 0.5, "dtype": "torch.bfloat16",
            "shape": "(4, 8)", "output_index": 0, "kind": "rel_error", "max_abs": 0.25,
            "threshold": 0.015625, "ratio": 32.0, "call_site": "train.py:12", "module": ""}
    base.update(kw)
    return base


def read(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def test_columns_start_with_msprobes():
    assert COLUMNS[:9] == ("rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype",
                           "shape", "output_index")
    assert COLUMNS[9:] == ("kind", "max_abs", "threshold", "ratio", "call_site", "module", "cause")


def test_header_once_whole_rows_and_reopen_appends(tmp_path):
    sink = results.CsvSink(str(tmp_path / "out"))
    path = sink.open()
    assert path == str(tmp_path / "out" / "free_benchmark.csv")
    assert read(path) == [list(COLUMNS)]                   # header written at open
    sink.write([row(), row(api_name="Tensor.sum.0.forward", ratio=math.inf)])
    sink.write([])
    again = results.CsvSink(str(tmp_path / "out"))        # a new session, same folder
    again.write([row(step=3, call_site='odd "name", with comma.py:1')])
    lines = read(path)
    assert lines[0] == list(COLUMNS)
    assert len(lines) == 4 and all(len(x) == len(COLUMNS) for x in lines)
    assert lines[1][4] == "Torch.matmul.0.forward" and lines[2][12] == "inf"
    assert lines[3][3] == "3" and lines[3][13] == 'odd "name", with comma.py:1'
    with open(path, "rb") as fh:
        data = fh.read()
    assert data.endswith(b"\n") and data.count(b"\n") == 4
    df = pd.read_csv(path)
    assert list(df.columns) == list(COLUMNS) and df["max_rel"].tolist() == [0.5] * 3


def test_foreign_header_is_left_alone(tmp_path):
    msprobe_header = ",".join(results.MSPROBE_COLUMNS) + "\n"
    (tmp_path / "free_benchmark.csv").write_text(msprobe_header +
                                                 "0,bit_noise,forward,0,x,1,a,b,\n")
    sink = results.CsvSink(str(tmp_path))
    sink.write([row()])
    assert (tmp_path / "free_benchmark.csv").read_text().startswith(msprobe_header)
    assert sink.path == str(tmp_path / "free_benchmark.1.csv")
    lines = read(sink.path)
    assert lines[0] == list(COLUMNS) and len(lines) == 2
    assert lines[1][:6] == ["0", "bit_noise", "forward", "0", "Torch.matmul.0.forward", "0.5"]


def test_empty_frame_has_the_columns_and_dtypes():
    df = results.frame([])
    assert list(df.columns) == list(COLUMNS) and len(df) == 0
    assert df["max_rel"].dtype == "float64" and df["step"].dtype == "int64"


def test_severity_order_and_html():
    rows = [row(ratio=2.0, api_name="a"), row(kind="nan_inf", ratio=0.0, api_name="b"),
            row(ratio=50.0, api_name="c"), row(kind="sign_flip", ratio=1e3, api_name="d")]
    df = results.frame(rows)
    assert results.by_severity(df)["api_name"].tolist() == ["b", "d", "c", "a"]
    summary = {"calls": 10, "checked": 4, "skipped": {"view": 6}, "flagged": 4, "steps": 1}
    html = Findings(df, summary)._repr_html_()
    assert html.index(">b<") < html.index(">d<") < html.index(">c<") < html.index(">a<")
    assert "10 calls seen · 4 checked · 6 skipped (view 6) · 4 flagged · 1 step" in html
    assert Findings(results.frame([]), summary)._repr_html_().count("<table") == 0


def test_session_writes_rows_at_each_gather_even_without_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    with fb:
        a + b                                # a site's first check: judged (and written) at once
        assert len(read(fb.csv_path)) == 2
        fb.step()
        a + b
        assert len(read(fb.csv_path)) == 2   # a later check: the verdict is still on the device
        fb.step()                            # the step's gather point
        lines = read(fb.csv_path)            # on disk inside the block
    assert len(lines) == 3
    df = fb.results.iloc[:1]
    assert df.shape == (1, len(COLUMNS))
    r = df.iloc[0]
    assert (r["rank"], r["pert_mode"], r["stage"], r["step"], r["api_name"], r["dtype"],
            r["shape"], r["output_index"], r["kind"]) == (
        0, "bit_noise", "forward", 0, "Tensor.__add__.0.forward", "torch.float32", "(1,)", 0,
        "rel_error")
    assert r["threshold"] == 2.0 ** -12 and r["ratio"] == pytest.approx(r["max_rel"] / 2.0 ** -12)
    # the CSV holds the same row
    on_disk = pd.read_csv(fb.csv_path)
    assert on_disk.iloc[0]["api_name"] == "Tensor.__add__.0.forward"
    assert on_disk.iloc[0]["max_rel"] == r["max_rel"]
    assert "<table" in fb._repr_html_() and "Tensor.__add__.0.forward" in fb._repr_html_()
    assert os.path.basename(fb.csv_path) == "free_benchmark.csv"
