"""From a free-benchmark finding to a standalone repro (issue 30): ``fb.repro(row)``,
``probekit freebench repro``, the record the session saves, the script that needs only torch.

"Fresh process" below is the honest check: the scripts run in a new Python with ``-I`` (no
PYTHONPATH, no working directory on its path) and probekit made unimportable (an editable install
puts it on every interpreter's path), torch and the standard library only; several scripts share
one such process (each run as ``__main__`` in its own namespace) to keep the suite lean.
"""
import ast
import itertools
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from probekit.cli import main
from probekit.errors import ReproError
from probekit.freebench import FreeBench
from probekit.freebench.judge import cause, scales
from probekit.freebench.perturb import perturb
from probekit.freebench.repro import (
    folder as repro, helpers as repro_helpers, record as repro_record)

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _real_bugs import REAL_BUGS, batch_norm_kernel_is_wrong  # noqa: E402

bf16, fp16 = torch.bfloat16, torch.float16

#: runs every script given in one isolated Python, probekit blocked: prints each exit status
MANY = repro.FRESH_DRIVER.split("script = sys.argv[1]")[0] + """
import io, contextlib
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [script]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc(file=out)
            code = 3
    print("@@", script, code)
    print(out.getvalue())
print("@@ probekit importable:", "probekit" in sys.modules)
"""


def fresh(*scripts) -> dict:
    """``{script: (exit status, output)}`` of the scripts in one fresh, isolated Python."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", MANY, *map(str, scripts)],
                          capture_output=True, text=True, env=env, cwd="/", timeout=900)
    assert proc.returncode == 0, proc.stderr
    parts = proc.stdout.split("@@ ")[1:]
    assert parts[-1].strip() == "probekit importable: False"
    got = {}
    for part in parts[:-1]:
        head, _, body = part.partition("\n")
        path, code = head.rsplit(" ", 1)
        got[path] = (int(code), body)
    return got


def result_line(output: str) -> dict:
    line = [s for s in output.splitlines() if s.startswith("result: ")][-1]
    return {int(k): v for k, v in json.loads(line[len("result: "):]).items()}


def gen():
    return torch.Generator().manual_seed(0)


# -- the bf16 layer_norm backward defect --------------------------------------------------------------
ROWS, D = 4096, 64


def layer_norm_inputs():
    g = gen()
    x = torch.randn(ROWS, D, generator=g).to(bf16).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(bf16).requires_grad_()
    b = (0.1 * torch.randn(D, generator=g)).to(bf16).requires_grad_()
    gy = torch.randn(ROWS, D, generator=g).to(bf16)
    return x, w, b, gy


def layer_norm_session(dump):
    x, w, b, gy = layer_norm_inputs()
    fb = FreeBench(dump_path=str(dump), pert_mode="improve_precision", fuzz_stage="backward",
                   list=["layer_norm"])
    with fb:
        F.layer_norm(x, (D,), w, b).backward(gy)
    return fb, (x, w, b, gy)


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    return layer_norm_session(tmp_path_factory.mktemp("ln"))


def test_bf16_layer_norm_backward_repro_reproduces_in_a_fresh_process(ln, tmp_path):
    fb, (x, w, b, gy) = ln
    df = fb.results
    # CPU bf16 layer_norm backward sums the weight and bias gradients in bf16, and reads its
    # mean and rstd as it saved them, in bf16 (the input gradient)
    assert df["output_index"].tolist() == [0, 2, 3] and set(df["cause"]) == {"inaccurate"}
    dump = fb.config.dump_path
    record = repro_record.record_path(dump, "Functional.layer_norm.0.backward", 0)
    assert os.listdir(os.path.dirname(record)) == [os.path.basename(record)]   # no .partial
    # x, g and the input gradient recorded (each bf16), small extras
    assert os.path.getsize(record) < 3 * ROWS * D * 2 + 64 * 1024
    row = df.iloc[2]
    r = fb.repro(row)
    folder = os.path.join(dump, "repro", "Functional.layer_norm.0.backward.rank0")
    assert r.path == folder and sorted(os.listdir(folder)) == ["REPORT.md", "inputs.pt",
                                                                "repro.py"]
    text = open(r.script).read()
    # the header: what a kernel team asks for
    assert f"torch {torch.__version__} (git {torch.version.git_version[:12]})" in text
    assert f"CPU capability: {torch.backends.cpu.get_cpu_capability()}" in text
    assert "device: cpu; autocast: off" in text
    assert "torch.nn.functional.layer_norm(x0, (64,), weight=x2, bias=x3, eps=1e-05)" in text
    assert "the gradient fed into output 0: g, bfloat16 (4096, 64)" in text
    assert ("judged: the gradient of x0 (`input`), the gradient of x2 (`weight`), the gradient "
            "of x3\n      (`bias`)") in text
    assert "import probekit" not in text and "from probekit" not in text
    (code, out), = fresh(r.script).values()
    assert code == 1, out
    assert "DEFECT PRESENT" in out and "u of max|exact|" in out and "error / bound = " in out
    got = result_line(out)
    # the numbers are the session's own: the kernel's bias gradient against float64, with the
    # judge's bound (norm family, k = 4096 rows, S = sum |g| over the rows: cause.Score)
    o = b.grad.double()
    r64 = gy.double().sum(0)
    S = gy.double().abs().sum(0)
    judge = scales.judge("improve_precision", "norm", ROWS, bf16, stage="backward")
    score = cause.Score(judge, 2.0 ** -8)
    score.accuracy(b.grad, r64, S)
    assert got[3]["accuracy"] == pytest.approx(score.acc, rel=1e-12) and score.acc > 1
    assert got[3]["max_error"] == pytest.approx((o - r64).abs().max().item(), rel=1e-12)
    in_u = got[3]["max_error"] / (2.0 ** -8 * got[3]["scale"])
    assert in_u > 4          # several bf16 u of the exact bias gradient (9.4 u here, AVX-512)
    assert got[3]["verdict"] == "inaccurate" and got[3]["vs_recorded"] == 0.0
    # the script's bound is the session judge's: the Judge the rows were judged with (the
    # engine's cache), evaluated by the analysis' own Score.bound, gives the script's
    # coefficients of |exact| and S; the threshold is the row's
    judges = [j for key, j in fb._engine._thresholds.items()
              if j.fam == "norm" and j.k == ROWS and key[6] == "backward"]
    assert len({(j.thr, j.k, j.u_out, j.u_acc) for j in judges}) == 1, judges
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    session = cause.Score(judges[0], 2.0 ** -8)
    for i in (2, 3):
        bd = r.meta["case"]["bound"][i]
        assert bd["a"] == session.bound(one, zero).item() > 0
        assert bd["b"] == session.bound(zero, one).item() > 0
    assert {e["index"]: e["thr"] for e in r.meta["judged"]}[3] == row["threshold"]
    assert got == {i: {k: pytest.approx(v) if isinstance(v, float) else v
                       for k, v in res.items()} for i, res in r.results.items()}
    report = open(os.path.join(folder, "REPORT.md")).read()
    assert "## Expected vs actual" in report and "gives a result further from the exact" in report


def test_layer_norm_repro_shrinks_while_it_reproduces(ln, tmp_path):
    fb, _ = ln
    r = fb.repro("Functional.layer_norm.0.backward", tmp_path / "small", shrink=True)
    note = [n for n in r.notes if n.startswith("shrunk:")]
    assert note and "x0 and g along dim 0 from 4096 to" in note[0], r.notes
    rows = int(note[0].split("from 4096 to ")[1].split()[0])
    assert rows < 4096
    text = open(r.script).read()
    assert f"'shape': [{rows}, 64]" in text and "shrunk: x0 and g" in text
    assert r.defect
    (code, out), = fresh(r.script).values()
    assert code == 1, out


def test_inputs_above_the_limit_are_generated_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(repro_record, "SAVE_LIMIT", 64 << 10)
    rng = torch.get_rng_state()
    fb, _ = layer_norm_session(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng)      # the training's stream is untouched
    path = repro_record.record_path(str(tmp_path), "Functional.layer_norm.0.backward", 0)
    assert os.path.getsize(path) < 64 << 10
    rec = repro_record.load(path)
    x_spec, g_spec = rec.meta["tensors"]["x0"], rec.meta["tensors"]["g"]
    for spec in (x_spec, g_spec):      # same shape, dtype, strides; the values' statistics
        assert (spec["stored"], spec["shape"], spec["stride"], spec["dtype"]) == (
            "generated", [ROWS, D], [D, 1], "bfloat16")
        assert abs(spec["mean"]) < 0.01 and abs(spec["std"] - 1) < 0.01
        assert len(spec["quantiles"]) == repro_record.QUANTILES
    assert rec.meta["tensors"]["x2"]["stored"] == "saved"
    assert rec.meta["generated_check"] == {"reproduced": True, "causes": {
        "0": "inaccurate", "2": "inaccurate", "3": "inaccurate"}}
    r = fb.repro(0)
    text = open(r.script).read()
    assert "x0: bfloat16 (4096, 64), stride (64, 1): generated (seed" in text
    assert "checked when recorded: the generated inputs reproduce the finding" in text
    (code, out), = fresh(r.script).values()
    assert code == 1, out
    # the fresh process drew the same inputs: its numbers are those measured here
    assert result_line(out)[2]["accuracy"] == pytest.approx(r.results[2]["accuracy"], rel=1e-12)


def test_generated_inputs_that_do_not_reproduce_are_saved(tmp_path, monkeypatch):
    # a + b with b = -(a - 0.01): every sum cancels to 0.01 (ill-conditioned), which two
    # independently generated inputs with the same statistics do not do
    monkeypatch.setattr(repro_record, "SAVE_LIMIT", 0)
    x = 1e4 + torch.randn(1000, generator=gen()) * 100

    def session(dump):
        fb = FreeBench(dump_path=str(dump), pert_mode="bit_noise")
        with fb:
            torch.add(x + 0.01, -x)
        return fb

    fb = session(tmp_path / "saved")
    rec = repro_record.load(repro_record.record_path(fb.config.dump_path,
                                                     "Torch.add.0.forward", 0))
    assert rec.meta["generated_check"] == {"reproduced": False, "causes": {"0": "unconfirmed"},
                                           "fallback": "saved"}
    assert {s["stored"] for s in rec.meta["tensors"].values()} == {"saved"}
    assert fb.repro(0).defect
    # too large to save: the record says so, and so does the script
    monkeypatch.setattr(repro_record, "FALLBACK_LIMIT", 0)
    r = session(tmp_path / "big").repro(0)
    assert "WARNING: the generated inputs did not reproduce the finding" in open(r.script).read()
    assert not r.defect


def test_a_sessions_records_are_bounded(tmp_path, monkeypatch, caplog):
    # two call sites of 8 KB of inputs each, 12 KB for the session: the second record keeps
    # its inputs' statistics only (here they do not reproduce, and the record says so)
    monkeypatch.setattr(repro_record, "SESSION_LIMIT", 12 << 10)
    x = 1e4 + torch.randn(1000, generator=gen()) * 100
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with caplog.at_level(logging.INFO, logger="probekit"):
        with fb:
            torch.add(x + 0.01, -x)
            torch.add(x + 0.02, -x)
    assert fb.results["api_name"].tolist() == ["Torch.add.0.forward", "Torch.add.1.forward"]
    first, second = (repro_record.load(repro_record.record_path(str(tmp_path), n, 0))
                     for n in fb.results["api_name"])
    assert first.nbytes == 8000 + 4000 and first.meta["generated_check"] is None   # + output
    assert second.nbytes == 0 and second.meta["generated_check"]["reproduced"] is False
    assert "fallback" not in second.meta["generated_check"]
    assert sum("repro records of this session reached 0.0117188 MiB" in r.getMessage()
               for r in caplog.records) == 1
    assert sorted(os.listdir(tmp_path / "repro" / "records")) == [
        "Torch.add.0.forward.rank0.pt", "Torch.add.1.forward.rank0.pt"]     # nothing partial


# -- the zoo's real bugs (tests/_real_bugs.py: the first eleven of the real-bug zoo) -------------
ZOO = REAL_BUGS[:11]


def test_zoo_findings_reproduce_in_a_fresh_process(tmp_path):
    scripts = {}
    for name, mode, options, fn, why in ZOO:
        fb = FreeBench(dump_path=str(tmp_path / name), pert_mode=mode, **options)
        with fb:
            fn()
        df = fb.results
        if name == "batch_norm_constant_channels" and not batch_norm_kernel_is_wrong():
            assert df.empty      # this CPU kernel path computes it right: nothing to report
            continue
        # the weight and bias gradients; the all-fp16 kernel's input gradient too (it keeps
        # its mean and rstd in fp16), the mixed-type kernel of autocast keeps them in fp32
        assert len(df) == {"fp16_layer_norm_backward": 3, "autocast_layer_norm_backward": 2}.get(
            name, 1), (name, df)
        assert set(df["cause"]) == {why}, (name, df)
        r = fb.repro(0)
        assert {v["verdict"] for v in r.results.values()} == {why}, (name, r.results)
        scripts[name] = r
    assert len([n for n, *_ in ZOO if n in scripts]) >= 9
    text = open(scripts["autocast_layer_norm_backward"].script).read()
    assert "device: cpu; autocast: bfloat16" in text and "'autocast': 'bfloat16'" in text
    assert "x0.index_add_(0, x2, x3)" in open(scripts["index_add_inplace_fp16"].script).read()
    assert "x1: the same tensor as x0" in open(scripts["cdist_self"].script).read()
    assert "x0.exp_()" in open(scripts["exp_inplace_bf16_backward"].script).read()
    ran = fresh(*(r.script for r in scripts.values()))
    for name, r in scripts.items():
        code, out = ran[r.script]
        assert code == 1, (name, out)
        assert result_line(out) == {i: {k: pytest.approx(v) if isinstance(v, float) else v
                                        for k, v in res.items()}
                                    for i, res in r.results.items()}, name


def test_healthy_calls_forced_report_no_defect(tmp_path):
    g = gen()
    x, w, b = torch.randn(64, 256, generator=g), torch.randn(256, 256, generator=g) / 16, \
        torch.randn(256, generator=g)
    fwd = repro.of_call(F.linear, x, w, b, out=tmp_path / "linear")
    xs = (torch.randn(32, 64, generator=g) * 3 + 1).requires_grad_()
    ws = (torch.rand(64, generator=g) + 0.5).requires_grad_()
    bwd = repro.of_call(F.layer_norm, xs, (64,), ws, out=tmp_path / "ln", stage="backward",
                        grad=torch.randn(32, 64, generator=g))
    assert not fwd.defect and not bwd.defect
    assert set(bwd.results) == {0, 2}            # the input's and the weight's gradients
    ran = fresh(fwd.script, bwd.script)
    for r in (fwd, bwd):
        code, out = ran[r.script]
        assert code == 0, out
        assert "no defect: every judged result is within" in out
        assert all(v["accuracy"] <= 1 for v in result_line(out).values())
    assert "shows no defect with these inputs" in open(os.path.join(fwd.path, "REPORT.md")).read()


def test_random_call_replays_its_mask(tmp_path):
    # a threshold below any rounding makes a dropout a finding (the analysis scales its level
    # alike): its script must draw the mask the training drew
    x = torch.randn(64, 32, generator=gen())
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", thresholds={"float32": 1e-12})
    torch.manual_seed(3)
    with fb:
        F.dropout(x, 0.5, training=True)
    after = torch.get_rng_state()
    r = fb.repro(0)
    assert torch.equal(torch.get_rng_state(), after)     # fb.repro leaves the stream alone
    rec = repro_record.load(repro_record.record_path(str(tmp_path),
                                                     "Functional.dropout.0.forward", 0))
    assert rec.meta["rng"] is True and rec.tensors["rng"].dtype == torch.uint8
    (code, out), = fresh(r.script).values()
    assert code == 1 and result_line(out)[0]["vs_recorded"] == 0.0, out


@torch.library.custom_op("probekit_repro_test::bf16_sum", mutates_args=())
def bf16_sum(x: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for i in range(x.shape[-1]):
        acc = acc + x[..., i]
    return acc


@bf16_sum.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


def test_a_custom_op_has_no_record_and_says_why(tmp_path, caplog):
    x = torch.rand(4, 2048, generator=gen()).to(bf16)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision")
    with caplog.at_level(logging.INFO, logger="probekit"):
        with fb:
            torch.ops.probekit_repro_test.bf16_sum(x)
    assert fb.results["cause"].tolist() == ["inaccurate"]
    assert any("no repro record for Torch.bf16_sum.0.forward (ReproError" in r.getMessage()
               and "not a torch API" in r.getMessage() for r in caplog.records)
    with pytest.raises(ReproError, match=r"no repro record for Torch\.bf16_sum\.0\.forward "
                                         r"\(rank 0\)"):
        fb.repro(0)


# -- the command line, the paths ---------------------------------------------------------------------
def test_cli_writes_the_folder_from_the_dump_alone(ln, tmp_path, capsys):
    fb, _ = ln
    dump = fb.config.dump_path
    out = tmp_path / "cli"
    assert main(["freebench", "repro", dump, "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"repro of Functional.layer_norm.0.backward (rank 0) in {out}")
    assert f"run: python {out / 'repro.py'}" in printed
    assert sorted(os.listdir(out)) == ["REPORT.md", "inputs.pt", "repro.py"]
    assert main(["freebench", "report", dump]) == 0
    assert (f"repro (a script needing only torch): probekit freebench repro {dump} "
            "Functional.layer_norm.0.backward") in capsys.readouterr().out
    assert main(["freebench", "repro", dump, "7"]) == 2
    assert "row: 7 is not valid; accepted: 0 to 2" in capsys.readouterr().err
    assert main(["freebench", "repro", dump, "Torch.nope.0.forward"]) == 2
    assert ("row: 'Torch.nope.0.forward' is not valid; accepted: an api_name of the findings "
            "(Functional.layer_norm.0.backward)") in capsys.readouterr().err


def test_file_names_come_from_safe_name_and_stay_in_the_dump(tmp_path):
    evil = "../../../tmp/x/../Torch.add.0.forward"
    path = repro_record.record_path(str(tmp_path), evil, 0)
    assert os.path.dirname(path) == os.path.join(os.path.realpath(tmp_path), "repro", "records")
    assert os.path.basename(path) == "_.._.._tmp_x_.._Torch.add.0.forward.rank0.pt"
    folder = repro.default_folder(str(tmp_path), {"api_name": evil, "rank": 0})
    assert os.path.dirname(folder) == os.path.join(os.path.realpath(tmp_path), "repro")
    with pytest.raises(ReproError, match="no repro record"):
        repro.for_row(str(tmp_path), {"api_name": evil, "rank": 0})
    assert sorted(os.listdir(tmp_path)) == []


# -- the script's code is probekit's -------------------------------------------------------------------
def test_helpers_need_only_torch_and_are_what_the_script_runs():
    from probekit.freebench.repro import script as repro_script

    src = repro_script.helpers_source()
    mods = {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import)
            for a in n.names} | {n.module for n in ast.walk(ast.parse(src))
                                 if isinstance(n, ast.ImportFrom)}
    assert mods == {"contextlib", "math", "torch"}
    assert src in open(repro_helpers.__file__).read()


@pytest.mark.parametrize("dtype", [bf16, fp16, torch.float32, torch.float64])
def test_nudges_are_perturbs_bit_for_bit(dtype):
    info = torch.finfo(dtype)
    x = torch.cat([torch.randn(500, generator=gen()) * 10, torch.tensor(
        [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 2, info.max, -info.max, math.inf,
         -math.inf, math.nan])]).to(dtype)
    for mine, theirs in ((repro_helpers.add_noise, perturb.add_noise),
                         (repro_helpers.flip_last_bit, perturb.flip_last_bit)):
        a, b = mine(x), theirs(x)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    leaves = [x, 3, x * 2]
    for noise, first in cause.NUDGES:
        mine = repro_helpers.nudged(leaves, {perturb.add_noise: repro_helpers.add_noise,
                                             perturb.flip_last_bit: repro_helpers.flip_last_bit}
                                    [noise], first)
        theirs = cause.nudged(leaves, noise, first)
        assert all((torch.equal(m.view(torch.uint8), t.view(torch.uint8))
                    if isinstance(m, torch.Tensor) else m == t) for m, t in zip(mine, theirs))


def test_measures_are_causes():
    g = gen()
    r = torch.randn(100, generator=g, dtype=torch.float64)
    o = (r + torch.randn(100, generator=g, dtype=torch.float64) * 1e-3).float()
    o[3], r[4], o[4], o[5] = math.nan, math.nan, math.nan, 0.0
    b = r.abs() * 1e-3 + 1e-4
    assert repro_helpers.ratio(o, r, b) == cause.ratio(o, r, b)
    o[6] = math.inf
    assert repro_helpers.ratio(o, r, b) == cause.ratio(o, r, b) == math.inf
    case = {"blame": cause.BLAME_FACTOR}
    for acc in (0.5, 1.5, 5.0):
        for moved in (0.0, 0.9, 1.5, 3.0):
            for lost in (0.0, 0.01, 0.1):
                for upcast in (True, False):
                    for error, stat in itertools.product(
                            (0.0, 0.01, 0.1, math.inf),     # the result's own lost bits
                            (0.5, 2.0, math.inf)):          # left by the saved statistics
                        bound = {"lost_level": math.sqrt(2.0 ** -8), "upcast": upcast}
                        mine = repro_helpers.verdict(acc, moved, lost, bound, case, error,
                                                     stat)
                        theirs = cause.verdict(acc, moved, lost, 2.0 ** -8, upcast, error,
                                               stat)
                        assert mine == (str(theirs) + (" (mild)" if getattr(theirs, "mild",
                                                                            False) else ""))
    for m, scale, want in ((0.0, 0.0, 0.0), (1.0, 0.0, math.inf), (1.0, 4.0, 0.25)):
        assert repro_helpers.relative_error({"max_error": m, "scale": scale}) == want
    out = (torch.ones(2), torch.tensor([1, 2]), [torch.zeros(3), 4.0])
    from probekit.freebench.judge import handlers
    assert list(repro_helpers.float_outputs(out)) == [i for i, _ in handlers.float_outputs(out)]


def test_generated_inputs_keep_layout_and_statistics():
    g = gen()
    cases = {
        "transposed": torch.randn(64, 32, generator=g).t(),
        "expanded": torch.randn(1, 512, generator=g).expand(8, 512),
        "sliced": torch.randn(20, 10, generator=g)[:, ::2],
        "indices": torch.randint(3, 9, (1000,), generator=g),
        "mask": torch.rand(100, generator=g) > 0.7,
        "shifted_bf16": (torch.randn(2000, generator=g) * 2 + 1000).to(bf16),
        "with_nan": torch.where(torch.rand(1000, generator=g) < 0.1, math.nan,
                                torch.rand(1000, generator=g)),
    }
    for name, t in cases.items():
        spec = dict(repro_record.value_stats(t), shape=list(t.shape), stride=list(t.stride()),
                    dtype=str(t.dtype).replace("torch.", ""), span=repro_record.span(t), seed=7)
        base = repro_helpers.generate(spec)
        y = repro_helpers.layout(base, spec["shape"], spec["stride"])
        assert (y.shape, y.stride(), y.dtype) == (t.shape, t.stride(), t.dtype), name
        torch.testing.assert_close(repro_helpers.generate(spec), base, rtol=0, atol=0,
                                   equal_nan=True)                      # seeded: the same draw
        if t.dtype == torch.bool:
            assert abs(y.float().mean() - t.float().mean()) < 0.1
        elif not t.is_floating_point():
            assert int(y.min()) >= 3 and int(y.max()) <= 8
        else:
            ok, yk = t[t.isfinite()].double(), y[y.isfinite()].double()
            assert abs(yk.mean() - ok.mean()) < 0.1 * ok.std() + 1e-3, name
            assert abs(yk.std() - ok.std()) < 0.15 * ok.std() + 1e-3, name
            assert abs(y.isnan().double().mean() - t.isnan().double().mean()) < 0.05, name
    assert cases["expanded"].stride()[0] == 0


def test_repro_inside_the_block_is_invisible_to_the_probe(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        torch.add(torch.tensor([1e4 + 0.01]), torch.tensor([-1e4]))
        before = dict(fb.summary)
        assert fb.repro(0).defect
        assert dict(fb.summary) == before
