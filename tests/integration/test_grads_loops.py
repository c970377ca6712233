"""The grad probe on real training loops: wrapped models (torch.compile), several optimizers,
closures (LBFGS), GradScaler's skipped steps, parameters unfrozen during training."""
import os
import sys

import numpy as np
import torch

from probekit.grads import GradProbe, compare_grads, open_grads

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _train import make_model, train  # noqa: E402


def test_compiled_model_compares_with_eager(tmp_path):
    eager = make_model()
    with GradProbe(eager, dump_path=str(tmp_path / "eager")):
        train(eager, steps=3)
    compiled = torch.compile(make_model(), backend="eager")
    with GradProbe(compiled, dump_path=str(tmp_path / "compiled")):
        train(compiled, steps=3)
    ds = open_grads(tmp_path / "compiled")
    names = [n for n, _ in eager.named_parameters()]
    assert ds["param"].values.tolist() == names
    assert ds.attrs["recorded_params"] == ["_orig_mod." + n for n in names]
    cmp = compare_grads(tmp_path / "eager", tmp_path / "compiled")
    assert cmp["param"].values.tolist() == names
    assert np.all(cmp["similarity"].values == 1.0)
    assert np.array_equal(ds["max"].values, open_grads(tmp_path / "eager")["max"].values)


def test_param_list_takes_either_name(tmp_path):
    compiled = torch.compile(make_model(), backend="eager")
    with GradProbe(compiled, dump_path=str(tmp_path / "a"), param_list=["0.weight",
                                                                        "_orig_mod.2.bias"]):
        train(compiled, steps=1)
    assert open_grads(tmp_path / "a")["param"].values.tolist() == ["0.weight", "2.bias"]


def test_param_unfrozen_later_is_recorded_from_its_first_gradient(tmp_path):
    model = make_model()
    model[0].weight.requires_grad_(False)
    seen = []

    def unfreeze(step):
        seen.append(model[0].weight.grad)
        if step == 1:
            model[0].weight.requires_grad_(True)

    with GradProbe(model, dump_path=str(tmp_path)):
        train(model, steps=4, on_step=unfreeze)
    ds = open_grads(tmp_path)
    present = ds["present"].sel(param="0.weight").values.tolist()
    assert present == [False, False, True, True]
    assert ds["max"].sel(param="0.weight").values[3] == float(seen[3].max())
