"""Sampled sign bits (grad_probe.sample) from MindSpore: the very elements PyTorch's probe
samples (chosen by global index), on every statistics path (host, device cell, compiled
graph), so a sampled MindSpore run compares with a sampled or a full PyTorch run."""
import numpy as np
import pytest

from ms_util import require_mindspore

ms = require_mindspore()

import torch  # noqa: E402

import probekit  # noqa: E402
from probekit.grads import GradProbe as TorchGradProbe  # noqa: E402
from probekit.grads.numerics.sampling import subsample  # noqa: E402
from probekit.mindspore import GradProbe, compare_frameworks  # noqa: E402

from ms_models import MLP, TorchMLP, data, graph_mode, make_step, run_steps, train  # noqa: E402

STEPS = 4
SAMPLE = 40  # fc1.weight (96) and fc2.weight (128) sampled, the rest whole


def record(path, where="auto", mode=None, sample=SAMPLE):
    ms.set_seed(11)
    net = MLP()
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=0.05)
    probe = GradProbe(opt, dump_path=path, sample=sample, where=where).start()
    batches = data(STEPS, seed=4)
    if mode is None:
        train(net, opt, batches)
    else:
        with graph_mode(mode):
            run_steps(make_step(mode, net, opt), batches)
    probe.stop()
    return net


def record_torch(path, sample):
    ms.set_seed(11)
    net = MLP()
    tnet = TorchMLP()
    with torch.no_grad():
        for name, p in tnet.named_parameters():
            p.copy_(torch.from_numpy(net.parameters_dict()[name].asnumpy()))
    topt = torch.optim.SGD(tnet.parameters(), lr=0.05)
    with TorchGradProbe(tnet, topt, dump_path=str(path), sample=sample):
        for x, y in data(STEPS, seed=4):
            topt.zero_grad()
            torch.nn.functional.mse_loss(tnet(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            topt.step()


@pytest.mark.parametrize("where,mode", [("host", None), ("device", None),
                                        ("auto", "graph_cell")])
def test_mindspore_samples_the_elements_pytorch_samples(tmp_path, where, mode):
    record(tmp_path / "full", where, mode, sample=0)
    record(tmp_path / "sampled", where, mode)
    full = probekit.open_grads(tmp_path / "full")
    got = probekit.open_grads(tmp_path / "sampled")
    assert got.attrs["sample"] == SAMPLE
    assert got["nbits"].values.tolist() == [40, 16, 40, 8, 24, 3]
    want = subsample(full, SAMPLE)  # the full run's bits at the sampled elements
    for var in ("direction", "significant"):
        np.testing.assert_array_equal(got[var].values, want[var].values, err_msg=var)
    np.testing.assert_array_equal(got["norm"].values, full["norm"].values)  # still exact
    record_torch(tmp_path / "pt_sampled", SAMPLE)
    record_torch(tmp_path / "pt_full", 0)
    for pt in ("pt_sampled", "pt_full"):
        res = compare_frameworks(tmp_path / pt, tmp_path / "sampled")
        assert (np.asarray(res["similarity"].values) == 1.0).all(), pt
        assert res["sampled"].values.tolist() == [40, 16, 40, 8, 24, 3]
        assert (np.asarray(res["similarity_low"].values) < 1.0).any()  # an interval, sampled


def test_a_restart_with_another_sample_is_refused(tmp_path):
    """One store holds one sample (as for PyTorch): a restart with the same sample continues
    the store, another one (or every element) is refused before any step is recorded: by the
    rank group it would continue, or (its bits laid out otherwise: another layout folder) by
    the store's segments."""
    from probekit.grads import GradStoreError

    record(tmp_path)
    ms.set_seed(11)

    def again(sample):
        net = MLP()
        opt = ms.nn.SGD(net.trainable_params(), learning_rate=0.05)
        probe = GradProbe(opt, dump_path=tmp_path, sample=sample, start_step=STEPS).start()
        train(net, opt, data(2, seed=5))
        probe.stop()

    for other in (24, 0):
        with pytest.raises(GradStoreError, match="differs in: .*sample|one store holds one "
                                                 "sample"):
            again(other)
    again(SAMPLE)
    ds = probekit.open_grads(tmp_path)
    assert ds["step"].values.tolist() == list(range(STEPS + 2)) and ds.attrs["sample"] == SAMPLE
