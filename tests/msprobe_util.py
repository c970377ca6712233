"""Locate msprobe 1.0.4's venv (made by `make test`/`make bench`) for interop tests."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def msprobe_python() -> str:
    """The msprobe venv's python; skips (or fails when PROBEKIT_REQUIRE_MSPROBE=1) if absent."""
    exe = os.environ.get("PROBEKIT_MSPROBE_PYTHON",
                         os.path.join(ROOT, ".venv-msprobe", "bin", "python"))
    ok = os.path.isfile(exe) and subprocess.run(
        [exe, "-c", "import msprobe"], capture_output=True).returncode == 0
    if not ok:
        msg = f"msprobe 1.0.4 venv not found at {exe} (make it with `make .venv-msprobe/.installed`)"
        if os.environ.get("PROBEKIT_REQUIRE_MSPROBE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def run_msprobe(script: str, *args, timeout=300) -> str:
    out = subprocess.run([msprobe_python(), "-c", script, *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    if out.returncode != 0:
        raise AssertionError(f"msprobe script failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout
