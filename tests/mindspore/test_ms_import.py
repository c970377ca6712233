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
