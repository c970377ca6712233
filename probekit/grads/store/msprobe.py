"""Read and write msprobe's dump folders, so either tool can work on the other's runs.

Grad probe (msprobe 1.0.4, PyTorch)::

    {dump_path}/rank{r}/grad_summary_{step}.csv     utf-8 with BOM, CRLF rows:
        param_name, [MD5] | [(-inf, b0], (b0, b1], ..., (bn, inf), =0], max, min, norm, shape
    {dump_path}/rank{r}/step{s}/{param}.npy          bool array of grad > 0, the param's shape

``read_grad_dump`` returns the same Dataset as ``probekit.open_grads`` (sign bits packed the same
way), and ``write_rank`` writes one rank's Dataset back out in msprobe's layout. A format module:
it reads no other store (``export.write_grad_dump`` turns any run into this layout).
"""
from __future__ import annotations

import csv
import os
import re

import numpy as np

from ...errors import MsprobeDumpError
from ..numerics.stats import interval_labels, padded_nbytes
from ...paths import safe_join, unique_names

SUMMARY_RE = re.compile(r"^grad_summary_(\d+)\.csv$")
STEP_RE = re.compile(r"^step(\d+)$")


def grad_dump_ranks(path: str) -> list[int]:
    ranks = []
    for d in os.listdir(path):
        sub = os.path.join(path, d)
        if d.startswith("rank") and d[4:].isdigit() and os.path.isdir(sub) and any(
                SUMMARY_RE.match(f) for f in os.listdir(sub)):
            ranks.append(int(d[4:]))
    return sorted(ranks)


def is_grad_dump(path: str) -> bool:
    return os.path.isdir(path) and bool(grad_dump_ranks(path))


def parse_number(text: str):
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return float(text)


def _bounds_from_labels(labels: list[str]) -> tuple:
    bounds = [parse_number(lab[1:-1].split(",")[1]) for lab in labels[:-1]]
    if interval_labels(bounds) != labels:
        raise MsprobeDumpError(f"interval columns {labels} do not follow msprobe's pattern")
    return tuple(bounds)


def _parse_shape(text: str) -> tuple:
    inner = text.strip().strip("[]()").strip()
    return tuple(int(x) for x in inner.split(",") if x.strip()) if inner else ()


def _read_summary(path: str):
    with open(path, encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.reader(fh))
    if not rows or not rows[0] or rows[0][0] != "param_name":
        raise MsprobeDumpError(f"{path}: first column is not 'param_name'")
    return rows[0], rows[1:]


def read_grad_dump(path: str, rank: int = 0):
    """One rank of an msprobe grad dump as a probekit grad Dataset."""
    import xarray as xr

    rank_dir = os.path.join(path, f"rank{int(rank)}")
    if not os.path.isdir(rank_dir):
        raise MsprobeDumpError(f"{path!r} has no rank{rank} folder; ranks: {grad_dump_ranks(path)}")
    files = sorted(((int(m.group(1)), f) for f in os.listdir(rank_dir)
                    if (m := SUMMARY_RE.match(f))))
    if not files:
        raise MsprobeDumpError(f"{rank_dir!r} holds no grad_summary_<step>.csv")
    header, _ = _read_summary(os.path.join(rank_dir, files[0][1]))
    level, bounds = _level_of(header)
    col = {name: i for i, name in enumerate(header)}
    n_int = len(bounds) + 1 if level == "L2" else 0
    per_step, names, shapes = [], {}, {}
    for step, fname in files:
        head, rows = _read_summary(os.path.join(rank_dir, fname))
        if head != header:
            raise MsprobeDumpError(f"{fname}: header {head} differs from {files[0][1]}'s {header}")
        seen = set()
        for i, row in enumerate(rows):
            where = f"{os.path.join(rank_dir, fname)!r}, row {i + 2}"
            if len(row) != len(header):
                raise MsprobeDumpError(f"{where}: {len(row)} columns, expected {len(header)} "
                                       f"({', '.join(header)})")
            if row[0] in seen:
                raise MsprobeDumpError(f"{where}: parameter {row[0]!r} twice in one step")
            seen.add(row[0])
            shape = _cell(where, "shape", row[col["shape"]], _parse_shape)
            if row[0] not in names:
                names[row[0]] = len(names)
                shapes[row[0]] = shape
        per_step.append((step, rows, fname))
    params = list(names)
    numels = np.array([int(np.prod(shapes[n])) for n in params], np.int64)
    s, p = len(per_step), len(params)
    present = np.zeros((s, p), bool)
    stats = {k: np.full((s, p), np.nan) for k in ("max", "min", "norm")}
    md5 = np.zeros((s, p, 16), np.uint8) if level == "L0" else None
    zeros = np.full((s, p), np.nan) if level == "L2" else None
    dist = np.full((s, p, n_int), np.nan) if level == "L2" else None
    for si, (_, rows, fname) in enumerate(per_step):
        for i, row in enumerate(rows):
            where = f"{os.path.join(rank_dir, fname)!r}, row {i + 2}"
            j = names[row[0]]
            present[si, j] = True
            for k in stats:
                stats[k][si, j] = _cell(where, k, row[col[k]], float)
            if md5 is not None:
                md5[si, j] = _cell(where, "MD5", row[col["MD5"]], _md5)
            if dist is not None:
                dist[si, j] = [_cell(where, header[1 + q], x, float)
                               for q, x in enumerate(row[1:1 + n_int])]
                zeros[si, j] = _cell(where, "=0", row[col["=0"]], float)
    steps = np.array([st for st, _, _ in per_step], np.int64)
    data_vars = {"present": (("step", "param"), present),
                 **{k: (("step", "param"), v) for k, v in stats.items()}}
    coords = {"step": steps, "param": np.array(params, dtype=str),
              "numel": ("param", numels),
              "shape": ("param", np.array([str(shapes[n]) for n in params], dtype=str))}
    if md5 is not None:
        data_vars["hash"] = (("step", "param"), np.array(
            [[row.tobytes().hex() for row in step_rows] for step_rows in md5], dtype="<U32"))
    if level in ("L1", "L2"):
        sizes = np.array([padded_nbytes(int(n)) for n in numels], np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        direction = np.zeros((s, int(sizes.sum())), np.uint8)
        for si, (step, rows, _) in enumerate(per_step):
            step_dir = os.path.join(rank_dir, f"step{step}")
            files_of = dict(zip((r[0] for r in rows), unique_names([r[0] for r in rows], ".npy")))
            for j in np.flatnonzero(present[si]):
                arr = _load_direction(step_dir, params[j], files_of[params[j]], int(numels[j]))
                packed = np.packbits(arr)
                direction[si, offsets[j]:offsets[j] + packed.size] = packed
        data_vars["direction"] = (("step", "byte"), direction)
        coords["offset"] = ("param", offsets)
    if level == "L2":
        data_vars["zeros"] = (("step", "param"), zeros)
        data_vars["dist"] = (("step", "param", "interval"), dist)
        coords["interval"] = np.array(interval_labels(bounds), dtype=str)
    attrs = {"format": "msprobe.grad_probe", "level": level, "bounds": list(bounds),
             "rank": int(rank), "source": os.path.abspath(path)}
    if level == "L0":
        attrs["hash_algorithm"] = "md5"
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


def _level_of(header: list[str]):
    if "MD5" in header:
        return "L0", (-1, 0, 1)
    if "=0" in header:
        labels = header[1:header.index("=0")]
        return "L2", _bounds_from_labels(labels)
    return "L1", (-1, 0, 1)


def _cell(where: str, column: str, text: str, parse):
    """``parse(text)`` of one cell of a summary CSV, or an error naming the file, row, column and
    value."""
    try:
        return parse(text)
    except (ValueError, TypeError) as exc:
        raise MsprobeDumpError(f"{where}, column {column!r}: cannot read {text!r} ({exc})") \
            from None


def _md5(text: str) -> np.ndarray:
    raw = bytes.fromhex(text.strip())
    if len(raw) != 16:
        raise ValueError(f"{len(raw)} bytes, an MD5 has 16")
    return np.frombuffer(raw, np.uint8)


def _load_direction(step_dir: str, param: str, fname: str, numel: int) -> np.ndarray:
    """A parameter's signs at one step: the file probekit's writer names it (``unique_names``),
    or msprobe's own name for it (the parameter's name plus ``.npy``) where that is one plain
    file name in the step's folder; a name taken from the dump never reaches outside it."""
    path = os.path.join(step_dir, fname)
    raw = f"{param}.npy"
    if (not os.path.isfile(path) and raw != fname and "/" not in raw and os.sep not in raw
            and "\0" not in raw and os.path.isfile(os.path.join(step_dir, raw))):
        path = os.path.join(step_dir, raw)      # msprobe writes names probekit would clean
    if not os.path.isfile(path):
        raise MsprobeDumpError(f"{path!r} is missing (the summary lists {param!r} at this step)")
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise MsprobeDumpError(f"{path!r}: not a .npy array of bools ({exc})") from None
    if arr.dtype != np.bool_ or arr.size != numel:
        raise MsprobeDumpError(f"{path!r}: expected {numel} bools, found {arr.size} of {arr.dtype}")
    return arr.reshape(-1)


def _fmt_float(x: float) -> str:
    return repr(float(x))


def write_rank(ds, rank_dir: str) -> list[str]:
    """One rank's Dataset in msprobe's layout under ``rank_dir``; returns the files written."""
    if ds.attrs.get("sample"):  # msprobe's .npy holds every element's sign
        raise MsprobeDumpError(
            f"the run recorded the sign bits of a sample of each parameter (grad_probe.sample "
            f"{ds.attrs['sample']}); msprobe's layout holds every element's: accepted: a run "
            "recorded without grad_probe.sample")
    os.makedirs(rank_dir, exist_ok=True)
    level = ds.attrs.get("level", "L1")
    bounds = ds.attrs.get("bounds", [-1, 0, 1])
    header = ["param_name"]
    if level == "L0":
        header.append("MD5")
    if level == "L2":
        header += [*interval_labels(bounds), "=0"]
    header += ["max", "min", "norm", "shape"]
    params = [str(x) for x in ds["param"].values]
    shapes = [_parse_shape(str(x)) for x in ds["shape"].values]
    numels = np.asarray(ds["numel"].values, np.int64)
    present = np.asarray(ds["present"].values, bool) if "present" in ds else None
    written = []
    for si, step in enumerate(np.asarray(ds["step"].values)):
        row_sel = ds.isel(step=si)
        mx, mn, nm = (np.asarray(row_sel[k].values) for k in ("max", "min", "norm"))
        lines = [header]
        for j, name in enumerate(params):
            if present is not None and not present[si, j]:
                continue
            line = [name]
            if level == "L0":
                line.append(str(row_sel["hash"].values[j]))
            if level == "L2":
                line += [_fmt_float(v) for v in np.asarray(row_sel["dist"].values[j])]
                line.append(_fmt_float(row_sel["zeros"].values[j]))
            line += [_fmt_float(mx[j]), _fmt_float(mn[j]), _fmt_float(nm[j]),
                     str(list(shapes[j]))]
            lines.append(line)
        path = os.path.join(rank_dir, f"grad_summary_{int(step)}.csv")
        with open(path, "w", encoding="utf-8-sig", newline="") as fh:
            csv.writer(fh).writerows(lines)
        written.append(path)
        if level in ("L1", "L2"):
            step_dir = os.path.join(rank_dir, f"step{int(step)}")
            os.makedirs(step_dir, exist_ok=True)
            bits = np.asarray(row_sel["direction"].values, np.uint8)
            offsets = np.asarray(ds["offset"].values, np.int64)
            here = [j for j in range(len(params)) if present is None or present[si, j]]
            # the step's file names as the reader finds them: from the names its summary lists
            files = unique_names([params[j] for j in here], ".npy")
            for j, fname in zip(here, files):
                n = int(numels[j])
                arr = np.unpackbits(bits[offsets[j]:offsets[j] + padded_nbytes(n)], count=n)
                target = safe_join(step_dir, fname)   # a link there cannot lead out
                np.save(target, arr.astype(bool).reshape(shapes[j]))
                written.append(target)
    return written
