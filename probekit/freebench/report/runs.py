"""A free-benchmark dump folder over runs: a run appends only when it is a restart.

A dump folder holds the findings of the runs that wrote into it: ``free_benchmark.csv`` (rows
of every rank, a ``rank`` column), the repro records (``repro/records/*.rank{r}.pt``) and, per
rank, a small marker saying which run wrote there last and whether it ended cleanly::

    free_benchmark.rank{r}.run.json     {"format", "run", "time", "rank", "closed"}

The rule, the grad store's (``grads/store/restarts.py``): a run **appends** to the folder when
it is a restart (``free_benchmark.resume``, or torchelastic's restart count above 0); any other
run into a folder that holds findings **replaces** them, with one line saying so, when the last
run that wrote there ended cleanly (every rank's marker says ``closed``: ``stop()``, the end of
a ``with`` block without an exception, the process's normal end), and is **refused**
(``DumpError`` naming ``resume=True`` and ``overwrite=True``) when it did not (it crashed, was
killed, or is still running): a crashed run's findings are never lost silently.
``overwrite`` replaces in any case. The decision is taken once per job (``dist.agree``: under
torch.distributed the first rank decides for all).

Replacing is safe: nothing is removed when the run begins. Each rank removes its own rows and
records of earlier runs (in a job, rank 0 also those of ranks the job no longer has) when its
run first has something to say: just before it writes its first rows, or at its first clean
``stop()``. A run that dies before leaves the earlier findings in place, and its marker says it
did not end cleanly. Rows are removed under the folder's lock (``results.CsvSink``), which every
rank's appends take too, so a rank never removes what another is writing.

The marker is written whole (a new file, renamed into place) when the run begins; after that
``stop()`` and ``start()`` change one byte of it in place: ``"closed": 0`` or ``1``, the
file's second-last byte. msprobe's loop stops and starts the probe every step, and two file
replacements per step cost a tenth of a small model's step (issue 38: 0.39 ms of 5.6 ms); a
one-byte ``pwrite`` cannot be torn, so a reader, or a process killed at any moment, sees the
marker whole, saying running or closed. The run keeps its marker mapped (``mmap``, shared), so a
flip is a store to memory that the page cache holds for every reader, and a killed process
leaves behind; ``start()``'s flip first checks (one ``stat``) that the path is still the file
this run wrote (the same inode and length: every whole write is a new file renamed into place,
so a marker another run wrote since, or a removed one, is another file) and otherwise writes
this run's marker whole again, so that a run that then crashes is seen. It checks at most once
every ``CHECK_EVERY_S`` seconds: right after a training step that ``stat`` took 37 us of the
small benchmark model's 13 ms step, so a loop that starts every step checks about once a second
and a marker replaced or removed meanwhile is written whole again within a second of blocks
(between two notebook cells, at the next start()). ``stop()``'s flip to
closed does not check: where another run's marker has replaced this one, that marker is the
one to keep. Issue 38: opening, reading, writing and closing the file took 48 us a flip right
after a training step, the JSON text 20-50 us more; now both texts are made once.
"""
from __future__ import annotations

import glob
import json
import mmap
import os
import sys
import time
import uuid

from ...atomic import atomic_write
from ...errors import DumpError
from ...log import get_logger
from . import results as _results

log = get_logger("probekit.freebench")

FORMAT = "probekit-freebench-run"
MARKER = "free_benchmark.rank{rank}.run.json"
#: start()'s flip checks that the marker is still this run's file at most this often (seconds)
CHECK_EVERY_S = 1.0


def marker_path(dump_path: str, rank: int) -> str:
    return os.path.join(dump_path, MARKER.format(rank=int(rank)))


def markers(dump_path: str) -> list[dict]:
    """Every rank's marker in the folder (unreadable ones skipped)."""
    out = []
    for path in glob.glob(os.path.join(glob.escape(dump_path),
                                       MARKER.format(rank="*").replace("rank*", "rank[0-9]*"))):
        try:
            with open(path, encoding="utf-8") as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("format") == FORMAT:
            out.append(info)
    return out


def _records(dump_path: str, ranks=None) -> list[str]:
    from ..repro.record import records_dir

    folder = records_dir(dump_path)
    paths = glob.glob(os.path.join(glob.escape(folder), "*.rank*.pt"))
    if ranks is None:
        return paths
    return [p for p in paths if _record_rank(p) in ranks]


def _record_rank(path: str):
    tail = os.path.basename(path)[:-3].rsplit(".rank", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


def plan(dump_path: str, *, rank: int, scope: str = "job", restart: str = "",
         overwrite: bool = False) -> dict:
    """The decision for a new run into ``dump_path`` (JSON-able, the same on every rank):
    ``{"run", "time", "action": "new" | "append" | "replace", "rows": rows held, "how"}``.
    ``restart``: why this run is a restart ("" when it is not); ``scope="rank"``: a process
    running alone beside others (no job to agree with): only its own rank's findings count."""
    mine = None if scope == "job" else {int(rank)}
    held = _results.CsvSink(dump_path).count_rows(mine)
    marks = [m for m in markers(dump_path) if mine is None or m.get("rank") in mine]
    evidence = held or marks or _records(dump_path, mine)
    run = {"run": uuid.uuid4().hex, "time": time.time_ns() // 1000, "rows": held}
    if not evidence:
        return dict(run, action="new", how="a new dump")
    if overwrite:
        return dict(run, action="replace", how="overwrite=True")
    if restart:
        return dict(run, action="append", how=f"a restart: {restart}")
    if marks:
        last = max(marks, key=lambda m: m.get("time") or 0)
        same = [m for m in marks if m.get("run") == last.get("run")]
        if not all(m.get("closed") for m in same):
            began = time.strftime("%Y-%m-%d %H:%M:%S",
                                  time.localtime((last.get("time") or 0) / 1e6))
            raise DumpError(
                f"free benchmark: {dump_path} holds {held} finding(s) of a run (begun {began}) "
                "that did not end cleanly: it crashed, was killed, or is still running. This "
                "run is not a restart (no resume=True, no elastic restart), so it would replace "
                "them. Pass resume=True to append to that dump, overwrite=True to replace it, "
                "or use another dump_path")
    return dict(run, action="replace",
                how="this run is not a restart and the last one ended cleanly")


class DumpRun:
    """One FreeBench session's run in its dump folder (``session/bench.py``): the decision at
    its first ``start()``, its marker, and the replacement of earlier findings when it first
    has something to say."""

    def __init__(self, dump_path: str, rank: int, run: dict, *, scope: str = "job",
                 world: int | None = None) -> None:
        self.dump_path, self.rank, self.run = dump_path, int(rank), run
        self.pending = run.get("action") == "replace"
        # in a job rank 0 also removes what ranks the job no longer has left
        self.also = (lambda r: r >= world) if scope == "job" and world and self.rank == 0 \
            else (lambda r: False)
        self.closed = None
        self._kept = None        # (mmap, (inode, device, size)) of the marker written last
        self._checked = float("-inf")   # when the kept marker was last known to be the file
        self._path = self._texts = None   # the marker's path, its text closed 0 and 1

    @classmethod
    def begin(cls, config, rank: int) -> "DumpRun":
        """Decide (once per job) and mark the run as running; logs a replacement."""
        from ...dist import agree, restart_count

        fb = config.free_benchmark
        why = "resume=True" if fb.resume else (
            f"an elastic restart (TORCHELASTIC_RESTART_COUNT={restart_count()})"
            if restart_count() else "")
        dump = config.dump_path
        scope_box = {}

        def decide(scope):
            scope_box["scope"] = scope
            return plan(dump, rank=rank, scope=scope, restart=why, overwrite=fb.overwrite)

        run = agree("freebench", os.path.abspath(dump), decide, DumpError)
        scope = scope_box.get("scope", "job")
        world = _world_size()
        if run["action"] == "replace" and run.get("rows"):
            log.info("Free benchmark: %s held %d finding(s) of an earlier run; %s, so this run "
                     "replaces them (resume=True appends)", dump, run["rows"], run["how"])
        elif run["action"] == "append" and run.get("rows"):
            log.info("Free benchmark: %s holds %d finding(s); this run appends to them (%s)",
                     dump, run["rows"], run["how"])
        out = cls(dump, rank, run, scope=scope, world=world)
        out.mark(False)
        return out

    def mark(self, closed: bool) -> None:
        """This rank's marker: the run, and whether it ended cleanly (module doc: whole at the
        first mark, one byte in place after)."""
        if self.closed is closed:
            return
        closed = bool(closed)
        if self._texts is None:
            self._path = marker_path(self.dump_path, self.rank)
            self._texts = tuple(json.dumps({"format": FORMAT, "run": self.run["run"],
                                            "time": self.run["time"], "rank": self.rank,
                                            "closed": c}).encode() for c in (0, 1))
        path, text = self._path, self._texts[closed]
        if self.closed is None or not self._flip(path, text, check=not closed):
            try:
                os.makedirs(self.dump_path, exist_ok=True)
            except OSError as exc:
                raise DumpError(f"free benchmark: dump_path {self.dump_path!r} cannot be "
                                f"created ({exc.strerror or exc}); accepted: a folder that "
                                "exists or can be created") from None
            # not fsync'd: it only steers the next run's decision; the findings are the CSV's
            atomic_write(path, text, fsync=False)
            self._keep(path, len(text))
        self.closed = closed

    def _flip(self, path: str, text: bytes, check: bool) -> bool:
        """Write the closed byte of ``text`` (its second-last) into the marker this run keeps
        mapped; ``check``: only where ``path`` is still that file (module doc). False where it
        is not, or none is kept: the caller then writes it whole."""
        kept = self._kept
        if kept is None:
            return False
        try:
            if check:
                now = time.monotonic()
                if now - self._checked >= CHECK_EVERY_S:
                    st = os.stat(path)
                    if (st.st_ino, st.st_dev, st.st_size) != kept[1]:
                        return False
                    self._checked = now
            kept[0][len(text) - 2] = text[-2]
            return True
        except (OSError, ValueError):
            return False

    def _keep(self, path: str, size: int) -> None:
        """Map the marker just written at ``path`` for the flips (unmapped with this object or
        by ``close()``). Not on Windows, where a mapped file cannot be replaced."""
        self.close()
        if os.name == "nt":
            return
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                return
            self._kept = (mmap.mmap(fd, size), (st.st_ino, st.st_dev, st.st_size))
            self._checked = time.monotonic()
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)   # the mapping holds the file

    def close(self) -> None:
        """Unmap the marker (a later flip writes it whole again)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept[0].close()

    def settle(self, sink, written=()) -> None:
        """Before this run's first rows, or at its first clean stop: remove this rank's rows
        and records of earlier runs (``written``: the records this run saved, kept)."""
        if not self.pending:
            return
        self.pending = False

        def gone(r):
            return r == self.rank or self.also(r)

        removed = sink.drop_rows(gone)
        keep = {os.path.abspath(p) for p in written}
        old = [p for p in _records(self.dump_path)
               if (r := _record_rank(p)) is not None and gone(r)
               and os.path.abspath(p) not in keep]
        for p in old:
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
        if removed or old:
            log.debug("Free benchmark: %d row(s) and %d record(s) of earlier runs removed from "
                      "%s", removed, len(old), self.dump_path)

    def stopped(self, sink, written=(), clean: bool = True) -> None:
        if clean:
            self.settle(sink, written)
        self.mark(clean)


def _world_size():
    from ...dist import initialized

    return sys.modules["torch"].distributed.get_world_size() if initialized() else None
