"""msprobe's grad dump layout with parameter names a file name cannot hold as they are: probekit
writes them so it reads them back, never two parameters in one file, and its reader finds
msprobe's own files without reaching outside the dump; a damaged summary or sign file is an
error naming it."""
import csv
import os

import numpy as np
import pytest
import torch

from probekit.errors import MsprobeDumpError
from probekit.grads import GradProbe, open_grads
from probekit.grads.store.export import write_grad_dump
from probekit.grads.store.msprobe import read_grad_dump


class Named(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        for i, n in enumerate(names):
            self.register_parameter(n, torch.nn.Parameter(torch.full((5,), float(i + 1))))

    def forward(self, x):
        return sum((p * x * (-1) ** i).sum() for i, p in enumerate(self.parameters()))


def _record(path, names):
    torch.manual_seed(0)
    m = Named([f"p{i}" for i in range(len(names))])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with GradProbe(m, dump_path=str(path), rename={f"p{i}": n for i, n in enumerate(names)}):
        for _ in range(2):
            opt.zero_grad()
            m(torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0])).backward()
            opt.step()


def test_export_reads_back_with_every_parameters_own_signs(tmp_path):
    names = ["a/b", "a_b", "层.weight", "权.weight", ".hidden", "enc." + "x" * 250 + ".weight"]
    _record(tmp_path / "run", names)
    files = write_grad_dump(str(tmp_path / "run"), str(tmp_path / "exp"))
    assert all(os.path.isfile(f) and f.endswith(".npy") for f in files if "step" in f)
    step0 = sorted(os.listdir(tmp_path / "exp" / "rank0" / "step0"))
    assert len(step0) == len(names)                       # no parameter overwrote another's
    back, orig = open_grads(str(tmp_path / "exp")), open_grads(str(tmp_path / "run"))
    assert list(back.param.values) == names
    # the signs alternate by parameter (the model's (-1)^i): each read back as its own
    np.testing.assert_array_equal(back.direction.values, orig.direction.values)
    for k in ("max", "min", "norm"):
        np.testing.assert_array_equal(back[k].values, orig[k].values)


def _dump(root, rows, header=("param_name", "max", "min", "norm", "shape"), files=None):
    rank = root / "rank0"
    (rank / "step0").mkdir(parents=True)
    with open(rank / "grad_summary_0.csv", "w", encoding="utf-8-sig", newline="") as fh:
        csv.writer(fh).writerows([list(header), *rows])
    for name, arr in (files or {}).items():
        np.save(rank / "step0" / name, arr)
    return str(root)


def test_reader_finds_msprobes_own_file_names(tmp_path):
    """msprobe names a sign file by the parameter as it is (here a name probekit would clean)."""
    signs = np.array([True, False, True])
    path = _dump(tmp_path / "d", [["层.weight", "1.0", "-1.0", "2.0", "[3]"]],
                 files={"层.weight.npy": signs})
    ds = read_grad_dump(path)
    assert list(ds.param.values) == ["层.weight"]
    assert np.unpackbits(ds.direction.values[0])[:3].tolist() == [1, 0, 1]


def test_a_name_from_the_dump_never_reads_outside_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    np.save(outside / "w.npy", np.array([True, True, True]))
    path = _dump(tmp_path / "d" / "dump", [["../../../outside/w", "1.0", "-1.0", "2.0", "[3]"]])
    with pytest.raises(MsprobeDumpError, match=r"_.._.._outside_w\.npy' is missing"):
        read_grad_dump(path)


@pytest.mark.parametrize("row,match", [
    (["w", "1.0", "-1.0", "2.0"], r"row 2: 4 columns, expected 5 \(param_name, max, min, norm, "
                                  r"shape\)"),
    (["w", "abc", "-1.0", "2.0", "[3]"], r"row 2, column 'max': cannot read 'abc'"),
    (["w", "1.0", "-1.0", "2.0", "[x]"], r"row 2, column 'shape': cannot read '\[x\]'"),
])
def test_a_damaged_summary_row_is_named(tmp_path, row, match):
    path = _dump(tmp_path / "d", [row], files={"w.npy": np.array([True, False, True])})
    with pytest.raises(MsprobeDumpError, match=match):
        read_grad_dump(path)


def test_a_bad_md5_and_a_damaged_sign_file_are_named(tmp_path):
    path = _dump(tmp_path / "m", [["w", "12ab", "1.0", "-1.0", "2.0", "[3]"]],
                 header=("param_name", "MD5", "max", "min", "norm", "shape"))
    with pytest.raises(MsprobeDumpError, match=r"column 'MD5': cannot read '12ab' \(2 bytes"):
        read_grad_dump(path)
    path = _dump(tmp_path / "n", [["w", "1.0", "-1.0", "2.0", "[3]"]])
    with open(os.path.join(path, "rank0", "step0", "w.npy"), "wb") as fh:
        fh.write(b"\x93NUMPY garbage")
    with pytest.raises(MsprobeDumpError, match=r"w\.npy': not a \.npy array of bools"):
        read_grad_dump(path)


def test_each_parameter_gets_its_own_picture(tmp_path):
    """msprobe's picture names: a parameter named ``summary`` does not overwrite the summary
    picture, and a long dotted name stays a ``.png`` (its cut once lost the extension and
    matplotlib read the text after the last dot as the format)."""
    from probekit.grads.compare.report import GradComparator

    long = "enc." + "x" * 250 + ".weight"
    _record(tmp_path / "a", ["summary", "x", long])
    _record(tmp_path / "b", ["summary", "x", long])
    GradComparator.compare_distributed(str(tmp_path / "a"), str(tmp_path / "b"),
                                       str(tmp_path / "cmp"), plots="all")
    pics = sorted(os.listdir(tmp_path / "cmp" / "rank0" / "similarities_picture"))
    assert len(pics) == 4 and all(p.endswith(".png") for p in pics)
    assert "summary_similarities.png" in pics and "x_similarities.png" in pics
    assert sum(p.startswith("summary_similarities-") for p in pics) == 1
    assert sum(p.startswith("enc.xxx") and len(p) == 200 for p in pics) == 1
