"""Where a grad-probe graph runs: dask on the local cores, or a ``dask.distributed`` cluster.

``run_graph(tasks)`` computes a list of ``dask.delayed`` results: with dask's threaded scheduler
on this machine's cores by default (numpy's loops and file reads release the GIL), with a
``distributed.Client`` given as ``client=``, or with one connected to ``scheduler=`` (an address
such as ``"tcp://10.0.0.5:8786"``) for the call. Long runs report progress on stderr: the
finished tasks over all, at most once a second, from the moment a run has taken ``delay``
seconds (``progress=True``: from the start; ``False``: never).

``Session`` runs a graph in stages, the tasks of a stage known only once the one before it ran
(the comparison: open the rank groups, plan, then count): one progress line over all of them,
whose total grows as stages are added, and on a cluster the results of a stage can stay there
(``keep=True``: futures) as the next stage's inputs.
"""
from __future__ import annotations

import sys
import time

from ...errors import GradCompareError
from ...log import in_kernel


class _Progress:
    """Finished tasks / all, printed on stderr once the run is slower than ``delay`` seconds
    (stdout in a notebook kernel, where stderr is drawn as an error)."""

    def __init__(self, total: int, label: str, delay: float, stream=None) -> None:
        self.total, self.label, self.delay = total, label, delay
        self.stream = stream or (sys.stdout if in_kernel() else sys.stderr)
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.shown = False

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.t0 >= self.delay and (now - self.last >= 1.0 or not self.shown
                                             or self.done == self.total):
            self.last, self.shown = now, True
            self.stream.write(f"\r[probekit] {self.label}: {self.done}/{self.total} tasks, "
                              f"{now - self.t0:.0f} s")
            self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def run_graph(tasks: list, *, client=None, scheduler=None, progress=None, label="graph",
              num_workers: int | None = None) -> list:
    """The values of ``tasks`` (``dask.delayed`` objects), computed together (one stage of a
    ``Session``)."""
    with Session(client=client, scheduler=scheduler, progress=progress, label=label,
                 num_workers=num_workers) as session:
        return session.run(tasks)


class Session:
    """Stages of one graph on the local threads or a cluster, one progress line for all."""

    def __init__(self, *, client=None, scheduler=None, progress=None, label="graph",
                 num_workers: int | None = None) -> None:
        if client is not None and scheduler is not None:
            raise ValueError("client= and scheduler= given; accepted: one of them (a "
                             "distributed.Client, or the address of its scheduler)")
        self.client, self.scheduler, self.label = client, scheduler, label
        self.num_workers = num_workers
        self.show = progress is not False
        self.delay = 0.0 if progress is True else 2.0
        self.bar = None
        self._own = False

    def __enter__(self) -> "Session":
        if self.scheduler is not None:
            try:
                from distributed import Client
            except ImportError:
                raise ImportError("scheduler=: a dask.distributed cluster needs the distributed "
                                  "package: pip install distributed (probekit's 'distributed' "
                                  "extra)") from None
            try:
                self.client = Client(self.scheduler, timeout="10s", set_as_default=False)
            except (OSError, ValueError, TypeError) as exc:
                raise GradCompareError(f"scheduler: {self.scheduler!r} cannot be reached "
                                       f"({type(exc).__name__}: {exc}); accepted: the address "
                                       "of a running dask scheduler, e.g. tcp://host:8786"
                                       ) from None
            self._own = True
        self.bar = _Progress(0, self.label, self.delay) if self.show else None
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._own:
            self.client.close()

    @property
    def on_cluster(self) -> bool:
        return self.client is not None

    def run(self, tasks: list, keep: bool = False, inner=()) -> list:
        """The values of ``tasks`` (``dask.delayed``); on a cluster with ``keep``, their futures
        (they stay on the workers, for the next stage). ``inner``: tasks of the same graph that
        ``tasks`` depend on, counted in the progress too (their values are not kept)."""
        if not tasks:
            return []
        inner = list(inner)
        if self.bar is not None:
            self.bar.total += len(tasks) + len(inner)
        if self.client is not None:
            from distributed import as_completed

            with self.client.as_current():
                futures = self.client.compute(list(tasks) + inner)
                outputs, rest = futures[:len(tasks)], futures[len(tasks):]
                rest_keys = {f.key for f in rest}
                del rest  # an inner result stays on the cluster only while a task needs it
                for fut in as_completed(futures):
                    if self.bar is not None:
                        self.bar.step()
                    if fut.key in rest_keys:
                        fut.release()
                del futures
                return outputs if keep else self.client.gather(outputs)
        import dask

        if self.bar is None:
            return list(dask.compute(*tasks, scheduler="threads", num_workers=self.num_workers,
                                     optimize_graph=False))
        from dask.callbacks import Callback

        keys = {t.key for t in tasks} | {t.key for t in inner}
        bar = self.bar

        class Count(Callback):
            def _posttask(self, key, result, dsk, state, worker_id):
                if key in keys:
                    bar.step()

        with Count():
            return list(dask.compute(*tasks, scheduler="threads", num_workers=self.num_workers,
                                     optimize_graph=False))

    def value(self, fn, handle, *args):
        """``fn(value of handle, *args)`` where the handle's value is (a small answer back)."""
        if self.client is not None and type(handle).__name__ == "Future":
            return self.client.submit(fn, handle, *args, pure=False).result()
        return fn(handle, *args)
