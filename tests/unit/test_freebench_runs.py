"""A free-benchmark dump folder over runs (issue 36): a run appends only when it is a restart;
any other run replaces the findings of a last run that ended cleanly (one line says so) and is
refused where that run crashed; nothing is removed before the new run has something to say."""
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from probekit.errors import DumpError
from probekit.freebench import FreeBench
from probekit.freebench.report.cli import load
from probekit.freebench.report import runs
from probekit.freebench.report.runs import marker_path, markers
from probekit.freebench.repro.record import records_dir


def naive_norm(x):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / ((x * x).mean(-1, keepdim=True) - mean * mean).sqrt()


def run(dump, offset=300.0, **options):
    """One session: the README's naive norm; ``offset`` 0 leaves it healthy (no finding)."""
    torch.manual_seed(0)
    fb = FreeBench(dump_path=str(dump), pert_mode="bit_noise", **options)
    with fb:
        naive_norm(torch.randn(64, 32) + offset).square().mean()
    return fb


def test_a_run_again_replaces_the_last_one(tmp_path, caplog):
    first = run(tmp_path)
    csv = (tmp_path / "free_benchmark.csv").read_bytes()
    records = sorted(os.listdir(records_dir(str(tmp_path))))
    assert len(first.results) == 1 and len(records) == 1
    with caplog.at_level(logging.INFO, logger="probekit"):
        again = run(tmp_path)
    assert (f"{tmp_path} held 1 finding(s) of an earlier run; this run is not a restart and "
            "the last one ended cleanly, so this run replaces them (resume=True appends)"
            ) in caplog.text
    assert (tmp_path / "free_benchmark.csv").read_bytes() == csv       # not twice the rows
    assert sorted(os.listdir(records_dir(str(tmp_path)))) == records
    assert len(again.results) == 1 and len(load(str(tmp_path))) == 1
    run(tmp_path, resume=True)                                         # a restart: appends
    assert len(load(str(tmp_path))) == 2
    run(tmp_path, offset=0.0)                                          # healthy: replaces all
    assert len(load(str(tmp_path))) == 0 and os.listdir(records_dir(str(tmp_path))) == []
    (m,) = markers(str(tmp_path))
    assert m["closed"] == 1 and m["rank"] == 0


def test_a_crashed_run_is_kept_until_told(tmp_path):
    run(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", resume=True):
            torch.manual_seed(0)
            naive_norm(torch.randn(64, 32) + 300.0).square().mean()
            raise RuntimeError("boom")
    assert len(load(str(tmp_path))) == 2
    with pytest.raises(DumpError, match=r"holds 2 finding\(s\) of a run \(begun .*\) that did "
                                        r"not end cleanly: it crashed, was killed, or is still "
                                        r"running.*Pass resume=True to append to that dump, "
                                        r"overwrite=True to replace it"):
        run(tmp_path)
    assert len(load(str(tmp_path))) == 2                                # untouched
    run(tmp_path, overwrite=True)
    assert len(load(str(tmp_path))) == 1


def test_nothing_is_removed_before_the_new_run_has_something_to_say(tmp_path):
    """The replacing run is killed before it wrote a row or stopped: the last run's findings
    are all there, and its marker says it did not end cleanly."""
    run(tmp_path)
    csv = (tmp_path / "free_benchmark.csv").read_bytes()
    script = textwrap.dedent(f"""
        import os, torch
        from probekit.freebench import FreeBench
        fb = FreeBench(dump_path={str(tmp_path)!r}, pert_mode="bit_noise")
        fb.start()
        torch.randn(3) + 1           # checked: nothing to say
        os._exit(9)                  # killed before stop()
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    assert subprocess.run([sys.executable, "-c", script], env=env).returncode == 9
    assert (tmp_path / "free_benchmark.csv").read_bytes() == csv
    assert os.listdir(records_dir(str(tmp_path)))
    (m,) = markers(str(tmp_path))
    assert m["closed"] == 0
    with pytest.raises(DumpError, match="did not end cleanly"):
        run(tmp_path)


def test_ranks_sharing_a_folder_replace_only_their_own_rows(tmp_path, monkeypatch):
    """Processes recording alone (WORLD_SIZE 2, no process group) into one folder: each
    replaces its own rank's rows, never another's."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        run(tmp_path)
    assert sorted(load(str(tmp_path))["rank"]) == [0, 1]
    monkeypatch.setenv("RANK", "1")
    run(tmp_path, offset=0.0)                   # rank 1 again, healthy: its row goes
    assert sorted(load(str(tmp_path))["rank"]) == [0]
    assert os.path.isfile(marker_path(str(tmp_path), 0))


def test_the_rule_is_the_config(tmp_path):
    from probekit.config import ConfigError, make_config

    fb = make_config("free_benchmark", resume=True).free_benchmark
    assert (fb.resume, fb.overwrite) == (True, False)
    with pytest.raises(ConfigError, match=r"free_benchmark\.resume and "
                                          r"free_benchmark\.overwrite: both true"):
        make_config("free_benchmark", resume=True, overwrite=True)
    with pytest.raises(ConfigError, match=r"free_benchmark\.overwrite"):
        make_config("free_benchmark", overwrite="yes")



def _on_disk(path):
    import json
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)["closed"], os.stat(path).st_ino


def test_a_loop_that_stops_and_starts_every_step_flips_one_byte_of_its_marker(tmp_path):
    """msprobe's loop (start, step, stop) does not replace the marker file every step: the
    first start() writes it whole, every later start() and stop() one byte in place (issue 38)."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    path = marker_path(str(tmp_path), 0)
    fb.start()
    first = _on_disk(path)
    assert first[0] == 0
    for _ in range(20):
        torch.randn(4) + 1
        fb.stop()
        assert _on_disk(path) == (1, first[1])      # closed, and the same file
        fb.step()
        fb.start()
        assert _on_disk(path) == (0, first[1])
    fb.stop()
    (m,) = markers(str(tmp_path))
    assert m["closed"] == 1 and m["run"] == fb._run.run["run"]


@pytest.mark.parametrize("end, closed", [("os._exit(9)", 0), ("fb.start(); os._exit(9)", 0),
                                         ("fb.stop(); os._exit(0)", 1)])
def test_a_process_killed_right_after_its_last_mark_leaves_it_whole(tmp_path, end, closed):
    """Killed at once after a start() or a clean stop(), the marker says what the last one
    said: a run killed while running is refused next time, one killed after stopping cleanly
    is replaced."""
    script = textwrap.dedent(f"""
        import os, torch
        from probekit.freebench import FreeBench
        fb = FreeBench(dump_path={str(tmp_path)!r}, pert_mode="bit_noise")
        fb.start()
        torch.randn(3) + 1
        fb.stop()
        fb.start()
        {end}
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", script], env=env)
    (m,) = markers(str(tmp_path))
    assert m["closed"] == closed
    if closed:
        run(tmp_path)
    else:
        with pytest.raises(DumpError, match="did not end cleanly"):
            run(tmp_path)


def test_a_marker_another_run_wrote_since_is_not_flipped(tmp_path, monkeypatch):
    """Two sessions into one folder in one process: the second's marker is not changed by the
    first one's later stop(); the first writes its own whole again (checked at every start
    here: ``CHECK_EVERY_S`` 0)."""
    monkeypatch.setattr(runs, "CHECK_EVERY_S", 0.0)
    a = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    a.start()
    a.stop()
    b = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    b.start()
    (m,) = markers(str(tmp_path))
    assert m["run"] == b._run.run["run"] and m["closed"] == 0
    a.start()
    a.stop()
    (m,) = markers(str(tmp_path))
    assert m["run"] == a._run.run["run"] and m["closed"] == 1
    b.stop()


def test_a_marker_removed_between_blocks_is_written_whole_at_the_next_start(tmp_path,
                                                                           monkeypatch):
    """The run keeps its marker mapped; a marker removed meanwhile (the folder cleared between
    two cells) is another file: the next start() writes it whole again, saying running, and a
    stop() whose marker was removed raises nothing (checked at every start: ``CHECK_EVERY_S``
    0)."""
    monkeypatch.setattr(runs, "CHECK_EVERY_S", 0.0)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    path = marker_path(str(tmp_path), 0)
    fb.start()
    fb.stop()
    os.remove(path)
    fb.start()
    assert _on_disk(path)[0] == 0
    os.remove(path)
    fb.stop()                                   # nothing to flip: no error
    assert not os.path.exists(path)
    fb.start()
    fb.stop()
    (m,) = markers(str(tmp_path))
    assert m["closed"] == 1 and m["run"] == fb._run.run["run"]
    fb.close()
    assert fb._run._kept is None


def test_the_marker_is_checked_at_most_once_per_interval(tmp_path, monkeypatch):
    """start() checks its marker at most every ``CHECK_EVERY_S`` seconds (a loop that starts
    every step pays one ``stat`` a second): a marker removed right after a check is rewritten by
    the first start() once the interval has passed, not before."""
    monkeypatch.setattr(runs, "CHECK_EVERY_S", 0.3)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    path = marker_path(str(tmp_path), 0)
    fb.start()                                  # written whole: known to be the file
    fb.stop()
    os.remove(path)
    fb.start()                                  # within the interval: flipped in the mapping
    fb.stop()
    assert not os.path.exists(path)
    time.sleep(0.35)
    fb.start()                                  # past it: checked, written whole, running
    assert _on_disk(path)[0] == 0
    fb.stop()
    assert _on_disk(path)[0] == 1
    fb.close()


def test_a_stop_leaves_a_marker_another_run_wrote_since(tmp_path):
    """A clean stop() does not take the marker back from a run that began since: that run's
    marker, saying running, is what the next run must see."""
    a = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    a.start()
    b = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", overwrite=True)
    b.start()
    a.stop()
    (m,) = markers(str(tmp_path))
    assert m["run"] == b._run.run["run"] and m["closed"] == 0
    b.stop()
    (m,) = markers(str(tmp_path))
    assert m["run"] == b._run.run["run"] and m["closed"] == 1
