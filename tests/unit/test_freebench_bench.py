"""FreeBench: configuration forms, filters (scope, list, step, rank), fix, error isolation,
logging, hook/mode removal."""
import json
import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import probekit
from probekit.config import ConfigError, FreeBenchmarkConfig, make_config
from probekit.freebench import FreeBench
from probekit.freebench.perturb import perturb
from probekit.freebench.session.bench import open_session

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_freebench_overhead import Bare as CallThrough, python_calls  # noqa: E402


A, B = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])


def cancellation():
    """One fp32 add that bit_noise always flags (catastrophic cancellation)."""
    return A + B


def mode_stack_depth():
    return torch._C._len_torch_function_stack()


# -- configuration ------------------------------------------------------------------------------
def test_config_forms(tmp_path):
    d = str(tmp_path)
    assert FreeBench(dump_path=d, pert_mode="bit_noise").config.free_benchmark.pert_mode == \
        "bit_noise"
    cfg = make_config("free_benchmark", dump_path=d, pert_mode="add_noise")
    assert FreeBench(cfg).config == cfg
    assert FreeBench(cfg, list=["relu"]).config.free_benchmark.api_list == ("relu",)
    fbc = FreeBenchmarkConfig(pert_mode="no_change")
    assert FreeBench(fbc, dump_path=d).config.free_benchmark == fbc
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "free_benchmark", "dump_path": d,
                                "free_benchmark": {"pert_mode": "change_value"}}))
    fb = FreeBench(str(path), handler_type="check")
    assert fb.config.free_benchmark.pert_mode == "change_value" and fb.config.dump_path == d
    # a config written for the grad probe: its common keys and its free_benchmark section apply
    other = make_config("grad_probe", dump_path=d, rank=[0], grad_level="L2")
    switched = FreeBench(other).config
    assert (switched.task, switched.dump_path, switched.rank) == ("free_benchmark", d, (0,))
    assert switched.free_benchmark == FreeBenchmarkConfig()
    with pytest.raises(ConfigError):
        FreeBench(dump_path=d, pert_mode="to_cpu")            # needs fuzz_device cpu
    with pytest.raises(ConfigError):
        FreeBench(42)
    assert isinstance(open_session(cfg), FreeBench)
    assert probekit.FreeBench is FreeBench


# -- filters ------------------------------------------------------------------------------------
def test_scope_selects_exact_calls(tmp_path):
    x = torch.randn(4, 4)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change",
                   scope=["Torch.matmul.1.forward", "Tensor.sum.0"])
    with fb:
        for _ in range(3):
            torch.matmul(x, x)
        x.sum(), x.sum(), F.relu(x)
    assert fb.summary["checked"] == 2
    assert fb.summary["skipped"] == {"out_of_scope": 4}
    assert fb.api_counts == {"Torch.matmul": 3, "Tensor.sum": 2}   # only scoped APIs counted


def test_list_selects_by_substring(tmp_path):
    x = torch.randn(4, 4)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change", list=["relu"])
    with fb:
        F.relu(x), torch.relu(x), x.relu(), torch.matmul(x, x), F.gelu(x)
    assert fb.summary["checked"] == 3
    assert fb.summary["skipped"] == {"out_of_scope": 2}


def test_out_of_scope_calls_cost_one_lookup(tmp_path):
    """Issue 38: an API none of whose names is in scope, once seen, costs the mode one dict
    lookup more than a mode that only calls through; an operator (``x + y``, named from the
    calling instruction) and a property read too. The counts stay what they were, and a step the
    step filter excludes counts its calls there."""
    x, y = torch.randn(4), torch.randn(4)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change",
                   scope=["Torch.matmul.0.forward"], step=[1])
    calls = [lambda: x.add(y), lambda: x + y, lambda: torch.add(x, y, alpha=2),
             lambda: F.relu(x), lambda: x.shape]
    with CallThrough():
        bare = [python_calls(f) for f in calls]
    with fb:
        for f in calls:
            f()
    fb.step()
    with fb:
        torch.matmul(x, x)
        for f in calls:
            f()
        probed = [python_calls(f) for f in calls]
    assert [p - q for p, q in zip(probed, bare)] == [1, 1, 1, 1, 1], (bare, probed)
    s = fb.summary
    # property reads are not calls; step 0, which the step filter excludes, intercepts nothing
    assert (s["calls"], s["checked"], s["steps_filtered"]) == (9, 1, 1)
    assert s["skipped"] == {"out_of_scope": 8}


def test_calls_skipped_before_the_decision_cost_a_few_python_calls(tmp_path):
    """Issue 38: a call skipped for a reason known before the decision's work (a view, a call
    site the budget leaves to a later step) costs at most 12 Python calls beyond a mode that only
    calls through (before: 24 and 38), and is counted as before."""
    x = torch.randn(8, 8)
    calls = [lambda: x.t(), lambda: torch.tanh(x)]
    with CallThrough():
        bare = [python_calls(f) for f in calls]
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", budget=1e-6)
    for _ in range(3):          # calibration, a reference step, a step with one check
        with fb:
            for _ in range(4):
                torch.exp(x), x.t(), torch.tanh(x)
        fb.step()
    # so small a budget then probes one step in 2^12, with one check
    assert (fb.summary["budget_limit"], fb.summary["budget_every"]) == (1, 4096)
    for _ in range(3, 4096):    # quiet and reference steps up to the next probed one
        fb.step()
    assert fb.summary["budget_steps"] == {"probed": 2, "quiet": 4096 - 2 - 410,
                                          "reference": 410}
    with fb:
        torch.exp(x), x.t(), torch.tanh(x)           # the window's one check: exp or tanh
        torch.exp(x), x.t()
        got = [python_calls(f) for f in calls]       # the fourth view, tanh's second site
    extra = [g - b for g, b in zip(got, bare)]
    assert all(0 < e <= 12 for e in extra), (bare, got)
    s = fb.summary
    assert s["skipped"] == {"view": 11, "budget": s["float_calls"] - 11 - s["checked"]}
    assert s["checked"] == 8 + 1 + 1 and s["float_calls"] == 31


def test_budget_reference_steps_intercept_nothing_and_the_summary_says_the_cost(tmp_path):
    """Issue 38: with a budget, step 1 and every tenth step after it run with nothing
    intercepted (the plain step's time), and so do the quiet steps (``step % every != 0``,
    ``every`` what the summary says before the step); the summary then says what the probe
    cost, end to end."""
    x = torch.randn(8, 8)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", budget=0.5)
    depth = mode_stack_depth()
    seen, probed = [], []
    for step in range(13):
        probed.append(step % 10 != 1 and step % fb.summary["budget_every"] == 0)
        before = fb.summary["calls"]
        with fb:
            assert fb.active and mode_stack_depth() == depth + probed[-1]
            torch.exp(x), torch.tanh(x)
        seen.append(fb.summary["calls"] - before)
        fb.step()
    assert seen == [2 * p for p in probed] and not probed[1] and not probed[11]
    s = fb.summary
    assert s["budget_steps"] == {"probed": sum(probed), "reference": 2,
                                 "quiet": 13 - 2 - sum(probed)}
    assert s["budget_cost"] is not None and s["budget_cost"] > -1.0
    assert f"budget: {100 * s['budget_cost']:.0f} % over the plain step" in str(s)
    cov = fb.coverage
    assert cov["calls"].tolist() == [sum(probed)] * 2 and (cov["checked"] >= 1).all()
    # a session left running across step() (start() once): the reference step still
    # intercepts nothing, the next one intercepts again
    fb2 = FreeBench(dump_path=str(tmp_path / "running"), pert_mode="bit_noise", budget=0.5)
    fb2.start()
    try:
        stack = []
        for step in range(4):
            stack.append(mode_stack_depth() - depth)
            torch.exp(x)
            fb2.step()
    finally:
        fb2.stop()
    # (no time passes outside the session here: steps 2 and 3 are probed or quiet as measured)
    assert stack[:2] == [1, 0] and fb2.summary["calls"] == 1 + sum(stack[2:])
    assert sum(stack[2:]) == fb2.summary["budget_steps"]["probed"] - 1


def test_budget_quiet_steps_rotate_the_modes_of_combined(tmp_path):
    """Issue 38: ``combined`` under a budget takes its modes in turn over the probed steps, so
    a budget that probes one step in 4096 still runs both (by the step's parity it would run
    improve_precision only)."""
    x = torch.randn(8, 8)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="combined", budget=1e-6)
    modes = {}
    for step in range(3 * 4096 + 1):
        if step % 10 != 1 and step % fb.summary["budget_every"] == 0:
            with fb:
                modes[step] = fb._engine.mode_name
                torch.exp(x)
        elif step == 1:         # the reference step: the plain step's time
            with fb:
                torch.exp(x)
        fb.step()
    # step 2 measures the interception (step 0's figure holds one-time work), then 1 in 4096
    assert list(modes) == [0, 2, 4096, 8192, 12288]
    assert list(modes.values()) == ["improve_precision", "bit_noise"] * 2 + ["improve_precision"]


def test_budget_reference_steps_follow_the_optimizer_in_a_plain_loop(tmp_path):
    """Issues 34 and 38 together: a ``with fb:`` loop that calls ``optimizer.step()`` and never
    ``fb.step()`` still ends its steps during a reference or quiet step (nothing intercepted
    there, the optimizer's hooks kept), and intercepts again after it; the dump's run closes
    cleanly."""
    x = torch.randn(8, 8)
    w = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([w], lr=0.0)
    depth = mode_stack_depth()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", budget=0.5)
    stack, probed = [], []
    with fb:
        for step in range(13):
            probed.append(int(step % 10 != 1 and step % fb.summary["budget_every"] == 0))
            stack.append(mode_stack_depth() - depth)
            (torch.exp(x).sum() * w).backward()
            opt.step()
    assert stack == probed and not probed[1] and not probed[11] and probed[0]
    s = fb.summary
    assert s["steps"] == 13 and s["budget_cost"] is not None
    assert mode_stack_depth() == depth and not fb.active
    fb2 = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")   # replaces: it closed
    with fb2:
        torch.exp(x)
    assert fb2.summary["calls"] == 1


def test_step_filter(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", step=[1, 3])
    for _ in range(4):
        with fb:
            cancellation()
        fb.step()
    assert fb.results["step"].tolist() == [1, 3]
    s = fb.summary
    # the excluded steps intercept nothing (no mode on the stack): their calls are not seen
    assert (s["calls"], s["checked"], s["steps"], s["steps_filtered"]) == (2, 2, 4, 2)
    assert s["skipped"] == {}
    assert str(s).endswith("· 4 steps (2 left out by the step filter)")


def test_a_step_the_filter_excludes_intercepts_nothing(tmp_path):
    """No mode on the stack in an excluded step; one again in a selected step, also where the
    optimizer ends the step inside the block (the session switches at the boundary)."""
    depth = torch._C._len_torch_function_stack
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.SGD([w], lr=0.1)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", step=[1, 2])
    seen = []
    with fb:
        for _ in range(4):     # steps follow the optimizer: 0, 1, 2, 3
            seen.append(depth())
            (w @ w).sum().backward()
            opt.step()
            opt.zero_grad()
    fb.close()
    assert seen == [0, 1, 1, 0]
    s = fb.summary
    assert (s["steps"], s["steps_filtered"], s["checked"]) == (4, 2, 4)


def test_rank_filter(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", rank=[0])
    depth = mode_stack_depth()
    with fb:
        assert mode_stack_depth() == depth and not fb.active
        cancellation()
    assert fb.summary["calls"] == 0 and fb.results.empty
    # a process's rank is read once (dist.RankCache); the launcher's RANK of another process:
    monkeypatch.setenv("RANK", "0")
    fb = FreeBench(dump_path=str(tmp_path / "r0"), pert_mode="bit_noise", rank=[0])
    with fb:
        cancellation()
    assert len(fb.results) == 1 and fb.results["rank"].tolist() == [0]


def test_thresholds_configurable(tmp_path):
    x = torch.tensor([1e4 + 0.01])
    loose = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise",
                      thresholds={"float32": 0.5})
    with loose:
        x + torch.tensor([-1e4])
    assert loose.results.empty and loose.summary["checked"] == 1


# -- fix ----------------------------------------------------------------------------------------
def test_fix_returns_upcast_result_cast_back(tmp_path):
    a = torch.tensor([256.0, 1.0], dtype=torch.bfloat16, requires_grad=True)
    b = torch.tensor([1.0, 2.0 ** -9], dtype=torch.bfloat16)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", handler_type="fix")
    with fb:
        y = torch.mul(a, 1.0078125)          # bf16: 258.0 rounds to 258, 1.0078125 exact
        z = torch.add(a, b)                  # 257 -> 256 in bf16, computed in fp32 then rounded
    assert y.dtype == z.dtype == torch.bfloat16
    assert z.tolist() == (a.float() + b.float()).to(torch.bfloat16).tolist()
    assert z.grad_fn is not None             # autograd flows through the upcast computation
    z.sum().backward()
    assert a.grad.tolist() == [1.0, 1.0]
    assert fb.summary["checked"] == 2 and fb.results.empty


def test_fix_fp32_computes_in_fp64(tmp_path):
    x = torch.tensor([1e8, 1.0, -1e8])
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="improve_precision", handler_type="fix")
    with fb:
        s = torch.cumsum(x, 0)
    assert s.dtype == torch.float32
    assert s.tolist() == torch.cumsum(x.double(), 0).float().tolist()


def test_fix_to_cpu(tmp_path):
    x = torch.randn(8, dtype=torch.float16)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="to_cpu", fuzz_device="cpu",
                   handler_type="fix")
    with fb:
        y = torch.exp(x)
    assert y.dtype == torch.float16 and y.device == x.device
    assert torch.equal(y, torch.exp(x.float()).half())


# -- isolation ----------------------------------------------------------------------------------
def test_exceptions_are_logged_and_never_disable_later_checks(tmp_path, monkeypatch, caplog):
    real = perturb.PERTURBATIONS["bit_noise"]
    calls = {"n": 0}

    def flaky(call, leaves):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(call, leaves)

    monkeypatch.setitem(perturb.PERTURBATIONS, "bit_noise", flaky)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with caplog.at_level(logging.WARNING, logger="probekit"):
        with fb:
            y1 = cancellation()
            y2 = cancellation()
    assert y1.tolist() == y2.tolist() == cancellation().tolist()
    assert fb.summary["skipped"] == {"error": 1} and fb.summary["checked"] == 1
    assert len(fb.results) == 1 and fb.results["api_name"].tolist() == ["Tensor.__add__.1.forward"]
    assert any("Tensor.__add__.0.forward, the check failed and was skipped (RuntimeError: boom)"
               in r.getMessage() for r in caplog.records)


def test_broken_comparison_is_isolated(tmp_path, monkeypatch):
    from probekit.freebench.judge import deferred

    def broken(o, p, floor, exact=False):
        raise ValueError("comparison exploded")

    monkeypatch.setattr(deferred, "device_stats", broken)   # every comparison goes through it
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    x = torch.ones(3)
    with fb:
        y = torch.exp(x)
    assert y.tolist() == torch.exp(x).tolist()
    assert fb.summary["skipped"] == {"error": 1}


def test_user_errors_still_raise_and_the_mode_is_removed(tmp_path):
    depth = mode_stack_depth()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with pytest.raises(RuntimeError):
        with fb:
            assert mode_stack_depth() == depth + 1
            torch.matmul(torch.ones(2, 3), torch.ones(2, 3))   # shape error: the user's
    assert mode_stack_depth() == depth and not fb.active
    with fb:                                                    # usable again
        cancellation()
    assert len(fb.results) == 1
    fb.close()
    with pytest.raises(RuntimeError, match="closed"):
        fb.start()


def test_optimizer_hooks_removed_on_stop(tmp_path):
    from torch.optim import optimizer as opt_mod

    before = (len(opt_mod._global_optimizer_pre_hooks), len(opt_mod._global_optimizer_post_hooks))
    fb = FreeBench(dump_path=str(tmp_path))
    with fb:
        assert len(opt_mod._global_optimizer_pre_hooks) == before[0] + 1
        ids = (list(opt_mod._global_optimizer_pre_hooks)[-1],
               list(opt_mod._global_optimizer_post_hooks)[-1])
    assert (len(opt_mod._global_optimizer_pre_hooks),
            len(opt_mod._global_optimizer_post_hooks)) == before
    # the next block puts the same handles back, last (as a new registration), and they work
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    for step in range(2):
        with fb:
            assert (list(opt_mod._global_optimizer_pre_hooks)[-1],
                    list(opt_mod._global_optimizer_post_hooks)[-1]) == ids
            p.sum().backward()
            opt.step()
            opt.zero_grad()
        assert (len(opt_mod._global_optimizer_pre_hooks),
                len(opt_mod._global_optimizer_post_hooks)) == before
        assert fb._engine.step == step + 1    # the optimizer's step ended the step
    fb.close()


def test_optimizer_update_not_rerun(tmp_path):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.5)
    opt = torch.optim.Adam([p], lr=0.1, foreach=False)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="no_change")
    with fb:
        opt.step()
    s = fb.summary
    assert s["checked"] == 0
    # the step ends the training step: run with the mode off the stack (test_freebench_optsteps)
    assert s["optimizer_steps_unseen"] == 1 and "optimizer" not in s["skipped"]


# -- logging ------------------------------------------------------------------------------------
def test_perturbation_logged_once_per_api_per_run_and_a_summary_every_n_steps(tmp_path, caplog):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    fb._engine.summary_every = 2
    x = torch.rand(4) + 1
    with caplog.at_level(logging.INFO, logger="probekit"):
        for _ in range(5):
            with fb:
                torch.exp(x), torch.exp(x), torch.log(x), cancellation()
            fb.step()
    msgs = [r.getMessage() for r in caplog.records if "Perturbation is" in r.getMessage()]
    assert msgs == ["[probekit] Free benchmark: Perturbation is bit_noise of Torch.exp.0.forward.",
                    "[probekit] Free benchmark: Perturbation is bit_noise of Torch.log.0.forward.",
                    "[probekit] Free benchmark: Perturbation is bit_noise of "
                    "Tensor.__add__.0.forward."]
    lines = [r.getMessage() for r in caplog.records if "steps " in r.getMessage()]
    assert lines == [
        "[probekit] Free benchmark: steps 0-1: 8 call(s) checked (100 % of 8 floating-point "
        "call(s)), 2 finding(s); 2 step(s), 2 finding(s) in all",
        "[probekit] Free benchmark: steps 2-3: 8 call(s) checked (100 % of 8 floating-point "
        "call(s)), 2 finding(s); 4 step(s), 4 finding(s) in all"]


def test_cancel_logged_with_reason(tmp_path, caplog):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="change_value")
    x = torch.tensor([2.0])
    with caplog.at_level(logging.INFO, logger="probekit"):
        with fb:
            torch.exp(x)
    assert fb.summary["skipped"] == {"cancelled": 1}
    assert ("[probekit] Free benchmark: For Torch.exp.0.forward, the input has fewer than 2 "
            "elements. Cancel perturbation.") in [r.getMessage() for r in caplog.records]


def test_summary_and_repr(tmp_path):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        cancellation()
    fb.step()
    assert fb.summary == {"calls": 1, "checked": 1, "skipped": {}, "flagged": 1, "steps": 1,
                          "float_calls": 1, "checked_share": 1.0, "float_skipped": {}}
    assert repr(fb) == ("FreeBench(pert_mode='bit_noise', handler_type='check', fuzz_stage="
                        "'forward', stopped; 1 call seen · 1 checked (100 % of 1 floating-point "
                        "call) · 0 skipped · 1 flagged · 1 step)")
    html = fb._repr_html_()          # the same findings view as the notebook's, one row
    assert "⚠ 1 finding in 1 API call" in html and html.count("<tr class=") == 1


def test_other_modes_see_only_the_users_calls(tmp_path):
    from torch.overrides import TorchFunctionMode

    seen = []

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", "?"))
            return func(*args, **(kwargs or {}))

    x = torch.rand(4, requires_grad=True)
    for stage in ("forward", "backward"):
        seen.clear()
        fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", fuzz_stage=stage)
        with Recorder():
            with fb:
                torch.exp(x).sum().backward()
        assert seen == ["exp", "sum", "backward"], (stage, seen)
        assert fb.summary["checked"] == 2


def test_meta_tensors_are_skipped(tmp_path):
    x = torch.empty(4, 4, device="meta")
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        torch.matmul(x, x)
    assert fb.summary["skipped"] == {"meta": 1}
