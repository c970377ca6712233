"""A dump folder is data (issue 36, point 3): a crafted repro record must not run code when
``probekit freebench repro`` reads it. Before the fix the CLI evaluated the argument texts read
from the record (``eval``) and executed a call source built from its fields (``exec``); each
record below created a file then. Now every field is checked and the literals are parsed by a
parser that accepts only literals (``record.parse_literal``)."""
import math
import os
import shutil

import pytest
import torch

from probekit.cli import main
from probekit.errors import ReproError
from probekit.freebench import FreeBench
from probekit.freebench.repro import record as repro_record

API = "Tensor.__sub__.1.forward"


def naive_norm(x):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / ((x * x).mean(-1, keepdim=True) - mean * mean).sqrt()


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A real dump: the README's naive norm under bit_noise (one finding, one record)."""
    path = tmp_path_factory.mktemp("fb")
    torch.manual_seed(0)
    with FreeBench(dump_path=str(path), pert_mode="bit_noise"):
        naive_norm(torch.randn(64, 32) + 300.0).square().mean()
    assert os.path.isfile(repro_record.record_path(str(path), API, 0))
    return path


def _marker_code(marker) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def _leaves(meta, marker):      # an argument text evaluated by the CLI
    meta["leaves"][1] = _marker_code(marker) + " or 1.0"
    meta["case"]["tensor_pos"] = [0]


def _key(meta, marker):         # the call's docstring, closed early, then code
    meta["key"] = f'Tensor.sub"""\n    {_marker_code(marker)}\n    """x'


def _keyword(meta, marker):     # a keyword name carrying an expression
    meta["spec"] = [["tuple", [None]], ["dict", [[f"alpha=1, **{{'a': {_marker_code(marker)}}}, "
                                                 "other", None]]]]


@pytest.mark.parametrize("craft", [_leaves, _key, _keyword], ids=["leaves", "key", "keyword"])
def test_a_crafted_record_runs_no_code(dump, tmp_path, craft, capsys):
    folder = tmp_path / "dump"
    shutil.copytree(dump, folder)
    marker = tmp_path / "PWNED"
    path = repro_record.record_path(str(folder), API, 0)
    rec = repro_record.load(path)
    craft(rec.meta, marker)
    repro_record.save(path, rec)          # a record as a crafted dump would hold it
    try:
        code = main(["freebench", "repro", str(folder), "0", "-o", str(tmp_path / "out")])
    except Exception as exc:              # before the fix: whatever the crafted call raised
        code = exc
    assert not marker.exists()            # nothing ran
    assert code == 2
    err = capsys.readouterr().err
    assert "repro record" in err or "is not a literal a repro record holds" in err, err
    assert not (tmp_path / "out" / "repro.py").exists()


def test_the_real_record_still_writes_its_repro(dump, tmp_path, capsys):
    assert main(["freebench", "repro", str(dump), "0", "-o", str(tmp_path / "out")]) == 0
    assert "ill-conditioned" in capsys.readouterr().out


@pytest.mark.parametrize("value", [
    0, -3, 2.5, -0.0, math.inf, -math.inf, 1e-300, complex(1, -2), "mean", True, None,
    Ellipsis, torch.bfloat16, torch.channels_last, torch.strided, torch.device("cpu"),
    torch.Size([3, 4]), slice(1, None, 2), range(0, 5, 2)])
def test_literals_round_trip_through_the_parser(value):
    text = repro_record.literal(value)
    assert repro_record.parse_literal(text) == value


def test_parse_literal_takes_only_literals():
    assert math.isnan(repro_record.parse_literal("math.nan"))
    for text in ("__import__('os')", "torch.load", "torch.device(x)", "(1).__class__",
                 "[1, 2]", "torch.Size([a])", "slice(1.5)", "open('f')", "1 + 1",
                 "math.pi", "lambda: 0", "f'{1}'"):
        with pytest.raises(ReproError, match="is not a literal a repro record holds"):
            repro_record.parse_literal(text)


def test_the_package_evaluates_nothing_it_reads():
    """No eval/exec/pickle of data anywhere in probekit: the notebook magic's exec runs the
    user's own cell; ``torch.load`` only with ``weights_only=True``; ``np.load`` without
    pickles (issue 36)."""
    import re

    import probekit

    root = os.path.dirname(probekit.__file__)
    hits = []
    for base, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root)
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                code = line.split("#")[0]
                if re.search(r"(?<![\w.])(eval|exec)\(", code) and rel != os.path.join(
                        "notebook", "magics.py"):
                    hits.append((rel, n, line.strip()))
                if re.search(r"\bpickle\b|yaml\.load|allow_pickle=True|\bmarshal\b", code):
                    hits.append((rel, n, line.strip()))
                if "torch.load(" in code and "weights_only=True" not in code:
                    hits.append((rel, n, line.strip()))
    assert hits == []
