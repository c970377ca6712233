"""The real-bug zoo (``tests/_real_bugs.py``): fifteen genuine defects and ill-conditioned
computations, each found with its cause in the mode it shows in -- and in ``combined``, which
runs it in its first step (improve_precision) or second (bit_noise). Issue 34 point 4 added
pytorch/pytorch#156173's own reproducer (k = 131,072: missed in every mode before, 14/15).
And the CPU bf16 kernels issue 34 measured on model sweeps (point 7): each a finding."""
import os
import sys

import pytest

from probekit.freebench import FreeBench

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _real_bugs import NEW_BF16, REAL_BUGS, batch_norm_kernel_is_wrong  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def found(tmp_path, mode, options, fn, steps=1) -> list:
    fb = FreeBench(dump_path=str(tmp_path), pert_mode=mode, **options)
    for _ in range(steps):
        with fb:
            fn()
        fb.step()
    return fb.results


@pytest.mark.parametrize("name, mode, options, fn, why", REAL_BUGS,
                         ids=[b[0] for b in REAL_BUGS])
def test_every_real_bug_is_found(tmp_path, name, mode, options, fn, why):
    if name == "batch_norm_constant_channels" and not batch_norm_kernel_is_wrong():
        pytest.skip("this CPU's batch norm computes constant channels right")
    df = found(tmp_path / mode, mode, options, fn)
    assert len(df) and set(df["cause"]) == {why}, df
    df = found(tmp_path / "combined", "combined", options, fn, steps=2)
    assert len(df) and set(df["cause"]) == {why} and mode in set(df["pert_mode"]), df


@pytest.mark.parametrize("name, options, fn, want", NEW_BF16, ids=[b[0] for b in NEW_BF16])
def test_cpu_bf16_kernels_that_round_in_bf16_are_found(tmp_path, name, options, fn, want):
    df = found(tmp_path, "improve_precision", options, fn)
    got = set(zip(df["api_name"], df["output_index"]))
    assert want in got, df
    assert set(df["cause"]) <= {"inaccurate", "ill-conditioned"}
