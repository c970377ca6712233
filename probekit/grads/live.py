"""Nothing buffered is lost: this process's open grad-store writers, written out at exit.

``LIVE`` knows every open ``GradWriter`` and writes their buffered steps ``atexit`` (normal end,
uncaught exception, ``sys.exit``, Ctrl-C, a probe never stopped), on SIGTERM (the handler writes,
then the process dies of SIGTERM as it would have; installed only where SIGTERM had its default
action), from a timer thread once a step waited ``flush_seconds`` (the thread ends with the last
writer), and before a reader in this process opens the store (``flush_live``). Writers flush with
plain file writes (``chunks.py``), so all of this works during interpreter shutdown and inside a
signal handler.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import time

from ..log import get_logger

log = get_logger(__name__)


class LiveWriters:
    """Every open writer of this process, so that nothing buffered is lost: written at exit
    (``atexit``: normal end, uncaught exception, ``sys.exit``, Ctrl-C), on SIGTERM (the handler
    writes, then the process dies of SIGTERM as it would have), by a timer once a step has waited
    ``flush_seconds``, and before a reader in this process opens the store."""

    def __init__(self) -> None:
        self.writers: dict = {}  # id -> GradWriter
        self.cond = threading.Condition()
        self.thread = None
        self.sigterm_installed = False
        self.pending_sigterm = False
        atexit.register(self.flush_all)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.cond = threading.Condition()
        self.thread = None

    def add(self, writer) -> None:
        with self.cond:
            self.writers[id(writer)] = writer
            if self.thread is None:
                self.thread = threading.Thread(target=self._timer, name="probekit-grad-flush",
                                               daemon=True)
                self.thread.start()
        self._install_sigterm()

    def remove(self, writer) -> None:
        with self.cond:
            self.writers.pop(id(writer), None)
            last = not self.writers
            self.cond.notify_all()  # the timer thread ends when no writer is left
        if last and self.sigterm_installed and \
                threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self.sigterm_installed = False
            except (ValueError, OSError):  # pragma: no cover
                pass

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def flush_all(self, path=None) -> None:
        for writer in list(self.writers.values()):
            if path is None or writer.url == path:  # a group's URL (local: absolute path)
                try:
                    writer.flush()
                except Exception as exc:  # never raise at exit; say what was lost
                    log.warning("grad_probe: writing the buffered steps of %s failed: %s",
                                writer.path, exc)

    def _timer(self) -> None:
        while True:
            with self.cond:
                if not self.writers:
                    self.thread = None
                    return
                now = time.monotonic()
                pending = [w for w in self.writers.values() if w._buffer]
                due = [w for w in pending if now - w._oldest >= w.flush_seconds]
                if not due:
                    waits = [w._oldest + w.flush_seconds - now for w in pending]
                    self.cond.wait(timeout=min(waits, default=None))
                    continue
            for w in due:
                try:
                    w.flush()
                except Exception as exc:
                    log.warning("grad_probe: timed write of %s failed: %s", w.path, exc)

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
                    self.pending_sigterm = True  # inside its own flush: it finishes, then dies
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


def flush_live(path=None) -> None:
    """Write the buffered steps of this process's open writers (of the rank group whose URL is
    ``path``, its absolute path for a local folder; or all), so a reader in this process (a
    notebook) sees every recorded step."""
    LIVE.flush_all(path)
