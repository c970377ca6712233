import json
import subprocess
import sys

from probekit import __version__
from probekit.cli import main


def test_version_entry_point():
    for module in ("probekit.cli", "probekit"):    # python -m probekit too
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == f"probekit {__version__}"


def test_config_check_prints_effective_settings(tmp_path, capsys, msprobe_config_dict):
    path = tmp_path / "config.json"
    msprobe_config_dict["free_benchmark"]["pert_mode"] = "bit_noise"
    path.write_text(json.dumps(msprobe_config_dict))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    head, body = out.split("\n", 1)
    assert head == f"{path}: OK (task free_benchmark)"
    effective = json.loads(body)
    assert effective["free_benchmark"]["pert_mode"] == "bit_noise"
    assert effective["free_benchmark"]["thresholds"] == {}   # none overridden


def test_config_check_bad_value(tmp_path, capsys, msprobe_config_dict):
    path = tmp_path / "config.json"
    msprobe_config_dict["free_benchmark"]["handler_type"] = "mend"
    path.write_text(json.dumps(msprobe_config_dict))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "probekit: error: free_benchmark.handler_type: 'mend' is not valid; accepted: check, fix" in err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: probekit" in capsys.readouterr().out


def test_config_check_refuses_a_dump_path_that_cannot_be_created(tmp_path, capsys,
                                                                 msprobe_config_dict):
    """A dump_path under a file cannot be created: ``config check`` says so, naming the path
    and why (it used to pass, and the run died with a raw traceback; issue 36)."""
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "runs" / "one"
    path = tmp_path / "config.json"
    msprobe_config_dict["dump_path"] = str(bad)
    path.write_text(json.dumps(msprobe_config_dict))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert (f"probekit: error: dump_path: {str(bad)!r} is not valid; accepted: a folder that "
            f"exists or can be created (this one cannot: {tmp_path / 'afile'} is a file)") in err
    msprobe_config_dict["dump_path"] = str(tmp_path / "new" / "deeper")   # creatable: fine
    path.write_text(json.dumps(msprobe_config_dict))
    assert main(["config", "check", str(path)]) == 0
    assert not (tmp_path / "new").exists()          # checked, not created
