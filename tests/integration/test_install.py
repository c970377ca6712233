"""Issue 28, point 1: the package installs as a user installs it. The wheel is built from this
checkout, installed with the CPU torch into a fresh venv (no PYTHONPATH, nothing else of this
environment), and there ``import probekit`` and the ``probekit`` command work. The distribution
name is ``probekit-precision`` (``probekit`` on the package index is another project); the
import name and the command stay ``probekit``."""
import glob
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import probekit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIST = "probekit-precision"
TORCH = "torch==" + torch.__version__.split("+")[0]  # the CPU build lies on disk (Makefile too)


def run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, **kw)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.mark.slow
def test_the_wheel_installs_probekit_and_its_command_in_a_fresh_venv(tmp_path):
    log = run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-v",
               "-w", str(tmp_path / "dist")], cwd=str(tmp_path))
    assert "BuildBackendWarning" not in log  # e.g. the deprecated license table
    wheels = glob.glob(str(tmp_path / "dist" / "*.whl"))
    assert [os.path.basename(w).split("-")[0] for w in wheels] == ["probekit_precision"]
    # every package of the tree (the stage sub-packages of freebench/ and grads/ too) is in it
    packages = sorted(os.path.dirname(n) for n in zipfile.ZipFile(wheels[0]).namelist()
                      if n.endswith("/__init__.py"))
    tree = sorted(os.path.relpath(os.path.dirname(p), ROOT).replace(os.sep, "/") for p in
                  glob.glob(os.path.join(ROOT, "probekit", "**", "__init__.py"), recursive=True))
    assert packages == tree and "probekit/grads/numerics" in tree
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = str(venv / "bin" / "python")
    # the running pip installs into the fresh venv; --no-compile: no .pyc for torch's files
    run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-compile",
         wheels[0], TORCH], cwd=str(tmp_path))
    out = run([py, "-c", "import importlib.metadata as m, importlib.util as u, probekit; "
               f"print(probekit.__file__); print(m.version({DIST!r})); "
               "print(u.find_spec('probekit.grads.numerics._kernel') is not None)"],
              cwd=str(tmp_path))
    where, version, compiled = out.split()[:3]
    assert where.startswith(str(venv)) and version == probekit.__version__
    assert compiled == "True"  # the C kernel was built into the wheel
    helptext = run([str(venv / "bin" / "probekit"), "--help"], cwd=str(tmp_path))
    assert helptext.startswith("usage: probekit ")
    for group in ("config", "freebench", "grads", "mindspore"):
        assert group in helptext
