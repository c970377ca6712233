"""torch.compile under the probe is refused (it would silently run the model eagerly)."""
import pytest
import torch

from probekit.freebench import CompiledModelError, FreeBench
from probekit.freebench.session.compiled import MESSAGE


def model_and_input():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                            torch.nn.Linear(16, 1))
    return m, torch.randn(8, 16)


def refusal(exc_info) -> BaseException:
    """The CompiledModelError itself (dynamo wraps what a compile callback raises)."""
    e = exc_info.value
    while e is not None and not isinstance(e, CompiledModelError):
        e = e.__cause__ or e.__context__
    assert MESSAGE in str(exc_info.value)   # dynamo's error carries the message
    return e


def test_compiled_model_under_probe_is_refused_and_training_untouched(tmp_path):
    torch._dynamo.reset()
    m, x = model_and_input()
    cm = torch.compile(m, backend="eager")
    before = cm(x).sum()
    params = [p.detach().clone() for p in m.parameters()]
    rng = torch.get_rng_state()
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    with pytest.raises(Exception) as info:
        with fb:
            cm(x).sum()
    err = refusal(info)
    assert isinstance(err, CompiledModelError) and str(err).strip() == MESSAGE
    assert "_orig_mod" in MESSAGE and "eager" in MESSAGE
    assert torch._C._len_torch_function_stack() == 0     # the probe is off again
    assert fb.summary["checked"] == 0 and fb.summary["compiled_refused"] == 1
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, m.parameters()))
    assert torch.equal(rng, torch.get_rng_state())
    # the compiled model still runs compiled, with the same result, once the probe is off
    after = cm(x).sum()
    assert torch.equal(before, after)
    # the way out: probe the uncompiled module
    with fb:
        y = cm._orig_mod(x).sum()
    assert torch.equal(y, m(x).sum()) and fb.summary["checked"] > 0


def test_start_refuses_a_compiled_module(tmp_path):
    m, _ = model_and_input()
    fb = FreeBench(dump_path=str(tmp_path))
    with pytest.raises(CompiledModelError, match="_orig_mod"):
        fb.start(torch.compile(m, backend="eager"))
    assert not fb.active and torch._C._len_torch_function_stack() == 0
    fb.start(m)
    fb.stop()


def test_compile_guard_removed_on_stop(tmp_path):
    from torch._dynamo.callback import callback_handler

    n = len(callback_handler.start_callbacks)
    fb = FreeBench(dump_path=str(tmp_path))
    with fb:
        assert len(callback_handler.start_callbacks) == n + 1
    assert len(callback_handler.start_callbacks) == n
    # compiling outside the probe is untouched
    torch._dynamo.reset()
    m, x = model_and_input()
    assert torch.equal(torch.compile(m, backend="eager")(x), m(x))
