"""FreeBench and the optimizer's steps (issue 38): a step whose calls can move no name runs with
the probe's mode off the stack; the names of every other call stay msprobe's; a step that raises
leaves the interception neither off nor on wrongly."""
import logging
import subprocess
import sys

import pytest
import torch

from probekit.freebench import FreeBench

pytestmark = pytest.mark.usefixtures("one_thread")


def depth():
    return torch._C._len_torch_function_stack()


def params(n=2):
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(4, 4, generator=g)) for _ in range(n)]


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))


def loop(fb, steps, after=lambda i: None, explicit=True):
    """A training loop of two parameters and SGD (``foreach=False``: one ``Tensor.add_`` per
    parameter); ``after(i)``: calls made after ``opt.step()`` inside the block. Returns the
    parameters, the per-step ``api_counts`` read just before each ``fb.step()``."""
    w = params()
    opt = torch.optim.SGD(w, lr=0.1, foreach=False)
    counts = []
    for i in range(steps):
        with fb if fb is not None else torch.enable_grad():
            opt.zero_grad()
            (X @ w[0] @ w[1]).sum().backward()
            opt.step()
            after(i)
        if fb is not None:
            counts.append(dict(fb.api_counts))
            if explicit:
                fb.step()
    return [p.detach().clone() for p in w], counts


def test_a_step_that_ends_the_step_is_not_intercepted(tmp_path):
    """Steps follow the optimizer: its step ends the training step, so its calls move no name
    (the counters reset right after) and it runs with the mode off the stack; calls after it
    are intercepted again (the next step's). The training is bit for bit the plain one."""
    ref, _ = loop(None, 3, explicit=False)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    seen = []
    got, counts = loop(fb, 3, after=lambda i: seen.append((depth(), torch.mul(X, 2))),
                       explicit=False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    s = fb.summary
    assert s["steps"] == 3 and s["optimizer_steps_unseen"] == 3
    assert "optimizer" not in s["skipped"]          # no update reached the mode
    assert [d for d, _ in seen] == [1, 1, 1]        # the mode is back after each step
    # the next step's first calls: torch.optim's closing call of the step, then torch.mul
    assert counts == [{"Torch._record_function_exit._RecordFunction": 1, "Torch.mul": 1}] * 3
    assert depth() == 0


def test_names_after_the_optimizer_step_are_msprobes(tmp_path):
    """With fb.step() ending the steps and calls after opt.step() in the same step, the
    optimizer's steps stay intercepted: a later ``Tensor.add_`` is numbered after the two the
    SGD update made (as msprobe numbers it), in every step; scope finds it by that name."""
    def after(i):
        y = X.clone()
        y.add_(1.0)

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise",
                   scope=["Tensor.add_.2.forward"])
    ref, _ = loop(None, 5)
    got, counts = loop(fb, 5, after=after)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # step 0 ends at the optimizer (its add_ is step 1's first); then fb.step() ends them
    assert counts == [{"Tensor.add_": 1}, {"Tensor.add_": 4}, {"Tensor.add_": 3}, {"Tensor.add_": 3},
                      {"Tensor.add_": 3}]
    s = fb.summary
    assert s["checked"] == 3                       # Tensor.add_.2 of steps 2, 3, 4: y.add_
    assert s["optimizer_steps_unseen"] == 1        # step 0 only (it ended the step)


def test_nothing_after_the_optimizer_step_lets_it_run_unintercepted(tmp_path, caplog):
    """fb.step() ends the steps and nothing is called after opt.step() in the block (the
    benchmark's loop): once a step showed it, the optimizer's steps run unintercepted. A step
    that then calls something after opt.step() gets a WARNING (its names may differ from
    msprobe's) and the optimizer's steps are intercepted again from then on."""
    def after(i):
        if i == 4:
            torch.mul(X, 2)

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    ref, _ = loop(None, 7)
    with caplog.at_level(logging.WARNING, logger="probekit"):
        got, counts = loop(fb, 7, after=after)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # step 0 ends at the optimizer; step 1 is watched (nothing follows); 2, 3, 4 unintercepted
    assert fb.summary["optimizer_steps_unseen"] == 4
    assert [c.get("Tensor.add_", 0) for c in counts] == [0, 2, 0, 0, 0, 2, 2]
    warned = [r.getMessage() for r in caplog.records if "followed optimizer.step()" in
              r.getMessage()]
    assert len(warned) == 1 and "step 4" in warned[0]


def test_a_closure_or_a_differentiable_optimizer_is_intercepted(tmp_path):
    """step(closure) runs the model inside the step (LBFGS): intercepted, its calls checked; the
    updates under no_grad skipped as ``optimizer``."""
    w = params(1)[0]
    opt = torch.optim.SGD([w], lr=0.1, foreach=False)

    def closure():
        opt.zero_grad()
        loss = (X @ w).sum()
        loss.backward()
        return loss

    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        opt.step(closure)
    s = fb.summary
    assert s["checked"] == 2 and s["skipped"]["optimizer"] == 1     # matmul, sum; w.add_
    assert "optimizer_steps_unseen" not in s


class Raising(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        raise RuntimeError("boom")


def test_a_step_that_raises_leaves_the_interception_on(tmp_path):
    """Torch runs no post hook when step() raises: the mode is back on the stack at the next
    module call, and the next optimizer step still ends the step (before, ``in_optimizer``
    stayed up and no later step ended)."""
    w = params(1)[0]
    lin = torch.nn.Linear(4, 4)
    opt = Raising([w], lr=0.1)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    with fb:
        (X @ w).sum().backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        lin(X)                          # a module call: the mode is back for its calls
        assert depth() == 1
        assert fb.api_counts.get("Functional.linear") == 1
        good = torch.optim.SGD([w], lr=0.1)
        good.step()                     # ends the step
        assert fb.summary["steps"] == 1 and depth() == 1
    assert depth() == 0
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == hooks


def test_a_raising_step_then_fb_step_or_stop(tmp_path):
    """After a raising step: fb.step() puts the mode back; stop() leaves the stack as it was
    before start() (a mode entered before start() stays) and removes every hook."""
    from torch.optim import optimizer as om
    from torch.overrides import TorchFunctionMode

    w = params(1)[0]
    w.grad = torch.ones_like(w)
    opt = Raising([w], lr=0.1)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    before = (len(om._global_optimizer_pre_hooks), len(om._global_optimizer_post_hooks),
              len(torch.nn.modules.module._global_forward_pre_hooks))
    fb.start()
    with pytest.raises(RuntimeError):
        opt.step()
    fb.step()
    assert depth() == 1
    torch.mul(X, 2)
    assert fb.api_counts == {"Torch.mul": 1}
    fb.stop()
    assert depth() == 0

    outer = TorchFunctionMode()
    with outer:
        with pytest.raises(RuntimeError):
            with fb:
                opt.step()
        assert depth() == 1 and torch._C._get_function_stack_at(0) is outer
    assert (len(om._global_optimizer_pre_hooks), len(om._global_optimizer_post_hooks),
            len(torch.nn.modules.module._global_forward_pre_hooks)) == before


class Wrapper(torch.optim.SGD):
    """An optimizer whose step steps another one (a wrapper's inner step)."""

    def __init__(self, params, inner):
        super().__init__(params, lr=0.1)
        self.inner, self.seen = inner, []

    def step(self, closure=None):
        self.inner.step()
        self.seen.append(depth())
        return super().step(closure)


def test_an_inner_step_does_not_end_the_suspension(tmp_path):
    a, b = params()
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt = Wrapper([a], torch.optim.SGD([b], lr=0.1))
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        opt.step()
        assert depth() == 1
    assert opt.seen == [0] and fb.summary["steps"] == 1


def test_another_threads_module_call_leaves_the_suspension_alone(tmp_path):
    """A module called on another thread while a step runs unintercepted (the global forward
    pre-hook fires there too) neither puts the mode on that thread's stack nor takes the
    resumption from the probe's thread."""
    import threading

    lin = torch.nn.Linear(4, 4)
    seen = []

    class Threaded(torch.optim.SGD):
        def step(self, closure=None):
            t = threading.Thread(target=lambda: seen.append((lin(X) is not None, depth())))
            t.start()
            t.join()
            seen.append(depth())
            return super().step(closure)

    w = params(1)[0]
    w.grad = torch.ones_like(w)
    opt = Threaded([w], lr=0.1)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with fb:
        opt.step()
        assert depth() == 1
    assert seen == [(True, 0), 0] and fb.summary["optimizer_steps_unseen"] == 1


def _calls(fb):
    return fb._engine.calls


def test_zero_grad_that_sets_none_reaches_no_mode(tmp_path):
    """``opt.zero_grad()`` and ``model.zero_grad()`` (set_to_none) run with the probe's mode off
    the stack: no call of theirs is counted, every gradient is None after them, and the mode is
    back on top; ``set_to_none=False`` zeroes with counted calls, intercepted as before."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb:
        model(X).sum().backward()
        before = _calls(fb)
        opt.zero_grad()
        assert _calls(fb) == before and depth() == 1
        assert all(p.grad is None for p in model.parameters())
        model(X).sum().backward()
        before = _calls(fb)
        model.zero_grad()
        assert _calls(fb) == before and depth() == 1
        assert all(p.grad is None for p in model.parameters())
        model(X).sum().backward()
        before = _calls(fb)
        opt.zero_grad(set_to_none=False)
        assert _calls(fb) > before
        assert all(torch.count_nonzero(p.grad).item() == 0 for p in model.parameters())
    fb.close()


def test_zero_grad_is_torchs_again_after_the_last_session_closes(tmp_path):
    """Replaced while a session lives (``hold_zero_grad``), torch's own method again once the
    last one closes; outside a probe the replacement only calls through. In a fresh process:
    sessions this test process left open hold it still."""
    script = f"""
import torch
from probekit.freebench import FreeBench
original = torch.optim.Optimizer.__dict__["zero_grad"]
module_original = torch.nn.Module.__dict__["zero_grad"]
a = FreeBench(dump_path={str(tmp_path / "a")!r})
b = FreeBench(dump_path={str(tmp_path / "b")!r})
with a:
    pass
with b:
    pass
replaced = torch.optim.Optimizer.__dict__["zero_grad"]
assert replaced is not original and replaced.probekit_original is original
assert torch.nn.Module.__dict__["zero_grad"].probekit_original is module_original
w = [torch.nn.Parameter(torch.ones(2))]
w[0].grad = torch.ones(2)
torch.optim.SGD(w, lr=0.1).zero_grad()      # no probe active: torch's behaviour
assert w[0].grad is None
a.close()
assert torch.optim.Optimizer.__dict__["zero_grad"] is replaced   # b still holds it
b.close()
assert torch.optim.Optimizer.__dict__["zero_grad"] is original
assert torch.nn.Module.__dict__["zero_grad"] is module_original
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_zero_grad_after_the_optimizer_step_keeps_it_unintercepted(tmp_path, caplog):
    """``opt.step(); opt.zero_grad(); fb.step()``: zero_grad's calls no longer count as calls
    after the optimizer's step, so its steps run unintercepted and no name moves; the
    training is bit for bit the plain one."""
    def run(fb):
        w = params()
        opt = torch.optim.SGD(w, lr=0.1, foreach=False)
        for _ in range(4):
            with fb if fb is not None else torch.enable_grad():
                (X @ w[0] @ w[1]).sum().backward()
                opt.step()
                opt.zero_grad()
            if fb is not None:
                fb.step()
        return [p.detach().clone() for p in w]
    ref = run(None)
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with caplog.at_level(logging.WARNING, logger="probekit"):
        got = run(fb)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert fb.summary["optimizer_steps_unseen"] == 3   # the first step learns it may
    assert "followed optimizer.step()" not in caplog.text
    fb.close()
