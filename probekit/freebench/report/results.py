"""Findings: the row layout, the CSV they are appended to, and their DataFrame (rendered by
``view.py``).

The first nine columns are msprobe's ``free_benchmark.csv`` columns, in its order; probekit adds
``kind`` (nan_inf, sign_flip, rel_error, abs_error), ``max_abs``, ``threshold``, ``ratio``
(``max_rel / threshold``; inf when the threshold is 0, as for no_change), ``call_site`` and
``module`` (the innermost named module running at the call under module scope, else "") and
``cause`` (ill-conditioned, inaccurate, unconfirmed, nondeterministic; see ``cause.py``).
"""
from __future__ import annotations

import csv
import io
import os

from ...log import get_logger

log = get_logger(__name__)

MSPROBE_COLUMNS = ("rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype", "shape",
                   "output_index")
COLUMNS = MSPROBE_COLUMNS + ("kind", "max_abs", "threshold", "ratio", "call_site", "module", "cause")
DTYPES = {"rank": "int64", "pert_mode": "object", "stage": "object", "step": "int64",
          "api_name": "object", "max_rel": "float64", "dtype": "object", "shape": "object",
          "output_index": "int64", "kind": "object", "max_abs": "float64", "threshold": "float64",
          "ratio": "float64", "call_site": "object", "module": "object",
          "cause": "object"}
#: severity order of the kinds (lower first), then by ratio
KIND_ORDER = {"nan_inf": 0, "sign_flip": 1, "rel_error": 2, "abs_error": 2}
CSV_NAME = "free_benchmark.csv"


def _line(values) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()


HEADER = _line(COLUMNS)


class CsvSink:
    """Appends rows to ``{dump_path}/free_benchmark.csv``: header once, whole lines, flushed.

    Each batch of rows is one ``os.write`` on a descriptor opened with ``O_APPEND``, under the
    dump folder's lock (``flock`` on the folder), so a line is never split, lines from several
    ranks sharing the folder do not interleave, and ``drop_rows`` (a run replacing an earlier
    one's rows: ``runs.py``) never loses a row another rank appends. A file holding a different
    header (e.g. msprobe's nine columns) is left alone: rows go to ``free_benchmark.1.csv`` (the
    first free or compatible name) and a warning says so.
    """

    def __init__(self, dump_path: str) -> None:
        self.dump_path = dump_path
        self.path: str | None = None

    def open(self) -> str:
        if self.path is None:
            os.makedirs(self.dump_path, exist_ok=True)
            base = os.path.join(self.dump_path, CSV_NAME)
            path, n = base, 0
            while not self._claim(path):
                n += 1
                path = os.path.join(self.dump_path, f"free_benchmark.{n}.csv")
            if path != base:
                log.warning("%s holds another header; probekit's rows go to %s", base, path)
            self.path = path
        return self.path

    def _claim(self, path: str) -> bool:
        """Write the header into an empty/new file; True when the file is ours to append to."""
        with folder_lock(self.dump_path):
            return self._claim_locked(path)

    @staticmethod
    def _claim_locked(path: str) -> bool:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                os.write(fd, HEADER.encode("utf-8"))
                return True
            os.lseek(fd, 0, os.SEEK_SET)
            first = os.read(fd, len(HEADER.encode("utf-8")) + 8).decode("utf-8", "replace")
            return first.lstrip("\ufeff").startswith(HEADER)
        finally:
            os.close(fd)

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(
            [_cell(r.get(c, "")) for c in COLUMNS] for r in rows)
        data = buf.getvalue().encode("utf-8")
        path = self.open()
        with folder_lock(self.dump_path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                view = memoryview(data)
                while view:  # one write in practice; a short write (disk full...) is completed
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)

    def _paths(self) -> list:
        """The CSVs of this folder probekit writes (``free_benchmark.csv`` and the numbered
        ones used beside a file of another header)."""
        import glob

        base = os.path.join(self.dump_path, CSV_NAME)
        return [base] + sorted(glob.glob(os.path.join(glob.escape(self.dump_path),
                                                      "free_benchmark.[0-9]*.csv")))

    def count_rows(self, ranks=None) -> int:
        """Rows (of ``ranks``, or all) in the folder's probekit CSVs."""
        n = 0
        for path in self._paths():
            for row in _rows(path):
                n += ranks is None or _rank(row) in ranks
        return n

    def drop_rows(self, gone) -> int:
        """Remove the rows whose rank ``gone(rank)`` holds, under the folder's lock, each CSV
        replaced whole (``atomic_write``); how many were removed."""
        from ...atomic import atomic_write

        removed = 0
        if not os.path.isdir(self.dump_path):
            return 0
        with folder_lock(self.dump_path):
            for path in self._paths():
                rows = _rows(path)
                keep = [r for r in rows if not gone(_rank(r))]
                if len(keep) == len(rows):
                    continue
                removed += len(rows) - len(keep)
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows([COLUMNS, *keep])
                atomic_write(path, buf.getvalue().encode("utf-8"))
        return removed


def _rows(path: str) -> list:
    """The data rows of a probekit CSV (none for a missing file or another header)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh)
            head = next(reader, None)
            if head != list(COLUMNS):
                return []
            return [r for r in reader if r]
    except FileNotFoundError:
        return []


def _rank(row) -> int | None:
    try:
        return int(row[0])
    except (ValueError, IndexError):
        return None


class folder_lock:
    """An exclusive ``flock`` on the dump folder (released on exit); no lock where the system
    has none (the appends then rely on ``O_APPEND`` alone, as before)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.fd = folder, None

    def __enter__(self):
        try:
            import fcntl

            self.fd = os.open(self.folder, os.O_RDONLY)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _cell(value):
    if isinstance(value, float):
        return repr(value)
    return value


def frame(rows: list[dict]):
    """The findings as a DataFrame with ``COLUMNS`` (typed even when empty)."""
    import pandas as pd

    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=DTYPES[c]) for c in COLUMNS})
    df = pd.DataFrame.from_records(rows, columns=list(COLUMNS))
    return df.astype(DTYPES)


def hotspot_frame(rows: list[dict]):
    """Hot spots (``FreeBench.hotspots``): ``COLUMNS`` plus ``count`` and ``bits_lost`` (the
    significant bits the result lost relative to itself, where measured: a sum that cancels far
    below its magnitude; NaN elsewhere), largest ratio first."""
    import pandas as pd

    df = frame(rows)
    df["count"] = pd.Series([int(r.get("count", 1)) for r in rows], dtype="int64")
    df["bits_lost"] = pd.Series([float("nan") if r.get("bits_lost") is None else
                                 float(r["bits_lost"]) for r in rows], dtype="float64")
    return by_severity(df).reset_index(drop=True)


def by_severity(df):
    """Rows sorted: NaN/Inf mismatches, then sign flips, then by ratio (largest first)."""
    if df.empty:
        return df
    order = df["kind"].map(KIND_ORDER).fillna(3)
    return (df.assign(_o=order, _r=-df["ratio"]).sort_values(["_o", "_r"], kind="stable")
            .drop(columns=["_o", "_r"]))
