"""MindSpore stays optional: nothing but probekit.mindspore's recorder and debugger import it."""
import subprocess
import sys
import textwrap

from ms_util import require_mindspore

require_mindspore()  # meaningful only where mindspore could be imported


def test_probekit_and_its_readers_never_import_mindspore():
    code = textwrap.dedent("""
        import sys
        import probekit, probekit.grads, probekit.cli
        probekit.cli.build_parser()  # every command group, probekit mindspore included
        from probekit.mindspore import align_runs, compare_frameworks
        probekit.GradProbe, probekit.open_grads
        print(sorted(m for m in sys.modules if m.split(".")[0] == "mindspore"))
        from probekit.mindspore import PrecisionDebugger
        print("mindspore" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def _numpy2_into(site: str) -> None:
    """Put numpy >= 2 into ``site``: linked from the Python named by PROBEKIT_NUMPY2_PYTHON
    (make test: the main venv's, numpy 2.x), else installed from PyPI."""
    import os

    other = os.environ.get("PROBEKIT_NUMPY2_PYTHON")
    if other:
        where = subprocess.run([other, "-c", "import numpy, os; print(os.path.dirname("
                                "os.path.dirname(numpy.__file__)))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        for name in os.listdir(where):
            if name == "numpy" or name.startswith(("numpy-", "numpy.libs")):
                os.symlink(os.path.join(where, name), os.path.join(site, name))
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--target", site, "numpy>=2"], check=True, timeout=600)


def test_numpy2_beside_mindspore_says_what_to_install(tmp_path):
    """The install trap: numpy 2 beside MindSpore 2.10's numpy-1 wheel (a throwaway venv whose
    own numpy 2 shadows this venv's numpy 1). ``import probekit.mindspore`` warns, and the
    MindSpore-backed names refuse, both naming the fix, before MindSpore's first op fails."""
    import os
    import sysconfig

    venv = tmp_path / "trap"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _numpy2_into(site)
    # everything else (mindspore, torch, probekit's dependencies) from this venv, after numpy 2
    with open(os.path.join(site, "zz_this_venv.pth"), "w") as fh:
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = textwrap.dedent("""
        import warnings, numpy
        print(numpy.__version__.split(".")[0])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            import probekit.mindspore as pm
        print([str(w.message) for w in seen if w.category is RuntimeWarning][0])
        pm.align_runs  # works on stored runs, no MindSpore needed
        for get in (lambda: pm.GradProbe, lambda: __import__("probekit.mindspore.recorder")):
            try:
                get()
            except ImportError as exc:
                print("ImportError:", exc)
    """)
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=str(tmp_path),
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "2"
    fix = 'Install numpy 1.x beside it: pip install "numpy<2" (probekit\'s "mindspore" extra'
    assert lines[1].startswith("MindSpore 2.10") and fix in lines[1]
    assert lines[2].startswith("ImportError: probekit.mindspore.GradProbe: MindSpore 2.10")
    assert lines[3].startswith("ImportError: probekit.mindspore: MindSpore 2.10")
    assert all(fix in line for line in lines[1:4])
    # and in this venv (probekit's mindspore extra: numpy 1.x) there is no conflict
    from probekit.mindspore import numpy_conflict

    assert numpy_conflict() is None
