"""%%freebench and %freebench_config in a real in-process IPython shell."""
import json
import os
import re

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from probekit.config import PERT_MODES, make_config
from probekit.notebook import magics
from probekit.notebook.display import Findings

#: a model with a planted ill-conditioned op: the variance as E[x^2] - E[x]^2 of activations with a
#: large offset (catastrophic cancellation in the subtraction)
SETUP = """
import torch
torch.manual_seed(0)
x = torch.randn(16, 32) + 300.0
def energy(h):
    return (h * h).mean(-1) - h.mean(-1) ** 2
"""


@pytest.fixture
def ip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shell = fresh_shell()
    shell.run_line_magic("load_ext", "probekit")
    shell.run_cell(SETUP)
    yield shell
    fresh_shell()


def fresh_shell():
    """The in-process shell with probekit's extension unloaded and its magics unregistered."""
    shell = InteractiveShell.instance()
    if "probekit" in shell.extension_manager.loaded:
        shell.run_line_magic("unload_ext", "probekit")
    magics.unregister(shell)          # also when registered by a panel, without %load_ext
    return shell


def run(ip, line, cell="y = energy(x)"):
    with capture_output() as cap:
        ip.run_cell_magic("freebench", line, cell)
    return cap


def test_load_ext_registers_and_unload_removes():
    shell = fresh_shell()
    assert "freebench" not in shell.magics_manager.magics["cell"]
    shell.run_line_magic("load_ext", "probekit")
    assert "freebench" in shell.magics_manager.magics["cell"]
    assert "freebench_config" in shell.magics_manager.magics["line"]
    shell.run_line_magic("unload_ext", "probekit")
    assert "freebench" not in shell.magics_manager.magics["cell"]
    assert "freebench_config" not in shell.magics_manager.magics["line"]


def test_cell_runs_under_free_benchmark_and_results_are_stored(ip, tmp_path):
    cap = run(ip, f"--pert-mode bit_noise --dump-path {tmp_path / 'out'}")
    bench = ip.user_ns["_freebench"]
    assert type(bench).__name__ == "FreeBench"
    assert ip.user_ns["y"].shape == (16,)                        # the cell ran in the user ns
    assert bench.config.free_benchmark.pert_mode == "bit_noise"
    assert bench.config.dump_path == str(tmp_path / "out")
    assert bench.summary["calls"] >= 4 and bench.summary["checked"] >= 1
    flagged = bench.results
    assert bench.summary["flagged"] == len(flagged) >= 1
    assert any("sub" in name for name in flagged.api_name)        # the planted cancellation
    # displayed: the findings (HTML table + summary line)
    (out,) = cap.outputs
    html = out.data["text/html"]
    assert "<table" in html and "flagged" in html and "calls seen" in html
    assert html.index("sub") < html.index("</table>")
    assert out.data["text/plain"].startswith("Free benchmark (bit_noise, check, forward): ")


def test_output_name_and_quiet(ip):
    cap = run(ip, "--pert-mode bit_noise -o fb --quiet")
    assert cap.outputs == []
    assert type(ip.user_ns["fb"]).__name__ == "FreeBench"
    with pytest.raises(UsageError, match=r"-o: '1x' is not valid; accepted: a Python identifier"):
        run(ip, "-o 1x")


def test_bench_object_is_visible_inside_the_cell(ip):
    run(ip, "--pert-mode bit_noise -o fb --quiet",
        "for _ in range(3):\n    y = energy(x)\n    fb.step()")
    assert ip.user_ns["fb"].summary["steps"] == 3


def test_info_logs_only_with_verbose(ip, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="probekit")
    run(ip, "--pert-mode bit_noise --quiet")
    assert [r for r in caplog.records if r.levelno < logging.WARNING] == []
    assert logging.getLogger("probekit").level == logging.INFO          # restored
    run(ip, "--pert-mode bit_noise --quiet --verbose")
    assert any("bit_noise" in r.getMessage() for r in caplog.records)


def test_call_sites_and_tracebacks_name_the_cell(ip):
    n = ip.execution_count
    with capture_output() as cap:
        ip.run_cell("%%freebench --pert-mode bit_noise\nh = x * 1\nv = (h * h).mean(-1) - h.mean(-1) ** 2",
                    store_history=True)
    site = ip.user_ns["_freebench"].results.call_site.iloc[0]
    text = cap.outputs[0].data["text/plain"]
    # the raw site names the compiled cell file; the display names the cell and its line as seen
    assert site.endswith(":3") and site not in text
    assert f"In [{n}] line 3" in text
    with capture_output() as cap:
        result = ip.run_cell("%%freebench --quiet\ny = 1\nraise ValueError('boom')",
                             store_history=True)
    assert isinstance(result.error_in_exec, ValueError)
    traceback = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout)
    assert f"Cell In[{n + 1}], line 3" in traceback and "raise ValueError('boom')" in traceback


def test_plot_option_adds_png(ip):
    cap = run(ip, "--pert-mode bit_noise --plot")
    assert len(cap.outputs) == 2
    assert cap.outputs[1].data["image/png"][:4] == b"\x89PNG"[:4] or cap.outputs[1].data[
        "image/png"].startswith("iVBOR")


def test_exception_propagates_and_probe_is_removed(ip):
    with pytest.raises(ZeroDivisionError):
        run(ip, "--pert-mode bit_noise", "y = energy(x)\n1 / 0")
    bench = ip.user_ns["_freebench"]
    calls = bench.summary["calls"]
    assert calls >= 1
    torch.ones(3).sum()                                             # no longer intercepted
    ip.run_cell("energy(x)")
    assert bench.summary["calls"] == calls
    assert torch.overrides._get_current_function_mode_stack() == []


def test_a_cell_after_an_interrupted_one_is_told_the_magics_options(ip):
    """A cell stopped by an exception (Jupyter's Stop button) leaves its findings kept (the
    dump's rule); the next run into that dump is refused before anything runs, as a UsageError
    naming the magic's --resume and --overwrite (not the keyword arguments), with no table of
    a run that did not happen; --overwrite then runs."""
    with pytest.raises(KeyboardInterrupt):
        run(ip, "--pert-mode bit_noise --dump-path q", "y = energy(x)\nraise KeyboardInterrupt")
    ip.user_ns.pop("ran", None)
    with capture_output() as cap, pytest.raises(UsageError) as err:
        ip.run_cell_magic("freebench", "--pert-mode bit_noise --dump-path q",
                          "ran = True\ny = energy(x)")
    assert "did not end cleanly" in str(err.value)
    assert "Pass --resume to append to that dump, --overwrite to replace it, or another " \
           "--dump-path" in str(err.value)
    assert "ran" not in ip.user_ns and cap.outputs == []
    run(ip, "--pert-mode bit_noise --dump-path q --overwrite -o fb")
    assert list(ip.user_ns["fb"].results["api_name"]) == ["Tensor.__sub__.0.forward"]


@pytest.mark.parametrize("line, key, value", [
    ("--pert-mode add_noise", "pert_mode", "add_noise"),
    ("--handler fix", "handler_type", "fix"),
    ("--stage backward", "fuzz_stage", "backward"),
    ("--pert-mode to_cpu --device cpu", "fuzz_device", "cpu"),
    ("--scope Torch.matmul.0.forward,Tensor.pow.4.forward", "scope",
     ("Torch.matmul.0.forward", "Tensor.pow.4.forward")),
    ("--scope A.x.0.forward --scope B.y.0.forward", "scope", ("A.x.0.forward", "B.y.0.forward")),
    ("--list matmul --list sub,mean", "api_list", ("matmul", "sub", "mean")),
    ("--preheat", "if_preheat", True),
    ("--preheat --preheat-step 2 --max-sample 3", "preheat_step", 2),
    ("--preheat --preheat-step 2 --max-sample 3", "max_sample", 3),
    ("--budget 0.2", "budget", 0.2),
    ("--threshold float16=0.001 --threshold other=1e-5", "thresholds",
     {"float16": 0.001, "other": 1e-5}),   # the others: from the dtype's unit roundoff
])
def test_every_option_sets_its_config_key(ip, line, key, value):
    ip.run_line_magic("freebench_config", line)
    section = magics.get_defaults(ip).free_benchmark
    got = getattr(section, key)
    assert (dict(got) if key == "thresholds" else got) == value


def test_no_preheat_overrides_defaults_and_top_limits_rows(ip):
    ip.run_line_magic("freebench_config", "--preheat --preheat-step 2")
    run(ip, "--pert-mode bit_noise --no-preheat --quiet")
    cfg = ip.user_ns["_freebench"].config.free_benchmark
    assert (cfg.if_preheat, cfg.preheat_step) == (False, 2)
    html = run(ip, "--pert-mode bit_noise --top 0").outputs[0].data["text/html"]
    assert re.search(r"<tbody>\s*</tbody>", html)
    assert "… 1 more API call in _freebench.results" in html


def test_common_options(ip, tmp_path):
    ip.run_line_magic("freebench_config", f"--dump-path {tmp_path} --rank 0,1 --step 2")
    cfg = magics.get_defaults(ip)
    assert (cfg.dump_path, cfg.rank, cfg.step) == (str(tmp_path), (0, 1), (2,))


def test_cell_magic_options_reach_the_bench(ip):
    run(ip, "--pert-mode add_noise --list mean,sub --threshold float32=0.01 --quiet")
    cfg = ip.user_ns["_freebench"].config.free_benchmark
    assert (cfg.pert_mode, cfg.api_list, cfg.thresholds["float32"]) == (
        "add_noise", ("mean", "sub"), 0.01)


@pytest.mark.parametrize("line, message", [
    ("--pert-mode typo", "--pert-mode (free_benchmark.pert_mode): 'typo' is not valid; accepted: "
                         + ", ".join(PERT_MODES)),
    ("--handler repair", "--handler (free_benchmark.handler_type): 'repair' is not valid; "
                         "accepted: check, fix"),
    ("--stage sideways", "--stage (free_benchmark.fuzz_stage): 'sideways' is not valid; "
                         "accepted: forward, backward"),
    ("--device gpu", "--device (free_benchmark.fuzz_device): 'gpu' is not valid; accepted: npu, cpu"),
    ("--pert-mode to_cpu", "--device (free_benchmark.fuzz_device): 'npu' is not valid with "
                           "pert_mode 'to_cpu'; accepted: 'cpu'"),
    ("--handler fix --pert-mode bit_noise", "--pert-mode (free_benchmark.pert_mode): 'bit_noise' "
                                            "is not valid with handler_type 'fix'"),
    ("--scope A.b.0.forward --list relu", "--scope: free_benchmark.scope ['A.b.0.forward'] and "
                                          "free_benchmark.list ['relu'] were both given"),
    ("--preheat-step 0", "--preheat-step (free_benchmark.preheat_step): 0 is not valid; "
                         "accepted: an integer > 0"),
    ("--preheat-step two", "argument --preheat-step: invalid int value: 'two'"),
    ("--threshold float16", "--threshold: 'float16' is not valid; accepted: DTYPE=VALUE with "
                            "DTYPE among float16, bfloat16, float32, other"),
    ("--threshold fp8=0.1", "--threshold (free_benchmark.thresholds key): 'fp8' is not valid; "
                            "accepted: float16, bfloat16, float32, other"),
    ("--threshold float16=-1", "--threshold (free_benchmark.thresholds.float16): -1.0 is not "
                               "valid; accepted: a finite number > 0"),
    ("--budget -0.5", "--budget (free_benchmark.budget): -0.5 is not valid; accepted: a finite "
                      "number > 0"),
    ("--rank a", "--rank (rank): 'a' is not valid; accepted: integers >= 0 separated by commas"),
    ("--config missing.json", "--config (config_path): 'missing.json' is not valid; accepted: "
                              "an existing JSON file"),
    ("--colour red", "unrecognized arguments: --colour red"),
    ("--top -3", "--top: -3 is not valid; accepted: an integer >= 0"),
    ("--dump-path ''", "--dump-path (dump_path): '' is not valid; accepted: a non-empty path"),
])
def test_bad_options_raise_usage_error_naming_option(ip, line, message):
    with pytest.raises(UsageError) as err:
        run(ip, line)
    assert str(err.value).startswith(message)
    with pytest.raises(UsageError):
        ip.run_line_magic("freebench_config", line)
    assert magics.get_defaults(ip) is None                         # nothing half-applied


def test_bad_option_runs_nothing(ip):
    ip.user_ns.pop("_freebench", None)
    with pytest.raises(UsageError):
        run(ip, "--pert-mode typo", "ran = True")
    assert "ran" not in ip.user_ns and "_freebench" not in ip.user_ns


def test_config_file_and_defaults_precedence(ip, tmp_path):
    path = tmp_path / "config.json"
    make_config("free_benchmark", pert_mode="change_value", list=["mean"],
                dump_path=str(tmp_path / "from_file")).to_json(path)
    ip.run_line_magic("freebench_config", "--pert-mode add_noise")
    run(ip, "--quiet")                                             # session defaults
    assert ip.user_ns["_freebench"].config.free_benchmark.pert_mode == "add_noise"
    run(ip, f"--config {path} --quiet")                           # the file, not the defaults
    cfg = ip.user_ns["_freebench"].config
    assert (cfg.free_benchmark.pert_mode, cfg.free_benchmark.api_list) == ("change_value",
                                                                          ("mean",))
    run(ip, f"--config {path} --pert-mode no_change --quiet")     # options over the file
    cfg = ip.user_ns["_freebench"].config
    assert (cfg.free_benchmark.pert_mode, cfg.free_benchmark.api_list, cfg.dump_path) == (
        "no_change", ("mean",), str(tmp_path / "from_file"))
    # a grad_probe config file: its common keys, the free_benchmark section's defaults
    gp = tmp_path / "gp.json"
    make_config("grad_probe", dump_path=str(tmp_path / "gp")).to_json(gp)
    run(ip, f"--config {gp} --quiet")
    assert ip.user_ns["_freebench"].config.task == "free_benchmark"
    assert ip.user_ns["_freebench"].config.dump_path == str(tmp_path / "gp")


def test_freebench_config_show_set_save_clear(ip, tmp_path, capsys):
    ip.run_line_magic("freebench_config", "")
    assert capsys.readouterr().out == "%%freebench defaults: the defaults\n"
    ip.run_line_magic("freebench_config", "--pert-mode bit_noise")
    ip.run_line_magic("freebench_config", "--list matmul")          # on top of the current ones
    assert capsys.readouterr().out.splitlines()[-1] == (
        "%%freebench defaults: list=['matmul'], pert_mode='bit_noise'")
    path = tmp_path / "saved.json"
    ip.run_line_magic("freebench_config", f"--save {path}")
    saved = json.loads(path.read_text())
    assert saved["task"] == "free_benchmark"
    assert saved["free_benchmark"]["pert_mode"] == "bit_noise"
    assert saved["free_benchmark"]["list"] == ["matmul"]
    ip.run_line_magic("freebench_config", "--clear")
    assert magics.get_defaults(ip) is None
    assert capsys.readouterr().out.splitlines()[-1] == "%%freebench defaults: the defaults"
    with pytest.raises(UsageError, match="--clear: combined with other options"):
        ip.run_line_magic("freebench_config", "--clear --pert-mode bit_noise")
    with pytest.raises(UsageError, match=r"--save: '/nonexistent-dir/c\.json' cannot be "
                                         r"written \(No such file or directory\); accepted"):
        ip.run_line_magic("freebench_config", "--save /nonexistent-dir/c.json")


def test_quoted_option_values_lose_their_quotes(ip, tmp_path):
    """As a shell reads them: a quoted scope once kept its quotes and matched no call (a silent
    "no findings"), a quoted path made folders named with quotes."""
    run(ip, "--pert-mode bit_noise --scope 'Tensor.__sub__.0.forward' -o fb "
            f"--dump-path \"{tmp_path / 'my runs' / 'x'}\"")
    fb = ip.user_ns["fb"]
    assert fb.config.free_benchmark.scope == ("Tensor.__sub__.0.forward",)
    assert list(fb.results["api_name"]) == ["Tensor.__sub__.0.forward"]
    assert fb.config.dump_path == str(tmp_path / "my runs" / "x")
    assert os.path.isdir(tmp_path / "my runs" / "x")


def test_set_defaults_from_objects(ip, tmp_path):
    cfg = make_config("free_benchmark", pert_mode="no_change")
    assert magics.set_defaults(cfg, ip) is cfg
    assert magics.set_defaults(cfg.free_benchmark, ip).free_benchmark.pert_mode == "no_change"
    path = tmp_path / "c.json"
    cfg.to_json(path)
    assert magics.set_defaults(str(path), ip) == cfg
    assert magics.set_defaults(None, ip) is None


def test_findings_display_without_flags():
    import pandas as pd

    empty = Findings(pd.DataFrame(columns=["api_name", "max_rel", "threshold", "ratio", "kind"]),
                     {"calls": 10, "checked": 4, "skipped": {"view": 5, "inplace": 1},
                      "flagged": 0, "steps": 1})
    html = empty._repr_html_()
    assert "✓ no findings" in html and "<table" not in html
    assert ("10 calls seen · 4 checked · 6 skipped (view 5, inplace 1) · 0 flagged · 1 step"
            in html)


def test_findings_table_merges_steps_and_names_cells():
    import pandas as pd

    def row(step, api, max_rel, out=0, kind="rel_error"):
        return dict(rank=0, pert_mode="bit_noise", stage="forward", step=step, api_name=api,
                    max_rel=max_rel, dtype="torch.float32", shape="(4, 4)", output_index=out,
                    kind=kind, max_abs=0.0, threshold=2e-4, ratio=max_rel / 2e-4,
                    call_site="123.py:7")

    df = pd.DataFrame([row(0, "Torch.mm.0.forward", 0.01), row(1, "Torch.mm.0.forward", 0.03),
                       row(2, "Torch.mm.0.forward", 0.02), row(1, "Torch.max.0.forward", 0.5,
                                                                  kind="sign_flip")])
    summary = {"calls": 9, "checked": 8, "skipped": {"view": 1}, "flagged": 4, "steps": 3}
    view = Findings(df, summary, cells={"123.py": "In [7]"}, mode="bit_noise, check, forward")
    html = view._repr_html_()
    assert "⚠ 4 findings in 2 API calls" in html
    rows = html.split("<tbody>")[1].split("</tr>")[:-1]
    assert len(rows) == 2
    assert "Torch.max.0.forward" in rows[0] and "pk-severe" in rows[0]       # sign flip first
    assert ">0–2<" in rows[1] and ">0.03<" in rows[1] and ">150.0×<" in rows[1]  # worst of 3 steps
    assert ">float32<" in rows[1] and "torch.float32" not in html
    assert ">In [7] line 7<" in rows[1]
    assert "<th" in html and ">output<" not in html            # single-output APIs: no column
    df.loc[3, "output_index"] = 1
    assert ">output<" in Findings(df, summary, cells={})._repr_html_()
    text = repr(view)
    assert text.splitlines()[0] == ("Free benchmark (bit_noise, check, forward): 4 findings in 2 "
                                    "API calls — 9 calls seen · 8 checked · 1 skipped (view 1) · "
                                    "4 flagged · 3 steps")
    assert text.splitlines()[2] == ("  2. Torch.mm.0.forward (steps 0–2) rel_error max_rel=0.03 "
                                    "threshold=0.0002 float32 (4, 4) In [7] line 7")
    assert len(Findings(df, summary, top=1, name="fb")._repr_html_().split("</tr>")) == 3
    assert "… 1 more API call in fb.results" in Findings(df, summary, top=1, name="fb")._repr_html_()


def test_findings_table_shows_the_cause(tmp_path):
    from probekit.freebench import FreeBench

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        torch.add(torch.tensor([1e4 + 0.01]), torch.tensor([-1e4]))   # fp32 cancellation
    view = Findings.of(fb, cells={})
    page = view._repr_html_()
    assert ">cause<" in page and ">ill-conditioned<" in page
    assert "rel_error (ill-conditioned)" in repr(view)


MODEL = """
from torch import nn
class Energy(nn.Module):
    def forward(self, h):
        return energy(h)
net = nn.Sequential(nn.Linear(32, 32), Energy())
with torch.no_grad():
    net[0].weight.copy_(torch.eye(32)); net[0].bias.fill_(0.0)
"""


def test_module_option_scopes_the_cell_to_a_module(ip):
    ip.run_cell(MODEL)
    cell = "y = energy(x); z = net(x)"      # the same subtraction outside and inside net[1]
    run(ip, "--pert-mode bit_noise --module 1 -o fb")
    fb = ip.user_ns["fb"]
    assert fb.config.free_benchmark.module == ("1",)
    run(ip, "--pert-mode bit_noise --module 1 -o fb", cell)
    fb = ip.user_ns["fb"]
    assert sorted(zip(fb.results["api_name"], fb.results["module"])) == [
        ("Tensor.__sub__.1.forward", "1")]
    html = Findings.of(fb)._repr_html_()
    assert ">module<" in html and ">1<" in html
    ip.user_ns["net2"] = ip.user_ns["net"]   # same object twice: still one model
    run(ip, "--module 1 --model net -o fb", cell)
    ip.run_cell("net3 = nn.Sequential(nn.Identity(), nn.Identity())")
    with pytest.raises(UsageError, match=r"--module \(1\): the model is ambiguous \(nn\.Module "
                       r"variables having these modules: net, net3\); accepted: --model NAME"):
        run(ip, "--module 1", cell)
    with pytest.raises(UsageError, match=r"--module \(free_benchmark\.module\): '1\.fc' is not a "
                       r"module of this Sequential"):
        run(ip, "--module 1.fc --model net", cell)
    with pytest.raises(UsageError, match=r"--model: 'nope' is not valid"):
        run(ip, "--module 1 --model nope", cell)
    with pytest.raises(UsageError, match=r"--module \(nope\): no nn\.Module variable has this "
                       r"module \(nn\.Module variables: net, net2, net3\); accepted: names as "
                       r"model\.named_modules\(\) gives them"):
        run(ip, "--module nope", cell)


def test_findings_table_gives_each_recorded_finding_its_repro_command(ip):
    # issue 30: the subtraction of energy() cancels (ill-conditioned); the session recorded its
    # call, so the table shows the command writing its standalone repro, and it works
    cap = run(ip, "--pert-mode bit_noise -o fb")
    html = cap.outputs[0].data["text/html"]
    assert ">repro<" in html and "fb.repro(&#x27;Tensor.__sub__.0.forward&#x27;)" in html
    ip.run_cell("r = fb.repro('Tensor.__sub__.0.forward')")
    r = ip.user_ns["r"]
    assert r.defect and r.results[0]["verdict"] == "ill-conditioned"
    assert os.path.isfile(r.script) and r.path == os.path.realpath(os.path.join(
        ip.user_ns["fb"].config.dump_path, "repro", "Tensor.__sub__.0.forward.rank0"))
    assert "repro (a script needing only torch): fb.repro('Tensor.__sub__.0.forward')" in repr(
        Findings.of(ip.user_ns["fb"], cells={}, name="fb"))
