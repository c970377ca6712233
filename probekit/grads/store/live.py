"""The grad store's writing thread, and nothing handed to it is lost.

``LIVE`` knows every open ``GradWriter`` of this process and runs one background thread,
``probekit-grad-writer``, that writes what the writers' training threads hand over (rows of
statistics, then commits) in the order handed, and commits a writer whose oldest step has waited
``flush_seconds``. The queue is bounded: ``put`` waits while the rows handed over and not yet
written exceed ``max_queued`` bytes (at least one row is always let through), so a training
thread faster than the disk is slowed down rather than memory growing. The thread ends with the
last writer and starts again with the next.

Every writer is also written out at exit (``atexit``: normal end, uncaught exception,
``sys.exit``, Ctrl-C, a probe never stopped; its run is marked as ended cleanly unless an
uncaught exception ends the process), on SIGTERM (the handler waits for the writing,
then the process dies of SIGTERM as it would have; installed only where SIGTERM had its default
action), and before a reader in this process opens the store (``flush_live``). Those wait for
the thread; where it cannot run (a forked child, a thread that died) the caller writes itself.
Writers write with plain file calls (``chunks.py``), so all of this works during interpreter
shutdown and inside a signal handler.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections import deque

from ...log import get_logger

log = get_logger(__name__)

#: bytes of rows handed over and not yet written, over all writers of the process
MAX_QUEUED = 256 << 20


class LiveWriters:
    """Every open writer of this process and the one thread writing for them."""

    def __init__(self) -> None:
        self.writers: dict = {}  # id -> GradWriter
        self.cond = threading.Condition()
        self.ready: deque = deque()  # writers with rows or commits handed over
        self.queued = 0  # bytes of rows handed over, not yet written
        self.max_queued = MAX_QUEUED
        self.thread = None
        self.sigterm_installed = False
        self.pending_sigterm = False
        atexit.register(self.exit_all)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        # the parent's writers are the parent's: a child writes none of them
        self.writers = {}
        self.cond = threading.Condition()
        self.ready = deque()
        self.queued = 0
        self.thread = None

    # -- writers -------------------------------------------------------------------------
    def add(self, writer) -> None:
        with self.cond:
            self.writers[id(writer)] = writer
            self._ensure_thread()
        self._install_sigterm()

    def remove(self, writer) -> None:
        with self.cond:
            self.writers.pop(id(writer), None)
            last = not self.writers
            self.cond.notify_all()  # the thread ends when no writer is left
        if last and self.sigterm_installed and \
                threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self.sigterm_installed = False
            except (ValueError, OSError):  # pragma: no cover
                pass

    def _ensure_thread(self) -> None:
        """(under ``cond``) the writing thread, started if it is not running."""
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="probekit-grad-writer",
                                           daemon=True)
            self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and \
            threading.current_thread() is not self.thread

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # -- the queue -----------------------------------------------------------------------
    def put(self, writer, item, nbytes: int, force: bool = False) -> None:
        """Hand ``item`` over to be written for ``writer`` (called under the writer's lock, so
        items are written in the order handed). Waits while more than ``max_queued`` bytes are
        queued, unless ``force`` or nothing is queued."""
        with self.cond:
            while (not force and self.queued and self.queued + nbytes > self.max_queued
                   and self.alive()):
                self.cond.wait(0.5)
            self.queued += nbytes
            writer._inbox.append(item)
            if writer not in self.ready:
                self.ready.append(writer)
            self._ensure_thread()
            self.cond.notify_all()

    def take(self, writer) -> list:
        """Everything handed over for ``writer`` (called by its ``_drain``, under its I/O
        lock)."""
        with self.cond:
            items = list(writer._inbox)
            writer._inbox.clear()
            return items

    def done(self, nbytes: int) -> None:
        with self.cond:
            self.queued -= nbytes
            self.cond.notify_all()

    def wait(self, writer, event=None) -> None:
        """Until ``event`` is set (or, without one, until nothing is queued for ``writer``),
        writing on this thread when the writing thread cannot."""
        while True:
            if event is not None and event.is_set():
                return
            with self.cond:
                empty = not writer._inbox
                if event is None and empty and not writer._io.locked():
                    return
                if not self.alive():
                    run_here = True
                else:
                    run_here = False
                    self.cond.wait(0.05)
            if run_here:
                writer._drain()
                if event is None:
                    return

    def _run(self) -> None:
        """The writing thread: write what is handed over; commit what waited too long."""
        while True:
            due = []
            with self.cond:
                if threading.current_thread() is not self.thread:
                    return  # replaced (after a fork)
                while not self.ready:
                    if not self.writers:
                        self.thread = None
                        return
                    now = time.monotonic()
                    waits = []
                    for w in self.writers.values():
                        oldest = w._oldest  # set and cleared by the writer's thread
                        if oldest is not None:
                            waits.append((oldest + w.flush_seconds - now, w))
                    due = [w for t, w in waits if t <= 0]
                    if due:
                        break
                    self.cond.wait(timeout=min((t for t, _ in waits), default=None))
                writer = self.ready.popleft() if self.ready else None
            if writer is not None:
                writer._drain()
                continue
            for w in due:  # the timer: hand the newest step over and commit
                if w._lock.acquire(blocking=False):
                    try:
                        if w._oldest is not None:
                            w._hand_all()
                    finally:
                        w._lock.release()
                else:  # its thread is handing a step over: it checks the time itself
                    with self.cond:
                        self.cond.wait(0.01)

    # -- exit paths ------------------------------------------------------------------------
    def flush_all(self, path=None, prefix: bool = False) -> None:
        for writer in list(self.writers.values()):
            if path is None or writer.url == path or (prefix and writer.url.startswith(
                    (path.rstrip("/") + "/", path.rstrip(os.sep) + os.sep))):
                try:
                    writer.flush()
                except Exception as exc:  # never raise at exit; say what was lost
                    log.warning("grad_probe: writing the buffered steps of %s failed: %s",
                                writer.path, exc)

    def exit_all(self) -> None:
        """At exit: every open writer written, and its run marked as ended cleanly unless the
        process ends on an uncaught exception (``sys.last_value``, set before ``atexit`` runs;
        a SIGTERM or a kill never gets here: those runs stay not closed, as crashes)."""
        import sys

        clean = getattr(sys, "last_value", None) is None
        for writer in list(self.writers.values()):
            try:
                writer.finish(clean)
            except Exception as exc:  # never raise at exit; say what was lost
                log.warning("grad_probe: writing the buffered steps of %s failed: %s",
                            writer.path, exc)

    def _install_sigterm(self) -> None:
        if self.sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the program handles SIGTERM itself (and then exits through atexit)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self.sigterm_installed = True
        except (ValueError, OSError):  # pragma: no cover - no signals here
            pass

    def _on_sigterm(self, signum, frame) -> None:
        for writer in list(self.writers.values()):
            try:
                if not writer.flush_from_signal():
                    self.pending_sigterm = True  # inside its own writing: it finishes, then dies
            except Exception as exc:
                log.warning("grad_probe: writing %s on SIGTERM failed: %s", writer.path, exc)
        if not self.pending_sigterm:
            self.terminate()

    @staticmethod
    def terminate() -> None:
        """Die of SIGTERM, as the process would have without probekit's handler."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


#: this process's open writers (a writer adds itself when created, removes itself on close)
LIVE = LiveWriters()


def flush_live(path=None, prefix: bool = False) -> None:
    """Write the buffered steps of this process's open writers (of the rank group whose URL is
    ``path``, its absolute path for a local folder; with ``prefix``, of every group under it; or
    all), so a reader in this process (a notebook) sees every recorded step."""
    LIVE.flush_all(path, prefix)
