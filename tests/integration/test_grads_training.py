"""Record real training runs, reopen them, compare them, and use every entry point."""
import csv
import json
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import xarray as xr

import probekit
from probekit import PrecisionDebugger
from probekit.grads.store.export import write_grad_dump
from probekit.grads.store.msprobe import read_grad_dump
from probekit.grads import GradComparator, GradProbe, compare_grads, open_grads

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _train import make_model, train  # noqa: E402

PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias", "4.weight", "4.bias"]


def record(path, lr=0.1, steps=20, **kw):
    model = make_model()
    with GradProbe(model, dump_path=str(path), **kw) as probe:
        losses = train(model, steps=steps, lr=lr)
    return probe, losses


def test_recording_does_not_change_training(tmp_path):
    plain = train(make_model(), steps=10)
    _, probed = record(tmp_path, steps=10, grad_level="L2")
    assert probed == plain


def test_record_reopen_exact_stats(tmp_path):
    model = make_model()
    grads = []

    def keep(step):
        pass

    opt_grads = {}

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            opt_grads[len(opt_grads)] = [p.grad.clone() for p in model.parameters()]
            return super().step(closure)

    with GradProbe(model, optimizer=None, grad_level="L2", dump_path=str(tmp_path)):
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
        opt = Spy(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    ds = open_grads(tmp_path)
    assert ds["param"].values.tolist() == PARAMS
    assert ds["step"].values.tolist() == [0, 1, 2]
    for s in range(3):
        for j, g in enumerate(opt_grads[s]):
            ref = g.double().numpy()
            assert ds["max"].values[s, j] == ref.max()
            assert ds["min"].values[s, j] == ref.min()
            assert ds["norm"].values[s, j] == pytest.approx(np.sqrt((ref ** 2).sum()), rel=1e-7)
            assert ds["zeros"].values[s, j] == np.mean(ref == 0)
            packed = np.packbits(ref.reshape(-1) > 0)
            off = ds["offset"].values[j]
            assert ds["direction"].values[s, off:off + packed.size].tolist() == packed.tolist()
    del grads, keep


def test_two_runs_find_the_divergence(tmp_path):
    record(tmp_path / "a", lr=0.1)
    record(tmp_path / "b", lr=0.1)
    record(tmp_path / "c", lr=0.6)
    same = compare_grads(tmp_path / "a", tmp_path / "b")
    assert np.all(same["similarity"].values == 1.0)
    assert not same["flag"].values.any() and same["first_step"].item() == -1
    diff = compare_grads(tmp_path / "a", tmp_path / "c").sel(rank=0)
    sim = diff["similarity"].values
    assert np.all(sim[0] == 1.0)  # step 0: same weights, same gradients
    assert diff["first_step"].item() == 1
    assert diff["flag"].values[1].any()
    # the first flagged param is the one with the lowest similarity at step 1
    flagged = diff["flag"].values[1]
    expected = PARAMS[int(np.argmin(np.where(flagged, sim[1], np.inf)))]
    assert diff["first_param"].item() == expected
    assert diff["total"].values[-1] < 0.97


def test_filters_steps_params_and_hooks_removed(tmp_path):
    model = make_model()
    probe = GradProbe(model, grad_level="L1", step=[0, 3, 5], param_list=["0.weight", "4.bias"],
                      dump_path=str(tmp_path)).start()
    train(model, steps=4)
    probe.stop()
    train(model, steps=3)  # after stop: nothing recorded, not even counted
    assert probe.steps_seen == 4
    ds = open_grads(tmp_path)
    assert ds["step"].values.tolist() == [0, 3]
    assert ds["param"].values.tolist() == ["0.weight", "4.bias"]
    assert ds["numel"].values.tolist() == [512, 4]


def test_old_keyword_spellings_warn_and_still_work(tmp_path):
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = GradProbe(model, level="L2", steps=(0, 2), ranks=[0], dump_path=str(tmp_path))
    assert [(w.category, str(w.message).split(";")[0]) for w in caught] == [
        (DeprecationWarning, f"GradProbe({k}=...) is deprecated") for k in ("level", "steps",
                                                                            "ranks")]
    new = GradProbe(model, grad_level="L2", step=[0, 2], rank=[0], dump_path=str(tmp_path))
    assert old.config == new.config
    assert (new.config.grad_probe.grad_level, new.config.step, new.config.rank) == \
        ("L2", (0, 2), (0,))
    with pytest.raises(TypeError, match="steps= and step= were both given"), \
            pytest.warns(DeprecationWarning):
        GradProbe(model, steps=[1], step=[1], dump_path=str(tmp_path))
    cfg = probekit.make_config("grad_probe", dump_path=str(tmp_path), grad_level="L0")
    assert GradProbe(model, config=cfg, bounds=[0]).config == cfg.replace(bounds=[0])


def test_unknown_param_named(tmp_path):
    with pytest.raises(probekit.ConfigError, match=r"param_list: \['nope'\] not found"):
        GradProbe(make_model(), param_list=["nope"], dump_path=str(tmp_path))


def test_only_the_owning_optimizer_counts(tmp_path):
    model, other = make_model(), torch.nn.Linear(3, 3)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with GradProbe(model, dump_path=str(tmp_path)) as probe:
        for _ in range(3):
            other(torch.ones(1, 3)).sum().backward()
            other_opt.step()
        train(model, steps=2)
    assert probe.steps_seen == 2
    assert open_grads(tmp_path)["step"].values.tolist() == [0, 1]


def test_main_grad_is_preferred(tmp_path):
    model = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradProbe(model, optimizer=opt, grad_level="L1", dump_path=str(tmp_path)):
        model.weight.grad = torch.tensor([[1.0, 1.0]])
        model.weight.main_grad = torch.tensor([[-3.0, 2.0]])
        opt.step()
    ds = open_grads(tmp_path)
    assert ds["max"].values.tolist() == [[2.0]] and ds["min"].values.tolist() == [[-3.0]]


def test_params_without_grad_are_logged_and_absent(tmp_path, caplog):
    model = make_model()
    model[4].bias.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="probekit"):
        with GradProbe(model, dump_path=str(tmp_path)):
            model(torch.ones(2, 16)).sum().backward()
            model[4].bias.grad = None
            opt.step()
    assert "[probekit] grad_probe: 4.bias has no gradient at step 0" in caplog.text
    ds = open_grads(tmp_path)
    assert ds["present"].values[0].tolist() == [True] * 7 + [False]


def test_precision_debugger_grad_probe_flow(tmp_path, msprobe_config_dict, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    msprobe_config_dict.update(task="grad_probe", dump_path=str(tmp_path), step=[1, 2])
    msprobe_config_dict["grad_probe"].update(grad_level="L2", bounds=[-0.01, 0, 0.01])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(msprobe_config_dict))
    debugger = PrecisionDebugger(config_path=str(path))
    model = make_model()
    debugger.monitor(model)
    train(model, steps=4)
    debugger.stop()
    ds = debugger.results
    assert ds["step"].values.tolist() == [1, 2]
    assert ds["interval"].values.tolist() == ["(-inf, -0.01]", "(-0.01, 0]", "(0, 0.01]",
                                              "(0.01, inf)"]
    assert np.allclose(ds["dist"].sum("interval").values, 1.0)
    debugger.close()


def test_rank_filter(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    model = make_model()
    with GradProbe(model, rank=[0], dump_path=str(tmp_path)) as probe:
        train(model, steps=2)
    assert not os.path.exists(tmp_path / "grads.zarr")
    assert probe.steps_seen == 0 and not probe.has_store


def test_compare_distributed_layout_and_csv(tmp_path):
    record(tmp_path / "a", lr=0.1, steps=6)
    record(tmp_path / "b", lr=0.6, steps=6)
    result = GradComparator.compare_distributed(str(tmp_path / "a"), str(tmp_path / "b"),
                                                str(tmp_path / "out"))
    rank_dir = tmp_path / "out" / "rank0"
    with open(rank_dir / "similarities.csv", encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "0", "1", "2", "3", "4", "5"]
    assert [r[0] for r in rows[1:]] == PARAMS + ["summary"]
    sim = result["similarity"].sel(rank=0).values
    assert [float(x) for x in rows[1][1:]] == sim[:, 0].tolist()
    assert [float(x) for x in rows[-1][1:]] == result["total"].sel(rank=0).values.tolist()
    pics = sorted(os.listdir(rank_dir / "similarities_picture"))
    assert pics == sorted([f"{p}_similarities.png" for p in PARAMS] + ["summary_similarities.png"])
    assert (rank_dir / "similarities_picture" / "summary_similarities.png").stat().st_size > 5000


def test_msprobe_layout_round_trip(tmp_path):
    for level in ("L0", "L1", "L2"):
        record(tmp_path / level, steps=3, grad_level=level, bounds=(-0.5, 0, 0.5))
        ours = open_grads(tmp_path / level)
        files = write_grad_dump(str(tmp_path / level), str(tmp_path / f"ms{level}"))
        assert os.path.join(str(tmp_path / f"ms{level}"), "rank0", "grad_summary_0.csv") in files
        back = read_grad_dump(str(tmp_path / f"ms{level}"), 0)
        for name in ("max", "min", "norm", "present", "direction", "dist", "zeros", "hash"):
            if name in ours:
                assert np.array_equal(back[name].values, ours[name].values), (level, name)
        assert back["shape"].values.tolist() == ours["shape"].values.tolist()
        assert back.attrs["level"] == level
    raw = (tmp_path / "msL2" / "rank0" / "grad_summary_0.csv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf") and b"\r\n" in raw
    header = raw[3:].split(b"\r\n")[0].decode()
    assert header == ('param_name,"(-inf, -0.5]","(-0.5, 0]","(0, 0.5]","(0.5, inf)",=0,'
                      "max,min,norm,shape")
    arr = np.load(tmp_path / "msL1" / "rank0" / "step2" / "0.weight.npy")
    assert arr.dtype == bool and arr.shape == (32, 16)


def test_mixed_formats_compare(tmp_path):
    record(tmp_path / "a", steps=4)
    record(tmp_path / "b", steps=4, lr=0.6)
    write_grad_dump(str(tmp_path / "b"), str(tmp_path / "ms_b"))
    native = compare_grads(tmp_path / "a", tmp_path / "b")
    mixed = compare_grads(tmp_path / "a", tmp_path / "ms_b")
    xr.testing.assert_equal(native["similarity"], mixed["similarity"])


def test_cli_grads(tmp_path):
    record(tmp_path / "a", steps=4)
    record(tmp_path / "b", steps=4, lr=0.6)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = lambda *a: subprocess.run([sys.executable, "-m", "probekit.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, env=env)
    out = run("grads", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "-o",
              str(tmp_path / "cmp"))
    assert out.returncode == 0, out.stderr
    assert "rank 0: 4 steps x 8 params compared" in out.stdout
    assert "rank 0: first flagged at step 1" in out.stdout
    assert os.listdir(tmp_path / "cmp" / "rank0" / "similarities_picture") == [
        "summary_similarities.png"]
    out = run("grads", "summary", str(tmp_path / "a"))
    assert out.stdout.startswith("rank 0: level L1, 8 params (1,796 elements), 4 steps (0..3)")
    out = run("grads", "export", str(tmp_path / "a"), "--to", "msprobe", str(tmp_path / "ms"))
    assert out.returncode == 0 and "wrote 36 files" in out.stdout
    out = run("grads", "compare", str(tmp_path / "nothing"), str(tmp_path / "b"), "-o",
              str(tmp_path / "x"))
    assert out.returncode == 2 and "is not a folder" in out.stderr


def test_stop_leaves_no_probekit_thread(tmp_path, monkeypatch):
    import threading

    from probekit.grads.numerics import stats

    monkeypatch.setattr(stats, "_PARALLEL_MIN", 0)   # split every step over the probe's pool
    model = make_model()
    with GradProbe(model, grad_level="L2", dump_path=str(tmp_path), flush_seconds=3600):
        train(model, steps=2)
        assert any(t.name.startswith("probekit-grads") for t in threading.enumerate()) or \
            torch.get_num_threads() == 1
    assert not [t.name for t in threading.enumerate() if t.name.startswith("probekit-grads")]
